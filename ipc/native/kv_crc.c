/* CRC-32C (Castagnoli) of many KV block rows in one call, optionally copying each row as it is summed.
 *
 * Why in C: a KV transfer moves ~1,000 blocks of a few KiB; a checksum per block from Python costs more
 * than the copy. Here the checksum runs on the x86 crc32 instruction over four rows at once (the
 * instruction's latency is hidden by the independent rows), and the copy is fused into the same pass so the
 * bytes are read once. Other CPUs get a table-driven CRC-32C with the same result.
 *
 * Rows: row i starts at src + src_off[i] and is copied (when dst is not NULL) to dst + dst_off[i];
 * out[i] receives its CRC-32C (initial value 0, the usual final xor, as the crc32c package computes it);
 * with out NULL the rows are only copied.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static uint32_t crc_table[256];
static int crc_table_ready;

static void crc_table_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        crc_table[i] = c;
    }
    crc_table_ready = 1;
}

static uint32_t crc_soft(uint32_t c, const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c;
}

static void rows_soft(const uint8_t *src, const int64_t *src_off, size_t parts, uint8_t *dst, const int64_t *dst_off,
                      size_t len, size_t n, uint32_t *out) {
    if (!crc_table_ready) crc_table_init();
    for (size_t i = 0; i < n; i++) {
        uint32_t c = ~0u;
        for (size_t p = 0; p < parts; p++) {
            const uint8_t *s = src + src_off[i * parts + p];
            c = crc_soft(c, s, len);
            if (dst) memcpy(dst + dst_off[i] + p * len, s, len);
        }
        out[i] = ~c;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define HW __attribute__((target("sse4.2")))

HW static uint32_t crc_hw(uint32_t c, const uint8_t *p, size_t n) {
    uint64_t c64 = c, v;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&v, p + i, 8);
        c64 = _mm_crc32_u64(c64, v);
    }
    c = (uint32_t)c64;
    for (; i < n; i++) c = _mm_crc32_u8(c, p[i]);
    return c;
}

/* One part of a row: the CRC state c carried on over it (and the bytes copied), 8 bytes at a time. */
HW static uint32_t part_hw(uint32_t c32, const uint8_t *s, uint8_t *d, size_t len) {
    if (!d) return crc_hw(c32, s, len);
    uint64_t c = c32, v;
    size_t j = 0;
    for (; j + 8 <= len; j += 8) {
        memcpy(&v, s + j, 8);
        c = _mm_crc32_u64(c, v);
        memcpy(d + j, &v, 8);
    }
    c32 = (uint32_t)c;
    for (; j < len; j++) {
        c32 = _mm_crc32_u8(c32, s[j]);
        d[j] = s[j];
    }
    return c32;
}

/* Rows of `parts` parts of len bytes each: part p of row i at src + src_off[i * parts + p], copied (when dst is
 * not NULL) to dst + dst_off[i] + p * len; one CRC per row over its parts in order. */
