"""The wire-protocol conformance suite: `docs/protocol.md` as executable checks.

Written from the document alone: it speaks to an endpoint with a raw ZeroMQ
DEALER (pyzmq + orjson, nothing of npuserve's own client, codec or schema),
so a bug shared by the server and npuserve's client library cannot hide.
`wire` reads every message whole, `checks` holds one check per promise of the
document, `runner` picks and runs them, `report` prints the verdict.
"""
