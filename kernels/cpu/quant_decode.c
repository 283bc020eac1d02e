/* Decode attention over QEvict's packed low-bit tier on the CPU, reading the codes in place.
 *
 * Two passes per (batch row, KV head), around the caller's softmax over [quantized | full precision]:
 *   quant_logits: every query row of the head's group against every quantized key, the key dequantized
 *                 (code * scale + zero, per channel and window) and re-rotated at its absolute position from
 *                 cos/sin rows, then dotted with each row;
 *   quant_values: each row's probabilities times the dequantized values (code * scale + zero, per token).
 * Scales and zero-points are float32, float16 or bfloat16 (``kind`` 0, 1, 2), widened exactly to float as they are
 * read: once per window for the keys' per-channel pairs, once per token for the values'.
 * Nothing of the tier is materialised beyond one key or value row on the stack. Built with
 * -ffp-contract=off so dequantization and rotation round exactly as the PyTorch path does (two roundings,
 * no fused multiply-add); the dot products sum in another order than BLAS, so logits agree to float rounding.
 * The bodies are inlined with head_dim and bits as constants for the common shapes (3.5x faster than the
 * generic loop for head_dim 64, INT2, on one AVX2 core), and generic otherwise.
 */
#include <stdint.h>
#include <string.h>

#define MAX_D 512
#define LANES 8
#define INLINE static inline __attribute__((always_inline))

/* Exact: every float16 and bfloat16 number is a float. _Float16 where the compiler has it (with F16C a vcvtph2ps
 * per 8 lanes: bench.cpu_kernel put the logits pass at 1.10-1.14x float32 pairs' time with it, 1.39-1.40x with the
 * bit arithmetic), bit arithmetic elsewhere or with -DQEVICT_BITWISE_HALF (how the tests reach it). */
