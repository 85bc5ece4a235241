/*
 * reference_chip.c -- a tiny deterministic "chip runtime" implementing
 * npuserve_chip.h, so the ctypes backend can be tested without hardware.
 *
 * It is not a neural network. Each token's KV entry records (magic, token,
 * position, running hash of the history up to and including the token); the
 * logits after a token are a fixed function of that running hash. Every call
 * re-verifies the whole kv_in history (magic, positions 0..P-1, hash chain),
 * so KV that was lost, reordered or mixed up in npuserve's paged cache makes
 * the call fail with SIMPLER_E_KV_CORRUPT instead of producing plausible
 * logits, and a decode after a prefill depends on every prompt token.
 *
 * Build: cc -shared -fPIC -O2 -o libreference_chip.so reference_chip.c
 *   -DSIMPLER_ABI_VERSION=N  build a library claiming another ABI version
 *   -DREF_VOCAB=N -DREF_MAX_SEQ=N  other model shapes
 *   -DREF_DEVICE_KV=0  leave out the optional device-resident KV group (npuserve
 *                      then keeps the paged cache in the worker's memory)
 *
 * Tensor parallelism (simpler_tp_init): rank r of w computes the logits of its
 * slice of the vocabulary, zeros elsewhere, and npuserve's all-reduce sums the
 * slices -- exactly the logits of one chip (a sum with zeros is exact), so the
 * callback is exercised on every row without changing any result.
 *
 * Device-resident KV (simpler_kv_*, simpler_model_*_paged; at the end): the
 * chip's paged cache lives in this library, npuserve names block ids.
 *
 * Python re-statement (used by the tests):
 *   mix32(x)       = lowbias32 finalizer below
 *   h0             = 0x811C9DC5
 *   h' = step(h,t) = mix32(h * 0x01000193 + t + 1)            (mod 2^32)
 *   logit(h, v)    = ((mix32(h ^ (v * 0x9E3779B9)) >> 16) & 0xFFF) / 256 - 8
 */
#include <string.h>

#include "npuserve_chip.h"

#ifndef REF_VOCAB
#define REF_VOCAB 320
#endif
#ifndef REF_MAX_SEQ
#define REF_MAX_SEQ 4096
#endif
#ifndef REF_DEVICE_KV
#define REF_DEVICE_KV 1
#endif
#define REF_MAX_CHIPS 64
#define REF_MAGIC 0x4E50554Bu /* "NPUK" */
#define REF_H0 0x811C9DC5u

typedef struct ref_kv_entry {
    uint32_t magic;
    int32_t token;
    int32_t position;
    uint32_t hash; /* running hash after this token */
} ref_kv_entry;

static uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

static uint32_t step(uint32_t h, int32_t token) {
    return mix32(h * 0x01000193u + (uint32_t)token + 1u);
}

typedef struct ref_tp {
    int rank, world;
    simpler_allreduce_fn reduce;
    void* ctx;
} ref_tp;

static ref_tp tp_state[REF_MAX_CHIPS];

int simpler_tp_init(int chip_id, int rank, int world, simpler_allreduce_fn reduce, void* ctx) {
    if (chip_id < 0 || chip_id >= REF_MAX_CHIPS || world < 1 || rank < 0 || rank >= world ||
        REF_VOCAB % world != 0)
        return SIMPLER_E_INVALID;
    if (world > 1 && reduce == NULL) return SIMPLER_E_INVALID; /* no collective of its own */
    tp_state[chip_id] = (ref_tp){rank, world, reduce, ctx};
    return SIMPLER_OK;
}

static int write_logits(int chip_id, uint32_t h, float* logits, int vocab) {
    const ref_tp* t = &tp_state[chip_id];
    int world = t->world > 0 ? t->world : 1, rank = t->world > 0 ? t->rank : 0;
    int lo = vocab / world * rank, hi = vocab / world * (rank + 1);
    for (int v = 0; v < vocab; v++) {
        if (v < lo || v >= hi) {
            logits[v] = 0.0f;
            continue;
        }
        uint32_t r = mix32(h ^ ((uint32_t)v * 0x9E3779B9u));
        logits[v] = (float)((r >> 16) & 0xFFFu) / 256.0f - 8.0f;
    }
    if (world > 1 && t->reduce(t->ctx, logits, (size_t)vocab) != 0) return SIMPLER_E_DEVICE;
    return SIMPLER_OK;
}

