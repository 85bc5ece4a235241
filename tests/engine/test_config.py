"""TOML configuration: defaults, strict validation, overrides, model cross-checks (engine.config)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import SECTIONS, ConfigError, TenantConfig, load_config, validate_against_model
from engine.config_schema import section_keys

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "engine" / "config_example.toml"
BAD = sorted((ROOT / "tests" / "configs").glob("bad_*.toml"))
ENV = {"XDG_RUNTIME_DIR": "/run/user/1000"}
MODEL_PROFILES, MODEL_MAX_SEQ = [1, 4, 8, 16], 2048


def write(tmp_path: pathlib.Path, text: str, name: str = "c.toml") -> str:
    p = tmp_path / name
    p.write_text('schema = "npuserve/v1"\n' + text)
    return str(p)


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


def test_defaults_match_the_contract():
    cfg = load_config(None, env=ENV)
    assert cfg.schema == "npuserve/v1"
    assert (cfg.board.id, cfg.board.chips, cfg.board.backend) == ("0", 2, "ref")
    assert cfg.board.runtime_dir == "/run/user/1000/npuserve"
    assert cfg.server.endpoints == ("ipc:///run/user/1000/npuserve/board-0.sock",)
    assert (cfg.model.alias, cfg.model.package) == ("tiny", "")
    a = cfg.admission
    assert (a.max_waiting_requests, a.max_waiting_prompt_tokens, a.deadline_default_ms) == (128, 262144, 120000)
    q = cfg.queues
    assert (q.decode_weight, q.short_prefill_weight, q.medium_prefill_weight, q.long_prefill_weight) == (8, 4, 2, 1)
    assert (q.short_prefill_max_tokens, q.medium_prefill_max_tokens, q.tenants) == (512, 4096, {})
    assert (cfg.batch.profiles, cfg.batch.batching_window_us, cfg.batch.chunked_prefill) == ((), 0, True)
    assert (cfg.executor.max_inflight, cfg.executor.job_timeout_ms, cfg.executor.worker_spin_us) == (1, 30000, 200)
    assert (cfg.kv.block_size, cfg.kv.num_blocks, cfg.kv.prefix_cache) == (16, 0, True)
    r = cfg.recovery
    assert (r.max_resets_per_10min, r.heartbeat_interval_ms, r.heartbeat_timeout_ms) == (2, 1000, 3000)
    assert r.supervise_interval_ms == 1000 and cfg.batch.prefill_window_us == 2000
    assert (cfg.server.max_message_bytes, cfg.server.max_send_queue, cfg.server.drain_timeout_s) == (1 << 20, 1000, 30.0)
    assert (cfg.metrics.port, cfg.metrics.host) == (0, "127.0.0.1")


def test_runtime_dir_falls_back_to_tmp_without_xdg():
    cfg = load_config(None, env={})
    assert cfg.board.runtime_dir == f"/tmp/npuserve-{os.getuid()}"


def test_example_file_loads_to_exactly_the_defaults():
    assert load_config(str(EXAMPLE), env=ENV) == load_config(None, env=ENV)


def test_example_file_lists_every_key_of_every_section():
    doc = tomllib.loads(EXAMPLE.read_text())
    assert set(doc) == {"schema", *SECTIONS}
    for name, cls in SECTIONS.items():
        expected = set(section_keys(cls)) - {"tenants"}  # tenants are shown as a commented example
        assert set(doc[name]) == expected, name
    text = EXAMPLE.read_text()
    for key in section_keys(TenantConfig):
        assert f"# {key} = " in text


def test_every_key_is_documented_in_its_declaration():
    for cls in [*SECTIONS.values(), TenantConfig]:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("path", BAD, ids=[p.name for p in BAD])
def test_bad_config_fails_with_its_documented_message(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), path.name
    expected = first[len("# expect: "):]
    with pytest.raises(ConfigError) as info:
        cfg = load_config(str(path), env=ENV)
        validate_against_model(cfg, MODEL_PROFILES, MODEL_MAX_SEQ)
    assert expected in str(info.value)


def test_there_are_many_bad_config_cases():
    assert len(BAD) >= 20


def test_a_file_with_tenants_profiles_and_endpoints(tmp_path):
    path = write(tmp_path, """
