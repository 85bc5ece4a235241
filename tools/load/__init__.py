"""The load generator behind `npuserve bench`, `bench-serve`, `soak` and `chaos`.

`workload` (what is sent), `runner` (client processes that send it),
`report` (percentiles, goodput, Pareto frontier, table), `chip_runs` (what the
chips did, daemon vs simulator), `plot` (the Pareto picture), `local_daemon`
(a daemon subprocess a tool starts for itself).
"""
