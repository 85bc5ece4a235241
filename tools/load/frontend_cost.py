"""`python -m tools.load.frontend_cost`: the daemon frontend's cost per streamed token, in-process.

Frontend.emit + flush for 64 streams on 2 client connections over a real
ZeroMQ ipc socket, 3000 steps of one token each, the clients draining every
20 steps. Measures the frontend's own Python and libzmq work without the
other processes' wake-ups that an end-to-end run on a small host adds, for
clients that asked for batched events (`hello`) and for clients that did not
(one event per message, the v1 default).
"""

from __future__ import annotations

import sys
import tempfile
import time

import zmq

from engine.client import build_hello
from engine.daemon.frontend import Frontend
from ipc.codec import encode


def measure(streams: int = 64, conns: int = 2, steps: int = 3000, batched: bool = True) -> dict:
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="npsfc-") as d:
        ep = f"ipc://{d}/f.sock"
        fe = Frontend(ctx, [ep], max_message_bytes=1 << 20, max_send_queue=1 << 20)
        dealers = []
        for k in range(conns):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, b"c%d" % k)
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(ep)
            if batched:
                s.send(encode(build_hello()))
            s.send(b'{"v":1,"op":"health","id":"x"}')
            dealers.append(s)
        router = fe.sockets[0]
        found = []  # the frontend answers each hello itself and hands on each health with its connection
        while len(found) < conns:
            if not router.poll(5000):
                raise RuntimeError("the client connections did not arrive")
            found += [conn for conn, _ in fe.receive(0)]
        for i in range(streams):
            fe.open(1000 + i, found[i % conns], f"r{i}", True, False, text=False, generation=0)

        def drain() -> int:
            n = 0
            for s in dealers:
                while True:
                    try:
                        s.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    n += 1
            return n

        got = 0
        t = time.perf_counter()
        for step in range(steps):
            for i in range(streams):
                fe.emit(1000 + i, [step % 300], None)
            fe.flush()
            if step % 20 == 0:
                got += drain()
        elapsed = time.perf_counter() - t
        time.sleep(0.1)
        got += drain()
        for s in dealers:
            s.close(0)
        for s in fe.sockets:
            s.close(0)
    ctx.term()
    return {"us_per_token": round(1e6 * elapsed / (steps * streams), 2), "events": got,
            "expected": steps * streams + (conns if batched else 0)}  # and the hello replies


if __name__ == "__main__":
    ok = True
    for batched in (True, False):
        r = measure(batched=batched)
        framing = "batched events (hello)" if batched else "one event per message"
        print(f"frontend, {framing}: {r['us_per_token']} us per streamed token "
              f"({r['events']} of {r['expected']} events received)")
        ok = ok and r["events"] == r["expected"]
    sys.exit(0 if ok else 1)
