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
 * Build: cc -shared -fPIC -O2 -o libreference_chip.so reference_chip.c -lm
 *   -DSIMPLER_ABI_VERSION=N  build a library claiming another ABI version
 *   -DREF_VOCAB=N -DREF_MAX_SEQ=N  other model shapes
 *   -DREF_DEVICE_KV=0  leave out the optional device-resident KV group (npuserve
 *                      then keeps the paged cache in the worker's memory)
 *   -DREF_DEVICE_LOOP=0  leave out the optional device-side multi-step decode
 *                      (simpler_model_decode_steps_paged; npuserve then loops
 *                      one-step decodes and samples on the host). REF_DEVICE_KV=0
 *                      leaves it out too: it needs the group.
 *
 * Tensor parallelism (simpler_tp_init): rank r of w computes the logits of its
 * slice of the vocabulary, zeros elsewhere, and npuserve's all-reduce sums the
 * slices -- exactly the logits of one chip (a sum with zeros is exact), so the
 * callback is exercised on every row without changing any result.
 *
 * Device-resident KV (simpler_kv_*, simpler_model_*_paged; at the end): the
 * chip's paged cache lives in this library, npuserve names block ids.
 *
 * Device-side multi-step decode (simpler_model_decode_steps_paged and its
 * penalised variant; at the very end): n decode steps on the paged pool, each
 * sampled here by a C port of workers/sampling.py (the sampler section below)
 * and of workers/penalties.py. `ref_sample_rows` exposes
 * that sampler alone for the tests; it is not part of the ABI.
 * REF_LOOP_TRACE=PATH in the environment: each call of the loop appends a line
 * "chip batch n_steps" to PATH (a test's evidence that the loop ran, from
 * inside a worker process).
 *
 * LoRA adapters (simpler_lora_*; -DREF_LORA=0 leaves them out): an adapter is
 * an opaque blob; its key is a hash of its bytes (never 0). A lane under an
 * adapter mixes the key into every step of its running hash, so its logits
 * differ from the base model's and from any other adapter's, and KV written
 * under one adapter fails verification (SIMPLER_E_KV_CORRUPT) when read under
 * another: the device itself checks that npuserve keys KV by adapter.
 *   step_a(h, t, key) = mix32(h * 0x01000193 + t + 1 + key * 0x27D4EB2F)   (key 0 = the base: step)
 *
 * Python re-statement (used by the tests):
 *   mix32(x)       = lowbias32 finalizer below
 *   h0             = 0x811C9DC5
 *   h' = step(h,t) = mix32(h * 0x01000193 + t + 1)            (mod 2^32)
 *   logit(h, v)    = ((mix32(h ^ (v * 0x9E3779B9)) >> 16) & 0xFFF) / 256 - 8
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
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
#ifndef REF_DEVICE_LOOP
#define REF_DEVICE_LOOP 1
#endif
#ifndef REF_LORA
#define REF_LORA 1
#endif
#define REF_LORA_SLOTS 8
#define REF_MAX_LANES 256
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

static uint32_t step(uint32_t h, int32_t token, uint32_t key) {
    return mix32(h * 0x01000193u + (uint32_t)token + 1u + key * 0x27D4EB2Fu);
}

/* LoRA state per chip: the key of each device slot (0 = empty) and the slot of each lane of the next calls. */
static uint32_t lora_keys[REF_MAX_CHIPS][REF_LORA_SLOTS];
static int32_t lane_slots[REF_MAX_CHIPS][REF_MAX_LANES];
static int n_lane_slots[REF_MAX_CHIPS];

/* The adapter key of lane `lane` of the current call (0: the base model). */
static uint32_t lane_key(int chip_id, int lane) {
    if (lane >= n_lane_slots[chip_id]) return 0u;
    int32_t s = lane_slots[chip_id][lane];
    return s < 0 ? 0u : lora_keys[chip_id][s];
}

#if REF_LORA
int simpler_lora_slots(int chip_id) {
    if (chip_id < 0 || chip_id >= REF_MAX_CHIPS) return SIMPLER_E_INVALID;
    return REF_LORA_SLOTS;
}

int simpler_lora_load(int chip_id, int slot, const void* data, size_t size) {
    if (chip_id < 0 || chip_id >= REF_MAX_CHIPS || slot < 0 || slot >= REF_LORA_SLOTS || (size > 0 && data == NULL))
        return SIMPLER_E_INVALID;
    if (size == 0) {
        lora_keys[chip_id][slot] = 0u;
        return SIMPLER_OK;
    }
    uint32_t h = REF_H0;
    const unsigned char* p = (const unsigned char*)data;
    for (size_t i = 0; i < size; i++) h = mix32(h * 0x01000193u + p[i]);
    lora_keys[chip_id][slot] = h ? h : 1u;
    return SIMPLER_OK;
}

int simpler_lora_select(int chip_id, int n, const int32_t* slots) {
    if (chip_id < 0 || chip_id >= REF_MAX_CHIPS || n < 0 || n > REF_MAX_LANES || (n > 0 && slots == NULL))
        return SIMPLER_E_INVALID;
    for (int i = 0; i < n; i++)
        if (slots[i] >= REF_LORA_SLOTS || slots[i] < -1 || (slots[i] >= 0 && lora_keys[chip_id][slots[i]] == 0u))
            return SIMPLER_E_INVALID;
    memcpy(lane_slots[chip_id], slots, (size_t)n * sizeof(int32_t));
    n_lane_slots[chip_id] = n;
    return SIMPLER_OK;
}
#endif /* REF_LORA */

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
static int check_history(const void* kv_in, size_t kv_size, uint32_t key, int32_t* n_out, uint32_t* h_out) {
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
        h = step(h, e.token, key);
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
static int extend(int chip_id, int32_t pos, uint32_t h, uint32_t key, const int32_t* tokens, int n, void* kv_out,
                  float* logits, int vocab) {
    if ((int64_t)pos + n > REF_MAX_SEQ) return SIMPLER_E_TOO_LONG;
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= REF_VOCAB) return SIMPLER_E_INVALID;
    }
    unsigned char* o = (unsigned char*)kv_out;
    for (int i = 0; i < n; i++) {
        h = step(h, tokens[i], key);
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
    uint32_t key = lane_key(chip_id, 0);
    int rc = check_history(kv_in, kv_size, key, &pos, &h);
    if (rc != SIMPLER_OK) return rc;
    return extend(chip_id, pos, h, key, tokens, n_tokens, kv_out, logits, vocab);
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
        uint32_t key = lane_key(chip_id, b);
        int rc = check_history(kv_in[b], kv_size[b], key, &pos, &h);
        if (rc != SIMPLER_OK) return rc;
        rc = extend(chip_id, pos, h, key, &tokens[b], 1, kv_out[b], logits + (size_t)b * (size_t)vocab, vocab);
        if (rc != SIMPLER_OK) return rc;
    }
    return SIMPLER_OK;
}

