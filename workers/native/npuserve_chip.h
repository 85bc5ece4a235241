/*
 * npuserve_chip.h -- the vendor C ABI that npuserve's `ctypes` backend loads.
 *
 * A chip runtime (the vendor's "simpler", whose name prefixes every symbol) is a shared library exporting
 * the functions below with C linkage. npuserve owns the paged KV cache on the
 * host side (unless the library exports the optional device-resident KV group
 * at the end of this file): for every call it gathers a sequence's KV blocks into one
 * contiguous `kv_in` buffer (the KV of positions [0, P)), and scatters the
 * returned `kv_out` (the KV of the new tokens only) back into the blocks. KV is
 * opaque bytes to npuserve: `kv_bytes_per_token` bytes per token, as declared
 * by simpler_model_describe().
 *
 * Conventions
 *  - Every function returns SIMPLER_OK (0) on success or a negative
 *    SIMPLER_E_* code. On failure the output buffers are undefined and the
 *    caller treats the KV the call would have produced as unknown.
 *  - The position of the first new token is implied by the KV passed in:
 *    P = kv_size / kv_bytes_per_token (kv_size must be a multiple of it).
 *  - Calls for one chip_id are never concurrent; different chip ids may be
 *    driven from different processes.
 *  - The library must not keep pointers to caller buffers after returning.
 *
 * Versioning: npuserve refuses to load a library whose simpler_abi_version()
 * differs from the SIMPLER_ABI_VERSION it was built for. Any change to a
 * signature or to simpler_model_info bumps the version.
 */
#ifndef NPUSERVE_CHIP_H
#define NPUSERVE_CHIP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifndef SIMPLER_ABI_VERSION
#define SIMPLER_ABI_VERSION 1
#endif

#define SIMPLER_MAX_EOS 8
#define SIMPLER_MAX_PROFILES 8

enum simpler_status {
    SIMPLER_OK = 0,
    SIMPLER_E_INVALID = -1,   /* bad argument: sizes, vocab, chip id, token id */
    SIMPLER_E_KV_CORRUPT = -2, /* kv_in does not hold a valid KV history */
    SIMPLER_E_DEVICE = -3,    /* the chip failed; retry after recovery */
    SIMPLER_E_TOO_LONG = -4   /* the sequence would exceed max_seq */
};

/* What the loaded model looks like. Fixed-size so it can cross the ABI by value. */
typedef struct simpler_model_info {
    int32_t abi_version;               /* == SIMPLER_ABI_VERSION */
    int32_t vocab;                     /* logits per row */
    int32_t max_seq;                   /* longest sequence (prompt + generated) */
    int32_t n_eos;                     /* valid entries of eos_ids */
    int32_t eos_ids[SIMPLER_MAX_EOS];
    int32_t n_profiles;                /* valid entries of profiles */
    int32_t profiles[SIMPLER_MAX_PROFILES]; /* compiled decode batch sizes, ascending */
    int32_t chunked_prefill;           /* 1: prefill with kv_size > 0 equals one-shot prefill */
    int32_t reserved;                  /* 0 */
    int64_t kv_bytes_per_token;        /* bytes of KV one token occupies */
} simpler_model_info;

/* The ABI version this library implements. Checked first, before any other call. */
int simpler_abi_version(void);

/* Fill *out for the model on chip_id. */
int simpler_model_describe(int chip_id, simpler_model_info* out);

/*
 * Prefill n_tokens new tokens of ONE sequence at positions [P, P + n_tokens).
 *   kv_in   : KV of positions [0, P), kv_size bytes (NULL allowed when kv_size == 0)
 *   kv_out  : receives the KV of the new tokens, n_tokens * kv_bytes_per_token bytes
 *   logits  : receives vocab floats, the logits after the LAST new token
 * A prefill split into chunks (each chunk passing the KV of all previous ones)
 * gives the same logits and KV as one call when info.chunked_prefill == 1.
 */
int simpler_model_prefill(int chip_id, const int32_t* tokens, int n_tokens,
                          const void* kv_in, size_t kv_size, void* kv_out,
                          float* logits, int vocab);

