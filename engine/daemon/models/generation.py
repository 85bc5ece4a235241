"""One model generation's processes and core: its chip links (workers, rings), scheduler and supervisor.

A generation is a unit of its own (docs/models.md#model-lifecycle): its package, its scheduler core
with its own KV pool per chip, one worker per chip of the board and the rings
between them. With `board.chips_per_replica` > 1 a "chip" of everything here is
a tensor-parallel replica: its workers sit behind one `ReplicaLink`. Unloading it is stopping its workers, unlinking its shared
memory and dropping its scheduler, so "no segment, fd or process outlives its
owner" holds per generation. The loop feeds it the events of its links and
carries out the actions its scheduler returns; requests admitted under it
stay on it (their ids are in `rids`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import deque
from collections.abc import Callable
from typing import Protocol

import zmq

from engine.config import Config, validate_against_model
from engine.core.model_state import ModelState
from engine.core.model_table import GenerationRecord
from engine.config_schema import ConfigError
from engine.core.scheduler import ChipSpec, ModelSpec, Scheduler
from engine.core.scheduler_config import scheduler_config_from
from engine.daemon.chip_link import SHM_PREFIX, ChipLink, Heartbeat, Ready, Result, WorkerFailed
from engine.daemon.handoff.intake import tick_holds
from engine.daemon.kv_tier_shell import KvTierShell
from engine.daemon.log import log
from engine.daemon.replica_link import ReplicaLink
from engine.daemon.supervisor import ChipState, Decision, Supervisor
from engine.daemon.text_io import piece_cache_stats, piece_function, served_tokenizer
from ipc.lane_imports import CAPABILITY as LANE_IMPORTS
from ipc.records import Job, JobResult
from ipc.ring import RingFull
from ipc.shm import ShmFull
from workers.backends.base import BackendInfo
from workers.package_manifest import PackageError


class ChipObserver(Protocol):
    """What a generation tells the observers (engine.daemon.observability.observers.Observers) of its chips."""

    def on_result(self, chip: int, result: JobResult, now: float, generation: int = 0) -> None: ...

    def on_chip_down(self, chip: int, now: float, generation: int = 0) -> None: ...


RESTART_TIMEOUT_S = 30.0  # READY of a restarted worker


class GenerationError(Exception):
    """A generation cannot be configured; `step` names the load step (configure, validate)."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step
        self.message = message


def _forks_blocks(supports: dict) -> bool:
    """The backend runs the KV_COPY job of a choice's fork (engine/core/sched/choice_fork.py): block copies in
    general, or just that fork (`fork_blocks`, llamacpp); a backend that says nothing copies blocks."""
    return bool(supports.get("fork_blocks", supports.get("copy_blocks", True)))


def backend_options(cfg: Config, chip: int) -> dict:
    """The config keys a backend's constructor understands (block size, KV blocks, chip id)."""
    from workers.backends.registry import backend_class

    wanted = {"block_size": cfg.kv.block_size, "chip_id": chip}
    if cfg.kv.num_blocks:
        wanted["num_blocks"] = cfg.kv.num_blocks
    if cfg.board.backend == "ctypes" and cfg.model.ctypes_library:
        wanted["library"] = cfg.model.ctypes_library
    if cfg.board.backend == "llamacpp":
        wanted.update(chips=cfg.board.chips, threads=cfg.board.threads_per_chip)
    params = inspect.signature(backend_class(cfg.board.backend).__init__).parameters
    return {k: v for k, v in wanted.items() if k in params}


