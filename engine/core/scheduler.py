"""Where callers find the scheduler: `engine.core.sched` holds it, one module per part (docs/architecture.md)."""

from engine.core.sched.scheduler import Scheduler
from engine.core.sched.state import ChipSpec, ModelSpec
from engine.core.scheduler_config import SchedulerConfig

__all__ = ["ChipSpec", "ModelSpec", "Scheduler", "SchedulerConfig"]
