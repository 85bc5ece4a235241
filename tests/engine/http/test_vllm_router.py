"""Two npuserve boards behind a real `vllm-router` (0.1.17, from PyPI): cache_aware and kv_aware.

Each board is a real daemon (the `sim` backend: stub tokens at a modelled ~18 ms per decode step, so a
long stream stays in flight while the test looks; Gemma on llama.cpp for chat) plus its real HTTP front
process (`npuserve http`). The router polls the fronts' /health, asks every front's /render for the
prompt's token ids, routes on its prefix tree over them (cache_aware) or on the boards' KV events
(kv_aware) and forwards the OpenAI request (see docs/cluster.md). Which board served a request is read
from that board's daemon (`stats` -> frontend.requests), never from the router's say-so.

The follow-ups come in runs (A A A Z Z A Z): round-robin alternates between the two boards and cannot
produce a run, and a random pick passes 7 requests with a chance of 1 in 128. So these tests fail
without prefix (cache_aware) or KV (kv_aware) routing; they do not measure how good that routing is.
"""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass

import openai
import pytest
import zmq

from daemon_procs import DaemonProc
from http_front_procs import HttpFrontProc, start_http_front
from repo_root import ROOT
from tools.load.ports import free_port
from waiting import read_log, wait_until

pytestmark = pytest.mark.integration

VLLM_ROUTER = os.path.join(os.path.dirname(sys.executable), "vllm-router")
MODEL = "tiny"  # the stub/sim model's alias
SIM_BLOCK_SIZE = 16  # the sim backend's KV block
START_TIMEOUT_S = 60.0

# Prompts whose byte tokens share no prefix: the router has no cache match for the second one.
ALPHA = "alpha: the first conversation, long enough to be a prefix worth keeping"
ZULU = "zulu: a second and unrelated conversation, also long enough to matter"
# Which prefix each follow-up extends: runs of one, so that alternating boards (round-robin) fails.
FOLLOW_UPS = "AAAZZAZ"
SUFFIXES = (" again", " once more", " and again", " one more time", " still", " later on", " at last")


def follow_ups(homes: dict[str, int]) -> list[tuple[str, int, bool]]:
    """(prompt, the board that holds its prefix, streamed?) for each follow-up of FOLLOW_UPS."""
    base = {"A": ALPHA, "Z": ZULU}
    return [(base[g] + SUFFIXES[i], homes[g], bool(i % 2)) for i, g in enumerate(FOLLOW_UPS)]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """GET `url`: its HTTP status, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, urllib.error.URLError):
        return None


def wait_ready(router: subprocess.Popen, url: str, log_path: str) -> None:
    """Until the router answers /readiness (it first waits for every worker's /health)."""
    def up() -> bool:
        if router.poll() is not None:
            raise AssertionError(f"vllm-router exited {router.returncode} during start-up:\n"
                                 f"{read_log(log_path)[-3000:]}")
        return http_status(f"{url}/readiness") == 200

    try:
        wait_until(up, timeout=START_TIMEOUT_S, interval=0.1, what="vllm-router ready")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{read_log(log_path)[-3000:]}") from None


@dataclass
class Board:
    """One board: a daemon and the HTTP front in front of it."""

    daemon: DaemonProc
    front: HttpFrontProc
    kv_events: str = ""  # the daemon's KV-event PUB endpoint, when it publishes

    def served(self) -> int:
        """Requests the daemon has accepted (render calls never reach it: the front tokenizes itself)."""
        with self.daemon.client(timeout=10.0) as c:
            return c.stats()["frontend"]["requests"]

    def kill(self, what: str) -> None:
        """The board dies: "front" = its front killed outright and its daemon stopped (the router's
        connections are refused); "daemon" = only its daemon stopped (the front answers 503 and its
        /health says 503)."""
        if what == "front":
            self.front.proc.kill()
            self.front.proc.wait()
        self.daemon.stop()


@dataclass
class Cluster:
    boards: list[Board]
    router: subprocess.Popen
    router_url: str
    router_log: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.router_url}/v1", api_key="unused", max_retries=0, timeout=60.0)

    def counts(self) -> list[int]:
        return [b.served() for b in self.boards]

    def which_served(self, before: list[int], n: int = 1) -> int:
        """The index of the board that served the last `n` requests (each board's count checked)."""
        after = self.counts()
        delta = [a - b for a, b in zip(after, before)]
        assert sorted(delta) == [0, n], f"expected one board to serve {n} request(s), got deltas {delta}"
        return delta.index(n)


