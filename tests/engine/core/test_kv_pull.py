"""The KV pull protocol on a fake clock: chunks, credits, checksum failure, timeout, release."""

from __future__ import annotations

from engine.core.kv_pull import Pull, PullState, Serve, ServeState

CHAINS = [bytes([i]) * 16 for i in range(10)]
RECS = {c: b"R" + c + bytes(7) for c in CHAINS}


def _serve(pull_hdr, now, **kw):
    return Serve(pull_hdr["tid"], pull_hdr["hid"], CHAINS[:pull_hdr["want"]], now, credit=pull_hdr["credit"], **kw)


def _run(pull: Pull, serve: Serve, now: float, available=lambda c: True, read=RECS.get, corrupt=None, max_rounds=50):
    """Move messages both ways until neither side has anything to say; returns the chunk count seen."""
    chunks = 0
    for _ in range(max_rounds):
        serve.pump(now, available, read)
        moved = bool(serve.outbox)
        for hdr, payload in serve.outbox:
            if hdr["t"] == "chunk":
                chunks += 1
                if corrupt is not None and hdr["seq"] == corrupt:
                    payload = b"X" + payload[1:]
            pull.on_message(hdr, payload, now)
        serve.outbox.clear()
        for hdr, _ in pull.outbox:
            serve.on_message(hdr, now)
            moved = True
        pull.outbox.clear()
        if not moved:
            break
    return chunks


def test_pull_in_chunks_against_credit():
    p = Pull("t1", "r1", want=10, now=0.0, credit=2)
    claim = p.outbox.pop(0)[0]
    assert claim["t"] == "claim" and claim["credit"] == 2
    s = _serve(claim, 0.0, chunk_blocks=3)
    s.pump(0.0, lambda c: True, RECS.get)
    assert [h["t"] for h, _ in s.outbox] == ["meta", "chunk", "chunk"]  # no more than the two credits
    s.outbox.clear()
    s.pump(0.0, lambda c: True, RECS.get)
    assert not s.outbox  # out of credit: nothing until the receiver grants more
    s2 = _serve(claim, 0.0, chunk_blocks=3)
    p2 = Pull("t1", "r1", want=10, now=0.0, credit=2)
    p2.outbox.clear()
    assert _run(p2, s2, 0.0) == 4  # 3+3+3+1
    assert p2.state is PullState.DONE and p2.records == [RECS[c] for c in CHAINS]
    assert s2.state is ServeState.ENDED  # the release reached the sender


def test_receiver_wants_fewer_than_held():
    p = Pull("t", "h", want=4, now=0.0)
    s = _serve(p.outbox.pop(0)[0], 0.0, chunk_blocks=3)
    _run(p, s, 0.0)
    assert p.state is PullState.DONE and len(p.records) == 4


def test_checksum_failure_fails_and_releases():
    p = Pull("t", "h", want=10, now=0.0)
    s = _serve(p.outbox.pop(0)[0], 0.0, chunk_blocks=2)
    _run(p, s, 0.0, corrupt=1)
    assert p.state is PullState.FAILED and p.failure == "checksum" and p.records == []
    assert s.state is ServeState.ENDED  # told at once, not at the deadline


def test_record_refused_by_verify():
    def verify(i, rec):
        if i == 3:
            raise ValueError("chain")
    p = Pull("t", "h", want=10, now=0.0, verify=verify)
    s = _serve(p.outbox.pop(0)[0], 0.0)
    _run(p, s, 0.0)
    assert p.state is PullState.FAILED and p.failure.startswith("record")


def test_timeout_on_a_silent_sender():
    p = Pull("t", "h", want=10, now=0.0, timeout_s=1.0)
    p.tick(0.9)
    assert p.state is PullState.CLAIMING and p.deadline() == 1.0
    p.tick(1.0)
    assert p.state is PullState.FAILED and p.failure == "timeout"
    assert p.outbox[-1][0] == {"t": "release", "tid": "t", "hid": "h", "ok": False}


