"""The default alias of a board started with a package and no model.alias: the package's manifest name (else
its folder's), made a valid alias; an explicit model.alias wins; without a package it stays `tiny`."""

from __future__ import annotations

import json

import pytest

from engine.config import load_config
from engine.model_alias import DEFAULT_ALIAS, alias_from_package, as_alias
from ipc.schema import NAME_RE

ENV = {"XDG_RUNTIME_DIR": "/run/user/1000"}


@pytest.mark.parametrize("name,alias", [
    ("gemma3-270m", "gemma3-270m"),
    ("org/model:q4_0", "org-model:q4_0"),
    ("My Model v2!", "My-Model-v2"),
    ("-.:leading", "leading"),
    ("..hidden", "hidden"),
    ("modèle", "mod-le"),
    ("x" * 100, "x" * 64),
    ("a" * 63 + " b", "a" * 63),  # cut at 64, then the trailing `-` goes
    ("!!!", None),
    ("", None),
    ("---", None),
])
def test_names_are_made_valid_aliases(name, alias):
    assert as_alias(name) == alias
    if alias is not None:
        assert NAME_RE.match(alias)


def package(tmp_path, folder: str, manifest: dict | None):
    d = tmp_path / folder
    d.mkdir()
    if manifest is not None:
        (d / "manifest.json").write_text(json.dumps(manifest))
    return str(d)


def test_the_manifest_name_first_then_the_folder_then_tiny(tmp_path):
    assert alias_from_package(package(tmp_path, "f1", {"name": "Llama 3.2 1B"})) == "Llama-3.2-1B"
    assert alias_from_package(package(tmp_path, "folder two", {"schema": "x"})) == "folder-two"  # no name
    assert alias_from_package(package(tmp_path, "f3", {"name": "???"})) == "f3"  # nothing usable in the name
    assert alias_from_package(package(tmp_path, "f4", {"name": 7})) == "f4"  # not a string
    assert alias_from_package(package(tmp_path, "f5", None)) == "f5"  # no manifest (the load will say so)
    (tmp_path / "f6").mkdir()
    (tmp_path / "f6" / "manifest.json").write_text("{not json")
    assert alias_from_package(str(tmp_path / "f6")) == "f6"
    assert alias_from_package(package(tmp_path, "###", None)) == DEFAULT_ALIAS == "tiny"
    assert alias_from_package(str(tmp_path / "f1") + "/") == "Llama-3.2-1B"


def test_config_takes_the_packages_name_unless_model_alias_is_set(tmp_path):
    pkg = package(tmp_path, "pkg", {"name": "my model"})
    assert load_config(None, {"model.package": pkg}, env=ENV).model.alias == "my-model"
    assert load_config(None, {"model.package": pkg, "model.alias": "tiny"}, env=ENV).model.alias == "tiny"
    assert load_config(None, {"model.package": pkg, "model.alias": "x1"}, env=ENV).model.alias == "x1"
    assert load_config(None, env=ENV).model.alias == "tiny"  # no package: the built-in model's alias
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('schema = "npuserve/v1"\n[model]\npackage = "pkg"\n')  # relative to the file
    assert load_config(str(cfg_file), env=ENV).model.alias == "my-model"
    cfg_file.write_text('schema = "npuserve/v1"\n[model]\npackage = "pkg"\nalias = "set-in-file"\n')
    assert load_config(str(cfg_file), env=ENV).model.alias == "set-in-file"
    assert load_config(str(cfg_file), {"model.alias": "flag"}, env=ENV).model.alias == "flag"
