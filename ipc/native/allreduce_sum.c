/* The shared-memory all-reduce's fast path (ipc/allreduce.py, mode "shared"): publish this rank's part,
 * wait briefly for the peers, sum every rank's slot in rank order.
 *
 * Why in C: from Python the slot write, the counter store, the barrier poll and np.add cost several
 * microseconds per call, more than the memory traffic of a decode step's activation. Everything that can
 * fail slowly (a peer late past the spin budget, dead, or an aborted group) is left to the Python caller,
 * which owns the deadlines and liveness checks: this routine only reports that it did not finish.
 *
 * The sum is ((s0 + s1) + s2) + ... per element in float32, the order NumPy's np.add then += gives, so both
 * paths produce the same bits.
 */
#define _POSIX_C_SOURCE 199309L
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Sum `size` floats of every rank's slot (slot r at slots + r * slot_stride floats) into res, in rank order. */
void npi_ar_sum(const float *slots, size_t slot_stride, int world, size_t size, float *res) {
    const float *a = slots, *b = slots + slot_stride;
    for (size_t i = 0; i < size; i++) res[i] = a[i] + b[i];
    for (int r = 2; r < world; r++) {
        const float *s = slots + (size_t)r * slot_stride;
        for (size_t i = 0; i < size; i++) res[i] += s[i];
    }
}

/* 1 when every peer's arrive word (hdr[r * line_words + arrive_word]) has reached n. */
static int all_arrived(const int64_t *hdr, size_t line_words, size_t arrive_word, int world, int rank, int64_t n) {
    for (int r = 0; r < world; r++)
        if (r != rank && __atomic_load_n(&hdr[(size_t)r * line_words + arrive_word], __ATOMIC_ACQUIRE) < n) return 0;
    return 1;
}

/* Copy `part` into this rank's slot, publish arrive = n (release), spin up to spin_ns for the peers
 * (acquire), then sum into res. Returns 0 when res holds the sum; 1 when the peers did not all arrive in
 * time or *abort_word is set (the slot is published: the caller waits, then calls npi_ar_sum).
 * *waited_ns: the time spent spinning for the peers. */
int npi_ar_shared(float *slots, size_t slot_stride, int world, int rank, const float *part, size_t size, float *res,
                  int64_t *hdr, size_t line_words, size_t arrive_word, int64_t n, const int64_t *abort_word,
                  int64_t spin_ns, int64_t *waited_ns) {
    memcpy(slots + (size_t)rank * slot_stride, part, size * sizeof(float));
    __atomic_store_n(&hdr[(size_t)rank * line_words + arrive_word], n, __ATOMIC_RELEASE);
    *waited_ns = 0;
    if (!all_arrived(hdr, line_words, arrive_word, world, rank, n)) {
        int64_t t0 = now_ns(), until = t0 + spin_ns;
        for (;;) {
            for (int k = 0; k < 64; k++) {
#if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
#endif
                if (all_arrived(hdr, line_words, arrive_word, world, rank, n)) {
                    *waited_ns = now_ns() - t0;
                    goto arrived;
                }
            }
            int64_t now = now_ns();
            if (__atomic_load_n(abort_word, __ATOMIC_RELAXED) || now >= until) {
                *waited_ns = now - t0;
                return 1;
            }
        }
    }
arrived:
    npi_ar_sum(slots, slot_stride, world, size, res);
    return 0;
}

/* npi_ar_shared with the group's fixed arguments in one array (fewer ctypes conversions per call):
 * ctx = {slots of parity 0, slots of parity 1, slot_stride, world, rank, hdr, line_words, arrive_word,
 *        abort_word, spin_ns, waited_ns}; the parity is n & 1. */
int npi_ar_step(const int64_t *ctx, const float *part, float *res, size_t size, int64_t n) {
    float *slots = (float *)(intptr_t)ctx[n & 1];
    return npi_ar_shared(slots, (size_t)ctx[2], (int)ctx[3], (int)ctx[4], part, size, res, (int64_t *)(intptr_t)ctx[5],
                         (size_t)ctx[6], (size_t)ctx[7], n, (const int64_t *)(intptr_t)ctx[8], ctx[9],
                         (int64_t *)(intptr_t)ctx[10]);
}
