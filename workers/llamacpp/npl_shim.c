/* npuserve <-> llama.cpp shim.
 *
 * Compiled on first use (or by `make venv`) against the pinned llama.h in
 * ./include and linked to the prebuilt libllama inside the xllamacpp wheel.
 * It exists so that Python never sees a llama.cpp struct: every function
 * below takes and returns plain integers, floats and pointers, and every
 * struct layout is the compiler's business, not a guess in ctypes.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

#define NPL_ABI_VERSION 5
/* LLAMA_MAX_SEQ of the pinned llama.cpp (src/llama-cparams.h); the wheel does not export
 * llama_max_parallel_sequences(). */
#define NPL_MAX_SEQ 256

typedef struct npl_handle {
    struct llama_model *model;
    struct llama_context *ctx; /* NULL for a vocab-only load */
    const struct llama_vocab *vocab;
    struct llama_batch batch;
    int32_t n_batch;
} npl_handle;

static int npl_log_level = GGML_LOG_LEVEL_ERROR;

static void npl_log(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_CONT || (int)level >= npl_log_level) fputs(text, stderr);
}

int npl_abi_version(void) { return NPL_ABI_VERSION; }

/* 0 = everything, 4 = errors only (the default), 5 = nothing */
void npl_set_log_level(int level) { npl_log_level = level; }

static bool npl_quiet_progress(float progress, void *user) {
    (void)progress;
    (void)user;
    return true;
}

static int npl_backend_ready = 0;

static void npl_init(void) {
    if (!npl_backend_ready) {
        llama_log_set(npl_log, NULL);
        llama_backend_init();
        npl_backend_ready = 1;
    }
}

static void npl_err(char *err, int errlen, const char *msg) {
    if (err && errlen > 0) snprintf(err, (size_t)errlen, "%s", msg);
}

/* npl_open flags. 0 is what the backend serves with; the other layout exists only to be measured. */
#define NPL_PER_SEQUENCE_KV 1 /* one cell stream per sequence (llama.cpp server's layout): n_ctx / n_seq_max
                                 cells each, no partial prefix copies between sequences */

/* Open a model. vocab_only: no weights, no context (a tokenizer). */
void *npl_open(const char *path, int vocab_only, int n_ctx, int n_batch, int n_ubatch, int n_seq_max,
               int n_threads, int flags, char *err, int errlen) {
    npl_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.vocab_only = vocab_only ? true : false;
    mp.progress_callback = npl_quiet_progress;
    struct llama_model *model = llama_model_load_from_file(path, mp);
    if (!model) {
        npl_err(err, errlen, "llama_model_load_from_file failed (not a GGUF llama.cpp can load?)");
        return NULL;
    }
    npl_handle *h = (npl_handle *)calloc(1, sizeof(npl_handle));
    if (!h) {
        llama_model_free(model);
        npl_err(err, errlen, "out of memory");
        return NULL;
    }
    h->model = model;
    h->vocab = llama_model_get_vocab(model);
    if (vocab_only) return h;

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)n_ctx;
    cp.n_batch = (uint32_t)n_batch;
    cp.n_ubatch = (uint32_t)n_ubatch;
    cp.n_seq_max = (uint32_t)n_seq_max;
    cp.n_threads = n_threads;
    cp.n_threads_batch = n_threads;
    cp.swa_full = true;   /* sequence ops must be able to cut anywhere */
    /* one cell pool shared by all sequences: prefix copies share cells */
    cp.kv_unified = (flags & NPL_PER_SEQUENCE_KV) ? false : true;
    cp.no_perf = true;
    h->ctx = llama_init_from_model(model, cp);
    if (!h->ctx) {
        llama_model_free(model);
        free(h);
        npl_err(err, errlen, "llama_init_from_model failed (context too large for memory?)");
        return NULL;
    }
    h->n_batch = (int32_t)llama_n_batch(h->ctx);
    h->batch = llama_batch_init(h->n_batch, 0, 1);
    return h;
}

