"""llama.cpp's own server engine (xllamacpp Server, in-process): the reference the real-model tests compare to."""

from __future__ import annotations


def llama_server_texts(gguf: str, requests: list[dict], max_tokens: int, adapters: tuple[str, ...] = ()) -> list[str]:
    """The text of each completion request (`prompt` and, with `adapters` loaded unapplied, its `lora`
    selection) from one greedy slot, one request at a time."""
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = gguf
    p.n_parallel = 1
    p.n_ctx = 512
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 1
    p.warmup = False
    p.swa_full = True  # a full-size sliding-window cache, as the llamacpp backend keeps it
    if adapters:
        p.lora_adapters = [xlc.CommonAdapterLoraInfo(a, 1.0) for a in adapters]
        p.lora_init_without_apply = True
    server = xlc.Server(p)
    try:
        return [server.handle_completions({"n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
                                           "cache_prompt": False, "stream": False, **req})["choices"][0]["text"]
                for req in requests]
    finally:
        del server
