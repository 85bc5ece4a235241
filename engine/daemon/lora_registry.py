"""The board's LoRA adapters: loading them through the gate, naming them, and unloading them under load.

An adapter is loaded onto a base model alias (`[[lora.adapter]]`, `--lora`,
`admin load-lora`). Loading runs the package gate's checks before anything
reaches a worker: the folder (inside the model root when one is set), the
optional Ed25519 signature of its manifest, every file's sha256, then its fit
with the base model (architecture, layer count, every target matrix's shape,
from the npz headers) and that the board's backend serves adapters. A refused
adapter is named with its reason and the board serves on.

A loaded adapter gets a board number (never reused), which requests carry
(`GenerateParams.adapter`) and jobs name per lane; every generation of its
base alias registers it with its workers (`LORA_ADD`), which keep the
adapters in device slots and a host cache (`workers.lora.adapter_book`).
Unloading takes the name away at once (new requests get 404
`adapter_not_found`); the workers drop it (`LORA_DROP`) once no request that
named it is live, so running requests finish on it.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.daemon.log import log
from engine.daemon.supervisor import ChipState
from workers.gguf_package import GgufPackage
from workers.lora.adapter_package import AdapterFacts, check_against_package, read_adapter_facts
from workers.lora.gguf_adapter import check_gguf_against_base
from workers.model_package import ModelPackage
from workers.package_manifest import MANIFEST, PackageError

if TYPE_CHECKING:
    from engine.daemon.models.generation import Generation

STEPS = ("resolve", "signature", "verify", "validate")


class AdapterRefused(Exception):
    """An adapter failed a load step; `code`/`reason` for the error event, `step` one of STEPS."""

    def __init__(self, step: str, message: str, code: int = 400, reason: str = "adapter_rejected") -> None:
        super().__init__(f"{step}: {message}")
        self.step, self.message, self.code, self.reason = step, message, code, reason


@dataclass
class Adapter:
    number: int
    name: str
    path: str
    sha256: str
    base: str  # the model alias it adapts
    rank: int
    targets: tuple[str, ...]
    state: str = "ready"  # "unloading": no new requests, dropped from the workers once none is live
    requests: int = 0
    tokens: int = 0
    live: set[int] = field(default_factory=set)
    facts: AdapterFacts | None = field(default=None, repr=False)  # its manifest, to check it against a new base

    def entry(self) -> dict:
        """Its `models` entry (vLLM lists an adapter with its base model as `parent`)."""
        return {"alias": self.name, "kind": "lora", "parent": self.base, "state": self.state,
                "adapter": self.number, "path": self.path, "sha256": self.sha256, "rank": self.rank,
                "targets": list(self.targets), "active_requests": len(self.live),
                "counters": {"requests": self.requests, "tokens": self.tokens}}


def verify_adapter(path: str, model_root: str = "", public_key: str = "", resolve: bool = False) -> AdapterFacts:
    """The gate's file-system steps (safe on a worker thread): folder, signature, sha256 of every file."""
    if resolve and model_root:
        from engine.daemon.models.package_gate import PackageRefused, resolve_package
        try:
            path = resolve_package(model_root, path)
        except PackageRefused as e:
            raise AdapterRefused("resolve", e.message) from None
    path = os.path.realpath(path)
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        raise AdapterRefused("resolve", f"{path}: not an adapter package (no {MANIFEST})")
    signed = None
    if public_key:
        from engine.daemon.models.package_signature import SignatureError, read_signed_manifest
        try:
            signed = read_signed_manifest(public_key, path)
        except SignatureError as e:
            raise AdapterRefused("signature", str(e)) from None
        except OSError as e:
            raise AdapterRefused("verify", f"{path}: cannot read ({e.strerror})") from None
    try:
        facts = read_adapter_facts(path)
    except PackageError as e:
        raise AdapterRefused("verify", str(e)) from None
    if signed is not None:
        import hashlib
        if hashlib.sha256(signed).hexdigest() != facts.sha256:
            raise AdapterRefused("signature", f"{path}/{MANIFEST}: changed while it was being verified")
    return facts


def check_fits_package(facts: AdapterFacts, pkg, alias: str) -> None:
    """PackageError unless the adapter fits the base package (architecture, layers, every target's shape).

    Reads the adapter's npz or GGUF headers (and a GGUF base's): call it off the loop."""
    if isinstance(pkg, ModelPackage):
        check_against_package(facts, pkg)
    elif isinstance(pkg, GgufPackage):  # llama.cpp's LoRA GGUF against the base GGUF, from the headers
        if facts.format != "gguf":
            raise PackageError(f"{facts.path}: a {facts.format} adapter cannot adapt a GGUF model")
        check_gguf_against_base(facts, pkg.gguf_path)
    else:
        raise PackageError(f"base model {alias!r} has no package to check the adapter against")


