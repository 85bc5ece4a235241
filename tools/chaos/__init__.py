"""`npuserve chaos`: named fault scenarios under load, each with the soak's invariant checks.

`harness` (result row, daemon under test, checks), one module per family:
`worker_faults`, `client_faults`, `resource_faults`; `main` (the command).
"""
