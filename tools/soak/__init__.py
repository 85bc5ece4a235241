"""`npuserve soak`: steady mixed load for a duration, with its invariants, resource trend and leak verdict.

`mix` (what is sent and what each answer must be), `resources` (psutil
sampling and the leak verdict), `main` (the command).
"""