@pytest.fixture
def cluster_of(daemon, short_dir):
    """Factory: `cluster_of(front_args=[...], **daemon_options)` -> two boards behind a started router."""
    boards: list[Board] = []
    routers: list[subprocess.Popen] = []

    def start(front_args: list[str] | None = None, kv_events: bool = False, settings: dict | None = None,
              pd: bool = False, **daemon_options) -> Cluster:
        """`kv_events`: the daemons publish KV events and the router runs `--policy kv_aware` on them.
        `pd`: board 0 is a prefill board, board 1 a decode board, and the router runs in its PD mode."""
        started = []
        for i in range(2):  # both daemons load at once (a model takes seconds), then both fronts
            kv = f"tcp://127.0.0.1:{free_port()}" if kv_events else ""
            board_settings = {**(settings or {}), **({"kv_events.endpoint": kv} if kv else {})}
            if pd:  # both boards on this host with disk KV tiers: the decode board imports the prefill board's
                board_settings.update({"board.role": ("prefill", "decode")[i],
                                       "kv.disk_dir": os.path.join(short_dir, f"kv{i}")})
                if i == 1:
                    board_settings.update({"board.handoff_peer_dirs": [os.path.join(short_dir, "kv0")],
                                           "kv.promote": "always"})
            started.append((daemon(settings=board_settings, wait=False, **daemon_options), kv))
        for d, kv in started:
            d.wait_healthy(START_TIMEOUT_S)
            log = os.path.join(short_dir, f"front{len(boards)}.log")
            boards.append(Board(d, start_http_front(d.endpoint, log, front_args), kv))
        policy = ["--policy", "cache_aware"]
        if kv_events:
            policy = ["--policy", "kv_aware", "--kv-event-block-size", str(SIM_BLOCK_SIZE), "--kv-event-model", MODEL]
            for b in boards:
                policy += ["--kv-event-source", f"{b.front.url}={b.kv_events}"]
        port = free_port()
        router_log = os.path.join(short_dir, "router.log")
        with open(router_log, "wb") as log:
            router = subprocess.Popen(
                [VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port),
                 *(["--vllm-pd-disaggregation", "--prefill", boards[0].front.url, "--decode", boards[1].front.url]
                   if pd else ["--worker-urls", *[b.front.url for b in boards]]), *policy,
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                 "--health-check-interval-secs", "1", "--worker-startup-check-interval", "1",
                 "--log-level", "debug"],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        routers.append(router)
        router_url = f"http://127.0.0.1:{port}"
        wait_ready(router, router_url, router_log)
        return Cluster(boards, router, router_url, router_log)

    try:
        yield start
    finally:
        for router in routers:
            if router.poll() is None:
                router.send_signal(signal.SIGTERM)
                try:
                    router.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    router.kill()
                    router.wait()
        # a board the test killed has a dead front; the others must stop cleanly (the daemons are the
        # `daemon` fixture's: stopped and checked after this)
        rcs = [b.front.stop() for b in boards if b.front.proc.returncode is None]
        assert all(rc == 0 for rc in rcs), f"HTTP fronts exited {rcs}"


@pytest.fixture
def cluster(cluster_of):
    return cluster_of(backend="sim")


def open_stream(client: openai.OpenAI, prompt: str):
    """A long streamed completion, read up to its first chunk: in flight at the router until closed."""
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1500, stream=True)
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    return stream


def complete(client: openai.OpenAI, prompt: str, stream: bool = False) -> str:
    """One short completion through the router; its text, and it ran to max_tokens."""
    if stream:
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
        return "".join(c.choices[0].text for c in chunks)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    return r.choices[0].text


def spread_over_both(c: Cluster, client: openai.OpenAI) -> tuple[int, int]:
    """ALPHA lands on one board while it streams, ZULU (no prefix match) on the least-loaded other one."""
    before = c.counts()
    s1 = open_stream(client, ALPHA)
    x = c.which_served(before)
    before = c.counts()
    s2 = open_stream(client, ZULU)
    y = c.which_served(before)
    s1.close()
    s2.close()
    assert x != y, "the router sent an unrelated prompt to the busy board"
    return x, y


