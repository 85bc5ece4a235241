"""What a load run sends: length distributions, prompts, shared prefixes, tenants, arrival times.

A workload is fixed before the run (from a seed), so two runs -- or a daemon
run and the in-process simulator -- see exactly the same requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

DIST_KINDS = ("fixed", "uniform", "normal", "heavy")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, spelled `fixed:N`, `uniform:LO,HI`, `normal:MEAN,SD` or `heavy:MEDIAN,SIGMA`.

    `normal` has a floor (64 for prompts, 16 for outputs), the same as
    `engine.sim.make_workload`, so a daemon's run and the simulator's draw
    alike. `heavy` is log-normal with the given median and shape: most
    requests short, a few many times longer -- the output
    lengths of a chat service, and the workload where static batching loses
    most (a batch waits for its longest member).
    """

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        kind, _, rest = text.partition(":")
        kind = kind.strip()
        if kind not in DIST_KINDS:
            raise ValueError(f"length distribution {text!r}: kind must be one of {', '.join(DIST_KINDS)}")
        try:
            nums = [float(x) for x in rest.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"length distribution {text!r}: parameters must be numbers") from None
        need = 1 if kind == "fixed" else 2
        if len(nums) != need:
            raise ValueError(f"length distribution {text!r}: {kind} takes {need} parameter(s), e.g. "
                             + {"fixed": "fixed:128", "uniform": "uniform:32,256", "normal": "normal:128,32",
                                "heavy": "heavy:64,1.0"}[kind])
        d = cls(kind, *nums)
        if d.a < 1 or (kind == "uniform" and d.b < d.a) or (kind in ("normal", "heavy") and d.b < 0):
            raise ValueError(f"length distribution {text!r}: lengths must be >= 1, LO <= HI, spread >= 0")
        return d

    def __str__(self) -> str:
        f = lambda v: f"{v:g}"  # noqa: E731
        return f"{self.kind}:{f(self.a)}" + ("" if self.kind == "fixed" else f",{f(self.b)}")

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "normal":
            return self.a
        return self.a * math.exp(self.b * self.b / 2)

    def draw(self, rng: random.Random, floor: int = 1) -> int:
        if self.kind == "fixed":
            return max(1, int(self.a))
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        if self.kind == "normal":
            return max(floor if self.a >= floor else 1, int(rng.gauss(self.a, self.b)))
        return max(1, int(round(rng.lognormvariate(math.log(self.a), self.b))))


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float


def parse_tenants(text: str | None) -> tuple[Tenant, ...]:
    """`a:3,b:1` -> tenants a and b, a sending three requests for each of b's. None -> one `default`."""
    if not text:
        return (Tenant("default", 1.0),)
    out = []
    for part in text.split(","):
        name, _, w = part.partition(":")
        try:
            weight = float(w) if w else 1.0
        except ValueError:
            raise ValueError(f"--tenants {text!r}: weight of {name!r} is not a number") from None
        if not name or weight <= 0:
            raise ValueError(f"--tenants {text!r}: expected NAME:WEIGHT with WEIGHT > 0, e.g. a:3,b:1")
        out.append(Tenant(name.strip(), weight))
    return tuple(out)


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int
    prompt: LengthDist
    output: LengthDist
    vocab: int = 256  # prompt ids are drawn from [1, vocab)
    max_seq: int = 2048
    text: bool = False  # send `text` (a string) instead of `prompt` token ids
    prefixes: int = 0  # shared-prefix mode: this many system prompts ...
    prefix_len: int = 0  # ... of this many tokens, each request starting with one of them
    tenants: tuple[Tenant, ...] = (Tenant("default", 1.0),)
    rate: float | None = None  # open loop: Poisson arrivals at this many requests/s; None = closed loop
    seed: int = 42


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_tokens: int
    seed: int
    tenant: str = "default"
    at: float = 0.0  # open loop: send this many seconds after the start
    text: str | None = None  # text mode: the prompt as a string (the ids stay for the simulator)
    extra: dict = field(default_factory=dict)  # further generate fields (deadline_ms, ...)
    # Scenarios (tools/load/scenarios.py): the requests of one `stream` go one after another, each no
    # sooner than its `at`; `disconnect_after`: the client hangs up once it has this many tokens;
    # `background`: a stream of these stops starting new ones once every other request has finished.
    stream: int | None = None
    disconnect_after: int | None = None
    background: bool = False
    role: str = ""  # what a scenario's metrics take the request for ("stream", "long", ...); never sent

    def wire(self) -> dict:
        """The fields a client sends (what `runner` hands to `AsyncClient.stream`)."""
        d = {"max_tokens": self.max_tokens, "seed": self.seed, "ignore_eos": True, **self.extra}
        if self.tenant != "default":
            d["tenant"] = self.tenant
        return d


def _text_of(ids: list[int]) -> str:
    """Printable ASCII for text mode: one character per prompt token id (byte-level tokenizers)."""
    return "".join(chr(32 + t % 95) for t in ids)


def build(spec: WorkloadSpec) -> list[Request]:
    """The requests of `spec`, lengths clipped so prompt + output fits `max_seq`."""
    rng = random.Random(spec.seed)
    vocab = max(2, spec.vocab)
    prefixes = [[rng.randrange(1, vocab) for _ in range(spec.prefix_len)] for _ in range(spec.prefixes)]
    names = [t.name for t in spec.tenants]
    weights = [t.weight for t in spec.tenants]
    t = 0.0
    out = []
    for i in range(spec.requests):
        p = spec.prompt.draw(rng, floor=64)
        g = spec.output.draw(rng, floor=16)
        head = prefixes[i % len(prefixes)] if prefixes else []
        p = max(p, len(head) + 1)
        p = min(p, spec.max_seq - 1)
        g = max(1, min(g, spec.max_seq - p))
        ids = head[:p] + [rng.randrange(1, vocab) for _ in range(p - len(head[:p]))]
        tenant = names[0] if len(names) == 1 else rng.choices(names, weights)[0]
        if spec.rate:
            t += rng.expovariate(spec.rate)
        out.append(Request(i, ids, g, seed=i, tenant=tenant, at=t if spec.rate else 0.0,
                           text=_text_of(ids) if spec.text else None))
    return out


def from_sim(sim_requests, vocab: int) -> list[Request]:
    """Requests from `engine.sim.make_workload` (the bench-serve preset), ids folded into `vocab`."""
    v = min(vocab, 256)
    return [Request(r.index, [t % v for t in r.prompt], r.max_tokens, seed=r.index) for r in sim_requests]
