"""`npuserve http` settings: the [http] section of a board config, flags over it (engine.http.main)."""

from __future__ import annotations

import pytest

from engine.config import ConfigError
from engine.http.main import main, parse_args, settings_from


def write(tmp_path, text: str) -> str:
    p = tmp_path / "board.toml"
    p.write_text('schema = "npuserve/v1"\n' + text)
    return str(p)


def test_defaults_without_a_config(monkeypatch):
    monkeypatch.setenv("NPUSERVE_ENDPOINT", "ipc:///tmp/x.sock")
    http, upstream = settings_from(parse_args([]))
    assert (http.listen, http.api_keys, http.default_temperature, upstream) == ("127.0.0.1:8000", "", 1.0,
                                                                                  "ipc:///tmp/x.sock")


def test_the_http_section_with_paths_relative_to_the_file(tmp_path):
    path = write(tmp_path, '[server]\nendpoints = ["ipc:///tmp/b.sock"]\n[http]\nlisten = "0.0.0.0:9000"\n'
                           'api_keys = "keys.txt"\nchat_template = "/abs/t.jinja"\ndefault_temperature = 0\n')
    http, upstream = settings_from(parse_args(["--config", path]))
    assert (http.listen, upstream, http.default_temperature) == ("0.0.0.0:9000", "ipc:///tmp/b.sock", 0.0)
    assert http.api_keys == str(tmp_path / "keys.txt") and http.chat_template == "/abs/t.jinja"
    http, upstream = settings_from(parse_args(["--config", path, "--listen", "127.0.0.1:1", "--upstream",
                                               "tcp://127.0.0.1:7070"]))
    assert (http.listen, upstream) == ("127.0.0.1:1", "tcp://127.0.0.1:7070")


@pytest.mark.parametrize("text,expected", [
    ('[http]\nlisten = "8000"\n', "http.listen: must be HOST:PORT"),
    ('[http]\nupstream = "localhost:7070"\n', "http.upstream: must be ipc:///absolute/path or tcp://HOST:PORT"),
    ('[http]\nhealth_timeout_ms = 0\n', "http.health_timeout_ms"),
    ('[http]\nlisten_on = "x"\n', "did you mean 'listen'"),
])
def test_bad_http_keys_name_themselves(tmp_path, text, expected):
    with pytest.raises(ConfigError) as e:
        settings_from(parse_args(["--config", write(tmp_path, text)]))
    assert expected in str(e.value)


def test_bad_flags_and_files_exit_2_before_serving(tmp_path, capsys):
    assert main(["--listen", "nowhere", "--upstream", "ipc:///tmp/x.sock"]) == 2
    assert "--listen: must be HOST:PORT" in capsys.readouterr().err
    assert main(["--api-keys", str(tmp_path / "missing"), "--upstream", "ipc:///tmp/x.sock"]) == 2
    assert "cannot read the key file" in capsys.readouterr().err
    assert main(["--chat-template", str(tmp_path / "missing"), "--upstream", "ipc:///tmp/x.sock"]) == 2
    assert "chat template" in capsys.readouterr().err