INLINE float half_to_float(uint16_t h) {
#if defined(__FLT16_MAX__) && !defined(QEVICT_BITWISE_HALF)
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        const float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

INLINE float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE float widen(const void *params, int64_t i, int kind) {
    if (kind == 0) return ((const float *)params)[i];
    const uint16_t h = ((const uint16_t *)params)[i];
    return kind == 1 ? half_to_float(h) : bf16_to_float(h);
}

/* d parameters from ``at``: float32 ones in place, narrower ones widened into ``buf`` (one branch per row, so
 * the loops vectorise). */
INLINE const float *widen_row(const void *params, int64_t at, int d, int kind, float *buf) {
    const uint16_t *h = (const uint16_t *)params + at;
    if (kind == 0) return (const float *)params + at;
    if (kind == 1)
        for (int i = 0; i < d; i++) buf[i] = half_to_float(h[i]);
    else
        for (int i = 0; i < d; i++) buf[i] = bf16_to_float(h[i]);
    return buf;
}

static void code_table(int bits, float *table) {
    int per = 8 / bits, mask = (1 << bits) - 1;
    for (int byte = 0; byte < 256; byte++)
        for (int i = 0; i < per; i++) table[byte * per + i] = (float)((byte >> (bits * i)) & mask);
}

INLINE void unpack_row(const uint8_t *codes, int packed, int per, const float *table, float *out) {
    for (int j = 0; j < packed; j++) memcpy(out + j * per, table + codes[j] * per, sizeof(float) * per);
}

INLINE float dot(const float *a, const float *b, int d) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

INLINE void logits_body(const float *q, const uint8_t *k_codes, const void *k_scale, const void *k_zero, int kind,
                        const int32_t *ids, const float *cos, const float *sin, float *out, int64_t out_stride,
                        int64_t heads_per_row, int64_t h0, int64_t h1, int64_t rows, int64_t n, const int d,
                        const int bits, int64_t omega, int64_t sinks, float scaling) {
    const int per = 8 / bits, packed = d / per, half = d / 2;
    const int64_t windows = n / omega;
    float table[256 * 4], key[MAX_D], rot[MAX_D], sc_buf[MAX_D], zc_buf[MAX_D];
    const float *sc = sc_buf, *zc = zc_buf;
    code_table(bits, table);
    for (int64_t bh = h0; bh < h1; bh++) {
        const int32_t *row_ids = ids + (bh / heads_per_row) * windows;
        const float *qh = q + bh * rows * d;
        float *oh = out + bh * rows * out_stride;
        for (int64_t t = 0; t < n; t++) {
            const int64_t w = t / omega, pos = sinks + (int64_t)row_ids[w] * omega + t % omega;
            if (t % omega == 0) {
                sc = widen_row(k_scale, (bh * windows + w) * d, d, kind, sc_buf);
                zc = widen_row(k_zero, (bh * windows + w) * d, d, kind, zc_buf);
            }
            const float *c = cos + pos * d, *s = sin + pos * d;
            unpack_row(k_codes + (bh * n + t) * packed, packed, per, table, key);
            for (int i = 0; i < d; i++) key[i] = key[i] * sc[i] + zc[i];
            for (int i = 0; i < half; i++) rot[i] = key[i] * c[i] - key[i + half] * s[i];
            for (int i = 0; i < half; i++) rot[i + half] = key[i + half] * c[i + half] + key[i] * s[i + half];
            for (int64_t r = 0; r < rows; r++) oh[r * out_stride + t] = dot(qh + r * d, rot, d) * scaling;
        }
    }
}

INLINE void values_body(const float *probs, int64_t stride, const uint8_t *v_codes, const void *v_scale,
                        const void *v_zero, int kind, float *out, int64_t h0, int64_t h1, int64_t rows, int64_t n,
                        const int d, const int bits) {
    const int per = 8 / bits, packed = d / per;
    float table[256 * 4], value[MAX_D];
    code_table(bits, table);
    for (int64_t bh = h0; bh < h1; bh++) {
        float *oh = out + bh * rows * d;
        const float *ph = probs + bh * rows * stride;
        memset(oh, 0, sizeof(float) * rows * d);
        for (int64_t t = 0; t < n; t++) {
            const float sc = widen(v_scale, bh * n + t, kind), zc = widen(v_zero, bh * n + t, kind);
            unpack_row(v_codes + (bh * n + t) * packed, packed, per, table, value);
            for (int i = 0; i < d; i++) value[i] = value[i] * sc + zc;
            for (int64_t r = 0; r < rows; r++) {
                const float p = ph[r * stride + t];
                float *o = oh + r * d;
                for (int i = 0; i < d; i++) o[i] += p * value[i];
            }
        }
    }
}

/* Constant head_dim and bits for the shapes of today's small and 7-8B models; anything else runs generic. */
#define DISPATCH(BODY, D, BITS, ...)                                                   \
    if ((D) == 64 && (BITS) == 2) BODY(__VA_ARGS__, 64, 2);                            \
    else if ((D) == 64 && (BITS) == 4) BODY(__VA_ARGS__, 64, 4);                       \
    else if ((D) == 128 && (BITS) == 2) BODY(__VA_ARGS__, 128, 2);                     \
    else if ((D) == 128 && (BITS) == 4) BODY(__VA_ARGS__, 128, 4);                     \
    else BODY(__VA_ARGS__, (int)(D), (int)(BITS));

#define LOGITS(...) logits_body(q, k_codes, k_scale, k_zero, kind, ids, cos, sin, out, n, heads_per_row, h0, h1,  \
                                rows, n, __VA_ARGS__, omega, sinks, scaling)
#define LOGITS_ONE(...) logits_body(q + h * rows * d, k_codes[h], k_scale[h], k_zero[h], kind, ids[h], cos, sin,   \
                                    out + h * rows * stride, stride, 1, 0, 1, rows, n[h], __VA_ARGS__, omega, sinks, \
                                    scaling)
#define VALUES_ONE(...) values_body(probs + h * rows * stride, stride, v_codes[h], v_scale[h], v_zero[h], kind,      \
                                    out + h * rows * d, 0, 1, rows, n[h], __VA_ARGS__)