def test_router_serves_through_both_boards_and_follows_prefixes(cluster):
    c = cluster
    client = c.client()
    x, y = spread_over_both(c, client)

    # Cache-aware: a prompt extending ALPHA goes back to the board that has ALPHA, ZULU's to the other,
    # streamed or not. Needs the fronts' render endpoint: without token ids every request lands on one board.
    for prompt, board, stream in follow_ups({"A": x, "Z": y}):
        before = c.counts()
        assert complete(client, prompt, stream) != ""
        assert c.which_served(before) == board, f"{prompt!r} did not follow its prefix to board {board}"

    # Chat through the router: the sim model has no chat template, and the board's own OpenAI-shaped 400
    # reaches the client unchanged (the router retries only 408/429/5xx).
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert e.value.body["code"] == "no_chat_template"

    # /v1/models through the router comes from a board.
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize("what", ["front", "daemon"])
def test_router_stops_sending_to_a_killed_board(cluster, what):
    c = cluster
    client = c.client()
    x, y = spread_over_both(c, client)
    c.boards[x].kill(what)
    survivor = c.boards[y]

    # ALPHA's prefix points at the dead board. The router retries a refused connection (or the front's
    # 503) 5 times on the same board and then answers with the last error; after 10 failed attempts its
    # circuit breaker opens (and after 3 failed health checks the board is out anyway), so at most 2
    # clients see an error.
    failed = 0

    def served_again() -> bool:
        nonlocal failed
        before = survivor.served()
        try:
            complete(client, ALPHA + " after the crash")
        except (openai.InternalServerError, openai.APIConnectionError):
            failed += 1
            return False
        assert survivor.served() == before + 1
        return True

    wait_until(served_again, timeout=30.0, interval=0.2, what="a request served after the board died")
    print(f"{what} killed: {failed} client(s) got an error")  # shown with -s; docs/cluster.md quotes it
    assert failed <= 2, f"{failed} clients got an error while the router dropped the dead board"

    before = survivor.served()
    for i, prompt in enumerate((ALPHA, ZULU, ALPHA + " later", ZULU + " later")):
        assert complete(client, prompt, stream=bool(i % 2)) != ""
    assert survivor.served() == before + 4
    assert c.router.poll() is None
    if what == "daemon":  # the orphaned front keeps running and tells the router why
        assert http_status(f"{c.boards[x].front.url}/health", timeout=30.0) == 503  # it asks the daemon first


GEMMA = "gemma3-270m"
GEMMA_TEMPLATE = os.path.join(os.path.dirname(__file__), "gemma_chat_template.jinja")  # its GGUF has none


def test_router_chat_follows_conversations_on_gemma_boards(cluster_of, gemma_package):
    """Chat through the router on a real model: /v1/chat/completions/render gives the template's token ids,
    so a conversation's next turn goes back to the board that holds its beginning."""
    c = cluster_of(["--chat-template", GEMMA_TEMPLATE], backend="llamacpp", extra=["--package", gemma_package],
                   settings={"board.threads_per_chip": 1, "model.alias": GEMMA})
    client = c.client()
    first = {"paris": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
             "rome": [{"role": "user", "content": "Name a famous Roman monument, please, in a few words."}]}

    # Spread the two conversations: the first one's stream stays open (ignore_eos, passed on by the router
    # as the client sent it) while the second is routed to the less loaded board.
    home = {}
    streams = []
    for name, messages in first.items():
        before = c.counts()
        stream = client.chat.completions.create(model=GEMMA, messages=messages, max_tokens=400, stream=True,
                                                temperature=0, extra_body={"ignore_eos": True})
        next(iter(stream))
        home[name] = c.which_served(before)
        streams.append(stream)
    for stream in streams:
        stream.close()
    assert home["paris"] != home["rome"]

    for name, stream in (("paris", False), ("paris", True), ("paris", False), ("rome", True), ("rome", False),
                         ("paris", True), ("rome", False)):  # runs, as FOLLOW_UPS: round-robin fails them
        messages = first[name] + [{"role": "assistant", "content": "Sure."},
                                  {"role": "user", "content": "Thank you! And one more thing?"}]
        before = c.counts()
        if stream:
            chunks = list(client.chat.completions.create(model=GEMMA, messages=messages, max_tokens=4,
                                                         stream=True, temperature=0))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("length", "stop")
        else:
            r = client.chat.completions.create(model=GEMMA, messages=messages, max_tokens=4, temperature=0)
            text = r.choices[0].message.content
            assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
        assert text.strip(), f"empty chat answer for {name}"
        assert c.which_served(before) == home[name], f"the {name} conversation left its board"


