"""The benchmarks behind `npuserve bench serve|micro|recovery` (the command tree is `tools.bench.main`).

`serve/`: end to end through real servers a run starts itself (daemons, a
balancer, a prefill/decode pair, the HTTP front, llama.cpp's server), driven
by the load runner; side-by-side comparisons run in paired rounds
(`tools.load.paired.alternate`). `micro/`: in-process measurements of one
part. `recovery`: how long a chip is out of service after a worker fault.
"""