/*
 * The sampler: a C port of workers/sampling.py, so a token sampled here equals
 * the one the worker would sample on the host from the same logits.
 *
 * Step by step as the host: float32 scaled logits s = (z - max z) / t; float64
 * weights exp(s) (libm's exp); float64 cumulative sums in the host's order
 * (numpy's pairwise summation where the host calls .sum(), a running sum where
 * it calls cumsum); the candidate order s descending, ties to the lower id; the
 * same margin loop for top-p. The only difference left is the last bit of a
 * float64 exp (numpy's SIMD exp against libm's), which moves a draw only when
 * it lands within ~1e-16 of a CDF boundary. No product feeds a sum, so FMA
 * contraction cannot change a result.
 */
#define SAMPLE_INITIAL_MARGIN 8.0
#define SAMPLE_MAX_MARGIN 128.0

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The lane's one uniform in [0, 1) for the token at `position` (sampling.lane_uniforms). */
static double lane_uniform(uint64_t seed, int64_t position) {
    uint64_t h = splitmix64(seed ^ splitmix64((uint64_t)position * 0xD6E8FEB86659FD93ull));
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

/* numpy's pairwise summation of a contiguous float64 array (what ndarray.sum() computes). */
static double pairwise_sum(const double* a, size_t n) {
    if (n < 8) {
        double res = -0.0;
        for (size_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        size_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

typedef struct sample_cand {
    float s;    /* scaled logit */
    int32_t id; /* token id */
    double w;   /* exp(s) */
} sample_cand;

/* s descending, ties to the lower id: a total order, so any sort gives the host's stable argsort. */
static int cand_cmp(const void* pa, const void* pb) {
    const sample_cand *a = pa, *b = pb;
    if (a->s != b->s) return a->s > b->s ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
}

typedef struct sample_scratch {
    float* s;
    sample_cand* cand;
    double* w;
} sample_scratch;

static int scratch_init(sample_scratch* sc, int vocab) {
    sc->s = malloc((size_t)vocab * sizeof(float));
    sc->cand = malloc((size_t)vocab * sizeof(sample_cand));
    sc->w = malloc((size_t)vocab * sizeof(double));
    return sc->s != NULL && sc->cand != NULL && sc->w != NULL;
}

static void scratch_free(sample_scratch* sc) {
    free(sc->s);
    free(sc->cand);
    free(sc->w);
}

/* Candidates with s >= threshold (every token when all), ascending id, their weights in w as well. */
static int collect(const float* s, int v, double threshold, int all, sample_cand* cand, double* w) {
    int n = 0;
    for (int i = 0; i < v; i++) {
        if (!all && !((double)s[i] >= threshold)) continue;
        cand[n] = (sample_cand){s[i], i, exp((double)s[i])};
        w[n] = cand[n].w;
        n++;
    }
    return n;
}

/* sampling._draw: the first index whose running sum exceeds u * total (zero weights never chosen). */
static int draw(const double* w, int n, double u) {
    double total = 0.0;
    for (int i = 0; i < n; i++) total += w[i];
    double x = u * total, c = 0.0;
    for (int i = 0; i < n; i++) {
        c += w[i];
        if (c > x) return i;
    }
    return n - 1;
}

/* How many of the ordered weights the nucleus keeps: the first j with cumsum / total >= top_p, plus one. */
static int nucleus(const double* w, int n, double total, double top_p) {
    double c = 0.0;
    for (int j = 0; j < n; j++) {
        c += w[j];
        if (c / total >= top_p) return j + 1;
    }
    return n;
}

/* One row: the token into *out and the row's maximum into *zmax (sampling._sample_row). */
static int sample_row(const float* z, int v, float temperature, float top_p, int32_t top_k, double u,
                      sample_scratch* sc, int32_t* out, float* zmax_out) {
    float zmax = z[0];
    int arg = 0;
    for (int i = 0; i < v; i++) {
        if (isnan(z[i])) return SIMPLER_E_DEVICE;
        if (z[i] > zmax) {
            zmax = z[i];
            arg = i;
        }
    }
    if (!isfinite(zmax)) return SIMPLER_E_DEVICE; /* +inf, or every logit -inf */
    *zmax_out = zmax;
    if (!(temperature > 0.0f) || top_k == 1) {
        *out = arg; /* greedy: the first maximum */
        return SIMPLER_OK;
    }
    float t = (double)temperature >= 1e-30 ? temperature : (float)1e-30;
    float* s = sc->s;
    for (int i = 0; i < v; i++) s[i] = (z[i] - zmax) / t; /* float32, as numpy */
    int k = (top_k > 0 && top_k < v) ? top_k : v;
    double p = (double)top_p;
    sample_cand* cand = sc->cand;
    double* w = sc->w;
    if (k < v) { /* top-k, then top-p over the renormalised top k */
        int nc = 0;
        for (double margin = SAMPLE_INITIAL_MARGIN;; margin *= 2.0) {
            int all = margin > SAMPLE_MAX_MARGIN;
            nc = collect(s, v, -margin, all, cand, w);
            if (nc >= k || all) break;
        }
        qsort(cand, (size_t)nc, sizeof *cand, cand_cmp);
        for (int j = 0; j < k; j++) w[j] = cand[j].w;
        int n = p < 1.0 ? nucleus(w, k, pairwise_sum(w, (size_t)k), p) : k;
        *out = cand[draw(w, n, u)].id;
        return SIMPLER_OK;
    }
    if (p < 1.0) { /* top-p over the candidates within a margin of the max, widened until they hold top_p */
        for (int i = 0; i < v; i++) w[i] = exp((double)s[i]);
        double total = pairwise_sum(w, (size_t)v);
        int nc = 0;
        for (double margin = SAMPLE_INITIAL_MARGIN;; margin *= 2.0) {
            nc = collect(s, v, -margin, margin > SAMPLE_MAX_MARGIN, cand, w);
            if (pairwise_sum(w, (size_t)nc) >= p * total || nc == v) break;
        }
        qsort(cand, (size_t)nc, sizeof *cand, cand_cmp);
        for (int j = 0; j < nc; j++) w[j] = cand[j].w;
        *out = cand[draw(w, nucleus(w, nc, total, p), u)].id;
        return SIMPLER_OK;
    }
    for (int i = 0; i < v; i++) w[i] = exp((double)s[i]); /* temperature alone: the whole row in id order */
    *out = draw(w, v, u);
    return SIMPLER_OK;
}

/* log-softmax of the raw logits at tok (sampling._logprob: float32 exp, float64 sum). */
static float logprob_of(const float* z, int v, float zmax, int32_t tok) {
    double sum = 0.0;
    for (int i = 0; i < v; i++) sum += (double)expf(z[i] - zmax);
    return (float)((double)z[tok] - ((double)zmax + log(sum)));
}

/*
 * Test entry (not part of the ABI): sample `rows` rows of `vocab` logits as
 * workers.sampling.sample does, positions[r] being the position of row r's
 * token; out_logprobs may be NULL.
 */
int ref_sample_rows(int rows, int vocab, const float* logits, const float* temperature, const float* top_p,
                    const int32_t* top_k, const uint64_t* seed, const int64_t* positions, int32_t* out_tokens,
                    float* out_logprobs) {
    if (rows <= 0 || vocab <= 0 || logits == NULL || temperature == NULL || top_p == NULL || top_k == NULL ||
        seed == NULL || positions == NULL || out_tokens == NULL)
        return SIMPLER_E_INVALID;
    for (int r = 0; r < rows; r++)
        if (!isfinite(temperature[r]) || !isfinite(top_p[r])) return SIMPLER_E_INVALID;
    sample_scratch sc;
    int rc = scratch_init(&sc, vocab) ? SIMPLER_OK : SIMPLER_E_DEVICE;
    for (int r = 0; r < rows && rc == SIMPLER_OK; r++) {
        const float* z = logits + (size_t)r * (size_t)vocab;
        float zmax;
        rc = sample_row(z, vocab, temperature[r], top_p[r], top_k[r], lane_uniform(seed[r], positions[r]), &sc,
                        &out_tokens[r], &zmax);
        if (rc == SIMPLER_OK && out_logprobs != NULL) out_logprobs[r] = logprob_of(z, vocab, zmax, out_tokens[r]);
    }
    scratch_free(&sc);
    return rc;
}

#if REF_DEVICE_KV
/*
 * Device-resident KV (the optional group of npuserve_chip.h): the chip's pool
 * of blocks lives here ("device memory": malloc'd by the library), npuserve
 * only names block ids. The transfer format of a block is its block_size
 * entries as stored (16 bytes each), so a block exported by one chip imports
 * into any other chip of the same build.
 */
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
                        int n_table, uint32_t key, float* logits, int vocab) {
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
    int rc = check_history(hist, (size_t)start * sizeof(ref_kv_entry), key, &got, &h);
    if (rc == SIMPLER_OK) rc = extend(chip_id, start, h, key, tokens, n, hist + start, logits, vocab);
    if (rc == SIMPLER_OK)
        for (int i = 0; i < n; i++) *slot(p, table, n_table, (int64_t)start + i) = hist[start + i];
    free(hist);
    return rc;
}

int simpler_model_prefill_paged(int chip_id, const int32_t* tokens, int n_tokens, int32_t start,
                                const int32_t* block_table, int n_table, float* logits, int vocab) {
    if (vocab != REF_VOCAB || tokens == NULL || logits == NULL) return SIMPLER_E_INVALID;
    return paged_extend(chip_id, tokens, n_tokens, start, block_table, n_table, lane_key(chip_id, 0), logits, vocab);
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
                              table_stride, lane_key(chip_id, b), logits + (size_t)b * (size_t)vocab, vocab);
        if (rc != SIMPLER_OK) return rc;
    }
    return SIMPLER_OK;
}
#if REF_DEVICE_LOOP
static void trace_loop(int chip_id, int batch, int n_steps) {
    const char* path = getenv("REF_LOOP_TRACE");
    if (path == NULL || *path == '\0') return;
    FILE* f = fopen(path, "a");
    if (f == NULL) return;
    fprintf(f, "%d %d %d\n", chip_id, batch, n_steps);
    fclose(f);
}

/*
 * Penalties (workers/penalties.py, in its order and float32 operations) on a
 * copy z of lane b's logits at its step k: min_tokens, logit bias,
 * repetition, frequency, presence; min_p once the row is final (below).
 * counts/seen: the lane's output counts and prompt-or-output marks [vocab].
 */
static void penalize_row(float* z, int v, const simpler_lane_penalties* pen, int b, int32_t done,
                         const int32_t* counts, const uint8_t* seen) {
    if (done < pen->min_tokens[b])
        for (int32_t j = pen->stop_start[b]; j < pen->stop_start[b + 1]; j++)
            if (pen->stop_ids[j] >= 0 && pen->stop_ids[j] < v) z[pen->stop_ids[j]] = -INFINITY;
    for (int32_t j = pen->bias_start[b]; j < pen->bias_start[b + 1]; j++)
        if (pen->bias_ids[j] >= 0 && pen->bias_ids[j] < v) z[pen->bias_ids[j]] += pen->bias_values[j];
    float r = pen->repetition[b], f = pen->frequency[b], p = pen->presence[b];
    if (r != 1.0f)
        for (int i = 0; i < v; i++)
            if (seen[i]) z[i] = z[i] > 0 ? z[i] / r : z[i] * r;
    if (f == 0.0f && p == 0.0f) return;
    for (int i = 0; i < v; i++) {
        if (counts[i] <= 0) continue;
        if (f != 0.0f) {
            volatile float d = f * (float)counts[i]; /* rounded to float32 before the subtraction, as numpy */
            z[i] -= d;
        }
        if (p != 0.0f) z[i] -= p;
    }
}

/* min_p: -inf where (z - max z) / temperature < ln(min_p), the scaling sample_row applies. */
static void min_p_filter(float* z, int v, float temperature, float min_p) {
    if (!(min_p > 0.0f) || !(temperature > 0.0f)) return;
    float zmax = -INFINITY;
    for (int i = 0; i < v; i++)
        if (z[i] > zmax) zmax = z[i];
    float t = (double)temperature >= 1e-30 ? temperature : (float)1e-30;
    double lm = log((double)min_p);
    for (int i = 0; i < v; i++) {
        float s = (z[i] - zmax) / t;
        if ((double)s < lm) z[i] = -INFINITY;
    }
}

static int check_penalties(const simpler_lane_penalties* pen, int batch, const uint8_t* lane_valid, int v) {
    if (pen->presence == NULL || pen->frequency == NULL || pen->repetition == NULL || pen->min_p == NULL ||
        pen->min_tokens == NULL || pen->done == NULL || pen->seen_start == NULL || pen->bias_start == NULL ||
        pen->stop_start == NULL)
        return SIMPLER_E_INVALID;
    const int32_t* starts[3] = {pen->seen_start, pen->bias_start, pen->stop_start};
    for (int a = 0; a < 3; a++) {
        if (starts[a][0] != 0) return SIMPLER_E_INVALID;
        for (int b = 0; b < batch; b++)
            if (starts[a][b + 1] < starts[a][b]) return SIMPLER_E_INVALID;
    }
    if ((pen->seen_start[batch] && (pen->seen_ids == NULL || pen->seen_counts == NULL)) ||
        (pen->bias_start[batch] && (pen->bias_ids == NULL || pen->bias_values == NULL)) ||
        (pen->stop_start[batch] && pen->stop_ids == NULL))
        return SIMPLER_E_INVALID;
    for (int b = 0; b < batch; b++) {
        if (!lane_valid[b]) continue;
        if (!(pen->repetition[b] > 0.0f) || !isfinite(pen->repetition[b]) || !isfinite(pen->presence[b]) ||
            !isfinite(pen->frequency[b]) || !(pen->min_p[b] >= 0.0f && pen->min_p[b] <= 1.0f) ||
            pen->done[b] < 0)
            return SIMPLER_E_INVALID;
        for (int32_t j = pen->seen_start[b]; j < pen->seen_start[b + 1]; j++)
            if (pen->seen_ids[j] < 0 || pen->seen_ids[j] >= v || pen->seen_counts[j] < 0) return SIMPLER_E_INVALID;
        for (int32_t j = pen->bias_start[b]; j < pen->bias_start[b + 1]; j++)
            if (!isfinite(pen->bias_values[j])) return SIMPLER_E_INVALID;
    }
    return SIMPLER_OK;
}

/*
 * Multi-step decode on the device: step-major (every valid lane's step k
 * before any step k + 1, as a compiled batch runs), each step a paged_extend
 * (verify the lane's history, write its new KV entry) and a sample; with
 * `pen`, the lanes' penalties first (their counts advance by each sample).
 */
static int decode_steps(int chip_id, int batch, int n_steps, const int32_t* tokens, const uint8_t* lane_valid,
                        const int32_t* start, const int32_t* block_tables, int table_stride,
                        const float* temperature, const float* top_p, const int32_t* top_k, const uint64_t* seed,
                        const simpler_lane_penalties* pen, int32_t* out_tokens, float* out_logprobs) {
    const ref_pool* p = pool_of(chip_id);
    if (p == NULL || batch <= 0 || n_steps <= 0 || tokens == NULL || lane_valid == NULL || start == NULL ||
        block_tables == NULL || table_stride <= 0 || temperature == NULL || top_p == NULL || top_k == NULL ||
        seed == NULL || out_tokens == NULL)
        return SIMPLER_E_INVALID;
    if (pen != NULL && check_penalties(pen, batch, lane_valid, REF_VOCAB) != SIMPLER_OK) return SIMPLER_E_INVALID;
    for (int b = 0; b < batch; b++) { /* everything checked before the first step writes anything */
        if (!lane_valid[b]) continue;
        const int32_t* table = block_tables + (size_t)b * (size_t)table_stride;
        if (!isfinite(temperature[b]) || !isfinite(top_p[b]) || start[b] < 0 || tokens[b] < 0 ||
            tokens[b] >= REF_VOCAB)
            return SIMPLER_E_INVALID;
        if ((int64_t)start[b] + n_steps > REF_MAX_SEQ) return SIMPLER_E_TOO_LONG;
        for (int64_t pos = 0; pos < (int64_t)start[b] + n_steps; pos++)
            if (slot(p, table, table_stride, pos) == NULL) return SIMPLER_E_INVALID;
    }
    trace_loop(chip_id, batch, n_steps);
    float* logits = malloc((size_t)REF_VOCAB * sizeof(float));
    float* z = pen != NULL ? malloc((size_t)REF_VOCAB * sizeof(float)) : NULL;
    int32_t* counts = pen != NULL ? calloc((size_t)batch * REF_VOCAB, sizeof(int32_t)) : NULL;
    uint8_t* seen = pen != NULL ? calloc((size_t)batch * REF_VOCAB, 1) : NULL;
    int32_t* cur = malloc((size_t)batch * sizeof(int32_t));
    sample_scratch sc;
    int rc = scratch_init(&sc, REF_VOCAB) && logits != NULL && cur != NULL &&
                     (pen == NULL || (z != NULL && counts != NULL && seen != NULL))
                 ? SIMPLER_OK
                 : SIMPLER_E_DEVICE;
    if (cur != NULL) memcpy(cur, tokens, (size_t)batch * sizeof(int32_t));
    if (rc == SIMPLER_OK && pen != NULL)
        for (int b = 0; b < batch; b++)
            for (int32_t j = pen->seen_start[b]; lane_valid[b] && j < pen->seen_start[b + 1]; j++) {
                counts[(size_t)b * REF_VOCAB + pen->seen_ids[j]] = pen->seen_counts[j];
                seen[(size_t)b * REF_VOCAB + pen->seen_ids[j]] = 1;
            }
    for (int k = 0; k < n_steps && rc == SIMPLER_OK; k++) {
        for (int b = 0; b < batch && rc == SIMPLER_OK; b++) {
            if (!lane_valid[b]) continue;
            const int32_t* table = block_tables + (size_t)b * (size_t)table_stride;
            rc = paged_extend(chip_id, &cur[b], 1, start[b] + k, table, table_stride, lane_key(chip_id, b), logits,
                              REF_VOCAB);
            if (rc != SIMPLER_OK) break;
            const float* row = logits;
            if (pen != NULL) {
                memcpy(z, logits, (size_t)REF_VOCAB * sizeof(float));
                penalize_row(z, REF_VOCAB, pen, b, pen->done[b] + k, counts + (size_t)b * REF_VOCAB,
                             seen + (size_t)b * REF_VOCAB);
                if (top_k[b] != 1) min_p_filter(z, REF_VOCAB, temperature[b], pen->min_p[b]);
                row = z;
            }
            int32_t tok;
            float zmax;
            rc = sample_row(row, REF_VOCAB, temperature[b], top_p[b], top_k[b],
                            lane_uniform(seed[b], (int64_t)start[b] + k + 1), &sc, &tok, &zmax);
            if (rc != SIMPLER_OK) break;
            size_t at = (size_t)b * (size_t)n_steps + (size_t)k;
            out_tokens[at] = tok;
            if (out_logprobs != NULL) {
                float raw_max = logits[0];
                for (int i = 1; i < REF_VOCAB; i++)
                    if (logits[i] > raw_max) raw_max = logits[i];
                out_logprobs[at] = logprob_of(logits, REF_VOCAB, raw_max, tok); /* the model's own */
            }
            if (pen != NULL) {
                counts[(size_t)b * REF_VOCAB + tok]++;
                seen[(size_t)b * REF_VOCAB + tok] = 1;
            }
            cur[b] = tok;
        }
    }
    scratch_free(&sc);
    free(logits);
    free(z);
    free(counts);
    free(seen);
    free(cur);
    return rc;
}

int simpler_model_decode_steps_paged(int chip_id, int batch, int n_steps, const int32_t* tokens,
                                     const uint8_t* lane_valid, const int32_t* start,
                                     const int32_t* block_tables, int table_stride,
                                     const float* temperature, const float* top_p, const int32_t* top_k,
                                     const uint64_t* seed, int32_t* out_tokens, float* out_logprobs) {
    return decode_steps(chip_id, batch, n_steps, tokens, lane_valid, start, block_tables, table_stride, temperature,
                        top_p, top_k, seed, NULL, out_tokens, out_logprobs);
}

int simpler_model_decode_steps_penalized_paged(int chip_id, int batch, int n_steps, const int32_t* tokens,
                                               const uint8_t* lane_valid, const int32_t* start,
                                               const int32_t* block_tables, int table_stride,
                                               const float* temperature, const float* top_p, const int32_t* top_k,
                                               const uint64_t* seed, const simpler_lane_penalties* penalties,
                                               int32_t* out_tokens, float* out_logprobs) {
    if (penalties == NULL) return SIMPLER_E_INVALID;
    return decode_steps(chip_id, batch, n_steps, tokens, lane_valid, start, block_tables, table_stride, temperature,
                        top_p, top_k, seed, penalties, out_tokens, out_logprobs);
}
#endif /* REF_DEVICE_LOOP */
#endif /* REF_DEVICE_KV */
