"""The scheduler core, one module per job: see `scheduler.py` for the order of work and who calls whom."""