/* Verify a KV history and return its final running hash via *h_out. */
static int check_history(const void* kv_in, size_t kv_size, int32_t* n_out, uint32_t* h_out) {
    if (kv_size % sizeof(ref_kv_entry) != 0) return SIMPLER_E_INVALID;
    size_t n = kv_size / sizeof(ref_kv_entry);
    if (n > 0 && kv_in == NULL) return SIMPLER_E_INVALID;
    if (n > REF_MAX_SEQ) return SIMPLER_E_TOO_LONG;
    uint32_t h = REF_H0;
    const unsigned char* p = (const unsigned char*)kv_in;
    for (size_t i = 0; i < n; i++) {
        ref_kv_entry e;
        memcpy(&e, p + i * sizeof e, sizeof e);
        if (e.magic != REF_MAGIC || e.position != (int32_t)i) return SIMPLER_E_KV_CORRUPT;
        h = step(h, e.token);
        if (e.hash != h) return SIMPLER_E_KV_CORRUPT;
    }
    *n_out = (int32_t)n;
    *h_out = h;
    return SIMPLER_OK;
}

int simpler_abi_version(void) { return SIMPLER_ABI_VERSION; }

int simpler_model_describe(int chip_id, simpler_model_info* out) {
    static const int32_t profiles[] = {1, 4, 8, 16};
    if (chip_id < 0 || chip_id >= REF_MAX_CHIPS || out == NULL) return SIMPLER_E_INVALID;
    memset(out, 0, sizeof *out);
    out->abi_version = SIMPLER_ABI_VERSION;
    out->vocab = REF_VOCAB;
    out->max_seq = REF_MAX_SEQ;
    out->n_eos = 1;
    out->eos_ids[0] = 1;
    out->n_profiles = (int32_t)(sizeof profiles / sizeof profiles[0]);
    memcpy(out->profiles, profiles, sizeof profiles);
    out->chunked_prefill = 1;
    out->kv_bytes_per_token = (int64_t)sizeof(ref_kv_entry);
    return SIMPLER_OK;
}

/* Append n tokens after a verified history; writes their KV entries and the last logits. */
static int extend(int chip_id, int32_t pos, uint32_t h, const int32_t* tokens, int n, void* kv_out,
                  float* logits, int vocab) {
    if ((int64_t)pos + n > REF_MAX_SEQ) return SIMPLER_E_TOO_LONG;
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= REF_VOCAB) return SIMPLER_E_INVALID;
    }
    unsigned char* o = (unsigned char*)kv_out;
    for (int i = 0; i < n; i++) {
        h = step(h, tokens[i]);
        ref_kv_entry e = {REF_MAGIC, tokens[i], pos + i, h};
        memcpy(o + (size_t)i * sizeof e, &e, sizeof e);
    }
    return write_logits(chip_id, h, logits, vocab);
}

int simpler_model_prefill(int chip_id, const int32_t* tokens, int n_tokens,
                          const void* kv_in, size_t kv_size, void* kv_out,
                          float* logits, int vocab) {
    if (chip_id < 0 || chip_id >= REF_MAX_CHIPS || vocab != REF_VOCAB || n_tokens <= 0 ||
        tokens == NULL || kv_out == NULL || logits == NULL)
        return SIMPLER_E_INVALID;
    int32_t pos;
    uint32_t h;
    int rc = check_history(kv_in, kv_size, &pos, &h);
    if (rc != SIMPLER_OK) return rc;
    return extend(chip_id, pos, h, tokens, n_tokens, kv_out, logits, vocab);
}

