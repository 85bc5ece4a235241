"""The SIGHUP reload diff: which keys changed, which apply live, what the daemon runs on afterwards."""

from __future__ import annotations

import fnmatch
import os
import re

from engine.config import RELOADABLE, SECTIONS, TenantConfig, load_config
from engine.config_schema import section_keys
from engine.config_reload import config_changes, flatten, is_reloadable, reloaded

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"XDG_RUNTIME_DIR": "/run/user/1000"}


def cfg(**overrides):
    return load_config(None, overrides, env=ENV)


def test_no_change_no_diff():
    assert config_changes(cfg(), cfg()) == []


def test_reloadable_and_restart_keys_are_told_apart():
    old = cfg()
    new = cfg(**{"admission.max_sequences": 8, "board.chips": 4, "log.level": "debug",
                 "server.drain_timeout_s": 5.0, "kv.block_size": 32})
    changes = {c.key: (c.old, c.new, c.reloadable) for c in config_changes(old, new)}
    assert changes == {
        "admission.max_sequences": (256, 8, True),
        "board.chips": (2, 4, False),
        "kv.block_size": (16, 32, False),
        "server.drain_timeout_s": (30.0, 5.0, True),
        "log.level": ("info", "debug", True),
    }


def test_the_running_config_takes_only_the_reloadable_values():
    old = cfg()
    new = cfg(**{"admission.max_waiting_requests": 3, "board.chips": 4, "server.endpoints": ["tcp://127.0.0.1:9"],
                 "queues.tenants.acme.weight": 2.5})
    running = reloaded(old, new)
    assert running.admission.max_waiting_requests == 3
    assert running.queues.tenants == {"acme": TenantConfig(weight=2.5)}
    assert running.board.chips == 2 and running.server.endpoints == old.server.endpoints
    # nothing that needs a restart differs from the old config
    assert all(c.reloadable for c in config_changes(old, running))


def test_tenants_added_changed_and_removed_are_listed_key_by_key():
    old = cfg(**{"queues.tenants.a.weight": 1.5, "queues.tenants.b.max_waiting_tokens": 10})
    new = cfg(**{"queues.tenants.a.weight": 3.0, "queues.tenants.c.weight": 0.5})
    changes = {c.key: (c.old, c.new) for c in config_changes(old, new)}
    assert changes == {
        "queues.tenants.a.weight": (1.5, 3.0),
        "queues.tenants.b.weight": (1.0, None), "queues.tenants.b.max_active_sequences": (0, None),
        "queues.tenants.b.max_waiting_tokens": (10, None),
        "queues.tenants.c.weight": (None, 0.5), "queues.tenants.c.max_active_sequences": (None, 0),
        "queues.tenants.c.max_waiting_tokens": (None, 0),
        "queues.tenants.b.default_adapter": ("", None), "queues.tenants.b.allowed_adapters": ((), None),
        "queues.tenants.c.default_adapter": (None, ""), "queues.tenants.c.allowed_adapters": (None, ()),
    }
    assert all(c.reloadable for c in config_changes(old, new))


def test_as_dict_is_plain_json():
    [c] = config_changes(cfg(), cfg(**{"batch.profiles": [1, 4]}))
    assert c.as_dict() == {"key": "batch.profiles", "old": [], "new": [1, 4]} and not c.reloadable


def test_every_reloadable_pattern_names_real_keys():
    keys = list(flatten(cfg(**{"queues.tenants.x.weight": 2.0})))
    for pattern in RELOADABLE:
        assert any(fnmatch.fnmatchcase(k, pattern) for k in keys), pattern


def test_configuration_page_lists_exactly_the_reloadable_keys():
    with open(os.path.join(ROOT, "docs", "configuration.md")) as fh:
        text = fh.read()
    section = text[text.index("## Reloading"):]
    listed = set(re.findall(r"^\* `([a-z_.*]+)`", section, re.M))
    assert listed == set(RELOADABLE)
    every_key = [f"{s}.{k}" for s, c in SECTIONS.items() for k in section_keys(c) if k != "tenants"]
    assert not any(is_reloadable(k) for k in every_key if k not in RELOADABLE)