[board]
id = "b7"
chips = 1
backend = "stub"
[queues.tenants.acme]
weight = 3
max_active_sequences = 4
[queues.tenants.free]
max_waiting_tokens = 1000
[batch]
profiles = [16, 1, 4]
[server]
endpoints = ["tcp://127.0.0.1:7070", "ipc:///tmp/np-b7.sock"]
""")
    cfg = load_config(path, env=ENV)
    assert cfg.board == dataclasses.replace(cfg.board, id="b7", chips=1, backend="stub")
    assert cfg.queues.tenants == {"acme": TenantConfig(weight=3.0, max_active_sequences=4),
                                  "free": TenantConfig(max_waiting_tokens=1000)}
    assert cfg.queues.tenant("acme").weight == 3.0
    assert cfg.queues.tenant("unlisted") == TenantConfig()
    assert cfg.batch.profiles == (1, 4, 16)
    assert cfg.server.endpoints == ("tcp://127.0.0.1:7070", "ipc:///tmp/np-b7.sock")


def test_relative_model_paths_are_resolved_against_the_config_folder(tmp_path):
    path = write(tmp_path, '[model]\npackage = "models/tiny"\n')
    assert load_config(path).model.package == str(tmp_path / "models" / "tiny")
    path = write(tmp_path, '[model]\npackage = "/abs/tiny"\n')
    assert load_config(path).model.package == "/abs/tiny"


def test_relative_model_paths_from_overrides_are_resolved_against_the_working_directory(tmp_path, monkeypatch):
    conf_dir, work_dir = tmp_path / "etc", tmp_path / "work"
    conf_dir.mkdir()
    work_dir.mkdir()
    path = write(conf_dir, '[model]\npackage = "in-file"\n')
    monkeypatch.chdir(work_dir)
    assert load_config(path, {"model.package": "from-flag"}).model.package == str(work_dir / "from-flag")
    assert load_config(path).model.package == str(conf_dir / "in-file")


def test_overrides_replace_file_values_and_are_validated(tmp_path):
    path = write(tmp_path, "[board]\nchips = 4\n")
    cfg = load_config(path, {"board.chips": 1, "board.backend": "stub", "server.endpoints": ["ipc:///tmp/x.sock"],
                             "metrics.port": 9100, "queues.tenants.acme.weight": 2.5}, env=ENV)
    assert (cfg.board.chips, cfg.board.backend, cfg.metrics.port) == (1, "stub", 9100)
    assert cfg.server.endpoints == ("ipc:///tmp/x.sock",)
    assert cfg.queues.tenant("acme").weight == 2.5
    assert "board.chips: must be an int in [1, 64], got 0" in error_of(path, {"board.chips": 0})
    assert "board.chipz: unknown key (did you mean 'chips'?)" in error_of(None, {"board.chipz": 1})
    assert "chips: an override key must be section.key" in error_of(None, {"chips": 1})


def test_a_bad_file_fails_even_when_a_flag_overrides_the_bad_key(tmp_path):
    path = write(tmp_path, '[board]\nbackend = "gpu"\n')
    assert "board.backend" in error_of(path, {"board.backend": "stub"})


def test_all_problems_are_reported_at_once(tmp_path):
    path = write(tmp_path, "[board]\nchips = 0\n[kv]\nnum_blocks = -1\nbogus = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.errors) == 3
    assert [e.split(":")[0] for e in info.value.errors] == ["board.chips", "kv.num_blocks", "kv.bogus"]


@pytest.mark.parametrize("text, expected", [
    ("[admission]\nmax_sequences = 1.0", "admission.max_sequences: must be an int"),
    ("[batch]\nchunked_prefill = 1", "batch.chunked_prefill: must be true or false"),
    ("[queues]\ndecode_cost_weight = true", "queues.decode_cost_weight: must be a finite number"),
    ("[server]\ndrain_timeout_s = -1", "server.drain_timeout_s: must be a finite number >= 0.0"),
    ("[server]\nendpoints = \"ipc:///tmp/a.sock\"", "server.endpoints: must be a list"),
    ("[server]\nendpoints = [\"tcp://127.0.0.1:0\"]", "server.endpoints: [0] must be"),
    ("[server]\nendpoints = [\"ipc:///" + "x" * 120 + "\"]", "unix socket limit"),
    ("[executor]\nmax_inflight = 9", "executor.max_inflight: must be an int in [1, 8], got 9"),
    ("[model]\nalias = \"my model\"", "model.alias: must be a model alias"),
    ("[queues.tenants.\"a b\"]\nweight = 1.0", "queues.tenants.a b: a tenant name must be"),
    ("[queues]\ntenants = 3", "queues.tenants: must be a table"),
])
def test_type_and_range_errors_name_the_key(tmp_path, text, expected):
    assert expected in error_of(write(tmp_path, text))


def test_integers_are_accepted_for_float_keys(tmp_path):
    cfg = load_config(write(tmp_path, "[server]\ndrain_timeout_s = 5\n"))
    assert cfg.server.drain_timeout_s == 5.0 and type(cfg.server.drain_timeout_s) is float


def test_file_errors(tmp_path):
    assert "not found" in error_of(str(tmp_path / "missing.toml"))
    bare = tmp_path / "bare.toml"
    bare.write_text("[board]\nchips = 1\n")
    assert "schema: required" in error_of(str(bare))


def test_default_endpoint_too_long_for_a_unix_socket_is_reported():
    msg = error_of(None, env={"XDG_RUNTIME_DIR": "/" + "d" * 110})
    assert "server.endpoints: the default endpoint is unusable" in msg


def test_validate_against_model():
    cfg = load_config(None, {"batch.profiles": [1, 8]}, env=ENV)
    validate_against_model(cfg, MODEL_PROFILES, MODEL_MAX_SEQ)  # declared: no error
    validate_against_model(load_config(None, env=ENV), [1], 16)  # [] = whatever the model declares
    with pytest.raises(ConfigError) as info:
        validate_against_model(cfg, [1, 4], MODEL_MAX_SEQ)
    assert str(info.value).startswith("batch.profiles:") and "[8]" in str(info.value)
    long_prompts = load_config(None, {"admission.max_prompt_tokens": 2048}, env=ENV)
    with pytest.raises(ConfigError, match="admission.max_prompt_tokens"):
        validate_against_model(long_prompts, MODEL_PROFILES, 2048)
    validate_against_model(long_prompts, MODEL_PROFILES, 2049)


def test_config_is_immutable():
    cfg = load_config(None, env=ENV)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.board.chips = 3  # type: ignore[misc]


_ALL_KEYS = [f"{s}.{k}" for s, cls in SECTIONS.items() for k in section_keys(cls)] + ["board.nope", "nope.x"]
_values = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=30) \
    | st.lists(st.integers(-5, 40) | st.text(max_size=10), max_size=4) | st.dictionaries(st.text(max_size=5), st.integers(), max_size=2)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(_ALL_KEYS), _values, max_size=3))
def test_any_override_is_accepted_or_one_config_error(overrides):
    try:
        cfg = load_config(None, overrides, env=ENV)
    except ConfigError as e:
        assert e.errors and all(":" in line for line in e.errors)
        return
    for dotted, value in overrides.items():
        section, name = dotted.split(".")
        got = getattr(getattr(cfg, section), name)
        got = list(got) if isinstance(got, tuple) else got  # list keys are kept as tuples (frozen config)
        if dotted in ("model.root", "model.signing_public_key"):  # paths: made absolute at load
            assert got == (os.path.abspath(value) if value else value), dotted
        elif name not in ("endpoints", "tenants", "runtime_dir", "package", "ctypes_library", "profiles"):
            assert got == value, dotted


def test_the_burst_budget_defaults_to_llama_cpp_servers_n_batch_and_reaches_the_scheduler(tmp_path):
    """batch.burst_token_budget: 2048 by default (a 32 x 128 burst on llamacpp starts in two jobs, as in
    llama.cpp's server); 0 turns it off; negative is a config error."""
    from engine.core.scheduler_config import scheduler_config_from

    cfg = load_config(None, env=ENV)
    assert cfg.batch.burst_token_budget == 2048
    assert scheduler_config_from(cfg).burst_token_budget == 2048
    off = load_config(write(tmp_path, "[batch]\nburst_token_budget = 0\n"), env=ENV)
    assert scheduler_config_from(off).burst_token_budget == 0
    assert "batch.burst_token_budget" in error_of(write(tmp_path, "[batch]\nburst_token_budget = -1\n"), env=ENV)