def test_cut_half_way_times_out():
    p = Pull("t", "h", want=10, now=0.0, credit=2, timeout_s=1.0)
    s = _serve(p.outbox.pop(0)[0], 0.0, chunk_blocks=2)
    s.pump(0.0, lambda c: True, RECS.get)
    for hdr, payload in s.outbox:
        p.on_message(hdr, payload, 0.1)
    assert p.state is PullState.RECEIVING and len(p.records) == 4  # then the sender dies
    p.tick(1.2)
    assert p.state is PullState.FAILED and p.records == []


def test_sender_waits_for_exports_then_serves_the_ready_prefix():
    ready = set(CHAINS[:3])
    avail = lambda c: True if c in ready else (False if c in CHAINS[:6] else None)  # noqa: E731
    p = Pull("t", "h", want=10, now=0.0)
    s = _serve(p.outbox.pop(0)[0], 0.0, grace_s=0.5)
    s.pump(0.1, avail, RECS.get)
    assert s.waiting and not s.outbox
    ready.update(CHAINS[3:5])
    s.pump(0.6, avail, RECS.get)  # grace over: what is ready now is served
    assert s.outbox[0][0] == {"t": "meta", "tid": "t", "blocks": 5}
    for hdr, payload in s.outbox:
        p.on_message(hdr, payload, 0.6)
    assert p.state is PullState.DONE and len(p.records) == 5


def test_refused_claim_and_evicted_block():
    p = Pull("t", "h", want=10, now=0.0)
    p.on_message({"t": "refused", "tid": "t", "reason": "unknown"}, None, 0.0)
    assert p.state is PullState.FAILED
    p = Pull("t", "h", want=10, now=0.0)
    s = _serve(p.outbox.pop(0)[0], 0.0, chunk_blocks=4)
    gone = {CHAINS[5]}
    _run(p, s, 0.0, read=lambda c: None if c in gone else RECS[c])
    assert p.state is PullState.FAILED and p.failure.startswith("refused")


def test_silent_receiver_ends_the_serve():
    s = Serve("t", "h", CHAINS, 0.0, credit=1, timeout_s=1.0)
    s.pump(0.0, lambda c: True, RECS.get)
    assert not s.expired(0.5) and s.expired(1.0)


def test_chunk_checksum_is_crc32c_when_the_claim_offers_it_and_crc32_otherwise():
    import zlib

    import crc32c

    p = Pull("t", "h", want=10, now=0.0)
    claim = p.outbox.pop(0)[0]
    assert claim["sums"] == ["crc32c"]
    s = _serve(claim, 0.0, chunk_blocks=4, sums=tuple(claim["sums"]))
    s.pump(0.0, lambda c: True, RECS.get)
    chunks = [(h, pl) for h, pl in s.outbox if h["t"] == "chunk"]
    assert chunks and all("crc" not in h and h["crc32c"] == crc32c.crc32c(pl) for h, pl in chunks)
    old = _serve({k: v for k, v in claim.items() if k != "sums"}, 0.0, chunk_blocks=4)  # a receiver without `sums`
    old.pump(0.0, lambda c: True, RECS.get)
    assert all("crc32c" not in h and h["crc"] == zlib.crc32(pl) for h, pl in old.outbox if h["t"] == "chunk")
    p2 = Pull("t", "h", want=10, now=0.0)
    p2.outbox.clear()
    s2 = _serve(claim, 0.0, chunk_blocks=4, sums=("crc32c",))
    _run(p2, s2, 0.0)
    assert p2.state is PullState.DONE and p2.records == [RECS[c] for c in CHAINS]


def test_crc32c_chunk_corruption_fails_and_releases():
    p = Pull("t", "h", want=10, now=0.0)
    s = _serve(p.outbox.pop(0)[0], 0.0, chunk_blocks=2, sums=("crc32c",))
    _run(p, s, 0.0, corrupt=2)
    assert p.state is PullState.FAILED and p.failure == "checksum" and p.records == []
    assert s.state is ServeState.ENDED