void npl_close(void *p) {
    npl_handle *h = (npl_handle *)p;
    if (!h) return;
    if (h->ctx) {
        llama_batch_free(h->batch);
        llama_free(h->ctx);
    }
    llama_model_free(h->model);
    free(h);
}

/* Integers describing the model and context; returns how many were written. */
int npl_describe(void *p, int64_t *out, int n) {
    npl_handle *h = (npl_handle *)p;
    int64_t v[16];
    v[0] = llama_vocab_n_tokens(h->vocab);
    v[1] = h->ctx ? (int64_t)llama_n_ctx(h->ctx) : 0;
    /* a vocab-only load has no hyper-parameters (llama.cpp aborts when asked) */
    int full = h->ctx != NULL;
    v[2] = full ? llama_model_n_ctx_train(h->model) : 0;
    v[3] = full ? llama_model_n_layer(h->model) : 0;
    v[4] = full ? llama_model_n_head(h->model) : 0;
    v[5] = full ? llama_model_n_head_kv(h->model) : 0;
    v[6] = full ? llama_model_n_embd(h->model) : 0;
    v[7] = h->ctx ? (int64_t)llama_n_seq_max(h->ctx) : 0;
    v[8] = llama_vocab_bos(h->vocab);
    v[9] = llama_vocab_eos(h->vocab);
    v[10] = llama_vocab_get_add_bos(h->vocab) ? 1 : 0;
    v[11] = full ? llama_model_n_swa(h->model) : 0;
    v[12] = h->ctx ? h->n_batch : 0;
    v[13] = llama_vocab_eot(h->vocab);
    v[14] = llama_vocab_get_add_eos(h->vocab) ? 1 : 0;
    v[15] = NPL_MAX_SEQ;
    int k = n < 16 ? n : 16;
    memcpy(out, v, (size_t)k * sizeof(int64_t));
    return k;
}

/* Metadata string by key (or the chat template when key is NULL); length or -1. */
int npl_meta(void *p, const char *key, char *buf, int len) {
    npl_handle *h = (npl_handle *)p;
    if (!key) {
        const char *t = llama_model_chat_template(h->model, NULL);
        if (!t) return -1;
        int n = (int)strlen(t);
        if (buf && len > 0) snprintf(buf, (size_t)len, "%s", t);
        return n;
    }
    return llama_model_meta_val_str(h->model, key, buf, (size_t)len);
}

int npl_is_eog(void *p, int32_t token) {
    return llama_vocab_is_eog(((npl_handle *)p)->vocab, token) ? 1 : 0;
}

/* One llama_decode over n tokens. For each token i whose want flag is set,
 * row rows[i] of logits_out receives its logits; with logits_out NULL nothing
 * is copied (read them in place with npl_logits). Returns llama_decode's
 * code, or -100 for a batch larger than n_batch. */
int npl_decode(void *p, int n, const int32_t *tokens, const int32_t *pos, const int32_t *seq, const int8_t *want,
               const int32_t *rows, float *logits_out, int n_vocab) {
    npl_handle *h = (npl_handle *)p;
    if (!h->ctx) return -101;
    if (n <= 0 || n > h->n_batch) return -100;
    struct llama_batch *b = &h->batch;
    for (int i = 0; i < n; i++) {
        b->token[i] = tokens[i];
        b->pos[i] = pos[i];
        b->n_seq_id[i] = 1;
        b->seq_id[i][0] = seq[i];
        b->logits[i] = want[i] ? 1 : 0;
    }
    b->n_tokens = n;
    int rc = llama_decode(h->ctx, *b);
    if (rc != 0) return rc;
    if (!logits_out) return 0;
    for (int i = 0; i < n; i++) {
        if (!want[i]) continue;
        const float *l = llama_get_logits_ith(h->ctx, i);
        if (!l) return -102;
        memcpy(logits_out + (size_t)rows[i] * (size_t)n_vocab, l, (size_t)n_vocab * sizeof(float));
    }
    return 0;
}

