"""The balancer's config file: strict checks, flags over the file, relative key paths, exit 2 on errors."""

from __future__ import annotations

import pytest

from engine.balancer import main as balance_main
from engine.balancer.routing import Policy
from engine.balancer.settings import load_settings
from engine.config import ConfigError

GOOD = """
schema = "npuserve-balancer/v1"
[balancer]
endpoints = ["tcp://127.0.0.1:7000"]
policy = "least-load"
[health]
heartbeat_interval_ms = 500
[security]
server_secret_key = "keys/b.key_secret"
client_secret_key = "keys/c.key_secret"
[[pools]]
name = "fast"
min_priority = 50
[[backends]]
endpoint = "tcp://127.0.0.1:7001"
pool = "fast"
weight = 2.0
server_key = "keys/d.key"
[[backends]]
endpoint = "ipc:///run/x/board-1.sock"
"""


def test_a_good_file_and_flags_over_it(tmp_path):
    p = tmp_path / "b.toml"
    p.write_text(GOOD)
    s = load_settings(str(p))
    assert s.balancer.policy == "least-load" and len(s.backends) == 2
    assert s.security.server_secret_key == str(tmp_path / "keys" / "b.key_secret")
    assert s.backends[0].server_key == str(tmp_path / "keys" / "d.key")
    cc = s.core_config()
    assert cc.health.heartbeat_interval_s == 0.5 and cc.pools == (("fast", 50),)
    assert cc.routing.policy is Policy.LEAST_LOAD
    s2 = load_settings(str(p), backends=["tcp://127.0.0.1:9"], policy="prefix", endpoints=["tcp://127.0.0.1:8"])
    assert [b.endpoint for b in s2.backends] == ["tcp://127.0.0.1:9"] and s2.balancer.policy == "prefix"
    assert s2.balancer.endpoints == ("tcp://127.0.0.1:8",)


@pytest.mark.parametrize("text,expect", [
    ('schema = "npuserve/v1"', "schema: must be"),
    ('[balancer]\nendpoints = ["tcp://h:1"]\npolicyy = "prefix"\n[[backends]]\nendpoint = "tcp://h:2"',
     "did you mean 'policy'"),
    ('[balancer]\nendpoints = ["tcp://h:1"]\npolicy = "random"\n[[backends]]\nendpoint = "tcp://h:2"',
     "must be one of prefix, least-load, round-robin"),
    ('[balancer]\nendpoints = ["tcp://h:1"]', "at least one [[backends]]"),
    ('[[backends]]\nendpoint = "tcp://h:2"', "balancer.endpoints: at least one endpoint"),
    ('[balancer]\nendpoints = ["tcp://h:1"]\n[[backends]]\nendpoint = "h:2"', "backends[0].endpoint"),
    ('[balancer]\nendpoints = ["tcp://h:1"]\n[[backends]]\nendpoint = "tcp://h:2"\n[[backends]]\n'
     'endpoint = "tcp://h:2"', "listed twice"),
    ('[balancer]\nendpoints = ["tcp://h:1"]\n[retry]\nmax_retries = -1\n[[backends]]\nendpoint = "tcp://h:2"',
     "retry.max_retries"),
    ("[nope]", "unknown section"),
    ('[balancer]\nendpoints = ["tcp://h:1"]\n[[backends]]\nendpoint = "tcp://h:2"\nserver_key = "/k/d.key"',
     "security.client_secret_key: required"),
])
def test_bad_files_name_the_key(tmp_path, text, expect):
    p = tmp_path / "b.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(str(p))
    assert expect in str(info.value)


def test_npuserve_balance_exits_2_on_a_configuration_error(tmp_path, capsys):
    p = tmp_path / "b.toml"
    p.write_text("[balancer]\nendpoints = []\n")
    assert balance_main.main(["--config", str(p)]) == 2
    assert "balancer.endpoints" in capsys.readouterr().err


def test_prefill_and_decode_flags_set_backend_roles():
    from engine.balancer.settings import load_settings
    s = load_settings(None, endpoints=["tcp://127.0.0.1:1"], prefill=["tcp://p:1", "tcp://p:2"],
                      decode=["tcp://d:1"], backends=["tcp://m:1"])
    assert [(b.endpoint, b.role) for b in s.backends] == [("tcp://m:1", "mixed"), ("tcp://p:1", "prefill"),
                                                          ("tcp://p:2", "prefill"), ("tcp://d:1", "decode")]
    assert [sp.role for sp in s.backend_specs()] == ["mixed", "prefill", "prefill", "decode"]


def test_prefill_without_decode_is_a_config_error():
    import pytest

    from engine.balancer.settings import load_settings
    from engine.config_schema import ConfigError
    with pytest.raises(ConfigError, match="one prefill and one decode"):
        load_settings(None, endpoints=["tcp://127.0.0.1:1"], prefill=["tcp://p:1"])


def test_pd_min_prompt_tokens_from_the_file_and_the_flag(tmp_path):
    import pytest

    from engine.balancer.settings import load_settings
    from engine.config_schema import ConfigError
    f = tmp_path / "b.toml"
    f.write_text('schema = "npuserve-balancer/v1"\n[routing]\npd_min_prompt_tokens = 256\n')
    kw = dict(endpoints=["tcp://127.0.0.1:1"], prefill=["tcp://p:1"], decode=["tcp://d:1"])
    assert load_settings(str(f), **kw).core_config().routing.pd_min_prompt_tokens == 256
    assert load_settings(str(f), pd_min_prompt=17, **kw).core_config().routing.pd_min_prompt_tokens == 17
    assert load_settings(None, **kw).core_config().routing.pd_min_prompt_tokens == 0
    with pytest.raises(ConfigError, match="pd_min_prompt_tokens"):
        f.write_text('schema = "npuserve-balancer/v1"\n[routing]\npd_min_prompt_tokens = -1\n')
        load_settings(str(f), **kw)