def misfits(adapters: list[tuple[str, AdapterFacts]], pkg, alias: str) -> dict[str, str]:
    """The adapters (name -> why) that do not fit `pkg`, a new package for their base alias (off the loop)."""
    out = {}
    for name, facts in adapters:
        try:
            check_fits_package(facts, pkg, alias)
        except PackageError as e:
            out[name] = str(e)
    return out


class LoraRegistry:
    """One per board, owned by `engine.daemon.generations.Generations` (`gens`), whose generations it serves."""

    def __init__(self, gens) -> None:
        self.gens = gens
        self.by_name: dict[str, Adapter] = {}
        self.unloading: dict[int, Adapter] = {}
        self.by_rid: dict[int, Adapter] = {}
        self._next = 0
        self._pending: list[tuple[concurrent.futures.Future, Callable]] = []
        self._synced: frozenset[int] = frozenset()  # serving generations `sync` last saw (a new one needs them)
        self.loads = self.unloads = self.refused = 0

    # ---- naming ----------------------------------------------------------------------------------------
    def resolve(self, name: str | None) -> Adapter | None:
        return None if name is None else self.by_name.get(name)

    def admit(self, rid: int, a: Adapter) -> None:
        a.live.add(rid)
        a.requests += 1
        self.by_rid[rid] = a

    def finished(self, rid: int, usage: dict | None) -> None:
        a = self.by_rid.pop(rid, None)
        if a is not None:
            a.live.discard(rid)
            if usage:
                a.tokens += int(usage.get("completion_tokens", 0))

    # ---- load ------------------------------------------------------------------------------------------
    def load(self, name: str, path: str, base: str = "", *, resolve: bool = False) -> Adapter:
        """Verify and attach an adapter now (start-up); AdapterRefused names the failed step."""
        cfg = self.gens.cfg
        facts = verify_adapter(path, cfg.model.root, cfg.model.signing_public_key, resolve)
        return self._attach(name, facts, base)

    def begin_load(self, name: str, path: str, base: str, done: Callable[[Adapter | None, AdapterRefused | None], None],
                   *, resolve: bool = True) -> None:
        """Verify on a worker thread (hashing a large adapter must not stall the loop); attach in `tick`."""
        cfg = self.gens.cfg
        self._precheck(name)
        fut = self.gens.run_in_thread(lambda: verify_adapter(path, cfg.model.root, cfg.model.signing_public_key,
                                                             resolve))

        def attach(f: concurrent.futures.Future) -> None:
            try:
                a = self._attach(name, f.result(), base)
            except AdapterRefused as e:
                self.refused += 1
                log("lora_refused", name=name, path=path, step=e.step, error=e.message)
                done(None, e)
                return
            done(a, None)
        self._pending.append((fut, attach))

    def _precheck(self, name: str) -> None:
        if name in self.by_name:
            raise AdapterRefused("validate", f"adapter {name!r} is loaded already; unload it first", 409, "busy")
        if name in self.gens.models.published:
            raise AdapterRefused("validate", f"{name!r} names a model; an adapter needs a name of its own", 409,
                                 "busy")

    def _attach(self, name: str, facts: AdapterFacts, base: str) -> Adapter:
        self._precheck(name)
        gens, cfg = self.gens, self.gens.cfg
        if len(self.by_name) >= cfg.lora.max_adapters:
            raise AdapterRefused("validate", f"the board has {len(self.by_name)} adapters loaded "
                                             f"(lora.max_adapters); unload one first", 409, "busy")
        base = base or gens.model_alias
        gid = gens.models.published.get(base)
        g = gens.generations.get(gid) if gid is not None else None
        if g is None:
            raise AdapterRefused("validate", f"base model {base!r} is not loaded", 404, "model_not_found")
        if base in gens.models.busy:  # the replace checked the adapters it saw: this one would go unchecked
            other = gens.models.generations[gens.models.busy[base]]
            raise AdapterRefused("validate", f"base model {base!r}: a {other.kind} is running; load the adapter "
                                             f"when it ends", 409, "busy")
        self._check_fits(facts, g)
        self._next += 1
        a = Adapter(number=self._next, name=name, path=facts.path, sha256=facts.sha256, base=base,
                    rank=facts.rank, targets=facts.targets, facts=facts)
        self.by_name[name] = a
        self.loads += 1
        self.sync()
        log("lora_loaded", name=name, adapter=a.number, base=base, path=facts.path, sha256=facts.sha256)
        return a

    def _check_fits(self, facts: AdapterFacts, g: "Generation") -> None:
        cfg = self.gens.cfg
        if cfg.board.chips_per_replica > 1:
            raise AdapterRefused("validate", "adapters are not served on tensor-parallel replicas "
                                             "(board.chips_per_replica > 1)")
        slots = (g.info.extra.get("lora") or {}).get("slots", 0) if g.info is not None else 0
        if not slots:
            raise AdapterRefused("validate", f"backend {cfg.board.backend!r} serves no LoRA adapters")
        try:
            check_fits_package(facts, g.package, g.alias)
        except PackageError as e:
            raise AdapterRefused("validate", str(e)) from None

    # ---- unload ----------------------------------------------------------------------------------------
    def unload(self, name: str) -> Adapter:
        """Take the name away now; the workers drop the adapter once its live requests ended (`tick`)."""
        a = self.by_name.pop(name, None)
        if a is None:
            raise AdapterRefused("resolve", f"adapter {name!r} is not loaded", 404, "adapter_not_found")
        a.state = "unloading"
        self.unloading[a.number] = a
        self.unloads += 1
        log("lora_unloading", name=name, adapter=a.number, live=len(a.live))
        self.tick()
        return a

    # ---- the loop's turn -------------------------------------------------------------------------------
    def tick(self) -> None:
        if self.by_name and self._synced != frozenset(g.id for g in self.gens.serving_generations()):
            self.sync()  # a generation appeared (a replace or rollback of a base alias): register the adapters
        if self._pending:
            left = []
            for fut, attach in self._pending:
                if fut.done():
                    attach(fut)
                else:
                    left.append((fut, attach))
            self._pending = left
        for number, a in list(self.unloading.items()):
            for rid in [r for r in a.live if self.gens.generation_of(r) is None]:  # ended outside the actions
                self.finished(rid, None)
            if not a.live:
                del self.unloading[number]
                self._drop(number)
                log("lora_unloaded", name=a.name, adapter=number)

    def sync(self) -> None:
        """Every serving generation of an adapter's base alias registers it with its workers."""
        serving = self.gens.serving_generations()
        self._synced = frozenset(g.id for g in serving)
        for g in serving:
            for a in self.by_name.values():
                if a.base == g.alias and a.number not in g.adapters:
                    g.adapters[a.number] = (a.path, a.sha256)
                    for chip, link in enumerate(g.links):
                        if g.supervisor is not None and g.supervisor.state(chip) is ChipState.UP:
                            link.lora_add(a.number, a.path, a.sha256)

    def _drop(self, number: int) -> None:
        for g in self.gens.generations.values():
            if g.adapters.pop(number, None) is not None:
                for chip, link in enumerate(g.links):
                    if g.supervisor is not None and g.supervisor.state(chip) is ChipState.UP:
                        link.lora_drop(number)

    # ---- views -----------------------------------------------------------------------------------------
    def of_base(self, alias: str) -> list[tuple[str, AdapterFacts]]:
        """The loaded adapters of `alias` with their manifests: what a replace of it must fit."""
        return [(a.name, a.facts) for a in self.by_name.values() if a.base == alias and a.facts is not None]

    def served(self) -> dict[str, str]:
        """The adapters requests may name (not those unloading), each with the alias it adapts."""
        return {a.name: a.base for a in sorted(self.by_name.values(), key=lambda a: a.number)}

    def entries(self) -> list[dict]:
        return [a.entry() for a in sorted([*self.by_name.values(), *self.unloading.values()],
                                          key=lambda a: a.number)]

    def chip_stats(self) -> list[dict]:
        """Per chip of the serving generations: the worker's adapter report (slots, swaps, swap seconds)."""
        out = []
        for g in self.gens.serving_generations():
            for chip, link in enumerate(g.links):
                st = getattr(link, "lora_stats", None)
                if st:
                    out.append({"generation": g.id, "chip": chip, **st})
        return out

    def stats(self) -> dict:
        return {"loaded": len(self.by_name), "unloading": len(self.unloading), "loads": self.loads,
                "unloads": self.unloads, "refused": self.refused, "chips": self.chip_stats(),
                "adapters": {a.name: {"requests": a.requests, "tokens": a.tokens, "live": len(a.live)}
                             for a in self.by_name.values()}}
