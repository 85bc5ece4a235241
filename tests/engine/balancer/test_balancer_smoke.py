from __future__ import annotations

from balancer_procs import balancer, tcp_daemon  # noqa: F401  (fixture)


def test_smoke(daemon, balancer):
    d1, e1 = tcp_daemon(daemon)
    d2, e2 = tcp_daemon(daemon)
    b = balancer(backends=[e1, e2])
    with b.client(timeout=20) as c:
        r = c.generate([1, 2, 3], max_tokens=5, seed=1)
        print(r)
        print(list(c.stream([1, 2, 3], max_tokens=5)))
        print(c.stats()["total"]["frontend"])
        print(c.health())
