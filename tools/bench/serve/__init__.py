"""End-to-end benchmarks: the load generator (`load`) and the paired A/B comparisons (`npuserve bench serve NAME`)."""
