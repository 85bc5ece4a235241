"""The balancer: one process that speaks the daemon's wire protocol on its frontend and routes to backends.

`core.py` (sans-I/O: routing, health, retries, migration) is driven by
`shell.py` (zmq sockets, signals, clock); `main.py` is `npuserve balance`.
"""