int simpler_model_decode(int chip_id, int batch, const int32_t* tokens,
                         const uint8_t* lane_valid, const void* const* kv_in,
                         const size_t* kv_size, void* const* kv_out,
                         float* logits, int vocab) {
    if (chip_id < 0 || chip_id >= REF_MAX_CHIPS || vocab != REF_VOCAB || batch <= 0 ||
        tokens == NULL || lane_valid == NULL || kv_in == NULL || kv_size == NULL ||
        kv_out == NULL || logits == NULL)
        return SIMPLER_E_INVALID;
    for (int b = 0; b < batch; b++) {
        if (!lane_valid[b]) continue;
        if (kv_out[b] == NULL) return SIMPLER_E_INVALID;
        int32_t pos;
        uint32_t h;
        int rc = check_history(kv_in[b], kv_size[b], &pos, &h);
        if (rc != SIMPLER_OK) return rc;
        rc = extend(chip_id, pos, h, &tokens[b], 1, kv_out[b], logits + (size_t)b * (size_t)vocab, vocab);
        if (rc != SIMPLER_OK) return rc;
    }
    return SIMPLER_OK;
}

#if REF_DEVICE_KV
/*
 * Device-resident KV (the optional group of npuserve_chip.h): the chip's pool
 * of blocks lives here ("device memory": malloc'd by the library), npuserve
 * only names block ids. The transfer format of a block is its block_size
 * entries as stored (16 bytes each), so a block exported by one chip imports
 * into any other chip of the same build.
 */
#include <stdlib.h>

typedef struct ref_pool {
    ref_kv_entry* entries; /* num_blocks * block_size */
    int num_blocks, block_size;
} ref_pool;

static ref_pool pools[REF_MAX_CHIPS];

int64_t simpler_kv_block_bytes(int chip_id, int block_size) {
    if (chip_id < 0 || chip_id >= REF_MAX_CHIPS || block_size <= 0) return SIMPLER_E_INVALID;
    return (int64_t)block_size * (int64_t)sizeof(ref_kv_entry);
}

int simpler_kv_init(int chip_id, int num_blocks, int block_size) {
    if (chip_id < 0 || chip_id >= REF_MAX_CHIPS || num_blocks <= 0 || block_size <= 0) return SIMPLER_E_INVALID;
    ref_pool* p = &pools[chip_id];
    free(p->entries);
    p->entries = calloc((size_t)num_blocks * (size_t)block_size, sizeof(ref_kv_entry));
    if (p->entries == NULL) {
        p->num_blocks = p->block_size = 0;
        return SIMPLER_E_DEVICE;
    }
    p->num_blocks = num_blocks;
    p->block_size = block_size;
    return SIMPLER_OK;
}

static const ref_pool* pool_of(int chip_id) {
    if (chip_id < 0 || chip_id >= REF_MAX_CHIPS || pools[chip_id].entries == NULL) return NULL;
    return &pools[chip_id];
}

/* Block ids in range and (for writes) not repeated: checked before anything moves. */
static int check_ids(const ref_pool* p, const int32_t* ids, int n, int unique) {
    if (n < 0 || (n > 0 && ids == NULL)) return SIMPLER_E_INVALID;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= p->num_blocks) return SIMPLER_E_INVALID;
        for (int j = 0; unique && j < i; j++)
            if (ids[j] == ids[i]) return SIMPLER_E_INVALID;
    }
    return SIMPLER_OK;
}

int simpler_kv_copy_out(int chip_id, const int32_t* block_ids, int n, void* dst, size_t dst_bytes) {
    const ref_pool* p = pool_of(chip_id);
    if (p == NULL) return SIMPLER_E_INVALID;
    size_t bb = (size_t)p->block_size * sizeof(ref_kv_entry);
    if (check_ids(p, block_ids, n, 0) != SIMPLER_OK || dst_bytes != (size_t)n * bb || (n > 0 && dst == NULL))
        return SIMPLER_E_INVALID;
    for (int i = 0; i < n; i++)
        memcpy((unsigned char*)dst + (size_t)i * bb, p->entries + (size_t)block_ids[i] * p->block_size, bb);
    return SIMPLER_OK;
}

