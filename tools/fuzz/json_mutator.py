"""A JSON-aware libFuzzer mutator: most mutations edit the parsed tree, so inputs stay JSON and reach the
schema checks instead of dying in the JSON parser; the rest are libFuzzer's byte mutations."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Sequence
from typing import Any

import atheris

# Values at and around the documented bounds, and every JSON type.
INTERESTING: tuple[Any, ...] = (
    None, True, False, 0, 1, -1, 2, 16, 63, 64, 65, 100, 101, -100, -101, 128, 129, 255, 256, 257, 1023, 1024,
    (1 << 16), (1 << 16) + 1, (1 << 20), (1 << 20) + 1, (1 << 31) - 1, 1 << 31, -(1 << 31), (1 << 63) - 1,
    -(1 << 63), (1 << 64) - 1, 1 << 64, 86_400_000, 86_400_001, 0.0, -0.0, 0.5, 1.0, 1.5, 100.0, 100.5, -0.5,
    1e-300, 1e308, "", "a", "x" * 40, "x" * 64, "x" * 65, "x" * 129, "x" * 257, ".a", "-a", "a:b", "tcp://h:1",
    "ipc:///tmp/x", "\u00e9", "\ud7ff", "\x00", "text", "json_object", "json_schema", "regex", "lark", "gbnf",
    "off", "ngram", "draft", "user", "assistant", "system", "tool", "none", "auto", [], [0], [1, 2], [[1]], ["a"],
    {}, {"type": "text"}, {"type": "json_object"}, {"kind": "regex", "body": "a+"},
)


def _paths(obj: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:32]):
            out += _paths(v, path + (i,))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _value(rng: random.Random, names: Sequence[str]) -> Any:
    r = rng.random()
    if r < 0.7:
        return copy.deepcopy(rng.choice(INTERESTING))  # never share a mutable value between inputs
    if r < 0.85:
        return rng.choice(names) if names else ""
    return rng.randint(-(1 << 64), 1 << 65)


def _mutate_tree(obj: Any, rng: random.Random, names: Sequence[str]) -> Any:
    path = rng.choice(_paths(obj))
    node = _get(obj, path)
    op = rng.randrange(6)
    if op == 0 and isinstance(node, dict) and node:  # drop a key
        del node[rng.choice(list(node))]
        return obj
    if op == 1 and isinstance(node, dict):  # add a known field name
        node[rng.choice(names) if names and rng.random() < 0.8 else str(_value(rng, names))] = _value(rng, names)
        return obj
    if op == 2 and isinstance(node, list):  # grow or shrink a list
        if node and rng.random() < 0.5:
            node.pop(rng.randrange(len(node)))
        else:
            node.insert(rng.randint(0, len(node)), copy.deepcopy(rng.choice(node)) if node and rng.random() < 0.5
                        else _value(rng, names))
        return obj
    if op == 3 and type(node) in (int, float):  # step a number
        new = node + rng.choice((-1, 1, -0.5, 0.5)) if rng.random() < 0.7 else -node
    elif op == 4 and isinstance(node, str) and node:  # stretch or cut a string
        new = node * rng.randint(2, 70) if rng.random() < 0.5 else node[:rng.randrange(len(node))]
    else:
        new = _value(rng, names)
    if not path:
        return new
    _get(obj, path[:-1])[path[-1]] = new
    return obj


def mutate(data: bytes, max_size: int, seed: int, names: Sequence[str] = ()) -> bytes:
    rng = random.Random(seed)
    if rng.random() < 0.2:
        return atheris.Mutate(data, max_size)
    try:
        obj = json.loads(data)
        for _ in range(rng.randint(1, 3)):
            obj = _mutate_tree(obj, rng, names)
        out = json.dumps(obj, separators=(",", ":"), ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError, UnicodeError):
        return atheris.Mutate(data, max_size)
    return out if len(out) <= max_size else atheris.Mutate(data, max_size)
