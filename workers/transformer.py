"""The NumPy decoder-only transformer of the `ref` backend (float32).

Llama-like: RMSNorm, rotary position embeddings (rotate-half), grouped-query
attention, SwiGLU MLP, tied or untied LM head. Two entry points:

* `Transformer.forward_paged`: the serving path. New tokens of several lanes
  arrive packed; their K/V are written into a `PagedKvCache` and attention
  reads each lane's context back through its block table. This is what
  prefill, chunked prefill and batched decode all run.
* `Transformer.dense_logits`: a deliberately separate, cache-free full
  recompute (its own Q/K/V projections, `np.repeat` for GQA, a causal mask).
  It is the oracle the paged path is tested against and the source of the
  golden cases, so it shares only the elementwise primitives.

Tensor parallelism (Megatron-style, `shard=(rank, world)`): a rank holds the
query heads, KV heads (so its KV cache) and MLP columns of its 1/world slice,
and the rows of `wo`/`w_down` that read them; embeddings, norms and the LM
head are replicated. The two partial products of a layer (after attention,
after the MLP) are summed by `reduce` (an all-reduce across the ranks), so
the residual stream, and the logits, are the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from workers.paged_kv import PagedKvCache

# Queries per attention call are processed in slices of this many rows so a
# long one-shot prefill does not materialise a [T, T] score matrix per head.
_QUERY_SLICE = 256


@dataclass(frozen=True)
class ModelDims:
    """Architecture hyper-parameters; the manifest's `dims` object."""

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "heads", "kv_heads", "head_dim", "ffn_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"dims.{name} must be positive")
        if self.heads % self.kv_heads:
            raise ValueError("dims.heads must be a multiple of dims.kv_heads")
        if self.head_dim % 2:
            raise ValueError("dims.head_dim must be even (rotary embeddings rotate pairs)")

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def tp_degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees this shape splits into evenly (heads, KV heads, MLP columns)."""
        return tuple(w for w in range(1, self.kv_heads + 1)
                     if self.kv_heads % w == 0 and self.heads % w == 0 and self.ffn_dim % w == 0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelDims":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown dims keys: {sorted(unknown)}")
        return cls(**known)


def weight_shapes(dims: ModelDims, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """The exact tensor names and shapes a package's weights.npz must hold."""
    d, h, kvh, hd, f = dims.d_model, dims.heads, dims.kv_heads, dims.head_dim, dims.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab_size, d), "final_norm": (d,)}
    if not dims.tie_embeddings:
        shapes["lm_head"] = (d, vocab_size)
    for i in range(dims.layers):
        p = f"layers.{i}."
        shapes |= {
            p + "attn_norm": (d,),
            p + "wq": (d, h * hd),
            p + "wk": (d, kvh * hd),
            p + "wv": (d, kvh * hd),
            p + "wo": (h * hd, d),
            p + "mlp_norm": (d,),
            p + "w_gate": (d, f),
            p + "w_up": (d, f),
            p + "w_down": (f, d),
        }
    return shapes


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(ms + np.float32(eps))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def rope_tables(head_dim: int, max_seq: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_seq, head_dim/2], computed in float64 once."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(max_seq, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, hd]; cos/sin [T, hd/2] for each token's position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _softmax_last(scores: np.ndarray) -> np.ndarray:
    scores = scores - scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def _cols(a: np.ndarray, rank: int, world: int) -> np.ndarray:
    n = a.shape[1] // world
    return a[:, rank * n:(rank + 1) * n]


def _rows(a: np.ndarray, rank: int, world: int) -> np.ndarray:
    n = a.shape[0] // world
    return a[rank * n:(rank + 1) * n]


