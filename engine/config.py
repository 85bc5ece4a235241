"""The board daemon's TOML configuration: schema `npuserve/v1`, strictly validated.

A mistake in a config file must stop start-up with a message that names the
key, not surface hours later as odd scheduling: unknown sections and keys are
errors (with a "did you mean"), values are type- and range-checked (a bool is
never accepted as a number), and `validate_against_model` rejects a batch
profile the model package does not declare: a board asked for a batch size
it has no compiled kernel for must refuse to start, not fail the first job of
that size (docs/configuration.md).

Every key is declared once, as a dataclass field whose metadata carries its
check and its one-line documentation (`engine.config_schema.key`); the loader,
the example file and the README are checked against those declarations by
the tests. Keys that set the scheduler take their defaults from
`SchedulerConfig`, so the core and the file agree by construction.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.config_schema import (BadValue, ConfigError, abs_path_or_empty, abs_paths, boolean, check_section,
                                  host_port, integer,
                                  key, name_list, number, string, unknown, zmq_endpoint,
                                  zmq_endpoint_or_empty, zmq_endpoints)
from engine.core.handoff import BOARD_ROLES, DEFAULT_DEADLINE_S
from engine.lora_config import LoraConfig
from engine.core.kv_pull import DEFAULT_TIMEOUT_S as KV_PULL_TIMEOUT_S
from engine.core.scheduler_config import SchedulerConfig, TenantPolicy
from engine.model_alias import DEFAULT_ALIAS, alias_from_package
from ipc.schema import NAME_RE  # model aliases and tenant names: the wire's rule
from workers.backends.names import BACKENDS

SCHEMA = "npuserve/v1"
_BOARD_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,32}\Z")  # ends up in shm names and socket paths
_KEY_NAMES = name_list("client key names")
# The scheduler's own defaults are the defaults of the keys that set them (one home: SchedulerConfig).
_SCHED = SchedulerConfig()
_TENANT = TenantPolicy()


def _profiles(v: Any) -> tuple[int, ...]:
    if type(v) not in (list, tuple) or not all(type(b) is int and 1 <= b <= 1024 for b in v):
        raise BadValue(f"must be a list of compiled batch sizes (ints in [1, 1024]), got {v!r}")
    if len(set(v)) != len(v):
        raise BadValue(f"must not repeat a batch size, got {list(v)!r}")
    return tuple(sorted(v))


@dataclass(frozen=True)
class BoardConfig:
    id: str = key("0", string(_BOARD_ID_RE, "1-32 characters of [A-Za-z0-9_-]"),
                  "board id: names the socket, shared-memory segments and metrics of this daemon")
    chips: int = key(2, integer(1, 64), "chips (worker processes) on this board")
    backend: str = key("ref", string(choices=BACKENDS), f"chip runtime: {' | '.join(BACKENDS)}")
    runtime_dir: str = key("", abs_path_or_empty,
                           "sockets and state; \"\" = $XDG_RUNTIME_DIR/npuserve, else /tmp/npuserve-$UID")
    threads_per_chip: int = key(0, integer(0, 1024), "CPU threads of each chip worker (backend llamacpp); "
                                                  "0 = the machine's cores split over the chips")
    chips_per_replica: int = key(1, integer(1, 64), "chips that run one model replica together (tensor "
                                                 "parallelism, backends ref, sim and ctypes); must divide chips; "
                                                 "the scheduler sees chips / chips_per_replica replicas")
    memory_budget_mb: int = key(0, integer(0), "memory the models of this board may hold (weights + KV pools of "
                                            "every worker, all generations); a load that does not fit is "
                                            "refused; 0 = no budget")
    role: str = key("mixed", string(choices=BOARD_ROLES), "prefill/decode disaggregation: \"prefill\" boards run "
                    "prompts and hand off, \"decode\" boards continue streams, \"mixed\" boards do both "
                    "(docs/disaggregation.md)")
    handoff_deadline_s: float = key(DEFAULT_DEADLINE_S, number(0.0, 3600.0, lo_open=True),
                                    "how long a prefill board holds a hand-off's KV for its decode board")
    handoff_peer_dirs: tuple = key((), abs_paths, "decode boards: the kv.disk_dir of prefill boards on this host, "
                                   "whose block files a hand-off imports (needs kv.disk_dir here); () = recompute")
    handoff_endpoint: str = key("", zmq_endpoint_or_empty, "prefill boards: the ZeroMQ endpoint (tcp://, CURVE with "
                                "security.server_secret_key; or ipc://) that serves held hand-offs' KV blocks to "
                                "decode boards on other hosts; advertised in the hand-off descriptor; \"\" = none")
    handoff_transfer_timeout_s: float = key(KV_PULL_TIMEOUT_S, number(0.0, 600.0, lo_open=True),
                                            "a KV transfer silent this long has failed: the decode board recomputes")
    handoff_client_key: str = key("", abs_path_or_empty, "decode boards: this board's CURVE key pair (NAME.key_secret) "
                                  "for pulling from prefill boards whose transfer endpoint has CURVE (the prefill "
                                  "board's security.client_keys_dir must list NAME.key); \"\" = plain only")
    malloc_trim_interval_s: float = key(60.0, number(0.0, 86400.0), "how often the daemon runs a full collection "
                                        "(emptying CPython's free lists) and gives glibc's free heap "
                                        "pages back to the kernel (malloc_trim); 0 = never")
    ring_layout_cache_entries: int = key(128, integer(1, 1 << 16), "record shapes whose layout each side of a chip's "
                                         "job and result rings keeps (an LRU, ~2 KB an entry)")

    @property
    def replicas(self) -> int:
        """Model replicas per generation: what the scheduler calls chips."""
        return self.chips // self.chips_per_replica


@dataclass(frozen=True)
class ModelConfig:
    alias: str = key(DEFAULT_ALIAS, string(NAME_RE, "a model alias (1-64 characters of [A-Za-z0-9_.:-])"),
                     "the name clients use in `model`; requests without `model` get this one; unset with "
                     "model.package: the package's manifest name (else its folder's), made a valid alias")
    package: str = key("", string(), "model package folder (relative = to the config file); "
                                   "\"\" = the built-in tiny model, built on first run")
    ctypes_library: str = key("", string(), "vendor shared library for backend = \"ctypes\" "
                                          "(relative = to the config file); required by that backend")
    root: str = key("", string(), "model root: the admin ops `load`/`replace` and `--model ALIAS=PACKAGE` name "
                                "packages under it and cannot leave it (symlinks included); "
                                "\"\" = no root: packages are paths, relative to the working directory")
    signing_public_key: str = key("", string(), "Ed25519 public key (PEM, `npuserve keygen --signing`) that must have "
                                              "signed a package's manifest.json (manifest.sig) for `load` to accept "
                                              "it (relative = to the config file); \"\" = signatures not required")
    piece_cache_entries: int = key(1024, integer(0, 1 << 20), "token ids whose text bytes the daemon keeps (an LRU "
                                   "cache in front of the tokenizer, ~200 bytes an entry); 0 = no cache")


@dataclass(frozen=True)
class AdmissionConfig:
    max_sequences: int = key(_SCHED.max_sequences, integer(1), "sequences admitted at once (prefilling or decoding)")
    max_kv_tokens: int = key(_SCHED.max_kv_tokens, integer(0), "KV tokens reserved by admitted sequences; 0 = the KV pool size")
    max_waiting_requests: int = key(_SCHED.max_waiting_requests, integer(0), "requests waiting for admission; beyond it 429")
    max_waiting_prompt_tokens: int = key(_SCHED.max_waiting_prompt_tokens, integer(0), "prompt tokens of waiting requests; beyond it 429")
    deadline_default_ms: int = key(round(_SCHED.default_deadline_s * 1000), integer(1), "deadline of a request that sets no deadline_ms")
    max_queue_wait_ms: int = key(round(_SCHED.max_queue_wait_s * 1000), integer(0), "longest wait for admission: "
                                 "a request waiting longer gets 429 queue_wait_exceeded (retryable), and so does a "
                                 "new one while its queue's oldest has waited that long; 0 = no bound")
    max_prompt_tokens: int = key(0, integer(0), "longest prompt (+ continuation) accepted; "
                                             "0 = the model's max_seq - 1; longer is 400")


@dataclass(frozen=True)
class TenantConfig:
    weight: float = key(_TENANT.weight, number(0.0, 1e6, lo_open=True), "weighted-fair-queue share")
    max_active_sequences: int = key(0, integer(0), "admitted sequences of this tenant; 0 = unlimited")
    max_waiting_tokens: int = key(0, integer(0), "waiting prompt tokens of this tenant; 0 = unlimited")
    default_adapter: str = key("", string(), "LoRA adapter of this tenant's requests that name none; \"\" = the base")
    allowed_adapters: tuple = key((), name_list("adapter names"), "LoRA adapters this tenant may name; empty = any")


def _check_tenants(raw: Any, path: str, errors: list[str]) -> dict[str, TenantConfig]:
    if type(raw) is not dict:
        errors.append(f"{path}: must be a table of [queues.tenants.NAME] tables, got {raw!r}")
        return {}
    out = {}
    for name, table in raw.items():
        if not NAME_RE.match(name):
            errors.append(f"{path}.{name}: a tenant name must be 1-64 characters of [A-Za-z0-9_.:-]")
            continue
        out[name] = TenantConfig(**check_section(TenantConfig, table, f"{path}.{name}", errors))
    return out


@dataclass(frozen=True)
class QueuesConfig:
    decode_weight: int = key(_SCHED.decode_weight, integer(1, 1000), "weighted round robin share of decode steps")
    short_prefill_weight: int = key(_SCHED.short_prefill_weight, integer(1, 1000), "share of short prefills (<= short_prefill_max_tokens)")
    medium_prefill_weight: int = key(_SCHED.medium_prefill_weight, integer(1, 1000), "share of medium prefills (<= medium_prefill_max_tokens)")
    long_prefill_weight: int = key(_SCHED.long_prefill_weight, integer(1, 1000), "share of long prefills")
    short_prefill_max_tokens: int = key(_SCHED.short_prefill_max_tokens, integer(1), "longest prompt that counts as short")
    medium_prefill_max_tokens: int = key(_SCHED.medium_prefill_max_tokens, integer(1), "longest prompt that counts as medium")
    decode_cost_weight: float = key(_SCHED.decode_cost_weight, number(0.0), "fair-queue cost of one requested output token, "
                                                      "relative to one prompt token")
    max_tenant_lane_share: float = key(_SCHED.max_tenant_lane_share, number(0.0, 1.0, lo_open=True),
                                       "one tenant's share of a decode batch's lanes and of the admitted "
                                       "sequences while another tenant waits (its youngest lane over the share "
                                       "is preempted for it); 1 = no cap")
    tenants: dict = key({}, lambda v: v, "per-tenant [queues.tenants.NAME] tables; unlisted tenants get "
                                         "the TenantConfig defaults", table=_check_tenants)

    def tenant(self, name: str) -> TenantConfig:
        return self.tenants.get(name) or TenantConfig()


@dataclass(frozen=True)
class BatchConfig:
    profiles: tuple = key((), _profiles, "compiled batch sizes to use; [] = every profile the model declares")
    batching_window_us: int = key(round(_SCHED.batching_window_s * 1e6), integer(0, 1_000_000), "wait up to this long to fill a decode batch "
                                                         "(never past the earliest deadline)")
    prefill_window_us: int = key(2000, integer(0, 1_000_000),
                                 "mixed batches: hold a job of prompts alone until no prompt has arrived for this "
                                 "long (at most 8x this long), so that a burst of arrivals shares one job (never "
                                 "past the earliest deadline)")
    chunked_prefill: bool = key(_SCHED.chunked_prefill, boolean, "split long prefills into chunks, only if the backend declares "
                                             "chunked prefill equal to one-shot")
    prefill_chunk_tokens: int = key(_SCHED.prefill_chunk_tokens, integer(1), "tokens per prefill chunk")
    mixed_batches: bool = key(_SCHED.mixed_batches, boolean, "one job carries the ready decode lanes and prompt chunks together, "
                                           "only if the backend declares mixed batches (llamacpp)")
    mixed_token_budget: int = key(_SCHED.mixed_token_budget, integer(0), "tokens per mixed job (decode lanes + prompt chunks), at most "
                                              "the backend's limit; 0 = the backend's limit. 512 (llama.cpp's "
                                              "n_ubatch): a long prompt never stalls the running streams for "
                                              "longer than one such step")
    prompt_tokens_while_decoding: int = key(_SCHED.prompt_tokens_while_decoding, integer(0),
                                            "mixed batches: prompt tokens a job computes at most while decode "
                                            "lanes run on the chip (a longer prompt goes in chunks of this many, "
                                            "one per job, when the backend chunks prefills), so the running "
                                            "streams wait about a plain decode step plus this share per step; "
                                            "0 = the mixed token budget alone")
    burst_token_budget: int = key(_SCHED.burst_token_budget, integer(0), "tokens per mixed job while no stream on "
                                  "the chip is decoding (a burst of prompts on an idle chip), so the burst's streams "
                                  "start together; at most the backend's limit; 0 (or not above mixed_token_budget) "
                                  "= off. 2048: llama.cpp's server's n_batch")
    static_batching: bool = key(_SCHED.static_batching, boolean, "baseline for benchmarks: admit a new batch only once every "
                                              "admitted sequence has finished (off = continuous batching)")


@dataclass(frozen=True)
class ExecutorConfig:
    max_inflight: int = key(_SCHED.max_inflight, integer(1, 8), "jobs in flight per chip (2 = ping/pong)")
    queue_next_step: bool = key(_SCHED.queue_next_step, boolean, "submit a decode lane's next step while its "
                                "current one runs (its token: the one the worker samples), so the chip does not "
                                "wait for the scheduler's turn (decode jobs without mixed batches)")
    decode_steps: int = key(_SCHED.decode_steps, integer(1, 64), "multi-step decode: a decode job runs up to this "
                            "many steps on the worker before it answers, when no prompt waits and no deadline "
                            "is near (1 = one step per job)")
    downgrade_timeouts: int = key(_SCHED.downgrade_timeouts, integer(0, 1000), "ping/pong drops to one job in "
                                  "flight on a chip after this many job timeouts (0 = never for timeouts)")
    downgrade_tpot_p99_ratio: float = key(_SCHED.downgrade_tpot_p99_ratio, number(0.0), "ping/pong drops to one "
                                          "job in flight when a chip's TPOT P99 passes this ratio x its "
                                          "one-in-flight window's (0 = off)")
    pingpong_min_gain: float = key(_SCHED.pingpong_min_gain, number(0.0), "ping/pong stays on only while a chip "
                                   "delivers at least 1 + this x its one-in-flight tokens/s, measured in turns; "
                                   "otherwise one job in flight until the next measurement (0 = not measured)")
    job_timeout_ms: int = key(round(_SCHED.job_timeout_s * 1000), integer(1), "an unanswered job is failed, its KV Unknown, its (hung) chip's worker restarted")
    worker_spin_us: int = key(200, integer(0, 100_000), "how long a chip worker polls for its next job before it "
                                                     "parks in the kernel, while spinning pays (most recent waits "
                                                     "ended within it); 0 = never spin")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = key(_SCHED.spec_method, string(choices=("off", "ngram", "draft")),
                      "speculative decoding for requests that do not choose: off, ngram (prompt lookup: "
                      "draft what followed the last tokens earlier in the prompt or output) or draft (the "
                      "draft_package model proposes); the target model verifies, so outputs are unchanged")
    draft_package: str = key("", string(), "a smaller model package with the target's vocabulary, run beside the "
                             "target on every chip to propose drafts (method draft); \"\" = none")
    max_draft_tokens: int = key(_SCHED.spec_max_draft_tokens, integer(0, 32),
                                "draft tokens per lane and step at most (adaptive k lowers it as drafts miss)")
    max_batch_lanes: int = key(_SCHED.spec_max_batch_lanes, integer(0, 256),
                               "no drafts in a job of more decode lanes (compute-bound: verification would cost "
                               "more than it saves)")
    k_choice: str = key(_SCHED.spec_k_choice, string(choices=("cost", "adaptive")),
                        "how a lane chooses its draft length: cost (the k with the most expected tokens per unit "
                        "of the verification step's cost, measured from the chip's jobs) or adaptive (grow on "
                        "full acceptance, shrink on rejection)")


@dataclass(frozen=True)
class KvConfig:
    block_size: int = key(16, integer(1, 1024), "tokens per KV block (a power of two)")
    num_blocks: int = key(0, integer(0), "KV blocks per chip; 0 = the backend/model default")
    prefix_cache: bool = key(_SCHED.prefix_cache, boolean, "share full blocks of common prompt prefixes (radix cache)")
    host_pool_mb: int = key(0, integer(0, 1 << 20), "the board's host KV tier: one shared-memory block pool of this "
                                                   "many MiB shared by every chip; 0 = off")
    disk_dir: str = key("", abs_path_or_empty, "the disk KV tier's directory (block files per KV layout, and the "
                                               "persisted prefix index); \"\" = off")
    disk_max_gb: float = key(4.0, number(0.0, 1e5, lo_open=True), "cap of the disk tier's block files (LRU beyond it)")
    write_through: bool = key(True, boolean, "export every block the prefix cache gains to the tiers at once (one "
                                             "prefix cache per board); false: only blocks the device evicts")
    promote: str = key("cost", string(choices=("cost", "always", "never")),
                       "promote a tier hit when the backend's transfer cost model says it beats recomputing "
                       "(cost), always, or never")
    index_flush_s: float = key(30.0, number(0.0, 86400.0, lo_open=True), "how often the disk tier's prefix index "
                                                                       "is written (and at shutdown)")


@dataclass(frozen=True)
class RecoveryConfig:
    max_resets_per_10min: int = key(2, integer(0), "worker restarts per chip per 10 minutes, then the chip "
                                                "stays out of service")
    heartbeat_interval_ms: int = key(1000, integer(1), "worker heartbeat period (a dead worker is seen at once; "
                                                    "heartbeats find a hung one)")
    heartbeat_timeout_ms: int = key(3000, integer(1), "a worker silent this long is declared dead")
    supervise_interval_ms: int = key(1000, integer(10, 60_000), "how often heartbeat silence and start-up timeouts "
                                                             "are checked (a worker's exit is seen at once)")


@dataclass(frozen=True)
class ServerConfig:
    endpoints: tuple = key((), zmq_endpoints, "ZeroMQ ROUTER endpoints; [] = ipc://{runtime_dir}/board-{id}.sock")
    max_message_bytes: int = key(1 << 20, integer(1024, 1 << 30), "larger client messages get a 400 too_large")
    max_send_queue: int = key(1000, integer(1), "queued events per client; a client that falls further behind "
                                             "has its requests cancelled")
    drain_timeout_s: float = key(30.0, number(0.0), "on SIGTERM or drain, in-flight requests get this long")
    loop_stall_ms: int = key(2000, integer(1), "a scheduler loop stalled this long reports unhealthy")


@dataclass(frozen=True)
class MetricsConfig:
    port: int = key(0, integer(0, 65535), "Prometheus /metrics HTTP port; 0 = off")
    host: str = key("127.0.0.1", string(re.compile(r"\S{1,253}\Z"), "a host name or address"),
                    "address the metrics server binds")


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "human")


@dataclass(frozen=True)
class LogConfig:
    level: str = key("info", string(choices=LOG_LEVELS), "lowest level written: debug | info | warning | error")
    format: str = key("auto", string(choices=LOG_FORMATS), "json = one JSON object per line; human = for "
                                                         "terminals; auto = human on a tty, else json")


@dataclass(frozen=True)
class SecurityConfig:
    server_secret_key: str = key("", abs_path_or_empty, "CURVE key pair file (npuserve keygen's NAME.key_secret) "
                                                          "for the tcp:// endpoints; \"\" = no CURVE")
    client_keys_dir: str = key("", abs_path_or_empty, "directory of allowed client public keys (NAME.key); "
                                                        "a key's NAME is its tenant")
    admins: tuple = key((), _KEY_NAMES, "client key names allowed admin ops (drain, resume, load, unload, "
                                         "replace, rollback) over tcp://")
    forwarders: tuple = key((), _KEY_NAMES, "client key names (balancers) whose requests' `tenant` is trusted")


@dataclass(frozen=True)
class HttpConfig:
    listen: str = key("127.0.0.1:8000", host_port, "HOST:PORT the OpenAI-compatible HTTP front listens on "
                                                   "(npuserve http)")
    upstream: str = key("", zmq_endpoint_or_empty, "the daemon or balancer the front sends requests to; "
                                                "\"\" = this config's first server.endpoints entry")
    api_keys: str = key("", string(), "file of `KEY TENANT` lines (relative = to the config file); \"\" = an "
                                    "open front (tenant from `user`)")
    package: str = key("", string(), "model package for the chat template and tokenizer (relative = to the config "
                                   "file); \"\" = the package the upstream reports")
    chat_template: str = key("", string(), "file with a Jinja2 chat template used instead of the package's "
                                         "(relative = to the config file); \"\" = the package's")
    default_temperature: float = key(1.0, number(0.0, 100.0), "temperature of a request that sends none "
                                                              "(OpenAI's default is 1)")
    health_interval_ms: int = key(1000, integer(10, 3_600_000), "how often the front asks the upstream's health")
    health_timeout_ms: int = key(2000, integer(10, 3_600_000), "an upstream silent this long is down: requests "
                                                            "get 503 until it answers again")


@dataclass(frozen=True)
class KvEventsConfig:
    endpoint: str = key("", zmq_endpoint_or_empty, "ZeroMQ PUB endpoint the board publishes its prefix-cache "
                                                "changes on, in the KV-event format vllm-router's kv_aware "
                                                "policy reads (e.g. \"tcp://*:5557\"); \"\" = off")
    topic: str = key("", string(), "topic frame of every KV-event message (vllm-router subscribes to all)")


SECTIONS: dict[str, type] = {
    "board": BoardConfig, "model": ModelConfig, "admission": AdmissionConfig, "queues": QueuesConfig,
    "batch": BatchConfig, "executor": ExecutorConfig, "kv": KvConfig, "recovery": RecoveryConfig,
    "server": ServerConfig, "metrics": MetricsConfig, "log": LogConfig, "security": SecurityConfig,
    "http": HttpConfig, "kv_events": KvEventsConfig, "speculative": SpeculativeConfig, "lora": LoraConfig,
}

# Keys SIGHUP applies to a running daemon (fnmatch patterns over dotted keys).
# A change to any other key is logged as needing a restart and not applied.
RELOADABLE: tuple[str, ...] = (
    "admission.max_sequences", "admission.max_waiting_requests", "admission.max_waiting_prompt_tokens",
    "admission.deadline_default_ms", "admission.max_queue_wait_ms", "queues.decode_cost_weight", "queues.tenants.*",
    "batch.batching_window_us", "batch.prefill_window_us", "executor.job_timeout_ms", "server.drain_timeout_s",
    "server.loop_stall_ms",
    "log.level", "log.format",
)


@dataclass(frozen=True)
class Config:
    schema: str = SCHEMA
    board: BoardConfig = field(default_factory=BoardConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    queues: QueuesConfig = field(default_factory=QueuesConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    kv: KvConfig = field(default_factory=KvConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


# ---------------------------------------------------------------- loading


def _check_document(doc: Mapping[str, Any], errors: list[str]) -> dict[str, dict[str, Any]]:
    checked: dict[str, dict[str, Any]] = {}
    for name, value in doc.items():
        if name == "schema":
            if value != SCHEMA:
                errors.append(f"schema: must be {SCHEMA!r}, got {value!r}")
        elif name in SECTIONS:
            checked[name] = check_section(SECTIONS[name], value, name, errors)
        else:
            errors.append(unknown(name, name, ["schema", *SECTIONS], "section"))
    return checked


def _apply_overrides(doc: dict[str, Any], overrides: Mapping[str, object], errors: list[str]) -> None:
    """Set dotted keys ("board.chips", "queues.tenants.acme.weight") in the raw document."""
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if len(parts) < 2 or not all(parts):
            errors.append(f"{dotted}: an override key must be section.key")
            continue
        node = doc
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if type(child) is not dict:
                errors.append(f"{'.'.join(parts[:i + 1])}: must be a table, got {child!r}")
                break
            node = child
        else:
            node[parts[-1]] = list(value) if isinstance(value, tuple) else value


def default_runtime_dir(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "npuserve")
    return f"/tmp/npuserve-{os.getuid()}"


_PATH_KEYS = ("package", "ctypes_library", "root", "signing_public_key")  # of [model]


def _relative_to(base_dir: str, p: str) -> str:
    return p if os.path.isabs(p) else os.path.normpath(os.path.join(base_dir, p))


def load_config(path: str | None, overrides: Mapping[str, object] | None = None,
                env: Mapping[str, str] | None = None) -> Config:
    """Read, check and complete a config. `path` None = all defaults; `overrides` are dotted keys.

    The file is checked on its own first (so a bad file fails even when a flag
    overrides the bad key), then again with the overrides applied. The result
    is concrete: runtime_dir and the endpoints are resolved, and relative model
    paths are made absolute (against the config file's folder when they come
    from the file, against the working directory when they come from overrides).
    """
    doc: dict[str, Any] = {"schema": SCHEMA}
    base_dir = None
    if path is not None:
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path}: not found") from None
        except OSError as e:
            raise ConfigError(f"config file {path}: cannot read ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path}: invalid TOML: {e}") from None
        if "schema" not in doc:
            raise ConfigError(f"schema: required at the top of {path}: schema = {SCHEMA!r}")
        base_dir = os.path.dirname(os.path.abspath(path))
        _build(doc)  # a config file must be valid by itself, whatever the flags override
        model = doc.get("model", {})
        for name in _PATH_KEYS:
            if model.get(name):
                model[name] = _relative_to(base_dir, model[name])
        for a in (doc.get("lora") or {}).get("adapter") or []:
            if isinstance(a, dict) and isinstance(a.get("path"), str) and a["path"]:
                a["path"] = _relative_to(base_dir, a["path"])
        spec = doc.get("speculative", {})
        if spec.get("draft_package"):
            spec["draft_package"] = _relative_to(base_dir, spec["draft_package"])
    if overrides:
        errors: list[str] = []
        _apply_overrides(doc, overrides, errors)
        if errors:
            raise ConfigError(errors)
    cfg = _build(doc)
    return _resolve(cfg, env, alias_given="alias" in (doc.get("model") or {}))


def _build(doc: Mapping[str, Any]) -> Config:
    errors: list[str] = []
    checked = _check_document(doc, errors)
    if errors:
        raise ConfigError(errors)
    cfg = Config(**{name: cls(**checked.get(name, {})) for name, cls in SECTIONS.items()})
    _check_cross_keys(cfg, errors)
    if errors:
        raise ConfigError(errors)
    return cfg


TP_BACKENDS = ("ref", "sim", "ctypes")  # the backends that run a replica across chips (board.chips_per_replica > 1)


def _check_cross_keys(cfg: Config, errors: list[str]) -> None:
    """Rules between keys, checked once overrides are applied."""
    if cfg.kv.block_size & (cfg.kv.block_size - 1):
        errors.append(f"kv.block_size: must be a power of two, got {cfg.kv.block_size}")
    q = cfg.queues
    if q.medium_prefill_max_tokens <= q.short_prefill_max_tokens:
        errors.append(f"queues.medium_prefill_max_tokens: must be > short_prefill_max_tokens "
                      f"({q.short_prefill_max_tokens}), got {q.medium_prefill_max_tokens}")
    r = cfg.recovery
    if r.heartbeat_timeout_ms <= r.heartbeat_interval_ms:
        errors.append(f"recovery.heartbeat_timeout_ms: must be > heartbeat_interval_ms "
                      f"({r.heartbeat_interval_ms}), got {r.heartbeat_timeout_ms}")
    b = cfg.board
    if b.chips % b.chips_per_replica:
        errors.append(f"board.chips_per_replica: must divide board.chips ({b.chips}), got {b.chips_per_replica}")
    if b.chips_per_replica > 1 and b.backend not in TP_BACKENDS:
        errors.append(f"board.chips_per_replica: tensor parallelism needs board.backend in {list(TP_BACKENDS)}, "
                      f"got {b.backend!r}")
    if cfg.board.backend == "ctypes" and not cfg.model.ctypes_library:
        errors.append("model.ctypes_library: required when board.backend = \"ctypes\"")


def _resolve(cfg: Config, env: Mapping[str, str] | None, alias_given: bool = True) -> Config:
    """`alias_given`: model.alias was set (file or flag); else a package's own name is the default alias."""
    runtime_dir = cfg.board.runtime_dir or default_runtime_dir(env)
    endpoints = cfg.server.endpoints or (f"ipc://{runtime_dir}/board-{cfg.board.id}.sock",)
    if not cfg.server.endpoints:
        try:
            zmq_endpoint(endpoints[0])
        except BadValue as bad:
            raise ConfigError(f"server.endpoints: the default endpoint is unusable, set one: {bad}") from None
    # Paths from the file were made relative to its folder; from flags, to the working directory.
    model = dataclasses.replace(cfg.model, **{k: os.path.abspath(v) for k in _PATH_KEYS if (v := getattr(cfg.model, k))})
    if not alias_given and model.package:
        model = dataclasses.replace(model, alias=alias_from_package(model.package))
    return dataclasses.replace(
        cfg,
        board=dataclasses.replace(cfg.board, runtime_dir=runtime_dir),
        model=model,
        server=dataclasses.replace(cfg.server, endpoints=endpoints),
    )


def validate_against_model(cfg: Config, profiles: list[int], max_seq: int) -> None:
    """Cross-check the config with what the loaded model declares; fail start-up on a mismatch."""
    errors = []
    missing = [b for b in cfg.batch.profiles if b not in profiles]
    if missing:
        errors.append(f"batch.profiles: the model declares profiles {sorted(profiles)}; "
                      f"{missing} not among them")
    if cfg.admission.max_prompt_tokens >= max_seq:
        errors.append(f"admission.max_prompt_tokens: must be < the model's max_seq ({max_seq}), "
                      f"got {cfg.admission.max_prompt_tokens}")
    if errors:
        raise ConfigError(errors)
