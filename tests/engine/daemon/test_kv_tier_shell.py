"""KvTierShell's disk side without a daemon: the index written and read back, other layouts ignored, orphans."""

from __future__ import annotations

import json
import os

from engine.config import load_config
from engine.daemon.kv_tier_shell import INDEX, KvTierShell
from workers.backends.sim import SimBackend


def _shell(tmp_path, **backend_kw) -> KvTierShell:
    cfg = load_config(None, {"kv.disk_dir": str(tmp_path), "kv.promote": "always"})
    be = SimBackend(**backend_kw)
    be.load(None)
    return KvTierShell(cfg, be.describe(), "npuservetest")


def test_index_round_trip_orphans_and_other_layouts(tmp_path, capsys):
    s = _shell(tmp_path)
    chains = [bytes([i]) * 16 for i in range(3)]
    for c in chains:
        s.tiers.disk.adopt(c)
        open(os.path.join(s.disk_dir, c.hex() + ".kv"), "wb").write(b"x")
    open(os.path.join(s.disk_dir, "ab" * 16 + ".kv"), "wb").write(b"orphan")
    open(os.path.join(s.disk_dir, "cd" * 16 + ".kv.123.tmp"), "wb").write(b"torn")
    s.close()
    assert json.load(open(os.path.join(s.disk_dir, INDEX)))["chains"] == [c.hex() for c in chains]

    os.unlink(os.path.join(s.disk_dir, chains[1].hex() + ".kv"))  # a file lost while the daemon was down
    again = _shell(tmp_path)
    assert again.tiers.disk_chains() == [chains[0], chains[2]]
    assert sorted(os.listdir(again.disk_dir)) == sorted([INDEX] + [c.hex() + ".kv" for c in (chains[0], chains[2])])
    assert "kv_disk_warm" in capsys.readouterr().err

    other = _shell(tmp_path, block_size=32)  # another KV layout: its own directory, the old one named
    assert other.disk_dir != again.disk_dir and other.tiers.disk_chains() == []
    err = capsys.readouterr().err
    assert "kv_disk_ignored" in err and again.layout_hex in err
