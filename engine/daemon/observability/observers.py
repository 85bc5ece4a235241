"""What the loop tells its observers (metrics, trace): one object, one call per fact.

The loop calls these hooks from its own thread with the facts it already has
(the actions it carries out, the job results it reads, a chip going down, the
end of a turn); the observers keep their own bookkeeping and never reach into
the scheduler. Metrics are always recorded (the `stats` op reports them); the
HTTP server runs only when metrics.port is set, the trace only with --trace.
"""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

from engine.core.actions import ReleaseBlocks, SubmitJob

from engine.daemon.observability.metrics import MetricsPortBusy, MetricsRecorder
from engine.daemon.observability.trace import DEFAULT_MAX_EVENTS, TraceWriter

if TYPE_CHECKING:
    from engine.config import Config
    from engine.daemon.views import Views
    from ipc.records import JobResult

__all__ = ["MetricsPortBusy", "Observers"]

# Actions that belong to no request (a load's internal requests are filtered by request id).
_NO_REQUEST = (SubmitJob, ReleaseBlocks)


class Observers:
    def __init__(self, cfg: "Config", *, trace_path: str | None = None, t0: float = 0.0,
                 trace_max_events: int = DEFAULT_MAX_EVENTS) -> None:
        tenants = {"default", *cfg.queues.tenants}
        self.metrics = MetricsRecorder(cfg.model.alias, bounded_tenants=tenants)
        self.trace: TraceWriter | None = None
        if cfg.metrics.port:
            self.metrics.serve(cfg.metrics.host, cfg.metrics.port)  # MetricsPortBusy propagates
        if trace_path:
            try:
                self.trace = TraceWriter(trace_path, board=cfg.board.id, t0=t0, max_events=trace_max_events)
            except OSError:
                self.metrics.close()
                raise

    def on_actions(self, actions: list, now: float, generation: int = 0, alias: str | None = None,
                   internal: Container[int] = ()) -> None:
        """`internal`: request ids of a load's golden and warm-up requests: traced, but not clients' requests,
        so not in the request metrics (their tokens and jobs count in the generation's scheduler figures)."""
        seen = actions if not internal else [a for a in actions if type(a) in _NO_REQUEST
                                             or a.request_id not in internal]
        self.metrics.on_actions(seen, now, generation, alias)
        if self.trace is not None:
            self.trace.on_actions(actions, now)

    def on_result(self, chip: int, result: "JobResult", now: float, generation: int = 0) -> None:
        self.metrics.on_result(chip, result, now, generation)
        if self.trace is not None:
            self.trace.on_result(chip, result, now)

    def on_chip_down(self, chip: int, now: float, generation: int = 0) -> None:
        self.metrics.on_chip_down(chip, generation)
        if self.trace is not None:
            self.trace.on_chip_down(chip, now)

    def publish(self, views: "Views", now: float) -> None:
        self.metrics.publish(views, now)

    def families(self, views: "Views", now: float) -> list[dict]:
        """The metric families as of now (for the stats op, which runs on the loop thread)."""
        self.metrics.publish(views, now, force=True)
        return self.metrics.families()

    def close(self) -> None:
        self.metrics.close()
        if self.trace is not None:
            self.trace.close()