/*
 * Decode one token for each valid lane of a compiled batch of `batch` lanes
 * (batch is one of info.profiles).
 *   tokens[batch]     : the lane's newest token (ignored for inactive lanes)
 *   lane_valid[batch] : 0 = inactive lane: the library must not read tokens,
 *                       kv_in, kv_size nor write kv_out or the logits row of it
 *   kv_in[batch]      : per lane, KV of positions [0, P_i), kv_size[i] bytes
 *   kv_size[batch]    : per lane, bytes in kv_in[i]; P_i = kv_size[i] / kv_bytes_per_token
 *   kv_out[batch]     : per lane, receives kv_bytes_per_token bytes: the KV of
 *                       tokens[i] at position P_i
 *   logits            : batch * vocab floats, row i = logits after tokens[i]
 */
int simpler_model_decode(int chip_id, int batch, const int32_t* tokens,
                         const uint8_t* lane_valid, const void* const* kv_in,
                         const size_t* kv_size, void* const* kv_out,
                         float* logits, int vocab);

/*
 * Tensor parallelism (optional: a library without this symbol runs one chip per
 * replica only; npuserve refuses board.chips_per_replica > 1 with it).
 *
 * A replica of `world` chips runs every call on all of them at once (the same
 * arguments on every rank, each rank with its own KV cache of its shard). The
 * runtime splits the model across the ranks and combines partial results with
 * an all-reduce (sum) -- NCCL/HCCL on real hardware. npuserve calls
 * simpler_tp_init once per chip before any other model call:
 *   rank, world : this chip's place in its replica (0 <= rank < world)
 *   reduce, ctx : npuserve's collective, for a runtime that has none of its own:
 *                 reduce(ctx, buf, count) sums `count` floats in place across the
 *                 ranks (every rank calls it in the same order with the same
 *                 count) and returns 0, or nonzero when a peer died or hung (the
 *                 call must then fail with SIMPLER_E_DEVICE). A runtime that owns
 *                 its collective ignores reduce and uses its own, keyed by
 *                 (rank, world) and the chip ids of the replica.
 * Every rank must return the same logits. Calls for one chip stay sequential; a
 * reduce that fails poisons the replica (npuserve restarts all its chips).
 */
typedef int (*simpler_allreduce_fn)(void* ctx, float* buf, size_t count);

int simpler_tp_init(int chip_id, int rank, int world, simpler_allreduce_fn reduce, void* ctx);

/*
 * Device-resident KV (optional: all six symbols or none; the ABI version is
 * unchanged). A library without them gets the KV history as host buffers
 * (kv_in / kv_out above) and npuserve keeps the paged cache in the worker's
 * memory. A library with them keeps the paged cache itself (device memory):
 * npuserve still allocates the block ids (its KV manager and prefix cache),
 * the library stores each block's KV wherever it likes, and KV leaves or
 * enters the device only through kv_copy_out / kv_copy_in (the host and disk
 * tiers, the prefix hand-off between chips, copy-on-write of a shared block).
 *
 * Buffer ownership: every pointer argument is owned by the caller and valid
 * for the duration of the call only; the library copies what it needs and
 * keeps no pointer after returning. The pool itself is owned by the library
 * from simpler_kv_init until the next simpler_kv_init of that chip (which
 * frees the old pool) or process exit.
 *
 * simpler_kv_block_bytes: bytes of ONE block of block_size tokens in the
 *   transfer format of kv_copy_out / kv_copy_in (opaque to npuserve, which
 *   stores and checksums it as-is; it must be a multiple of block_size, and
 *   the same for every chip running this model so blocks can move between
 *   them). Returns > 0, or a negative SIMPLER_E_* code.
 * simpler_kv_init: allocate (or reallocate, dropping the old contents) the
 *   chip's pool of num_blocks blocks of block_size tokens. Called once at
 *   load, before any other call of this group.
 * simpler_kv_copy_out: write the blocks block_ids[0..n) into dst, block i at
 *   dst + i * block_bytes; dst_bytes must equal n * block_bytes.
 * simpler_kv_copy_in: overwrite the blocks block_ids[0..n) from src (the same
 *   format); src_bytes must equal n * block_bytes. A block id repeated in one
 *   call, or outside [0, num_blocks), is SIMPLER_E_INVALID and nothing is
 *   written. The same block may be read by copy_out while it is shared.
 * simpler_model_prefill_paged: as simpler_model_prefill, the KV of positions
 *   [0, start) read from and the new tokens' KV written into the blocks of
 *   block_table (position p lives in block_table[p / block_size] at offset
 *   p % block_size; n_table entries, enough for start + n_tokens). Only the
 *   positions [start, start + n_tokens) are written, so blocks shared through
 *   the prefix cache stay intact.
 * simpler_model_decode_paged: as simpler_model_decode; lane i's newest token
 *   goes to position start[i], its history [0, start[i]) is in the blocks
 *   block_tables[i * table_stride ..] (table_stride entries per lane).
 */
