"""The in-process simulator: the scheduler core on a virtual clock with the sim latency model."""

from __future__ import annotations

from engine.sim.runner import POLICIES, SimResult, predict, simulate
from engine.sim.workload import SimRequest, make_workload

__all__ = ["POLICIES", "SimRequest", "SimResult", "make_workload", "predict", "simulate"]
