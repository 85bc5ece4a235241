"""Write an npuserve `.npz` model as a Llama-architecture GGUF (the `gguf` package).

Why: the `llamacpp` backend must be testable in seconds, and `ref` (the
oracle) and llama.cpp must be shown to compute the same model. So the tiny
random-weight model is written twice from one set of weights: as
`weights.npz` for `ref` and as `model.gguf` for llama.cpp, and its golden
cases (made by the `ref` oracle) are replayed through llama.cpp.

Two conventions differ and are converted here, exactly as llama.cpp's own
`convert_hf_to_gguf.py` does for Hugging Face Llama checkpoints:

* npuserve stores projections as `x @ W` ([in, out]); GGUF stores
  `[out, in]` row-major, so every matrix is transposed.
* `ref` uses rotate-half RoPE; llama.cpp's `llama` architecture rotates
  adjacent pairs, so the rows of Q and K are permuted per head.

The vocabulary is byte-level: ids 0-255 are the byte tokens `<0x00>`..,
then bos, eos, pad and unused control tokens, as a SentencePiece (`llama`)
vocabulary llama.cpp can load; npuserve's own tokenizer for it stays
`bytes`.
"""

from __future__ import annotations

import numpy as np

from workers.transformer import ModelDims


def _permute_rope(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of a [heads*head_dim, in] Q/K matrix from rotate-half to pairwise order."""
    out, inp = w_out_in.shape
    return (w_out_in.reshape(n_heads, 2, out // n_heads // 2, inp).swapaxes(1, 2).reshape(out, inp))


def _vocab(vocab: int, bos: int, eos: int, pad: int) -> tuple[list[bytes], list[float], list[int]]:
    import gguf

    T = gguf.TokenType
    tokens, scores, types = [], [], []
    for i in range(vocab):
        if i < 256:
            tokens.append(f"<0x{i:02X}>".encode())
            types.append(T.BYTE)
        elif i == bos:
            tokens.append(b"<s>")
            types.append(T.CONTROL)
        elif i == eos:
            tokens.append(b"</s>")
            types.append(T.CONTROL)
        elif i == pad:
            tokens.append(b"<pad>")
            types.append(T.CONTROL)
        elif i == pad + 1:
            tokens.append(b"<unk>")
            types.append(T.UNKNOWN)
        else:
            tokens.append(f"<unused{i}>".encode())
            types.append(T.UNUSED)
        scores.append(0.0)
    return tokens, scores, types


def write_llama_gguf(path: str, *, name: str, dims: ModelDims, weights: dict[str, np.ndarray], vocab_size: int,
                     bos_id: int, eos_id: int, pad_id: int, max_seq: int) -> None:
    """Write `weights` (npuserve layout, float32) to `path` as a llama-architecture GGUF."""
    import gguf

    if vocab_size < 260 or not (256 <= min(bos_id, eos_id, pad_id)):
        raise ValueError("the GGUF form needs the byte-level layout: vocab >= 260, special ids >= 256")
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_context_length(max_seq)
    w.add_embedding_length(dims.d_model)
    w.add_block_count(dims.layers)
    w.add_feed_forward_length(dims.ffn_dim)
    w.add_head_count(dims.heads)
    w.add_head_count_kv(dims.kv_heads)
    w.add_key_length(dims.head_dim)
    w.add_value_length(dims.head_dim)
    w.add_rope_dimension_count(dims.head_dim)
    w.add_rope_freq_base(float(dims.rope_theta))
    w.add_layer_norm_rms_eps(float(dims.norm_eps))
    w.add_vocab_size(vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("llama")
    tokens, scores, types = _vocab(vocab_size, bos_id, eos_id, pad_id)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(bos_id)
    w.add_eos_token_id(eos_id)
    w.add_pad_token_id(pad_id)
    w.add_unk_token_id(pad_id + 1)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", f32(weights["embed"]))
    w.add_tensor("output_norm.weight", f32(weights["final_norm"]))
    if not dims.tie_embeddings:
        w.add_tensor("output.weight", f32(weights["lm_head"].T))
    for i in range(dims.layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", f32(weights[p + "attn_norm"]))
        w.add_tensor(b + "attn_q.weight", f32(_permute_rope(weights[p + "wq"].T, dims.heads)))
        w.add_tensor(b + "attn_k.weight", f32(_permute_rope(weights[p + "wk"].T, dims.kv_heads)))
        w.add_tensor(b + "attn_v.weight", f32(weights[p + "wv"].T))
        w.add_tensor(b + "attn_output.weight", f32(weights[p + "wo"].T))
        w.add_tensor(b + "ffn_norm.weight", f32(weights[p + "mlp_norm"]))
        w.add_tensor(b + "ffn_gate.weight", f32(weights[p + "w_gate"].T))
        w.add_tensor(b + "ffn_up.weight", f32(weights[p + "w_up"].T))
        w.add_tensor(b + "ffn_down.weight", f32(weights[p + "w_down"].T))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