int64_t simpler_kv_block_bytes(int chip_id, int block_size);
int simpler_kv_init(int chip_id, int num_blocks, int block_size);
int simpler_kv_copy_out(int chip_id, const int32_t* block_ids, int n, void* dst, size_t dst_bytes);
int simpler_kv_copy_in(int chip_id, const int32_t* block_ids, int n, const void* src, size_t src_bytes);
int simpler_model_prefill_paged(int chip_id, const int32_t* tokens, int n_tokens, int32_t start,
                                const int32_t* block_table, int n_table, float* logits, int vocab);
int simpler_model_decode_paged(int chip_id, int batch, const int32_t* tokens, const uint8_t* lane_valid,
                               const int32_t* start, const int32_t* block_tables, int table_stride,
                               float* logits, int vocab);

/*
 * Device-side multi-step decode (optional: a library without this symbol gets
 * a multi-step decode job, executor.decode_steps = n, as n calls of
 * simpler_model_decode[_paged] with npuserve sampling each step on the host;
 * the ABI version is unchanged). It requires the device-resident KV group
 * above (step k + 1 reads the KV step k wrote, on the device): npuserve
 * refuses a library exporting it without the group.
 *
 * simpler_model_decode_steps_paged: n_steps decode steps of a compiled batch
 *   (batch is one of info.profiles) on the paged device KV, each step fed the
 *   token the step before sampled, sampled ON THE DEVICE.
 *   tokens[batch]     : the input token of step 0 per lane
 *   lane_valid[batch] : 0 = inactive lane: the library must not read any of
 *                       its inputs, write KV for it, nor write its rows of
 *                       out_tokens / out_logprobs
 *   start[batch]      : step k of lane i writes the KV of position start[i] + k
 *   block_tables, table_stride : as simpler_model_decode_paged; lane i's table
 *                       must reach position start[i] + n_steps - 1
 *   temperature, top_p, top_k, seed [batch] : lane i's sampling parameters
 *   out_tokens[batch * n_steps]   : row i = lane i's n_steps sampled tokens
 *   out_logprobs[batch * n_steps] : the same layout, or NULL (none wanted)
 * Sampling is exactly npuserve's host sampler (workers/sampling.py): step k
 * of lane i samples the token at position p = start[i] + k + 1 from the
 * logits after step k's input, with the lane's one uniform in [0, 1) of
 * (seed[i], p): u = (splitmix64(seed ^ splitmix64(p * 0xD6E8FEB86659FD93)) >> 11)
 * * 2^-53. temperature <= 0 or top_k == 1: argmax, lowest id on ties.
 * Otherwise s = (z - max z) / max(temperature, 1e-30) in float32; top_k
 * (0 < top_k < vocab) keeps the top_k largest s (ties to the lower id);
 * top_p < 1 keeps the shortest prefix, in the order (s descending, id
 * ascending), whose float64 cumulative weight exp(s) reaches top_p of the
 * mass (of the top-k set, or of the whole row); then an inverse-CDF draw over
 * the kept weights in that order (over the whole row in id order with
 * neither filter): the first index whose float64 cumulative weight exceeds
 * u * their total. A logprob is the log-softmax of the RAW logits (temperature
 * 1, no filter) at the chosen token. Every rank of a tensor-parallel replica
 * returns the same tokens (it samples the same all-reduced logits).
 * The library stops no lane early: every valid lane gets n_steps tokens, and
 * npuserve (which knows EOS, stop strings and max_tokens) keeps each lane's
 * tokens up to its end and treats the KV past it as garbage.
 * A row of logits holding NaN or +inf fails the call with SIMPLER_E_DEVICE;
 * a non-finite temperature or top_p, or a table too short, fails it with
 * SIMPLER_E_INVALID before anything is written. On any failure out_tokens and
 * out_logprobs are undefined and the KV of positions [start[i], start[i] +
 * n_steps) of every valid lane is unknown (the KV before start[i] stays).
 * Buffers as for the group above: npuserve's, valid for the call only.
 */
int simpler_model_decode_steps_paged(int chip_id, int batch, int n_steps, const int32_t* tokens,
                                     const uint8_t* lane_valid, const int32_t* start,
                                     const int32_t* block_tables, int table_stride,
                                     const float* temperature, const float* top_p, const int32_t* top_k,
                                     const uint64_t* seed, int32_t* out_tokens, float* out_logprobs);

