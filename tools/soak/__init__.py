"""`npuserve soak`: steady mixed load for a duration, with its invariants, resource trend and leak verdict.

`mix` (what is sent and what each answer must be), `resources` (psutil
sampling and the leak verdict), `main` (the command), `periods` (durations and
request counts). With model switching and faults: `switches` (two packages,
replace / rollback, the generation contract), `faults` (the chaos tool's
faults on the soak's board), `rounds` (settled samples per round, per-worker
fits), `report` (the end-of-run tables).
"""
