"""The shell of the KV tiers of one generation: the host slot pool, the disk tier's files and its index.

The core (`engine.core.tier_transfers.KvTiers`) decides what moves; this
owns what it moves between: the shared-memory slot pool every chip worker of
the board attaches (`KvSlotPool`, sent to each worker as a KV_POOL control
message, so it is in place before the first transfer job), and the directory
of block files, one sub-directory per KV layout (`disk_dir/<layout tag>/`).

Persistence: the READY disk chains are written to `index.json` in that
directory every `kv.index_flush_s` and at shutdown (write to a temporary
file, then rename). A daemon started with the same model and KV layout reads
it back and starts warm (blocks are promoted on demand); block files the
index does not name are removed. Directories of other layouts are left alone
and named in the log.
"""

from __future__ import annotations

import json
import os

from engine.config import Config
from engine.core.kv.tier_policy import PromoteMode, TierPolicy, TransferCost
from engine.core.tier_transfers import KvTiers
from engine.daemon.log import log
from ipc.kv_slots import KvSlotPool, record_bytes
from workers.backends.base import BackendInfo
from workers.kv_transfer import layout_of

INDEX = "index.json"
INDEX_VERSION = 1


class KvTierShell:
    def __init__(self, cfg: Config, info: BackendInfo, shm_prefix: str) -> None:
        kv, c = info.kv, cfg.kv
        self.layout = layout_of(info)
        self.layout_hex = f"{self.layout:016x}"
        self.block_bytes = kv.block_bytes()
        self.slot_bytes = record_bytes(self.block_bytes)
        self.flush_s = c.index_flush_s
        self.pool: KvSlotPool | None = None
        slots = (c.host_pool_mb << 20) // self.slot_bytes
        if c.host_pool_mb and slots < 1:
            log("kv_host_pool_too_small", host_pool_mb=c.host_pool_mb, block_bytes=self.block_bytes)
        if slots >= 1:
            self.pool = KvSlotPool.create(shm_prefix, cfg.board.id, slots, self.slot_bytes)
        self.disk_dir: str | None = None
        disk_blocks = 0
        if c.disk_dir:
            self.disk_dir = os.path.join(c.disk_dir, self.layout_hex)
            os.makedirs(self.disk_dir, mode=0o700, exist_ok=True)
            disk_blocks = max(1, int(c.disk_max_gb * 1e9) // self.slot_bytes)
        cost = info.kv_transfer
        self.tiers = KvTiers(self.layout_hex, kv.block_size, host_slots=slots, disk_blocks=disk_blocks,
                             block_bytes=self.block_bytes, write_through=c.write_through,
                             policy=TierPolicy(PromoteMode(c.promote), TransferCost(
                                 cost.base_s, cost.per_block_s, cost.prefill_s_per_token)))
        self._next_flush = 0.0
        self.files_deleted = 0
        if self.disk_dir is not None:
            self._restore(c.disk_dir)
        log("kv_tiers", host_slots=slots, host_mb=c.host_pool_mb, disk_dir=self.disk_dir, disk_blocks=disk_blocks,
            block_bytes=self.block_bytes, layout=self.layout_hex, write_through=c.write_through, promote=c.promote,
            disk_warm_blocks=len(self.tiers.disk) if self.tiers.disk is not None else 0)

    @classmethod
    def wanted(cls, cfg: Config, info: BackendInfo) -> bool:
        on = bool(cfg.kv.host_pool_mb or cfg.kv.disk_dir) and cfg.kv.prefix_cache
        if on and info.kv_transfer is None:
            log("kv_tiers_unsupported", backend=info.name, reason="the backend declares no KV transfer")
            return False
        return on

    def pool_message(self) -> dict:
        """The KV_POOL control message's fields for a worker."""
        p = self.pool
        return {"name": None if p is None else p.name, "slots": 0 if p is None else p.slots,
                "slot_bytes": self.slot_bytes, "disk_dir": self.disk_dir}

    # -- periodic ------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Unlink the block files the core let go of; write the index when it is due."""
        self.delete_files()
        if self.disk_dir is not None and now >= self._next_flush:
            self._next_flush = now + self.flush_s
            self.flush_index()

    def delete_files(self) -> None:
        if self.disk_dir is None:
            return
        disk = self.tiers.disk
        for chain in self.tiers.take_disk_deletes():
            if chain in disk:  # exported again since: the file is the new one
                continue
            try:
                os.unlink(os.path.join(self.disk_dir, chain.hex() + ".kv"))
                self.files_deleted += 1
            except FileNotFoundError:
                pass

    def flush_index(self) -> None:
        if self.disk_dir is None:
            return
        data = {"version": INDEX_VERSION, "layout": self.layout_hex, "block_bytes": self.block_bytes,
                "chains": [c.hex() for c in self.tiers.disk_chains()]}
        path = os.path.join(self.disk_dir, INDEX)
        tmp = path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError as e:
            log("kv_index_flush_failed", error=str(e))

    def _restore(self, root: str) -> None:
        for name in sorted(os.listdir(root)):
            if name != self.layout_hex and os.path.isfile(os.path.join(root, name, INDEX)):
                log("kv_disk_ignored", directory=os.path.join(root, name), reason="another model or KV layout",
                    layout=self.layout_hex)
        path = os.path.join(self.disk_dir, INDEX)
        chains: list[bytes] = []
        try:
            with open(path) as f:
                data = json.load(f)
            if data.get("version") != INDEX_VERSION or data.get("layout") != self.layout_hex \
                    or data.get("block_bytes") != self.block_bytes:
                log("kv_disk_ignored", directory=self.disk_dir, reason="index of another version or layout")
            else:
                chains = [bytes.fromhex(c) for c in data.get("chains", [])]
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            log("kv_disk_ignored", directory=self.disk_dir, reason=f"unreadable index: {e}")
        present = {n[:-3] for n in os.listdir(self.disk_dir) if n.endswith(".kv")}
        chains = [c for c in chains if c.hex() in present]
        self.tiers.restore_disk(chains)
        kept = {c.hex() for c in self.tiers.disk_chains()}
        for n in os.listdir(self.disk_dir):  # files no index names (a crash, a torn write): not trusted
            if (n.endswith(".kv") and n[:-3] not in kept) or n.endswith(".tmp"):
                try:
                    os.unlink(os.path.join(self.disk_dir, n))
                except OSError:
                    pass
        if chains:
            log("kv_disk_warm", directory=self.disk_dir, blocks=len(kept))

    def stats(self) -> dict:
        out = self.tiers.stats()
        out["files_deleted"] = self.files_deleted
        out["layout"] = self.layout_hex
        return out

    def close(self) -> None:
        """At shutdown: the index once more, then the pool goes (the workers are stopped first)."""
        try:
            self.delete_files()
            self.flush_index()
        finally:
            if self.pool is not None:
                self.pool.close()
                self.pool.unlink()
                self.pool = None