/*
 * Device-side multi-step decode with penalties (optional, beside the symbol
 * above; a library without it gets the jobs that have penalised lanes as n
 * one-step decodes sampled on the host; the ABI version is unchanged):
 * simpler_model_decode_steps_penalized_paged takes the arguments of
 * simpler_model_decode_steps_paged plus `penalties`, per lane [batch]:
 *   presence, frequency, repetition, min_p : the lane's penalties (0, 0, 1, 0 = none)
 *   min_tokens, done : EOS and the stop ids are masked while done + k < min_tokens
 *                      at step k (done = output tokens before step 0's sample)
 *   seen_ids[seen_start[i]:seen_start[i+1]] : lane i's distinct prompt and
 *                      output token ids before step 0, seen_counts beside
 *                      them their occurrences in the output (0: prompt only)
 *   bias_ids / bias_values [bias_start[i]:bias_start[i+1]] : the logit bias
 *   stop_ids [stop_start[i]:stop_start[i+1]] : what min_tokens masks
 * Step k of lane i samples, from a float32 copy z of its logits: z[stop] =
 * -inf while done + k < min_tokens; z[id] += bias; for every seen token
 * z = z > 0 ? z / repetition : z * repetition; for every output token
 * z -= frequency * count (the product rounded to float32), then z -= presence;
 * then, unless greedy (temperature <= 0 or top_k == 1), z = -inf where
 * (z - max z) / max(temperature, 1e-30) < ln(min_p) in float32 / float64
 * when min_p > 0; then the sampler above on z. The sampled token counts as an
 * output token from step k + 1 on. Logprobs stay those of the raw logits.
 * (workers/penalties.py is the host's statement of the same.)
 */
typedef struct simpler_lane_penalties {
    const float* presence;
    const float* frequency;
    const float* repetition;
    const float* min_p;
    const int32_t* min_tokens;
    const int32_t* done;
    const int32_t* seen_start; /* [batch + 1] */
    const int32_t* seen_ids;
    const int32_t* seen_counts;
    const int32_t* bias_start; /* [batch + 1] */
    const int32_t* bias_ids;
    const float* bias_values;
    const int32_t* stop_start; /* [batch + 1] */
    const int32_t* stop_ids;
} simpler_lane_penalties;

int simpler_model_decode_steps_penalized_paged(int chip_id, int batch, int n_steps, const int32_t* tokens,
                                               const uint8_t* lane_valid, const int32_t* start,
                                               const int32_t* block_tables, int table_stride,
                                               const float* temperature, const float* top_p, const int32_t* top_k,
                                               const uint64_t* seed, const simpler_lane_penalties* penalties,
                                               int32_t* out_tokens, float* out_logprobs);

/*
 * LoRA adapters (optional: all three symbols or none; the ABI version is
 * unchanged). A library without them serves no adapters (npuserve refuses to
 * load one on its board). npuserve owns which adapter sits in which slot
 * (least recently used swapped out, never one the running job uses).
 *
 * simpler_lora_slots: how many adapters the chip holds in device memory at
 *   once (> 0), or a negative SIMPLER_E_* code.
 * simpler_lora_load: copy an adapter into device slot `slot` (0 <= slot <
 *   slots), replacing what it held; `data`/`size` are the adapter package's
 *   weights file as-is (npuserve's npz adapter: adapter.npz, see docs/lora.md),
 *   owned by the caller for the call only. size 0 (data NULL) frees the slot.
 * simpler_lora_select: the adapter of each lane of the model calls that follow
 *   on this chip, until the next select: slots[i] for lane i (a decode batch's
 *   lane, or lane 0 for a prefill call), -1 = the base model; lanes at or past
 *   n run the base model. npuserve calls it before every model call (n 0 when
 *   no lane has an adapter). A slot that holds no adapter is SIMPLER_E_INVALID
 *   and the selection is unchanged. Lanes of different adapters may share one
 *   decode call. The KV a lane writes under an adapter is that adapter's:
 *   npuserve never lets a lane under another adapter read it.
 */
int simpler_lora_slots(int chip_id);
int simpler_lora_load(int chip_id, int slot, const void* data, size_t size);
int simpler_lora_select(int chip_id, int n, const int32_t* slots);

#ifdef __cplusplus
}
#endif

#endif /* NPUSERVE_CHIP_H */
