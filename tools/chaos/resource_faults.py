"""Running out of resources: /dev/shm nearly full at start-up, the KV pool exhausted by long prompts.

/dev/shm is shared by everyone on the machine, so the scenario never fills
the real one: the daemon runs in a private user + mount namespace
(`unshare --user --map-root-user --mount`) whose /dev/shm is a small tmpfs of
its own, filled to the wanted level; the tmpfs disappears with the namespace.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile

from tools.chaos.harness import (DaemonUnderTest, ScenarioResult, check_traces, serves_fresh_requests,
                                 stream_all)
from tools.load import local_daemon
from tools.load.wire_load import WireLoad

RING_BYTES = 64 << 20  # engine.daemon.chip_link.ChipLink's default ring size; two rings per chip
TMPFS_MB = 160

# Inside the namespace: a private tmpfs on /dev/shm, filled, then the daemon; SIGTERM is passed on, and
# what is left in the private /dev/shm after the daemon exits is written to $NPS_SHM_LIST.
_NS_SCRIPT = r"""
mount -t tmpfs -o size=${NPS_TMPFS_MB}m tmpfs /dev/shm || exit 97
head -c "$NPS_FILL" /dev/zero > /dev/shm/filler || exit 98
"$@" &
child=$!
trap 'kill -TERM $child' TERM INT
wait $child; rc=$?
while kill -0 $child 2>/dev/null; do wait $child; rc=$?; done
ls -1 /dev/shm > "$NPS_SHM_LIST"
exit $rc
"""


def _namespace_available() -> str | None:
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) is not installed"
    p = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if p.returncode != 0:
        return f"unprivileged user namespaces are not available: {p.stderr.decode().strip()}"
    return None


def _start_in_namespace(fill_bytes: int, listing: str) -> local_daemon.LocalDaemon:
    env = {**os.environ, "NPS_TMPFS_MB": str(TMPFS_MB), "NPS_FILL": str(fill_bytes), "NPS_SHM_LIST": listing}
    return local_daemon.start(backend="stub", chips=1, prefix="npc-", env=env,
                              wrap=["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _NS_SCRIPT, "sh"])


def _left(listing: str) -> list[str] | None:
    try:
        with open(listing) as fh:
            return [n for n in fh.read().split() if n != "filler"]
    except FileNotFoundError:
        return None


def shm_full(res: ScenarioResult) -> None:
    """A private /dev/shm too full for the rings, then one with just enough room, under load."""
    why = _namespace_available()
    if why:
        res.fail(f"cannot build a private /dev/shm: {why}")
        return
    tmp = tempfile.mkdtemp(prefix="npc-shm-")
    try:
        # 1. Room for less than one chip's two rings: start-up must fail, clearly, and leave nothing.
        listing = os.path.join(tmp, "full.txt")
        d = _start_in_namespace((TMPFS_MB << 20) - RING_BYTES - (8 << 20), listing)
        try:
            code = d.proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        log = d.log_tail(2000)
        d.cleanup()
        res.faults += 1
        res.details["full_exit"] = code
        res.expect(code == 1, f"daemon on a full /dev/shm exited {code}, want 1 (start-up failure)")
        res.expect("/dev/shm has no room" in log, f"no clear /dev/shm message in the daemon's output: {log[-300:]!r}")
        res.expect(_left(listing) == [], f"segments left in the private /dev/shm: {_left(listing)}")
        # 2. Just enough room (two rings + 8 MB): it serves a burst and stops cleanly.
        listing = os.path.join(tmp, "tight.txt")
        d = _start_in_namespace((TMPFS_MB << 20) - 2 * RING_BYTES - (8 << 20), listing)
        try:
            local_daemon.wait_healthy(d.endpoint, d, timeout=60)

            async def burst():
                load = WireLoad(d.endpoint)
                try:
                    return await stream_all(load, 40, 256, prompt_len=400, timeout=60)
                finally:
                    await load.close()

            traces = asyncio.run(burst())
            res.requests = len(traces)
            check_traces(res, traces, allowed_errors=set())
            code = d.stop()
            res.details["tight_exit"] = code
            res.expect(code == 0, f"daemon on a nearly full /dev/shm exited {code} after SIGTERM (SIGBUS is -7)")
            res.expect(_left(listing) == [], f"segments left in the private /dev/shm: {_left(listing)}")
        except SystemExit as e:
            res.fail(f"daemon with just enough /dev/shm did not start: {e}")
        finally:
            if res.problems:
                res.details["daemon_log_tail"] = d.log_tail(1500)
            d.cleanup()
        res.faults += 1
        res.recovery_s = 0.0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def kv_exhausted(res: ScenarioResult) -> None:
    """A 64-block KV pool (1,024 tokens) and 24 requests of ~800 tokens each, plus 4 that can never fit."""
    with DaemonUnderTest(res, backend="stub", chips=1, settings=["kv.num_blocks=64"]) as d:

        async def run():
            load = WireLoad(d.endpoint)
            try:
                fits = [await load.start([1 + (i * 7 + k) % 250 for k in range(600)], max_tokens=200, seed=i,
                                         ignore_eos=True) for i in range(24)]
                never = [await load.start([2 + (i + k) % 250 for k in range(1100)], max_tokens=100, seed=i,
                                          ignore_eos=True) for i in range(4)]
                await asyncio.gather(*(load.finished(t, 120) for t in fits + never))
                await asyncio.sleep(0.3)
                return fits, never
            finally:
                await load.close()

        fits, never = asyncio.run(run())
        res.faults, res.requests = 1, len(fits) + len(never)
        check_traces(res, fits + never, allowed_errors={400, 429, 503})
        res.expect(all(t.terminal and t.terminal["ev"] == "done" for t in fits),
                   f"requests that fit the pool one at a time did not all finish: "
                   f"{[t.terminal for t in fits if not (t.terminal and t.terminal['ev'] == 'done')][:2]}")
        res.expect(all(t.error_code in (400, 429) for t in never),
                   f"requests larger than the pool must be refused (400/429), got "
                   f"{[t.terminal for t in never][:2]}")
        s = local_daemon.stats(d.endpoint)
        blocks = s["scheduler"]["chips"]["0"]["kv"]["blocks"]
        res.details.update(kv_blocks=blocks, refusals=[t.terminal.get("reason") for t in never if t.terminal])
        res.expect(blocks["used"] == 0 and blocks["quarantined"] == 0,
                   f"KV blocks still held after every request finished: {blocks}")
        serves_fresh_requests(res, d.endpoint)
        res.recovery_s = 0.0
