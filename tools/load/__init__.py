"""The load generator behind `npuserve bench`, `bench-serve`, the paired benchmarks, `soak` and `chaos`.

`workload` (what is sent), `runner` (client processes that send it, and
`Timed`: what TTFT and TPOT are), `openai_load` (its HTTP driver), `wire_load`
(a raw client that keeps every event, for the soak and chaos invariants),
`report` (the one percentile helper `pct`, goodput, Pareto frontier, table),
`paired` (two routes in alternating rounds: medians, per-round ratios,
targets; `bench-http`, `bench-http-peer`, `bench-peer`, `bench-observe`),
`chip_runs` (what the chips did, daemon vs simulator), `plot` (the Pareto
picture), `local_daemon` / `local_front` / `llamacpp_server` (servers a tool
starts for itself), `child_process` (stopping them), `ports` (a free port).
"""