#define VALUES(...) values_body(probs, stride, v_codes, v_scale, v_zero, kind, out, h0, h1, rows, n, __VA_ARGS__)
#define UNUSED 0

static int bad_shape(int64_t d, int64_t bits, int64_t kind) {
    return d <= 0 || d > MAX_D || d % 2 || (bits != 2 && bits != 4) || d % (8 / bits) || kind < 0 || kind > 2;
}

/* q (B*H, R, D); k_codes (B*H, N, D/per); k_scale, k_zero (B*H, N/omega, D) of ``kind``; ids (B, N/omega);
 * cos, sin (T, D) rows by absolute position; out (B*H, R, N). Heads [h0, h1) of the flattened B*H. */
int quant_logits(const float *q, const uint8_t *k_codes, const void *k_scale, const void *k_zero, int64_t kind,
                 const int32_t *ids, const float *cos, const float *sin, float *out, int64_t heads_per_row,
                 int64_t h0, int64_t h1, int64_t rows, int64_t n, int64_t d, int64_t bits, int64_t omega,
                 int64_t sinks, float scaling) {
    if (bad_shape(d, bits, kind) || omega <= 0 || n % omega) return 1;
#define LOGITS_AT(unused, D, BITS) LOGITS(D, BITS)
    DISPATCH(LOGITS_AT, d, bits, UNUSED)
    return 0;
}

/* probs (B*H, R, stride) whose first N columns belong to the quantized keys; v_codes (B*H, N, D/per);
 * v_scale, v_zero (B*H, N); out (B*H, R, D) is overwritten with probs[:, :, :N] @ dequantized values. */
int quant_values(const float *probs, int64_t stride, const uint8_t *v_codes, const void *v_scale,
                 const void *v_zero, int64_t kind, float *out, int64_t h0, int64_t h1, int64_t rows, int64_t n,
                 int64_t d, int64_t bits) {
    if (bad_shape(d, bits, kind) || stride < n) return 1;
#define VALUES_AT(unused, D, BITS) VALUES(D, BITS)
    DISPATCH(VALUES_AT, d, bits, UNUSED)
    return 0;
}

/* Heads of one layer whose tiers differ in length ("varlen"): head h's tier is its own allocation (pointer
 * arrays, n[h] keys, window-major), so a layer whose heads keep different windows runs in one call.
 * q (H, R, D); out (H, R, stride): head h's columns [0, n[h]) get its logits, [n[h], stride) -inf, so one
 * softmax over the padded rows weighs every head's keys and nothing else. Heads [h0, h1). */
int quant_logits_varlen(const float *q, const uint8_t *const *k_codes, const void *const *k_scale,
                        const void *const *k_zero, int64_t kind, const int32_t *const *ids, const int64_t *n,
                        const float *cos, const float *sin, float *out, int64_t stride, int64_t h0, int64_t h1,
                        int64_t rows, int64_t d, int64_t bits, int64_t omega, int64_t sinks, float scaling) {
    if (bad_shape(d, bits, kind) || omega <= 0) return 1;
    for (int64_t h = h0; h < h1; h++)
        if (n[h] < 0 || n[h] % omega || n[h] > stride) return 1;
    for (int64_t h = h0; h < h1; h++) {
#define LOGITS_ONE_AT(unused, D, BITS) LOGITS_ONE(D, BITS)
        DISPATCH(LOGITS_ONE_AT, d, bits, UNUSED)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t t = n[h]; t < stride; t++) out[(h * rows + r) * stride + t] = -__builtin_inff();
    }
    return 0;
}

/* probs (H, R, stride) whose first n[h] columns of head h weigh its quantized values; v_codes[h] (n[h], D/per);
 * v_scale[h], v_zero[h] (n[h]); out (H, R, D) is overwritten with each head's probs @ dequantized values. */