def router_saw(c: Cluster, board: Board, seq: int) -> bool:
    """The router's KV index has applied `board`'s event message `seq` (its debug log says so)."""
    pat = re.compile(rf"live sequence advanced source={re.escape(board.front.url)} rank=0 seq=(\d+)")
    return any(int(m) >= seq for m in pat.findall(ANSI.sub("", read_log(c.router_log)[-(1 << 20):])))


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_kv_aware_router_follows_what_each_board_holds(cluster_of):
    """Each board is warmed DIRECTLY (the router never sees those requests); its KV events alone tell the
    router's kv_aware policy where each prefix lives, so follow-ups through the router land there."""
    c = cluster_of(kv_events=True, backend="sim")
    ctx = zmq.Context()
    subs = []
    try:
        for b in c.boards:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(b.kv_events)
            subs.append(sub)
        prompts = [ALPHA, ZULU]
        for b, sub, prompt in zip(c.boards, subs, prompts):
            with openai.OpenAI(base_url=f"{b.front.url}/v1", api_key="unused", max_retries=0, timeout=60) as direct:
                seq = None
                while seq is None:  # PUB/SUB drops messages sent before the subscription is in place
                    direct.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
                    prompt += "!"  # a fresh prompt next time: a cached one publishes nothing
                    if sub.poll(2000):
                        seq = struct.unpack(">Q", sub.recv_multipart()[1])[0]
            wait_until(lambda: router_saw(c, b, seq), timeout=30.0, interval=0.05,
                       what=f"the router applying {b.front.url}'s KV events")

        client = c.client()
        for prompt, board, stream in follow_ups({"A": 0, "Z": 1}):
            before = c.counts()
            assert complete(client, prompt, stream=stream) != ""
            assert c.which_served(before) == board, f"{prompt!r} did not go to the board holding its prefix"
    finally:
        for sub in subs:
            sub.close(linger=0)
        ctx.term()


def test_prefill_decode_disaggregation_behind_the_routers_pd_mode(cluster_of):
    """`--vllm-pd-disaggregation`: the router asks the prefill board for one token (kv_transfer_params
    do_remote_decode), passes its answer's kv_transfer_params to the decode board with the original body,
    and the client gets the decode board's answer: the same text as the decode board serving it alone."""
    c = cluster_of(backend="ref", pd=True)
    prefill, decode = c.boards
    direct = openai.OpenAI(base_url=f"{decode.front.url}/v1", api_key="unused", max_retries=0, timeout=60.0)
    cases = [("the quick brown fox", 0.0, 8, False), ("jumps over the lazy dog " * 6, 0.8, 12, True),
             ("a", 0.0, 5, True), ("seeded and sampled", 1.0, 10, False)]
    before_p, before_d = prefill.served(), decode.served()
    for prompt, temperature, n, stream in cases:
        kw = dict(model=MODEL, prompt=prompt, max_tokens=n, temperature=temperature, seed=27)
        if stream:
            chunks = list(c.client().completions.create(stream=True, **kw))
            text = "".join(ch.choices[0].text for ch in chunks)
        else:
            got = c.client().completions.create(**kw)
            text = got.choices[0].text
        want = direct.completions.create(**kw)  # afterwards: before, it would be a prefix hit on the decode board
        if not stream:
            assert got.usage.prompt_tokens == want.usage.prompt_tokens  # the prompt counted once
            assert got.usage.completion_tokens == want.usage.completion_tokens
        else:
            assert chunks[-1].choices[0].finish_reason == want.choices[0].finish_reason
        assert text == want.choices[0].text, (prompt, text, want.choices[0].text)
    assert prefill.served() - before_p == len(cases)  # every request's prefill leg
    assert decode.served() - before_d == 2 * len(cases)  # the direct runs and every decode leg
    with prefill.daemon.client() as pc, decode.daemon.client() as dc:
        p, d = pc.stats()["daemon"], dc.stats()["daemon"]
    assert p["handoff_exports"] == len(cases)
    # the decode board found the prompts' blocks in the prefill board's disk tier and imported them
    assert d["handoff_imported"] + d["handoff_recomputed"] == len(cases) and d["handoff_imported"] >= 2, d
    with decode.daemon.client() as dc:
        assert dc.stats()["scheduler"]["counters"]["tier_hit_tokens"] > 0