class Transformer:
    """Weights plus precomputed tables; stateless across calls (KV lives in the cache)."""

    def __init__(self, dims: ModelDims, weights: dict[str, np.ndarray], *, vocab_size: int, max_seq: int,
                 shard: tuple[int, int] = (0, 1),
                 reduce: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        expected = weight_shapes(dims, vocab_size)
        missing = sorted(set(expected) - set(weights))
        extra = sorted(set(weights) - set(expected))
        if missing or extra:
            raise ValueError(f"weights do not match dims: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"weight {name} has shape {weights[name].shape}, expected {shape}")
        rank, world = shard
        if world not in dims.tp_degrees() or not 0 <= rank < world:
            raise ValueError(f"tensor-parallel shard {rank}/{world}: degrees this model supports are "
                             f"{list(dims.tp_degrees())} (heads, KV heads and ffn_dim must divide evenly)")
        if world > 1 and reduce is None:
            raise ValueError("a tensor-parallel shard needs a reduce (all-reduce) callable")
        self.dims = dims
        self.vocab_size = vocab_size
        self.max_seq = max_seq
        self.rank, self.world = rank, world
        self._reduce = reduce if world > 1 else None
        self.heads, self.kv_heads = dims.heads // world, dims.kv_heads // world  # this rank's
        self.ffn_dim = dims.ffn_dim // world
        w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        # A shard keeps only its slices (the cache-free oracle needs the whole model: world 1 only).
        self.weights = w if world == 1 else {}
        self.embed = w["embed"]
        self.final_norm = w["final_norm"]
        self.lm_head = np.ascontiguousarray(self.embed.T) if dims.tie_embeddings else w["lm_head"]
        self.layers = []
        hd = dims.head_dim
        for i in range(dims.layers):
            p = f"layers.{i}."
            wq, wk, wv = (_cols(w[p + n].reshape(dims.d_model, -1, hd), rank, world).reshape(dims.d_model, -1)
                          if world > 1 else w[p + n] for n in ("wq", "wk", "wv"))
            self.layers.append({
                "attn_norm": w[p + "attn_norm"],
                "wqkv": np.ascontiguousarray(np.concatenate([wq, wk, wv], axis=1)),
                "wo": np.ascontiguousarray(_rows(w[p + "wo"], rank, world)),
                "mlp_norm": w[p + "mlp_norm"],
                "w_gate_up": np.ascontiguousarray(np.concatenate(
                    [_cols(w[p + "w_gate"], rank, world), _cols(w[p + "w_up"], rank, world)], axis=1)),
                "w_down": np.ascontiguousarray(_rows(w[p + "w_down"], rank, world)),
            })
        self.cos, self.sin = rope_tables(dims.head_dim, max_seq, dims.rope_theta)
        self.scale = np.float32(1.0 / np.sqrt(dims.head_dim))

    # ---- serving path -------------------------------------------------------------

    def forward_paged(
        self,
        cache: PagedKvCache,
        tokens: np.ndarray,
        positions: np.ndarray,
        lane_starts: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        extra_rows: np.ndarray | None = None,
        lora=None,
    ) -> np.ndarray:
        """Run the new tokens of n lanes; return logits [n, V] of each lane's last token.

        `lora` (a `workers.lora.lora_rows.LoraRows` over the packed rows, or
        None): adds each lane's adapter's low-rank product to the matrices it
        adapts, for that lane's rows only.

        `extra_rows` (packed token indices, speculative verification): their
        logits are returned too, after the n last-token rows ([n + len, V]).

        tokens/positions [T] are packed lane after lane; lane i owns
        tokens[lane_starts[i]:lane_starts[i+1]] (every lane owns >= 1 token and
        its positions run contiguously up to context_lens[i]-1). The caller has
        validated the block tables; K/V of every new token are written into
        the cache before any lane attends, so a lane sees its own new tokens.
        """
        d = self.dims
        n = len(context_lens)
        counts = np.diff(lane_starts)
        assert n > 0 and np.all(counts > 0)
        t_total = int(lane_starts[-1])
        bs = cache.block_size
        lane_of = np.repeat(np.arange(n), counts)
        block_ids = block_tables[lane_of, positions // bs]
        offsets = positions % bs
        cos, sin = self.cos[positions], self.sin[positions]

        # Padded [n, q_max] view of the packed tokens, for batched attention.
        q_max = int(counts.max())
        within = np.arange(t_total) - lane_starts[lane_of]
        last_rows = lane_starts[1:] - 1
        pad_src = np.minimum(lane_starts[:-1, None] + np.arange(q_max)[None, :], last_rows[:, None])
        q_pos = positions[pad_src]  # padded queries repeat the lane's last token: harmless, discarded
        n_blocks = int(-(-int(context_lens.max()) // bs))
        tables = block_tables[:, :n_blocks]

        x = self.embed[tokens]
        h_q, h_kv, hd = self.heads, self.kv_heads, d.head_dim
        for li, layer in enumerate(self.layers):
            last_layer = li == d.layers - 1
            h = rms_norm(x, layer["attn_norm"], d.norm_eps)
            qkv = h @ layer["wqkv"]
            if lora is not None:
                for target, col in (("wq", 0), ("wk", h_q * hd), ("wv", (h_q + h_kv) * hd)):
                    lora.add(qkv, h, li, target, col)
            q = qkv[:, : h_q * hd].reshape(t_total, h_q, hd)
            k = qkv[:, h_q * hd : (h_q + h_kv) * hd].reshape(t_total, h_kv, hd)
            v = qkv[:, (h_q + h_kv) * hd :].reshape(t_total, h_kv, hd)
            k = apply_rope(k, cos, sin)
            cache.write(li, block_ids, offsets, k, v)
            if last_layer:
                # Only each lane's last token feeds the LM head: skip the other queries.
                if extra_rows is None or not len(extra_rows):
                    q = apply_rope(q[last_rows], cos[last_rows], sin[last_rows])
                    attn = self._attend(cache, li, q[:, None], (context_lens - 1)[:, None], tables)[:, 0]
                    x = x[last_rows]
                    lora = lora.take(last_rows) if lora is not None else None
                else:  # each row attends as of its own position, within its lane's table
                    rows = np.concatenate([last_rows, extra_rows])
                    q = apply_rope(q[rows], cos[rows], sin[rows])
                    attn = self._attend(cache, li, q[:, None], positions[rows][:, None], tables[lane_of[rows]])[:, 0]
                    x = x[rows]
                    lora = lora.take(rows) if lora is not None else None
            else:
                q = apply_rope(q, cos, sin)
                attn_pad = self._attend(cache, li, q[pad_src], q_pos, tables)
                attn = attn_pad[lane_of, within]
            attn = attn.reshape(attn.shape[0], h_q * hd)
            o = attn @ layer["wo"]
            if lora is not None:
                lora.add(o, attn, li, "wo")
            x = x + self._all_reduce(o)
            x = x + self._all_reduce(self._mlp(x, layer, lora, li))
        return self._logits(x)

    def _all_reduce(self, partial: np.ndarray) -> np.ndarray:
        return partial if self._reduce is None else self._reduce(partial)

    def _attend(self, cache: PagedKvCache, layer: int, q: np.ndarray, q_pos: np.ndarray,
                tables: np.ndarray) -> np.ndarray:
        """q [n, Q, H, hd] at q_pos [n, Q] over each lane's cached context -> [n, Q, H, hd]."""
        d = self.dims
        n, q_len = q.shape[0], q.shape[1]
        heads, kv_heads = self.heads, self.kv_heads
        k_ctx, v_ctx = cache.gather(layer, tables)  # [n, S, KVH, hd]
        s_len = k_ctx.shape[1]
        kt = k_ctx.transpose(0, 2, 3, 1)  # [n, KVH, hd, S]
        vt = v_ctx.transpose(0, 2, 1, 3)  # [n, KVH, S, hd]
        key_idx = np.arange(s_len)
        out = np.empty((n, q_len, heads, d.head_dim), dtype=np.float32)
        for a in range(0, q_len, _QUERY_SLICE):
            b = min(q_len, a + _QUERY_SLICE)
            qs = q[:, a:b].reshape(n, b - a, kv_heads, d.group, d.head_dim)
            qs = qs.transpose(0, 2, 1, 3, 4).reshape(n, kv_heads, (b - a) * d.group, d.head_dim)
            scores = (qs @ kt) * self.scale  # [n, KVH, Q*G, S]
            visible = key_idx[None, None, :] <= q_pos[:, a:b, None]  # [n, Q, S]; pos < ctx by construction
            visible = np.repeat(visible, d.group, axis=1)[:, None]  # [n, 1, Q*G, S]
            scores = np.where(visible, scores, np.float32(-np.inf))
            probs = _softmax_last(scores)
            o = probs @ vt  # [n, KVH, Q*G, hd]
            o = o.reshape(n, kv_heads, b - a, d.group, d.head_dim).transpose(0, 2, 1, 3, 4)
            out[:, a:b] = o.reshape(n, b - a, heads, d.head_dim)
        return out

    def _mlp(self, x: np.ndarray, layer: dict, lora=None, li: int = 0) -> np.ndarray:
        h = rms_norm(x, layer["mlp_norm"], self.dims.norm_eps)
        gu = h @ layer["w_gate_up"]
        f = self.ffn_dim
        if lora is None:
            return (silu(gu[:, :f]) * gu[:, f:]) @ layer["w_down"]
        lora.add(gu, h, li, "w_gate")
        lora.add(gu, h, li, "w_up", f)
        act = silu(gu[:, :f]) * gu[:, f:]
        down = act @ layer["w_down"]
        lora.add(down, act, li, "w_down")
        return down

    def _logits(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.final_norm, self.dims.norm_eps) @ self.lm_head

    # ---- oracle -------------------------------------------------------------------

    def dense_logits(self, tokens) -> np.ndarray:
        """Logits [T, V] for every position of `tokens`, recomputed from scratch without a cache."""
        d, w = self.dims, self.weights
        if self.world > 1:
            raise ValueError("dense_logits needs the whole model (a tensor-parallel shard holds a slice)")
        toks = np.asarray(tokens, dtype=np.int64)
        t = len(toks)
        if not 0 < t <= self.max_seq:
            raise ValueError(f"sequence length {t} outside 1..{self.max_seq}")
        cos, sin = self.cos[:t], self.sin[:t]
        causal = np.tril(np.ones((t, t), dtype=bool))
        x = w["embed"][toks]
        for i in range(d.layers):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "attn_norm"], d.norm_eps)
            q = apply_rope((h @ w[p + "wq"]).reshape(t, d.heads, d.head_dim), cos, sin)
            k = apply_rope((h @ w[p + "wk"]).reshape(t, d.kv_heads, d.head_dim), cos, sin)
            v = (h @ w[p + "wv"]).reshape(t, d.kv_heads, d.head_dim)
            k = np.repeat(k, d.group, axis=1)  # query head j reads kv head j // group
            v = np.repeat(v, d.group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) * self.scale
            scores = np.where(causal[None], scores, -np.inf)
            attn = np.einsum("hqk,khd->qhd", _softmax_last(scores), v).reshape(t, d.heads * d.head_dim)
            x = x + attn @ w[p + "wo"]
            h = rms_norm(x, w[p + "mlp_norm"], d.norm_eps)
            x = x + (silu(h @ w[p + "w_gate"]) * (h @ w[p + "w_up"])) @ w[p + "w_down"]
        head = w["embed"].T if d.tie_embeddings else w["lm_head"]
        return (rms_norm(x, w["final_norm"], d.norm_eps) @ head).astype(np.float32)