class Generation:
    """The shell of one generation. Loop thread only."""

    def __init__(self, rec: GenerationRecord, cfg: Config, ctx: zmq.Context, *, package_path: str | None,
                 package=None, extra_backend_options: dict | None = None,
                 register: Callable[["Generation", int], None], unregister: Callable[["Generation", int], None],
                 observe: Callable[[], ChipObserver | None]) -> None:
        self.rec = rec
        self.cfg = cfg
        self.ctx = ctx
        self.package_path = package_path
        self.package = package  # the verified package (workers.model_package), None for stub/sim/ctypes
        self.extra_backend_options = dict(extra_backend_options or {})
        self._register, self._unregister, self._observe = register, unregister, observe
        chips = cfg.board.replicas  # a tensor-parallel replica is one "chip" to everything below
        self.links: list[ChipLink | ReplicaLink] = []
        self.infos: dict[int, BackendInfo] = {}
        self.info: BackendInfo | None = None
        self.tokenizer = None
        self.piece = None  # the tokenizer's bytes of a token, behind the bounded cache (engine.daemon.text_io)
        self.scheduler: Scheduler | None = None
        self.kv_tiers: KvTierShell | None = None  # the host/disk KV tiers (kv.host_pool_mb, kv.disk_dir)
        self.handoff_hold = None  # prefill/decode hand-offs held for their decode boards (handoff/hold.py)
        self.supervisor: Supervisor | None = None
        self.rids: set[int] = set()  # requests pinned to this generation (clients' and the load job's)
        self.adapters: dict[int, tuple[str, str]] = {}  # LoRA adapters its workers know: number -> (path, sha256)
        self._backlog: list[deque[Job]] = [deque() for _ in range(chips)]
        self.device_us = [0] * chips
        self.worker_us = [0] * chips
        self.counters = {"jobs_submitted": 0, "ring_full": 0, "results": 0, "chip_failures": 0,
                         "worker_restarts": 0}

    @property
    def id(self) -> int:
        return self.rec.id

    @property
    def alias(self) -> str:
        return self.rec.alias

    # -- configure ---------------------------------------------------------------------
    def spawn(self) -> None:
        """Create every chip's rings and socket and start its worker; READY comes later (`startup_events`)."""
        cfg = self.cfg
        hb = cfg.recovery.heartbeat_interval_ms / 1000.0
        per = cfg.board.chips_per_replica
        if per > 1 and self.package is not None:
            try:
                self.package.check_tp_degree(per)  # the package's declared degrees (heads etc. divide)
            except PackageError as e:  # a config error: exit status 2 at start-up
                raise GenerationError("validate", str(e)) from None
        for chip in range(cfg.board.replicas):
            common = dict(package_path=self.package_path, runtime_dir=cfg.board.runtime_dir, heartbeat_interval_s=hb,
                          generation=self.id, job_spin_s=cfg.executor.worker_spin_us / 1e6,
                          ring_layout_cache_entries=cfg.board.ring_layout_cache_entries,
                          package_sha256=self.package.sha256 if self.package is not None else None)
            members = list(range(chip * per, (chip + 1) * per))
            opts = []
            for c in members:
                o = backend_options(cfg, c)
                o.update(self.extra_backend_options)
                if cfg.speculative.draft_package:  # the worker loads it beside the target (workers.main.load_draft)
                    o["spec_draft_package"] = cfg.speculative.draft_package
                o["lora_limits"] = [cfg.lora.max_loaded_per_chip, cfg.lora.max_cached]  # the worker's adapter book
                opts.append(o)
            if per == 1:
                link = ChipLink(ctx=self.ctx, board=cfg.board.id, chip=chip, backend=cfg.board.backend,
                                backend_options=opts[0], **common)
            else:
                link = ReplicaLink(ctx=self.ctx, board=cfg.board.id, replica=chip, chips=members,
                                   backend=cfg.board.backend, backend_options=opts,
                                   tp_timeout_s=cfg.executor.job_timeout_ms / 1000.0, **common)
            self.links.append(link)
            try:
                link.start()
            except ShmFull as e:
                raise GenerationError("configure", f"chip {chip}: {e.strerror}") from None
            except (OSError, ValueError) as e:
                raise GenerationError("configure", f"chip {chip}: cannot start its worker: {e}") from None
            self._register(self, chip)

    def startup_events(self) -> bool:
        """Read the workers' start-up messages; True once every chip is READY. Raises GenerationError."""
        for chip, lk in enumerate(self.links):
            for ev in lk.handle_events():
                if isinstance(ev, Ready):
                    self.infos[chip] = ev.info
                elif isinstance(ev, WorkerFailed):
                    raise GenerationError("configure", f"chip {chip} worker failed to start: {ev.message}")
        return len(self.infos) == len(self.links)

    def build(self, now: float) -> None:
        """All workers READY: check they agree and fit the config, load the tokenizer, make the core."""
        cfg = self.cfg
        infos = [self.infos[c] for c in range(len(self.links))]
        self.info = info = infos[0]
        for chip, other in enumerate(infos):
            if (other.vocab_size, other.max_seq, other.profiles, other.eos_ids) != \
                    (info.vocab_size, info.max_seq, info.profiles, info.eos_ids):
                raise GenerationError("configure", f"chip {chip} loaded a different model than chip 0")
        profiles = [p.batch for p in info.profiles]
        try:
            validate_against_model(cfg, profiles, info.max_seq)
        except ValueError as e:  # ConfigError
            raise GenerationError("validate", "; ".join(getattr(e, "errors", [str(e)]))) from None
        model = ModelSpec(generation=self.id, vocab_size=info.vocab_size, eos_ids=tuple(info.eos_ids),
                          max_seq=info.max_seq, profiles=tuple(profiles), chunked_prefill=info.chunked_prefill,
                          mixed_batch_tokens=info.mixed_batch_tokens,
                          spec_verify=bool(info.extra.get("spec_verify", False)),
                          spec_draft=bool(info.extra.get("spec_draft", False)),
                          lora_slots=min(int((info.extra.get("lora") or {}).get("slots", 0)),
                                         cfg.lora.max_loaded_per_chip),
                          lora_mixed=bool((info.extra.get("lora") or {}).get("mixed", True)),
                          kv_copy=_forks_blocks(info.extra.get("supports") or {}),
                          lane_imports=bool(info.extra.get(LANE_IMPORTS, False)))
        chips = [ChipSpec(chip=c, num_blocks=i.kv.num_blocks, block_size=i.kv.block_size)
                 for c, i in enumerate(infos)]
        try:
            self.tokenizer = served_tokenizer(self.package_path, info, package=self.package)
        except Exception as e:  # noqa: BLE001 - any failure to load it fails the load, named
            raise GenerationError("configure", f"cannot load the model's tokenizer: {e}") from None
        piece = None if self.tokenizer is None else piece_function(self.tokenizer, cfg.model.piece_cache_entries)
        self.piece = piece
        # Golden cases and warm-up are the load's own requests: they must not meet the clients' admission
        # limits (max_waiting_requests may be 0, max_queue_wait_ms shorter than a warm-up's queue). The
        # configured limits apply from publication (`serve`).
        sc = scheduler_config_from(cfg)
        checking = dataclasses.replace(sc, max_waiting_requests=max(sc.max_waiting_requests, 1024),
                                       max_waiting_prompt_tokens=max(sc.max_waiting_prompt_tokens, 1 << 22),
                                       max_queue_wait_s=0.0)
        if KvTierShell.wanted(cfg, info) and not self._tp_without_tiers():
            try:
                self.kv_tiers = KvTierShell(cfg, info, SHM_PREFIX)
            except ShmFull as e:
                raise GenerationError("configure", f"host KV pool: {e.strerror}") from None
            except OSError as e:
                raise GenerationError("configure", f"KV tiers: {e}") from None
        try:
            self.scheduler = Scheduler(checking, model, chips, piece=piece,
                                       tiers=None if self.kv_tiers is None else self.kv_tiers.tiers)
        except ConfigError as e:
            raise GenerationError("validate", f"configuration does not fit the model: {e}") from None
        if self.kv_tiers is not None:
            for lk in self.links:
                lk.attach_kv_pool(self.kv_tiers.pool_message())
        self.supervisor = Supervisor(cfg.board.replicas, max_resets_per_10min=cfg.recovery.max_resets_per_10min,
                                     heartbeat_timeout_s=cfg.recovery.heartbeat_timeout_ms / 1000.0,
                                     startup_timeout_s=RESTART_TIMEOUT_S, now=now)
        for chip in range(cfg.board.replicas):
            self.supervisor.on_ready(chip, now)

    def _tp_without_tiers(self) -> bool:
        """KV tiers move a chip's KV as one blob; a TP replica's KV is split across its ranks: not yet."""
        if self.cfg.board.chips_per_replica == 1:
            return False
        log("kv_tiers_unsupported", backend=self.cfg.board.backend,
            reason="tensor-parallel replicas (board.chips_per_replica > 1) keep no host or disk KV tier yet")
        return True

    def serve(self, accepting: bool, reopen_at: float | None = None) -> None:
        """Published: the board's admission limits and admission state (and a drain's end) apply from now on."""
        self.scheduler.reconfigure(scheduler_config_from(self.cfg))
        self.scheduler.set_accepting(accepting, "draining", reopen_at)

    # -- serving -------------------------------------------------------------------------
    def on_link(self, chip: int, now: float) -> list:
        sched, sup, obs = self.scheduler, self.supervisor, self._observe()
        out: list = []
        for ev in self.links[chip].handle_events():
            t = type(ev)
            if t is Result:
                self.counters["results"] += 1
                if obs is not None:
                    obs.on_result(chip, ev.result, now, self.id)
                self.device_us[chip] += ev.result.device_us
                self.worker_us[chip] += ev.result.worker_us
                out += sched.on_result(chip, ev.result, now)
            elif t is Heartbeat:
                pass  # ChipLink.last_heartbeat is what supervision reads
            elif t is Ready:
                if sup.state(chip) in (ChipState.STARTING, ChipState.RESTARTING):
                    sup.on_ready(chip, now)
                    log("chip_up", chip=chip, pid=ev.pid, model=self.alias, generation=self.id)
                    if self.kv_tiers is not None:  # a restarted worker maps the pool again
                        self.links[chip].attach_kv_pool(self.kv_tiers.pool_message())
                    for number, (path, sha) in self.adapters.items():  # a restarted worker knows none
                        self.links[chip].lora_add(number, path, sha)
                    out += sched.on_chip_up(chip, now)
            elif t is WorkerFailed:
                if sup.state(chip) is not ChipState.OUT:
                    out += self.chip_failed(chip, f"worker failed: {ev.message}", now)
        return out

    def submit(self, chip: int, job: Job) -> None:
        backlog = self._backlog[chip]
        if self.supervisor.state(chip) is not ChipState.UP:
            return  # the core will see the chip-down / time the job out; nothing to run it on
        if backlog:
            backlog.append(job)
            return
        try:
            self.links[chip].submit(job)
            self.counters["jobs_submitted"] += 1
        except RingFull:
            self.counters["ring_full"] += 1
            backlog.append(job)

    def release(self, chip: int, blocks) -> None:
        """Tell the chip's worker the scheduler freed these KV blocks (a restarting worker starts empty)."""
        if self.supervisor.state(chip) is ChipState.UP:
            self.links[chip].release_blocks(blocks)

    def retry_backlog(self) -> None:
        for chip, backlog in enumerate(self._backlog):
            while backlog:
                try:
                    self.links[chip].submit(backlog[0])
                except RingFull:
                    break
                backlog.popleft()
                self.counters["jobs_submitted"] += 1

    def backlog_len(self, chip: int) -> int:
        return len(self._backlog[chip])

    # -- supervision -----------------------------------------------------------------------
    def supervise(self, now: float) -> list:
        sup = self.supervisor
        out: list = []
        if self.kv_tiers is not None:
            self.kv_tiers.tick(now)
            tick_holds(self, now)
        for chip, lk in enumerate(self.links):
            if sup.state(chip) is ChipState.OUT:
                continue
            reason = sup.check(chip, alive=lk.is_alive(), last_heartbeat=lk.last_heartbeat, now=now)
            if reason is not None:
                out += self.chip_failed(chip, reason, now)
        return out

    def chip_hung(self, chip: int, reason: str, now: float) -> list:
        """The core timed out a job on `chip` and took the chip down: restart its worker as on a heartbeat
        loss (the quarantined KV is recovered on its READY). A generation going away is not restarted."""
        if self.supervisor.state(chip) is not ChipState.UP or \
                self.rec.state in (ModelState.UNLOADING, ModelState.RECOVERING):
            return []
        log("chip_hung", chip=chip, reason=reason, job_timeout_ms=self.cfg.executor.job_timeout_ms,
            model=self.alias, generation=self.id)
        return self.chip_failed(chip, reason, now)

    def chip_failed(self, chip: int, reason: str, now: float) -> list:
        sup = self.supervisor
        was_up = sup.state(chip) is ChipState.UP
        self.counters["chip_failures"] += 1
        out = self.scheduler.on_chip_down(chip, now) if was_up else []
        obs = self._observe()
        if obs is not None:
            obs.on_chip_down(chip, now, self.id)
        self._backlog[chip].clear()
        decision = sup.on_failure(chip, reason, now)
        lk = self.links[chip]
        self._unregister(self, chip)
        lk.kill()
        if decision is Decision.RESTART:
            log("chip_down", chip=chip, reason=reason, action="restart", model=self.alias, generation=self.id)
            try:
                lk.restart()
            except Exception as e:  # e.g. no room for new rings: this chip cannot come back
                log("restart_failed", chip=chip, error=repr(e))
                sup.take_out(chip, f"restart failed: {e}", now)
                decision = Decision.TAKE_OUT
            else:
                self.counters["worker_restarts"] += 1
                self._register(self, chip)
        if decision is Decision.TAKE_OUT:
            log("chip_down", chip=chip, reason=reason, action="out_of_service",
                max_resets_per_10min=sup.max_resets, model=self.alias, generation=self.id)
            try:
                lk.stop()
            except Exception as e:
                log("stop_failed", chip=chip, error=repr(e))
        return out

    def all_out(self) -> bool:
        return self.supervisor is not None and self.supervisor.all_out()

    def inflight_jobs(self) -> int:
        if self.scheduler is None:
            return 0
        return sum(len(ch.inflight) for ch in self.scheduler.chips.values()) + sum(map(len, self._backlog))

    def workers_alive(self) -> bool:
        return any(lk.is_alive() for lk in self.links)

    # -- tear-down -----------------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL every worker: after they are dead no job can write the rings any more."""
        for lk in self.links:
            lk.kill()

    def stop(self) -> None:
        """Stop the workers and free rings, sockets and fds (idempotent)."""
        for chip, lk in enumerate(self.links):
            self._unregister(self, chip)
            try:
                lk.stop()
            except Exception as e:  # keep cleaning the other chips
                log("stop_failed", chip=chip, error=repr(e), model=self.alias, generation=self.id)
        if self.kv_tiers is not None:
            try:
                self.kv_tiers.close()
            except Exception as e:
                log("kv_tiers_close_failed", error=repr(e), model=self.alias, generation=self.id)
            self.kv_tiers = None
        self.scheduler = None

    # -- reports -----------------------------------------------------------------------------
    def chips_info(self, now: float) -> list[dict]:
        if self.supervisor is None:
            return [{"chip": c, "state": "starting", "pid": lk.pid} for c, lk in enumerate(self.links)]
        snap = self.supervisor.snapshot(now)
        for s, lk in zip(snap, self.links):
            s["pid"] = lk.pid
            if isinstance(lk, ReplicaLink):
                s["pids"], s["member_chips"] = lk.pids, lk.chips
            s["backlog"] = len(self._backlog[s["chip"]])
            s["device_s"] = round(self.device_us[s["chip"]] / 1e6, 3)
            s["worker_s"] = round(self.worker_us[s["chip"]] / 1e6, 3)
            s["ring_layouts"] = lk.ring_layout_stats()
        return snap

    def piece_cache_stats(self) -> dict | None:
        """The token-bytes cache of this generation's tokenizer (`model.piece_cache_entries`); None without one."""
        return piece_cache_stats(self.piece)

    def model_info(self) -> dict:
        """The single-model `model` entry of health (what a one-model daemon has always answered)."""
        i = self.info
        out = {"alias": self.alias, "backend": self.cfg.board.backend, "generation": self.id}
        if i is not None:
            out.update(vocab_size=i.vocab_size, max_seq=i.max_seq, eos_ids=list(i.eos_ids),
                       profiles=[p.batch for p in i.profiles], sha256=i.model_sha256,
                       text=self.tokenizer is not None)
        return out