int quant_values_varlen(const float *probs, int64_t stride, const uint8_t *const *v_codes,
                        const void *const *v_scale, const void *const *v_zero, int64_t kind, const int64_t *n,
                        float *out, int64_t h0, int64_t h1, int64_t rows, int64_t d, int64_t bits) {
    if (bad_shape(d, bits, kind)) return 1;
    for (int64_t h = h0; h < h1; h++)
        if (n[h] < 0 || n[h] > stride) return 1;
    for (int64_t h = h0; h < h1; h++) {
#define VALUES_ONE_AT(unused, D, BITS) VALUES_ONE(D, BITS)
        DISPATCH(VALUES_ONE_AT, d, bits, UNUSED)
    }
    return 0;
}

#define MAX_OMEGA 256

/* One window's mass: each key's probability summed over the rows (row-wise adds of contiguous keys, which
 * vectorise), then the keys [at, at + keys) summed in order. */
INLINE float window_mass(const float *p, int64_t stride, int64_t rows, int64_t at, int64_t keys) {
    float key[MAX_OMEGA];
    for (int64_t j = 0; j < keys; j++) key[j] = p[at + j];
    for (int64_t r = 1; r < rows; r++)
        for (int64_t j = 0; j < keys; j++) key[j] += p[r * stride + at + j];
    float mass = 0.0f;
    for (int64_t j = 0; j < keys; j++) mass += key[j];
    return mass;
}

/* Eq. 1's fold for the heads of one layer laid out as quant_logits_varlen's callers lay them out: probs (H, R, stride)
 * with head h's quantized windows in columns [0, n_q[h]) (ids q_ids[h]), its sinks from column ``width_q`` (no
 * window), then its n_f[h] full windows (ids f_ids[h]) and ``recent`` keys in windows first_recent, first_recent + 1,
 * ... (the last may be partial). Each window's mass, averaged over the R query rows, is added to table[h][id]
 * (table rows ``table_stride`` apart). Heads [h0, h1) of ``heads``. */
int fold_varlen(const float *probs, int64_t stride, int64_t rows, const int64_t *n_q, const int32_t *const *q_ids,
                int64_t width_q, int64_t sinks, const int64_t *n_f, const int32_t *const *f_ids, int64_t first_recent,
                int64_t recent, float *table, int64_t table_stride, int64_t omega, int64_t heads, int64_t h0,
                int64_t h1) {
    if (omega <= 0 || omega > MAX_OMEGA || rows <= 0 || recent < 0 || first_recent < 0) return 1;
    for (int64_t h = 0; h < heads; h++) { /* every head, whatever [h0, h1): a refused call writes nothing */
        const int64_t fp = width_q + sinks + n_f[h] * omega;
        const int64_t n_recent = (recent + omega - 1) / omega;
        if (n_q[h] < 0 || n_q[h] % omega || n_q[h] > width_q || n_f[h] < 0 || fp + recent > stride ||
            first_recent + n_recent > table_stride) return 1;
        for (int64_t w = 0; w < n_q[h] / omega; w++)
            if (q_ids[h][w] < 0 || q_ids[h][w] >= table_stride) return 1;
        for (int64_t w = 0; w < n_f[h]; w++)
            if (f_ids[h][w] < 0 || f_ids[h][w] >= table_stride) return 1;
    }
    for (int64_t h = h0; h < h1; h++) {
        const float *p = probs + h * rows * stride;
        float *row = table + h * table_stride;
        const float g = (float)rows;
        for (int64_t w = 0; w < n_q[h] / omega; w++)
            row[q_ids[h][w]] += window_mass(p, stride, rows, w * omega, omega) / g;
        const int64_t full = width_q + sinks;
        for (int64_t w = 0; w < n_f[h]; w++)
            row[f_ids[h][w]] += window_mass(p, stride, rows, full + w * omega, omega) / g;
        const int64_t at = full + n_f[h] * omega;
        for (int64_t w = 0; w * omega < recent; w++) {
            const int64_t keys = recent - w * omega < omega ? recent - w * omega : omega;
            row[first_recent + w] += window_mass(p, stride, rows, at + w * omega, keys) / g;
        }
    }
    return 0;
}
