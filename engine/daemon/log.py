"""The daemon's log: one line per thing that happened, on stderr (journald under systemd).

Two formats: `json` (one JSON object per line, `{"ts", "level", "event", ...}`,
what journald and log shippers read) and `human` (a time, the level, the
event and `key=value` pairs, for a terminal). Every kind of line has a stable
`event` name from `EVENTS`, which also fixes its level; docs/operations.md
lists them, and a test holds the code, this table and that page together.
"""

from __future__ import annotations

import sys
import time

import orjson

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
# The human format's level column: the conventional short names, not a cut at five letters ("WARNI").
HUMAN_LEVELS = {"debug": "DEBUG", "info": "INFO", "warning": "WARN", "error": "ERROR"}

EVENTS: dict[str, str] = {
    # start-up and serving
    "starting": "info",
    "reaped_stale_shm": "info",
    "metrics_serving": "info",
    "serving": "info",
    "kv_events_publishing": "info",
    "handoff_serving": "info",
    "handoff_pull_skipped": "warning",
    "handoff_pull_failed": "warning",
    "handoff_shm_refused": "info",
    "kv_tiers": "info",
    "kv_tiers_unsupported": "warning",
    "kv_host_pool_too_small": "warning",
    "kv_index_flush_failed": "warning",
    "kv_disk_warm": "info",
    "kv_disk_ignored": "info",
    "kv_tiers_close_failed": "warning",
    "startup_failed": "error",
    # chips
    "chip_up": "info",
    "chip_down": "warning",
    "chip_hung": "warning",
    "inflight_downgraded": "warning",
    "inflight_reenabled": "info",
    "restart_failed": "error",
    "stop_failed": "warning",
    # requests
    "request_failed": "error",
    # model lifecycle (engine/daemon/models)
    "model_ready": "info",
    "model_load_failed": "warning",
    "model_draining": "info",
    "model_drain_first": "info",
    "model_recovering": "warning",
    "model_unloaded": "info",
    # LoRA adapters (engine/daemon/lora_registry.py)
    "lora_loaded": "info",
    "lora_refused": "warning",
    "lora_unloading": "info",
    "lora_unloaded": "info",
    # stop, drain
    "drain_started": "info",
    "drain_progress": "info",
    "drain_ended": "info",
    "drain_timed_out": "warning",
    "stopping": "info",
    "stopped": "info",
    "fatal": "error",
    # reload
    "reload_started": "info",
    "config_reloaded": "info",
    "reload_needs_restart": "warning",
    "reload_failed": "error",
    # systemd
    "notify_socket_invalid": "warning",
    "watchdog_enabled": "info",
    "test_hook_stall": "warning",
    "heap_snapshots_on": "warning",
    "malloc_trim": "info",
    # the balancer (`npuserve balance`) logs through the same catalogue
    "balancing": "info",
    "reloaded": "info",
    "reload_ignored": "warning",
    "bad_upstream_event": "warning",
    "backend_disconnected": "warning",
}

_state = {"min_level": LEVELS["info"], "human": False}


def configure(level: str = "info", fmt: str = "auto", stream=None) -> None:
    """Set the lowest level written and the format (`auto` = human when stderr is a terminal)."""
    assert level in LEVELS and fmt in ("auto", "json", "human"), (level, fmt)
    stream = sys.stderr if stream is None else stream
    _state["min_level"] = LEVELS[level]
    if fmt == "auto":
        try:
            _state["human"] = stream.isatty()
        except (AttributeError, ValueError):
            _state["human"] = False
    else:
        _state["human"] = fmt == "human"


def log(event: str, **fields) -> None:
    level = EVENTS.get(event, "info")
    if LEVELS[level] < _state["min_level"]:
        return
    ts = time.time()
    line = human_line(ts, level, event, fields) if _state["human"] else json_line(ts, level, event, fields)
    try:
        sys.stderr.buffer.write(line + b"\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def json_line(ts: float, level: str, event: str, fields: dict) -> bytes:
    rec = {"ts": round(ts, 3), "level": level, "event": event, **fields}
    try:
        return orjson.dumps(rec, default=str)
    except TypeError:
        return orjson.dumps({"ts": rec["ts"], "level": level, "event": event, "fields": repr(fields)})


def human_line(ts: float, level: str, event: str, fields: dict) -> bytes:
    """`20:44:37.123 WARN  chip_down chip=1 reason="..."`; a traceback follows on its own lines."""
    clock = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"
    parts = [clock, HUMAN_LEVELS[level].ljust(5), event]
    tail = ""
    for k, v in fields.items():
        if k == "traceback" and isinstance(v, str):
            tail = "\n" + v.rstrip("\n")
            continue
        parts.append(f"{k}={_human_value(v)}")
    return (" ".join(parts) + tail).encode("utf-8", "replace")


def _human_value(v) -> str:
    if isinstance(v, str):
        return v if v and all(c.isalnum() or c in "._-/:@" for c in v) else orjson.dumps(v).decode()
    try:
        return orjson.dumps(v, default=str).decode()
    except TypeError:
        return repr(v)
