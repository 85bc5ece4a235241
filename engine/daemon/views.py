"""What the board reports about itself: the `health`, `stats` and `models` answers and the board counters.

Read-only over the generations registry, the frontend and the loop's
liveness; answered on the loop thread (the `stats` op, the metrics snapshot).
Kept apart from the loop so that a view never reaches for a socket, and a
new figure is added here without touching the loop's turn.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.daemon.handoff.intake import HANDOFF_COUNTER_KEYS
from engine.daemon.lifecycle.liveness import LoopLiveness
from engine.daemon.load_report import load_report

if TYPE_CHECKING:
    from engine.daemon.frontend import Frontend
    from engine.daemon.generations import Generations
    from engine.daemon.heap_trim import HeapTrimmer

BOARD_COUNTER_KEYS = ("jobs_submitted", "ring_full", "results", "chip_failures", "worker_restarts") + HANDOFF_COUNTER_KEYS


class Views:
    def __init__(self, gens: "Generations", frontend: "Frontend", liveness: LoopLiveness, *, started_at: float,
                 loop_counters: dict[str, int], metric_families: Callable[[float], list[dict]],
                 heap_trim: "HeapTrimmer | None" = None) -> None:
        """`loop_counters`: the loop's own counters (read live); `metric_families(now)`: the metric families
        as of now (engine.daemon.observability.observers.Observers.families)."""
        self.gens = gens
        self.frontend = frontend
        self.liveness = liveness
        self.started_at = started_at
        self._loop_counters = loop_counters
        self._metric_families = metric_families
        self.heap_trim = heap_trim  # board.malloc_trim_interval_s: its trims and what they gave back

    def model_info(self) -> dict:
        g = self.gens.default_generation()
        if g is None:
            return {"alias": self.gens.model_alias, "backend": self.gens.cfg.board.backend, "generation": None}
        return g.model_info()

    def models_list(self) -> list[dict]:
        gens = self.gens
        return [gens.entry(r) for r in sorted(gens.models.generations.values(), key=lambda r: r.id)]

    def chips_info(self, now: float) -> list[dict]:
        g = self.gens.default_generation()
        return [] if g is None else g.chips_info(now)

    def board_counters(self) -> dict:
        out = dict(self.gens.retired_counters)
        for g in self.gens.generations.values():
            for k, v in g.counters.items():
                out[k] = out.get(k, 0) + v
        for k in BOARD_COUNTER_KEYS:
            out.setdefault(k, 0)
        return out | self._loop_counters

    def health(self, now: float) -> dict:
        gens = self.gens
        g = gens.default_generation()
        up = g.supervisor.in_service() if g is not None and g.supervisor is not None else []
        sched = g.scheduler if g is not None else None
        loop_ok = self.liveness.healthy(now)
        return {
            "ok": bool(up) and loop_ok and gens.accepting,
            "accepting": gens.accepting,
            "loop_ok": loop_ok,
            "loop_lag_ms": round(self.liveness.lag_s(now) * 1000, 3),
            "chips_up": len(up),
            "chips": self.chips_info(now),
            "model": self.model_info(),
            "models": sorted(gens.models.published),
            "adapters": gens.lora.served(),  # what a balancer routes adapter requests by
            "board": gens.cfg.board.id,
            "role": gens.cfg.board.role,
            "pid": os.getpid(),
            "uptime_s": round(now - self.started_at, 3),
            "active_requests": self.frontend.active(),
            "load": load_report(sched.stats()) if sched is not None else None,
        }

    def stats(self, now: float) -> dict:
        default = self.gens.default_generation()
        sched = default.scheduler if default is not None else None
        return {
            "scheduler": sched.stats(now) if sched is not None else None,
            "piece_cache": default.piece_cache_stats() if default is not None else None,
            "heap_trim": self.heap_trim.stats() if self.heap_trim is not None else None,
            "metrics": self._metric_families(now),
            "frontend": self.frontend.counters.as_dict(),
            "daemon": dict(self.board_counters(), active_requests=self.frontend.active(),
                           loop_turns=self.liveness.turns,
                           loop_max_turn_ms=round(self.liveness.max_turn_s * 1000, 3)),
            "chips": self.chips_info(now),
            "models": [dict(self.gens.entry(g.rec), scheduler=g.scheduler.stats(now) if g.scheduler else None,
                            chips=g.chips_info(now), piece_cache=g.piece_cache_stats())
                       for g in sorted(self.gens.generations.values(), key=lambda g: g.id)],
            "uptime_s": round(now - self.started_at, 3),
        }
