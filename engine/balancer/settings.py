"""The balancer's TOML file (`schema = "npuserve-balancer/v1"`), strictly checked like the daemon's.

    schema = "npuserve-balancer/v1"
    [balancer]  endpoints, policy
    [health]    heartbeat_interval_ms, missed_heartbeats, stale_after_ms, failure_threshold, cooldown_ms
    [retry]     max_retries, backoff_base_ms, backoff_max_ms, migrate, max_migrations, no_backend_wait_ms
    [routing]   block_size, decode_cost_tokens, imbalance_abs, imbalance_rel, prefix_capacity_blocks,
                pd_min_prompt_tokens
    [metrics]   port, host
    [security]  server_secret_key, client_keys_dir, admins, forwarders, client_secret_key
    [[backends]] endpoint, pool, weight, server_key, role
    [[pools]]   name, min_priority

Key declarations use `engine.config_schema`, as the daemon's do (one check and one line of
documentation per key; unknown keys are errors with a "did you mean").
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from typing import Any

from engine.balancer.backend_state import BackendSpec, HealthPolicy
from engine.balancer.core import CoreConfig
from engine.balancer.pd_routing import ROLES
from engine.balancer.routing import Policy, RoutingPolicy
from engine.config_schema import (BadValue, ConfigError, boolean, check_section, integer, key, name_list, number,
                                  string, unknown, zmq_endpoint, zmq_endpoints)
from ipc.schema import NAME_RE

SCHEMA = "npuserve-balancer/v1"
POLICIES = tuple(p.value for p in Policy)
_NAMES = name_list("key names")


@dataclass(frozen=True)
class BalancerSection:
    endpoints: tuple = key((), zmq_endpoints, "ZeroMQ ROUTER endpoints the balancer listens on (required)")
    policy: str = key("prefix", string(choices=POLICIES), "routing policy: prefix | least-load | round-robin")
    max_message_bytes: int = key(1 << 20, integer(1024, 1 << 30), "larger client messages get a 400 too_large")
    max_send_queue: int = key(1000, integer(1), "queued events per client before it counts as blocked")


@dataclass(frozen=True)
class HealthSection:
    heartbeat_interval_ms: int = key(1000, integer(10), "how often each backend is asked for its health")
    missed_heartbeats: int = key(3, integer(1), "unanswered heartbeat intervals that take a backend out")
    stale_after_ms: int = key(2000, integer(1), "a load figure older than this counts as saturated")
    failure_threshold: int = key(3, integer(1), "consecutive failed requests that open a backend's breaker")
    cooldown_ms: int = key(1000, integer(0), "wait before a half-open probe (doubles per failed probe, <= 30 s)")


@dataclass(frozen=True)
class RetrySection:
    max_retries: int = key(3, integer(0, 100), "re-sends of a request that has not streamed yet")
    backoff_base_ms: int = key(20, integer(0), "first retry delay after a 429/503 (doubles, jitter 50-100%)")
    backoff_max_ms: int = key(1000, integer(0), "longest retry delay")
    migrate: bool = key(True, boolean, "resume broken streams on another backend (continuation)")
    max_migrations: int = key(3, integer(0, 100), "migrations of one stream, then 503 retryable")
    no_backend_wait_ms: int = key(5000, integer(0), "a request without a deadline waits this long for a backend")


@dataclass(frozen=True)
class RoutingSection:
    block_size: int = key(16, integer(1, 1024), "tokens per block of the prefix index (the daemons' kv.block_size)")
    decode_cost_tokens: int = key(64, integer(0), "prefix policy: cost of one request in flight, in prompt tokens")
    imbalance_abs: int = key(8, integer(0), "imbalance guard: max - min load (requests) beyond which least-load")
    imbalance_rel: float = key(2.0, number(1.0), "imbalance guard: and max > this x (min + 1)")
    prefix_capacity_blocks: int = key(65536, integer(1), "block hashes remembered per backend")
    pd_min_prompt_tokens: int = key(0, integer(0), "disaggregation: prompts shorter than this go whole to a decode "
                                    "board, longer ones are handed off (0: every one; docs/disaggregation.md)")


@dataclass(frozen=True)
class MetricsSection:
    port: int = key(0, integer(0, 65535), "Prometheus /metrics port (npuserve:balancer_* series); 0 = off")
    host: str = key("127.0.0.1", string(), "address the /metrics server binds")


@dataclass(frozen=True)
class SecuritySection:
    server_secret_key: str = key("", string(), "CURVE secret key file of this balancer (npuserve keygen); "
                                             "\"\" = tcp:// endpoints without CURVE")
    client_keys_dir: str = key("", string(), "directory of allowed client public keys; a key's file name is its tenant")
    admins: tuple = key((), _NAMES, "client key names allowed admin ops (drain, resume)")
    forwarders: tuple = key((), _NAMES, "client key names (balancers) whose `tenant` field is trusted")
    client_secret_key: str = key("", string(), "CURVE secret key file this balancer presents to backends")


@dataclass(frozen=True)
class BackendEntry:
    endpoint: str = key("", zmq_endpoint, "the backend's endpoint (daemon or balancer)")
    pool: str = key("default", string(NAME_RE, "a pool name"), "pool it belongs to")
    weight: float = key(1.0, number(0.0, 1e6, lo_open=True), "share of the traffic relative to the others")
    server_key: str = key("", string(), "the backend's CURVE public key file (tcp:// with CURVE)")
    role: str = key("mixed", string(choices=ROLES), "prefill | decode | mixed: with both prefill and decode "
                    "backends a request is prefilled on one and decoded on another (docs/disaggregation.md)")


@dataclass(frozen=True)
class PoolEntry:
    name: str = key("default", string(NAME_RE, "a pool name"), "pool name")
    min_priority: int = key(0, integer(-100, 100), "requests with priority >= this go to this pool (highest wins)")


@dataclass(frozen=True)
class BalancerSettings:
    balancer: BalancerSection = field(default_factory=BalancerSection)
    health: HealthSection = field(default_factory=HealthSection)
    retry: RetrySection = field(default_factory=RetrySection)
    routing: RoutingSection = field(default_factory=RoutingSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    backends: tuple = ()
    pools: tuple = ()

    def backend_specs(self) -> list[BackendSpec]:
        return [BackendSpec(b.endpoint, b.pool, b.weight, b.role) for b in self.backends]

    def core_config(self) -> CoreConfig:
        h, r, ro = self.health, self.retry, self.routing
        return CoreConfig(
            health=HealthPolicy(h.heartbeat_interval_ms / 1000, h.missed_heartbeats, h.stale_after_ms / 1000,
                                h.failure_threshold, h.cooldown_ms / 1000),
            routing=RoutingPolicy(Policy(self.balancer.policy), ro.block_size, ro.decode_cost_tokens,
                                  ro.imbalance_abs, ro.imbalance_rel, ro.pd_min_prompt_tokens),
            max_retries=r.max_retries, migrate=r.migrate, max_migrations=r.max_migrations,
            backoff_base_s=r.backoff_base_ms / 1000, backoff_max_s=r.backoff_max_ms / 1000,
            no_backend_wait_s=r.no_backend_wait_ms / 1000,
            pools=tuple((p.name, p.min_priority) for p in self.pools),
            prefix_capacity_blocks=ro.prefix_capacity_blocks)


SECTIONS = {"balancer": BalancerSection, "health": HealthSection, "retry": RetrySection,
            "routing": RoutingSection, "metrics": MetricsSection, "security": SecuritySection}
ARRAYS = {"backends": BackendEntry, "pools": PoolEntry}
_PATH_KEYS = (("security", "server_secret_key"), ("security", "client_keys_dir"), ("security", "client_secret_key"))


def load_settings(path: str | None, *, endpoints: list[str] | None = None, backends: list[str] | None = None,
                  policy: str | None = None, prefill: list[str] | None = None,
                  decode: list[str] | None = None, metrics_port: int | None = None,
                  pd_min_prompt: int | None = None) -> BalancerSettings:
    """Read and check the file (if any), then apply the command-line flags. Raises ConfigError."""
    doc: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                doc = tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{path}: {e}") from None
    errors: list[str] = []
    base = os.path.dirname(os.path.abspath(path)) if path else os.getcwd()
    out: dict[str, Any] = {}
    for name, value in doc.items():
        if name == "schema":
            if value != SCHEMA:
                errors.append(f"schema: must be {SCHEMA!r}, got {value!r}")
        elif name in SECTIONS:
            out[name] = SECTIONS[name](**check_section(SECTIONS[name], value, name, errors))
        elif name in ARRAYS:
            if type(value) is not list:
                errors.append(f"{name}: must be an array of tables ([[{name}]]), got {value!r}")
                continue
            out[name] = tuple(ARRAYS[name](**check_section(ARRAYS[name], t, f"{name}[{i}]", errors))
                              for i, t in enumerate(value))
        else:
            errors.append(unknown(name, name, ["schema", *SECTIONS, *ARRAYS], "section"))
    s = BalancerSettings(**out)
    try:
        if endpoints:
            s = replace(s, balancer=replace(s.balancer, endpoints=zmq_endpoints(endpoints)))
        if backends or prefill or decode:  # the flags together replace [[backends]]
            s = replace(s, backends=tuple(BackendEntry(endpoint=zmq_endpoint(e), role=role)
                                          for role, eps in (("mixed", backends), ("prefill", prefill),
                                                            ("decode", decode)) for e in eps or ()))
        if policy:
            s = replace(s, balancer=replace(s.balancer, policy=string(choices=POLICIES)(policy)))
        if metrics_port is not None:
            s = replace(s, metrics=replace(s.metrics, port=integer(0, 65535)(metrics_port)))
        if pd_min_prompt is not None:
            s = replace(s, routing=replace(s.routing, pd_min_prompt_tokens=integer(0)(pd_min_prompt)))
    except BadValue as bad:
        errors.append(f"command line: {bad}")
    sec = s.security
    s = replace(s, security=replace(sec, **{k: _abs(getattr(sec, k), base) for _, k in _PATH_KEYS}),
                backends=tuple(replace(b, server_key=_abs(b.server_key, base)) for b in s.backends))
    if not s.balancer.endpoints:
        errors.append("balancer.endpoints: at least one endpoint to listen on (or --endpoint)")
    if not s.backends:
        errors.append("backends: at least one [[backends]] entry (or --backends, --prefill/--decode)")
    roles = {b.role for b in s.backends}
    if ("prefill" in roles) != ("decode" in roles):
        errors.append("backends: prefill/decode disaggregation needs at least one prefill and one decode backend")
    if any(b.server_key and b.endpoint.startswith("tcp://") for b in s.backends) and not s.security.client_secret_key:
        errors.append("security.client_secret_key: required when a backend has a server_key (the key pair this "
                      "balancer presents to CURVE backends)")
    if len({b.endpoint for b in s.backends}) != len(s.backends):
        errors.append("backends: an endpoint is listed twice")
    if errors:
        raise ConfigError(errors)
    return s


def _abs(p: str, base: str) -> str:
    return p if not p or os.path.isabs(p) else os.path.join(base, p)
