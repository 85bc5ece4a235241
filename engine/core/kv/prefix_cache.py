"""A radix tree over FULL KV blocks, one per chip, with LRU eviction.

Each node is one full block whose edge label is that block's tokens; a path
from a root is a cached prompt prefix. Roots are per `PrefixKey` (model
generation + optional tenant salt), so different keys never share a block.

The cache does not own ref counts: the manager tells it when a cached block
gains its first reference or loses its last one. Only unreferenced LEAVES are
evictable (evicting an inner node would strand its children); because every
holder of a node also holds all its ancestors (see `insert`), repeatedly
evicting leaves can always reach every unreferenced block.

LRU order comes from a counter bumped on every match/insert, never a clock.
A path is used as a whole: a node's effective age is the newest use of any
node below it. `match` and `insert` touch every node they walk; `extend`
(the per-block hot path of a growing sequence) touches only the nodes it
adds, and an evicted leaf hands its age to its parent, which is the only
moment an inner node's age is read (it becomes a leaf).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefixKey:
    generation: int
    salt: str = ""


@dataclass(eq=False)
class _Node:
    block: int
    key: PrefixKey
    edge: tuple[int, ...]
    parent: _Node | None
    last_used: int
    referenced: bool = True
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    alive: bool = True


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._roots: dict[PrefixKey, dict[tuple[int, ...], _Node]] = {}
        self._by_block: dict[int, _Node] = {}
        self._unreferenced = 0
        self._tick = 0
        self._heap: list[tuple[int, int, _Node]] = []  # (last_used, seq, node); lazily invalidated
        self._heap_seq = 0
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0
        self.evictions = 0
        # Bumped whenever nodes vanish other than by eviction (clear, drop_key):
        # a holder's remembered path end may then be gone, see `extend`.
        self.epoch = 0
        # None, or a list the cache appends its changes to for a shell to drain (KV events for a cluster
        # router, engine/daemon/kv_events.py): ("stored", parent block | None, [(block, edge tokens), ...])
        # for a chain of new nodes, ("removed", [block, ...]) for nodes gone.
        self.journal: list[tuple] | None = None
        # None, or where evicted blocks are noted for demotion to the KV tiers: (key, every token of the
        # evicted block's path, block id), read before the block is reused
        self.evict_sink: list[tuple[PrefixKey, list[int], int]] | None = None

    # -- lookup --------------------------------------------------------------
    def _walk(self, key: PrefixKey, tokens: Sequence[int]) -> list[_Node]:
        bs = self.block_size
        level = self._roots.get(key)
        path: list[_Node] = []
        for i in range(len(tokens) // bs):
            if not level:
                break
            node = level.get(tuple(tokens[i * bs : (i + 1) * bs]))
            if node is None:
                break
            path.append(node)
            level = node.children
        return path

    def lookup(self, key: PrefixKey, tokens: Sequence[int]) -> list[int]:
        """Like `match` but without side effects (no LRU touch, no counters)."""
        return [n.block for n in self._walk(key, tokens)]

    def match(self, key: PrefixKey, tokens: Sequence[int]) -> list[int]:
        path = self._walk(key, tokens)
        if path:
            self.hits += 1
            self.hit_tokens += len(path) * self.block_size
            self._tick += 1
            for node in path:
                self._touch(node)
        else:
            self.misses += 1
        return [n.block for n in path]

    def is_cached(self, block: int) -> bool:
        return block in self._by_block

    def is_referenced(self, block: int) -> bool:
        return self._by_block[block].referenced

    def __len__(self) -> int:
        return len(self._by_block)

    def cached_blocks(self) -> list[int]:
        return list(self._by_block)

    def keys(self) -> list[PrefixKey]:
        return list(self._roots)

    def evictable(self) -> int:
        return self._unreferenced

    # -- insert --------------------------------------------------------------
    def insert(self, key: PrefixKey, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Register the full blocks of `tokens`; returns how many of `blocks` are now on the cached path.

        Walking down, a position already cached by the SAME block is kept; a
        position already cached by a DIFFERENT block (two sequences computed
        the same prefix concurrently) keeps the existing block and stops the
        insert there, so a node is never attached below a block its inserter
        does not hold. New nodes start referenced (the inserter holds them).
        """
        n_full = len(tokens) // self.block_size
        if len(blocks) < n_full:
            raise ValueError(f"{n_full} full blocks of tokens but only {len(blocks)} block ids")
        return self.extend(key, None, tokens, blocks, 0, n_full)

    def extend(self, key: PrefixKey, after_block: int | None, tokens: Sequence[int], blocks: Sequence[int],
               start: int, n_full: int) -> int:
        """`insert` of blocks start..n_full-1 for a holder whose first `start` blocks are on the cached path.

        `insert` is this from the root (start 0, after_block None): one walk
        serves both.

        `after_block` is the cached block at position start-1 (None when
        start == 0) and `tokens` the holder's whole sequence (not copied).
        Valid only while `epoch` is what it was when that path was built:
        the holder references every block on it, so nothing but clear or
        drop_key can remove it. Costs O(new blocks), not O(path), which is
        why a sequence feeds the cache through this on every filled block.
        Returns the length of the holder's cached path, as `insert` does.
        """
        bs = self.block_size
        if len(blocks) < n_full or len(tokens) < n_full * bs:
            raise ValueError(f"{n_full} full blocks wanted but {len(blocks)} block ids / {len(tokens)} tokens")
        if after_block is None:
            assert start == 0, "extend below the root needs the block before `start`"
            parent = None
            level = self._roots.setdefault(key, {})
        else:
            parent = self._by_block[after_block]
            assert parent.alive and parent.key == key and parent.referenced, "extend below a stale path end"
            level = parent.children
        self._tick += 1
        done = start
        stored: list[tuple[int, tuple[int, ...]]] | None = None  # new nodes: one chain below `chain_parent`
        chain_parent: _Node | None = None
        for i in range(start, n_full):
            edge = tuple(tokens[i * bs : (i + 1) * bs])
            block = blocks[i]
            node = level.get(edge)
            if node is None:
                if block in self._by_block:
                    raise AssertionError(f"block {block} already cached at another position")
                node = _Node(block=block, key=key, edge=edge, parent=parent, last_used=self._tick)
                level[edge] = node
                self._by_block[block] = node
                if self.journal is not None:
                    if stored is None:
                        stored, chain_parent = [], parent
                    stored.append((block, edge))
            elif node.block != block:
                break
            else:
                self._touch(node)
            done += 1
            parent = node
            level = node.children
        if after_block is None and not self._roots[key]:
            del self._roots[key]
        if stored:
            self.journal.append(("stored", None if chain_parent is None else chain_parent.block, stored))
        return done

    # -- reference tracking ----------------------------------------------------
    def mark_unreferenced(self, block: int) -> None:
        node = self._by_block[block]
        if not node.referenced:
            raise AssertionError(f"cached block {block} already unreferenced")
        node.referenced = False
        self._unreferenced += 1
        self._push_if_evictable(node)

    def mark_referenced(self, block: int) -> None:
        node = self._by_block[block]
        if node.referenced:
            raise AssertionError(f"cached block {block} already referenced")
        node.referenced = True
        self._unreferenced -= 1

    # -- eviction ------------------------------------------------------------
    def evict(self, n: int) -> list[int]:
        """Drop up to n least-recently-used unreferenced leaves; the caller frees the returned blocks."""
        out: list[int] = []
        while len(out) < n and self._heap:
            last_used, _, node = heapq.heappop(self._heap)
            if not self._is_evictable(node) or node.last_used != last_used:
                continue
            if self.evict_sink is not None:
                self.evict_sink.append((node.key, self.path_tokens(node), node.block))
            self._remove(node)
            out.append(node.block)
            parent = node.parent
            if parent is not None:
                if node.last_used > parent.last_used:  # the path's newest use (see `extend`)
                    parent.last_used = node.last_used
                self._push_if_evictable(parent)
        self.evictions += len(out)
        if out and self.journal is not None:
            self.journal.append(("removed", list(out)))
        return out

    def clear(self) -> list[int]:
        """Drop every node (chip recovery, generation purge); returns all blocks that were cached."""
        out = list(self._by_block)
        self.epoch += 1
        for node in self._by_block.values():
            node.alive = False
        self._roots.clear()
        self._by_block.clear()
        self._heap.clear()
        self._unreferenced = 0
        if out and self.journal is not None:
            self.journal.append(("removed", list(out)))
        return out

    def drop_key(self, key: PrefixKey) -> list[int]:
        """Forget every node of one key (e.g. a retired model generation).

        Returns the blocks removed that were unreferenced (the caller frees
        them); referenced ones simply stop being cached, and their holders
        free them on release.
        """
        level = self._roots.pop(key, None)
        self.epoch += 1
        out: list[int] = []
        gone: list[int] = []
        stack = list(level.values()) if level else []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.alive = False
            del self._by_block[node.block]
            gone.append(node.block)
            if not node.referenced:
                self._unreferenced -= 1
                out.append(node.block)
        if gone and self.journal is not None:
            self.journal.append(("removed", gone))
        return out

    @staticmethod
    def path_tokens(node: _Node) -> list[int]:
        """Every token from the root through `node`'s block."""
        edges = []
        while node is not None:
            edges.append(node.edge)
            node = node.parent
        return [t for edge in reversed(edges) for t in edge]

    # -- internals -----------------------------------------------------------
    def _touch(self, node: _Node) -> None:
        node.last_used = self._tick
        self._push_if_evictable(node)

    def _is_evictable(self, node: _Node) -> bool:
        return node.alive and not node.referenced and not node.children

    def _push_if_evictable(self, node: _Node) -> None:
        if not self._is_evictable(node):
            return
        self._heap_seq += 1
        heapq.heappush(self._heap, (node.last_used, self._heap_seq, node))
        if len(self._heap) > 4 * len(self._by_block) + 64:
            self._heap = [e for e in self._heap if self._is_evictable(e[2]) and e[2].last_used == e[0]]
            heapq.heapify(self._heap)

    def _remove(self, node: _Node) -> None:
        level = node.parent.children if node.parent is not None else self._roots[node.key]
        del level[node.edge]
        if node.parent is None and not level:
            del self._roots[node.key]
        del self._by_block[node.block]
        node.alive = False
        if not node.referenced:
            self._unreferenced -= 1

    def check_invariants(self) -> None:
        """Tree links consistent; counters match; a referenced node's ancestors are referenced."""
        seen = 0
        unref = 0
        stack: list[tuple[_Node | None, dict[tuple[int, ...], _Node]]] = [(None, lvl) for lvl in self._roots.values()]
        while stack:
            parent, level = stack.pop()
            for edge, node in level.items():
                seen += 1
                if not node.alive or self._by_block.get(node.block) is not node:
                    raise AssertionError(f"cached node for block {node.block} not indexed")
                if node.parent is not parent or node.edge != edge or len(edge) != self.block_size:
                    raise AssertionError(f"cached node for block {node.block} has broken links")
                if node.referenced and parent is not None and not parent.referenced:
                    raise AssertionError(f"cached block {node.block} referenced below unreferenced parent")
                unref += not node.referenced
                stack.append((node, node.children))
        if seen != len(self._by_block):
            raise AssertionError(f"{len(self._by_block)} blocks indexed but {seen} reachable")
        if unref != self._unreferenced:
            raise AssertionError(f"evictable count {self._unreferenced} != {unref}")
