"""`ref`'s building blocks against values computed without them.

The dense oracle (`Transformer.dense_logits`) shares `rms_norm`, `silu`,
`rope_tables`, `apply_rope` and the softmax with the paged path, so a bug in
one of them would pass every paged-vs-dense test. Here each is checked against
closed forms and against a float64 textbook implementation written out below
(scalar loops and `math`, nothing imported from `workers.transformer`), and the
whole model against that textbook decoder: llama-like, pre-norm, rotate-half
RoPE (docs/backends.md), grouped-query attention, SwiGLU MLP.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from workers import transformer as tf

# -- the textbook, float64, one scalar at a time ------------------------------------


def tb_rms_norm(x: list[float], w: list[float], eps: float) -> list[float]:
    rms = math.sqrt(sum(v * v for v in x) / len(x) + eps)
    return [v / rms * g for v, g in zip(x, w)]


def tb_silu(v: float) -> float:
    return v / (1.0 + math.exp(-v)) if v > -700 else 0.0


def tb_angle(pos: int, i: int, head_dim: int, theta: float) -> float:
    """Rotation angle of pair i (dims i and i + head_dim/2) at position pos."""
    return pos / theta ** (2.0 * i / head_dim)


def tb_rope(vec: list[float], pos: int, theta: float) -> list[float]:
    hd = len(vec)
    half = hd // 2
    out = [0.0] * hd
    for i in range(half):
        a = tb_angle(pos, i, hd, theta)
        x1, x2 = vec[i], vec[i + half]
        out[i] = x1 * math.cos(a) - x2 * math.sin(a)
        out[i + half] = x1 * math.sin(a) + x2 * math.cos(a)
    return out


def tb_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    es = [math.exp(v - m) if v != -math.inf else 0.0 for v in xs]
    s = sum(es)
    return [e / s for e in es]


def tb_matvec(x: list[float], w: np.ndarray) -> list[float]:
    """x [in] times w [in, out], as Python floats."""
    rows = w.astype(np.float64).tolist()
    return [sum(x[i] * rows[i][j] for i in range(len(x))) for j in range(len(rows[0]))]


def tb_logits(weights: dict[str, np.ndarray], dims: tf.ModelDims, tokens: list[int]) -> np.ndarray:
    """The decoder written out position by position and head by head."""
    d, hd, nh, nkv = dims.d_model, dims.head_dim, dims.heads, dims.kv_heads
    group = nh // nkv
    xs = [weights["embed"][t].astype(np.float64).tolist() for t in tokens]
    for layer in range(dims.layers):
        p = f"layers.{layer}."
        qs, ks, vs = [], [], []
        for pos, x in enumerate(xs):
            h = tb_rms_norm(x, weights[p + "attn_norm"].tolist(), dims.norm_eps)
            q, k, v = tb_matvec(h, weights[p + "wq"]), tb_matvec(h, weights[p + "wk"]), tb_matvec(h, weights[p + "wv"])
            qs.append([tb_rope(q[j * hd:(j + 1) * hd], pos, dims.rope_theta) for j in range(nh)])
            ks.append([tb_rope(k[j * hd:(j + 1) * hd], pos, dims.rope_theta) for j in range(nkv)])
            vs.append([v[j * hd:(j + 1) * hd] for j in range(nkv)])
        new = []
        for pos, x in enumerate(xs):
            attn: list[float] = []
            for j in range(nh):
                kv = j // group
                scores = [sum(a * b for a, b in zip(qs[pos][j], ks[s][kv])) / math.sqrt(hd) for s in range(pos + 1)]
                probs = tb_softmax(scores)
                attn += [sum(probs[s] * vs[s][kv][c] for s in range(pos + 1)) for c in range(hd)]
            x = [a + b for a, b in zip(x, tb_matvec(attn, weights[p + "wo"]))]
            h = tb_rms_norm(x, weights[p + "mlp_norm"].tolist(), dims.norm_eps)
            gate, up = tb_matvec(h, weights[p + "w_gate"]), tb_matvec(h, weights[p + "w_up"])
            mlp = tb_matvec([tb_silu(g) * u for g, u in zip(gate, up)], weights[p + "w_down"])
            new.append([a + b for a, b in zip(x, mlp)])
        xs = new
    head = weights["embed"].T if dims.tie_embeddings else weights["lm_head"]
    return np.array([tb_matvec(tb_rms_norm(x, weights["final_norm"].tolist(), dims.norm_eps), head) for x in xs])


# -- closed forms ---------------------------------------------------------------------


def test_rms_norm_of_a_constant_vector_is_its_sign_times_the_weight():
    w = np.array([1.0, 2.0, -3.0, 0.5], np.float32)
    for c in (0.25, 3.0, -7.0):
        got = tf.rms_norm(np.full((1, 4), c, np.float32), w, 0.0)
        np.testing.assert_allclose(got[0], np.sign(c) * w, rtol=1e-6)
    # with eps: x / sqrt(mean(x^2) + eps); [3, 4] has mean square 12.5
    got = tf.rms_norm(np.array([[3.0, 4.0]], np.float32), np.ones(2, np.float32), 0.25)
    np.testing.assert_allclose(got[0], [3 / math.sqrt(12.75), 4 / math.sqrt(12.75)], rtol=1e-6)


def test_rms_norm_matches_the_textbook_row_by_row():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 12)).astype(np.float32) * 3
    w = rng.standard_normal(12).astype(np.float32)
    got = tf.rms_norm(x, w, 1e-5)
    want = [tb_rms_norm(row, w.tolist(), 1e-5) for row in x.astype(np.float64).tolist()]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_silu_closed_forms_and_textbook():
    # silu(x) = x * sigmoid(x); sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4
    x = np.array([0.0, math.log(3), -math.log(3), 30.0, -30.0], np.float32)
    want = [0.0, 0.75 * math.log(3), -0.25 * math.log(3), 30.0, -30.0 * math.exp(-30.0)]
    np.testing.assert_allclose(tf.silu(x), want, rtol=1e-6, atol=1e-12)
    grid = np.linspace(-12, 12, 97, dtype=np.float32)
    np.testing.assert_allclose(tf.silu(grid), [tb_silu(v) for v in grid.tolist()], rtol=1e-6, atol=1e-7)


def test_rope_tables_are_cos_and_sin_of_position_times_inverse_frequency():
    hd, theta = 8, 10000.0
    cos, sin = tf.rope_tables(hd, 64, theta)
    assert cos.shape == sin.shape == (64, hd // 2)
    np.testing.assert_array_equal(cos[0], 1.0)  # position 0: no rotation
    np.testing.assert_array_equal(sin[0], 0.0)
    np.testing.assert_allclose(cos[:, 0], np.cos(np.arange(64)), rtol=0, atol=1e-6)  # pair 0 turns 1 rad per position
    # the last pair turns theta^(-(hd-2)/hd) rad per position: 10000^(-3/4) = 1e-3
    np.testing.assert_allclose(sin[:, -1], np.sin(np.arange(64) * 1e-3), rtol=1e-6, atol=1e-9)
    for pos in (1, 7, 63):
        for i in range(hd // 2):
            a = tb_angle(pos, i, hd, theta)
            assert cos[pos, i] == pytest.approx(math.cos(a), abs=1e-6)
            assert sin[pos, i] == pytest.approx(math.sin(a), abs=1e-6)


def test_apply_rope_rotates_pair_i_with_i_plus_half_by_the_positions_angle():
    hd, theta = 8, 500.0
    cos, sin = tf.rope_tables(hd, 32, theta)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, 3, hd)).astype(np.float32)  # [T, heads, hd], token t at position t
    got = tf.apply_rope(x, cos, sin)
    for t in range(32):
        for h in range(3):
            np.testing.assert_allclose(got[t, h], tb_rope(x[t, h].astype(np.float64).tolist(), t, theta),
                                       rtol=1e-5, atol=1e-5)
    # closed form: a unit vector on dim 0 at position 1 turns by exactly 1 rad into dim hd/2
    e0 = np.zeros((1, 1, hd), np.float32)
    e0[0, 0, 0] = 1.0
    out = tf.apply_rope(e0, cos[1:2], sin[1:2])[0, 0]
    np.testing.assert_allclose(out[[0, hd // 2]], [math.cos(1), math.sin(1)], atol=1e-6)
    assert np.count_nonzero(np.abs(out) > 1e-7) == 2


def test_rope_scores_depend_only_on_the_distance_between_positions():
    hd = 16
    cos, sin = tf.rope_tables(hd, 64, 10000.0)
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 1, 1, hd)).astype(np.float32)

    def score(m: int, n: int) -> float:
        qm = tf.apply_rope(q, cos[m:m + 1], sin[m:m + 1])
        kn = tf.apply_rope(k, cos[n:n + 1], sin[n:n + 1])
        return float((qm * kn).sum())

    assert score(5, 2) == pytest.approx(score(40, 37), rel=1e-4)
    assert score(9, 9) == pytest.approx(float((q * k).sum()), rel=1e-4)


def test_softmax_closed_forms_masking_and_overflow():
    got = tf._softmax_last(np.log(np.array([[1.0, 2.0, 3.0]], np.float32)))
    np.testing.assert_allclose(got, [[1 / 6, 2 / 6, 3 / 6]], rtol=1e-6)
    masked = tf._softmax_last(np.array([[0.0, -np.inf, 0.0]], np.float32))
    np.testing.assert_array_equal(masked, [[0.5, 0.0, 0.5]])
    big = tf._softmax_last(np.array([[1000.0, 1000.0, -1000.0]], np.float32))  # no overflow
    np.testing.assert_allclose(big, [[0.5, 0.5, 0.0]], atol=1e-12)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((4, 9)) * 5).astype(np.float32)
    np.testing.assert_allclose(tf._softmax_last(x.copy()), [tb_softmax(r) for r in x.astype(np.float64).tolist()],
                               rtol=1e-5, atol=1e-7)


# -- the whole model -------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_dense_oracle_equals_the_textbook_decoder(tie):
    """GQA (4 query heads on 2 KV heads), two layers, causal attention, SwiGLU:
    the oracle agrees with the float64 textbook (and the paged path agrees
    with the oracle: test_ref_backend.py)."""
    dims = tf.ModelDims(layers=2, d_model=16, heads=4, kv_heads=2, head_dim=8, ffn_dim=24, rope_theta=1000.0,
                        norm_eps=1e-5, tie_embeddings=tie)
    vocab = 40
    rng = np.random.default_rng(5)
    weights = {name: (rng.standard_normal(shape) * (0.5 if len(shape) == 2 else 1.0)).astype(np.float32)
               for name, shape in tf.weight_shapes(dims, vocab).items()}
    for name in weights:
        if name.endswith("norm"):
            weights[name] = (1.0 + 0.3 * rng.standard_normal(weights[name].shape)).astype(np.float32)
    tokens = [3, 17, 17, 0, 39, 8, 22]
    want = tb_logits(weights, dims, tokens)
    model = tf.Transformer(dims, weights, vocab_size=vocab, max_seq=32)
    np.testing.assert_allclose(model.dense_logits(tokens), want, rtol=2e-4, atol=2e-4)