HW static void rows_hw(const uint8_t *src, const int64_t *src_off, size_t parts, uint8_t *dst, const int64_t *dst_off,
                       size_t len, size_t n, uint32_t *out) {
    size_t i = 0, words = len / 8;
    for (; i + 4 <= n; i += 4) { /* four independent CRC chains: the instruction's latency overlaps */
        uint64_t c0 = 0xFFFFFFFFu, c1 = c0, c2 = c0, c3 = c0, v0, v1, v2, v3;
        for (size_t p = 0; p < parts; p++) {
            const uint8_t *s0 = src + src_off[i * parts + p], *s1 = src + src_off[(i + 1) * parts + p],
                          *s2 = src + src_off[(i + 2) * parts + p], *s3 = src + src_off[(i + 3) * parts + p];
            if (dst) {
                uint8_t *d0 = dst + dst_off[i] + p * len, *d1 = dst + dst_off[i + 1] + p * len,
                        *d2 = dst + dst_off[i + 2] + p * len, *d3 = dst + dst_off[i + 3] + p * len;
                for (size_t w = 0; w < words; w++) {
                    memcpy(&v0, s0 + 8 * w, 8); memcpy(&v1, s1 + 8 * w, 8);
                    memcpy(&v2, s2 + 8 * w, 8); memcpy(&v3, s3 + 8 * w, 8);
                    c0 = _mm_crc32_u64(c0, v0); c1 = _mm_crc32_u64(c1, v1);
                    c2 = _mm_crc32_u64(c2, v2); c3 = _mm_crc32_u64(c3, v3);
                    memcpy(d0 + 8 * w, &v0, 8); memcpy(d1 + 8 * w, &v1, 8);
                    memcpy(d2 + 8 * w, &v2, 8); memcpy(d3 + 8 * w, &v3, 8);
                }
                uint32_t c[4] = {(uint32_t)c0, (uint32_t)c1, (uint32_t)c2, (uint32_t)c3};
                const uint8_t *s[4] = {s0, s1, s2, s3};
                uint8_t *d[4] = {d0, d1, d2, d3};
                for (int r = 0; r < 4; r++)
                    for (size_t j = 8 * words; j < len; j++) {
                        c[r] = _mm_crc32_u8(c[r], s[r][j]);
                        d[r][j] = s[r][j];
                    }
                c0 = c[0]; c1 = c[1]; c2 = c[2]; c3 = c[3];
            } else {
                for (size_t w = 0; w < words; w++) {
                    memcpy(&v0, s0 + 8 * w, 8); memcpy(&v1, s1 + 8 * w, 8);
                    memcpy(&v2, s2 + 8 * w, 8); memcpy(&v3, s3 + 8 * w, 8);
                    c0 = _mm_crc32_u64(c0, v0); c1 = _mm_crc32_u64(c1, v1);
                    c2 = _mm_crc32_u64(c2, v2); c3 = _mm_crc32_u64(c3, v3);
                }
                uint32_t c[4] = {(uint32_t)c0, (uint32_t)c1, (uint32_t)c2, (uint32_t)c3};
                const uint8_t *s[4] = {s0, s1, s2, s3};
                for (int r = 0; r < 4; r++)
                    for (size_t j = 8 * words; j < len; j++) c[r] = _mm_crc32_u8(c[r], s[r][j]);
                c0 = c[0]; c1 = c[1]; c2 = c[2]; c3 = c[3];
            }
        }
        out[i] = ~(uint32_t)c0; out[i + 1] = ~(uint32_t)c1; out[i + 2] = ~(uint32_t)c2; out[i + 3] = ~(uint32_t)c3;
    }
    for (; i < n; i++) {
        uint32_t c = 0xFFFFFFFFu;
        for (size_t p = 0; p < parts; p++)
            c = part_hw(c, src + src_off[i * parts + p], dst ? dst + dst_off[i] + p * len : NULL, len);
        out[i] = ~c;
    }
}

static int have_hw(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    }
    return known;
}
#endif

/* Rows made of `parts` parts of len bytes (part p of row i at src + src_off[i * parts + p]), each copied when dst
 * is not NULL to dst + dst_off[i] + p * len; out[i] the CRC-32C of row i's parts in order. */
void npi_crc32c_parts(const uint8_t *src, const int64_t *src_off, size_t parts, uint8_t *dst, const int64_t *dst_off,
                      size_t len, size_t n, uint32_t *out) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (have_hw()) {
        rows_hw(src, src_off, parts, dst, dst_off, len, n, out);
        return;
    }
#endif
    rows_soft(src, src_off, parts, dst, dst_off, len, n, out);
}

/* 1 when the hardware CRC instruction is used, 0 for the table. */
int npi_crc32c_hardware(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    return have_hw();
#else
    return 0;
#endif
}

void npi_crc32c_rows(const uint8_t *src, const int64_t *src_off, uint8_t *dst, const int64_t *dst_off, size_t len,
                     size_t n, uint32_t *out) {
    if (!out) { /* a plain gather/scatter of rows: no checksum wanted */
        for (size_t i = 0; i < n; i++) memcpy(dst + dst_off[i], src + src_off[i], len);
        return;
    }
    npi_crc32c_parts(src, src_off, 1, dst, dst_off, len, n, out);
}
