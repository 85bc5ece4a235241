"""`python -m tools.load.frontend_cost`: the daemon frontend's cost per streamed token, in-process.

Frontend.emit + flush for 64 streams on 2 client connections over a real
ZeroMQ ipc socket, 3000 steps of one token each, the clients draining every
20 steps. Measures the frontend's own Python and libzmq work without the
other processes' wake-ups that an end-to-end run on a small host adds.
"""

from __future__ import annotations

import sys
import tempfile
import time

import zmq

from engine.daemon.frontend import Conn, Frontend


def measure(streams: int = 64, conns: int = 2, steps: int = 3000) -> dict:
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
            s.send(b'{"v":1,"op":"health","id":"x"}')
            dealers.append(s)
        router = fe.sockets[0]
        envs = []
        while len(envs) < conns:
            if not router.poll(5000):
                raise RuntimeError("the client connections did not arrive")
            envs.append(tuple(router.recv_multipart()[:-1]))
        for i in range(streams):
            fe.open(1000 + i, Conn(sock=0, envelope=envs[i % conns], local=True), f"r{i}", True, False,
                    text=False, generation=0)

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
            "expected": steps * streams}


if __name__ == "__main__":
    r = measure()
    print(f"frontend: {r['us_per_token']} us per streamed token ({r['events']} of {r['expected']} events received)")
    sys.exit(0 if r["events"] == r["expected"] else 1)