/* The last decode's logits in place: one row of n_vocab floats per wanted
 * token, in batch order. Owned by llama.cpp; valid until the next decode. */
const float *npl_logits(void *p) {
    npl_handle *h = (npl_handle *)p;
    return h->ctx ? llama_get_logits(h->ctx) : NULL;
}

int npl_seq_rm(void *p, int32_t seq, int32_t p0, int32_t p1) {
    return llama_memory_seq_rm(llama_get_memory(((npl_handle *)p)->ctx), seq, p0, p1) ? 1 : 0;
}

void npl_seq_cp(void *p, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    llama_memory_seq_cp(llama_get_memory(((npl_handle *)p)->ctx), src, dst, p0, p1);
}

int32_t npl_seq_pos_max(void *p, int32_t seq) {
    return llama_memory_seq_pos_max(llama_get_memory(((npl_handle *)p)->ctx), seq);
}

int32_t npl_seq_pos_min(void *p, int32_t seq) {
    return llama_memory_seq_pos_min(llama_get_memory(((npl_handle *)p)->ctx), seq);
}

/* One sequence's KV as bytes (llama_state_seq_*_ext; flags 0: every cache of the model, both of Gemma 3's
 * full and sliding-window caches). With dst NULL: the size only. Returns the bytes written (0: failed). */
int64_t npl_state_seq_get(void *p, int32_t seq, uint8_t *dst, int64_t size, uint32_t flags) {
    struct llama_context *ctx = ((npl_handle *)p)->ctx;
    if (!dst) return (int64_t)llama_state_seq_get_size_ext(ctx, seq, flags);
    return (int64_t)llama_state_seq_get_data_ext(ctx, dst, (size_t)size, seq, flags);
}

/* Bytes from npl_state_seq_get into sequence `seq` (whose cells are replaced). 0: refused by llama.cpp. */
int64_t npl_state_seq_set(void *p, int32_t seq, const uint8_t *src, int64_t size, uint32_t flags) {
    return (int64_t)llama_state_seq_set_data_ext(((npl_handle *)p)->ctx, src, (size_t)size, seq, flags);
}

void npl_clear(void *p) { llama_memory_clear(llama_get_memory(((npl_handle *)p)->ctx), true); }

int npl_tokenize(void *p, const char *text, int len, int32_t *out, int max, int add_special, int parse_special) {
    return llama_tokenize(((npl_handle *)p)->vocab, text, len, out, max, add_special != 0, parse_special != 0);
}

int npl_piece(void *p, int32_t token, char *buf, int len, int special) {
    return llama_token_to_piece(((npl_handle *)p)->vocab, token, buf, len, 0, special != 0);
}

/* LoRA adapters (llama.cpp's adapter API). An adapter belongs to the handle's model; llama.cpp applies one
 * set of adapters per context, so every sequence of the next decodes runs under the set adapter (NULL: none). */
void *npl_lora_load(void *hp, const char *path, char *err, int errlen) {
    npl_handle *h = (npl_handle *)hp;
    struct llama_adapter_lora *a = llama_adapter_lora_init(h->model, path);
    if (!a) npl_err(err, errlen, "llama_adapter_lora_init failed (not a LoRA GGUF for this model?)");
    return a;
}

void npl_lora_free(void *adapter) {
    if (adapter) llama_adapter_lora_free((struct llama_adapter_lora *)adapter);
}

int npl_lora_set(void *hp, void *adapter) {
    npl_handle *h = (npl_handle *)hp;
    if (!h->ctx) return -1;
    struct llama_adapter_lora *a = (struct llama_adapter_lora *)adapter;
    float scale = 1.0f;
    return (int)llama_set_adapters_lora(h->ctx, a ? &a : NULL, a ? 1 : 0, a ? &scale : NULL);
}