int simpler_kv_copy_in(int chip_id, const int32_t* block_ids, int n, const void* src, size_t src_bytes) {
    const ref_pool* p = pool_of(chip_id);
    if (p == NULL) return SIMPLER_E_INVALID;
    size_t bb = (size_t)p->block_size * sizeof(ref_kv_entry);
    if (check_ids(p, block_ids, n, 1) != SIMPLER_OK || src_bytes != (size_t)n * bb || (n > 0 && src == NULL))
        return SIMPLER_E_INVALID;
    for (int i = 0; i < n; i++)
        memcpy(p->entries + (size_t)block_ids[i] * p->block_size, (const unsigned char*)src + (size_t)i * bb, bb);
    return SIMPLER_OK;
}

/* The entry of position pos in a block table, or NULL when the table does not reach it. */
static ref_kv_entry* slot(const ref_pool* p, const int32_t* table, int n_table, int64_t pos) {
    int64_t b = pos / p->block_size;
    if (b >= n_table || table[b] < 0 || table[b] >= p->num_blocks) return NULL;
    return p->entries + (size_t)table[b] * p->block_size + (size_t)(pos % p->block_size);
}

/* One sequence on paged KV: gather [0, start), verify, extend by n tokens, scatter [start, start + n). */
static int paged_extend(int chip_id, const int32_t* tokens, int n, int32_t start, const int32_t* table,
                        int n_table, float* logits, int vocab) {
    const ref_pool* p = pool_of(chip_id);
    if (p == NULL || table == NULL || start < 0 || n <= 0) return SIMPLER_E_INVALID;
    if ((int64_t)start + n > REF_MAX_SEQ) return SIMPLER_E_TOO_LONG;
    for (int64_t pos = 0; pos < (int64_t)start + n; pos++)
        if (slot(p, table, n_table, pos) == NULL) return SIMPLER_E_INVALID; /* before anything is written */
    ref_kv_entry* hist = malloc(((size_t)start + (size_t)n) * sizeof(ref_kv_entry));
    if (hist == NULL) return SIMPLER_E_DEVICE;
    for (int32_t pos = 0; pos < start; pos++) hist[pos] = *slot(p, table, n_table, pos);
    int32_t got;
    uint32_t h;
    int rc = check_history(hist, (size_t)start * sizeof(ref_kv_entry), &got, &h);
    if (rc == SIMPLER_OK) rc = extend(chip_id, start, h, tokens, n, hist + start, logits, vocab);
    if (rc == SIMPLER_OK)
        for (int i = 0; i < n; i++) *slot(p, table, n_table, (int64_t)start + i) = hist[start + i];
    free(hist);
    return rc;
}

int simpler_model_prefill_paged(int chip_id, const int32_t* tokens, int n_tokens, int32_t start,
                                const int32_t* block_table, int n_table, float* logits, int vocab) {
    if (vocab != REF_VOCAB || tokens == NULL || logits == NULL) return SIMPLER_E_INVALID;
    return paged_extend(chip_id, tokens, n_tokens, start, block_table, n_table, logits, vocab);
}

int simpler_model_decode_paged(int chip_id, int batch, const int32_t* tokens, const uint8_t* lane_valid,
                               const int32_t* start, const int32_t* block_tables, int table_stride,
                               float* logits, int vocab) {
    if (vocab != REF_VOCAB || batch <= 0 || tokens == NULL || lane_valid == NULL || start == NULL ||
        block_tables == NULL || table_stride <= 0 || logits == NULL)
        return SIMPLER_E_INVALID;
    for (int b = 0; b < batch; b++) {
        if (!lane_valid[b]) continue;
        int rc = paged_extend(chip_id, &tokens[b], 1, start[b], block_tables + (size_t)b * (size_t)table_stride,
                              table_stride, logits + (size_t)b * (size_t)vocab, vocab);
        if (rc != SIMPLER_OK) return rc;
    }
    return SIMPLER_OK;
}
#endif /* REF_DEVICE_KV */
