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

/* One row's codes into floats in channel order. A row of d codes is packed in 8 / bits bit planes (qevict_core/quant.py):
 * plane k, at bit bits * k of each of the row's ``packed`` bytes, holds channels k * packed .. (k + 1) * packed - 1,
 * so each plane is a shift and a mask over contiguous bytes, which the compiler vectorises. */
INLINE void unpack_row(const uint8_t *codes, int packed, int bits, float *out) {
    const uint8_t mask = (uint8_t)((1 << bits) - 1);
    for (int k = 0; k < 8 / bits; k++) {
        float *plane = out + k * packed;
        const int shift = bits * k;
        for (int j = 0; j < packed; j++) plane[j] = (float)((uint8_t)(codes[j] >> shift) & mask);
    }
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
    float key[MAX_D], rot[MAX_D], sc_buf[MAX_D], zc_buf[MAX_D];
    const float *sc = sc_buf, *zc = zc_buf;
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
            unpack_row(k_codes + (bh * n + t) * packed, packed, bits, key);
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
    float value[MAX_D];
    for (int64_t bh = h0; bh < h1; bh++) {
        float *oh = out + bh * rows * d;
        const float *ph = probs + bh * rows * stride;
        memset(oh, 0, sizeof(float) * rows * d);
        for (int64_t t = 0; t < n; t++) {
            const float sc = widen(v_scale, bh * n + t, kind), zc = widen(v_zero, bh * n + t, kind);
            unpack_row(v_codes + (bh * n + t) * packed, packed, bits, value);
            for (int i = 0; i < d; i++) value[i] = value[i] * sc + zc;
            for (int64_t r = 0; r < rows; r++) {
                const float p = ph[r * stride + t];
                float *o = oh + r * d;
                for (int i = 0; i < d; i++) o[i] += p * value[i];
            }
        }
    }
}

#if defined(__AVX2__) && defined(__F16C__)
/* The same two passes in AVX2 for head_dim 64 and 128: a key or value row lives in D / 8 registers from its codes to
 * its dot products. Dequantization and rotation round as above (a multiply, then an add: no fused multiply-add);
 * the dot products and the value sums use fused multiply-adds, another order of float rounding than BLAS's. */
#include <immintrin.h>
#define QEVICT_AVX2 1

INLINE __m256 bytes_to_floats(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); } /* low 8 bytes */

/* A row of D codes (bit planes, quant.py) -> D / 8 vectors of 8 floats in channel order. */
INLINE void codes_row(const uint8_t *c, const int d, const int bits, __m256 *out) {
    const int packed = d * bits / 8, per = 8 / bits;
    const __m128i mask = _mm_set1_epi8((char)((1 << bits) - 1));
    for (int chunk = 0; chunk < packed / 16; chunk++) { /* 16 bytes: 16 channels of each plane */
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(c + 16 * chunk));
        for (int k = 0; k < per; k++) {
            const __m128i plane = _mm_and_si128(_mm_srl_epi16(bytes, _mm_cvtsi32_si128(bits * k)), mask);
            const int at = (k * packed + 16 * chunk) / 8;
            out[at] = bytes_to_floats(plane);
            out[at + 1] = bytes_to_floats(_mm_srli_si128(plane, 8));
        }
    }
}

/* 8 scales or zero-points of ``kind`` at element ``i`` as floats (exact widening). */
INLINE __m256 params8(const void *p, int64_t i, int kind) {
    if (kind == 0) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
#ifdef QEVICT_BITWISE_HALF
    if (kind == 1) {
        float wide[8];
        for (int l = 0; l < 8; l++) wide[l] = half_to_float(((const uint16_t *)p)[i + l]);
        return _mm256_loadu_ps(wide);
    }
#else
    if (kind == 1) return _mm256_cvtph_ps(h);
#endif
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

INLINE void logits_avx2(const float *q, const uint8_t *k_codes, const void *k_scale, const void *k_zero, int kind,
                        const int32_t *ids, const float *cos, const float *sin, float *out, int64_t out_stride,
                        int64_t heads_per_row, int64_t h0, int64_t h1, int64_t rows, int64_t n, const int d,
                        const int bits, int64_t omega, int64_t sinks, float scaling) {
    const int nv = d / 8, half = nv / 2, packed = d * bits / 8;
    const int64_t windows = n / omega;
    __m256 sc[16], zc[16], key[16], rot[16];
    for (int64_t bh = h0; bh < h1; bh++) {
        const int32_t *row_ids = ids + (bh / heads_per_row) * windows;
        const float *qh = q + bh * rows * d;
        float *oh = out + bh * rows * out_stride;
        for (int64_t w = 0; w < windows; w++) {
            for (int i = 0; i < nv; i++) {
                sc[i] = params8(k_scale, (bh * windows + w) * d + 8 * i, kind);
                zc[i] = params8(k_zero, (bh * windows + w) * d + 8 * i, kind);
            }
            for (int64_t j = 0; j < omega; j++) {
                const int64_t t = w * omega + j, pos = sinks + (int64_t)row_ids[w] * omega + j;
                const float *c = cos + pos * d, *s = sin + pos * d;
                codes_row(k_codes + (bh * n + t) * packed, d, bits, key);
                for (int i = 0; i < nv; i++) key[i] = _mm256_add_ps(_mm256_mul_ps(key[i], sc[i]), zc[i]);
                for (int i = 0; i < half; i++) {
                    rot[i] = _mm256_sub_ps(_mm256_mul_ps(key[i], _mm256_loadu_ps(c + 8 * i)),
                                           _mm256_mul_ps(key[i + half], _mm256_loadu_ps(s + 8 * i)));
                    rot[i + half] = _mm256_add_ps(_mm256_mul_ps(key[i + half], _mm256_loadu_ps(c + 8 * (i + half))),
                                                  _mm256_mul_ps(key[i], _mm256_loadu_ps(s + 8 * (i + half))));
                }
                for (int64_t r = 0; r < rows; r++) {
                    const float *qr = qh + r * d;
                    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qr), rot[0]);
                    for (int i = 1; i < nv; i++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * i), rot[i], acc);
                    oh[r * out_stride + t] = hsum(acc) * scaling;
                }
            }
        }
    }
}

INLINE void values_avx2(const float *probs, int64_t stride, const uint8_t *v_codes, const void *v_scale,
                        const void *v_zero, int kind, float *out, int64_t h0, int64_t h1, int64_t rows, int64_t n,
                        const int d, const int bits) {
    const int nv = d / 8, packed = d * bits / 8;
    __m256 value[16];
    for (int64_t bh = h0; bh < h1; bh++) {
        float *oh = out + bh * rows * d;
        const float *ph = probs + bh * rows * stride;
        memset(oh, 0, sizeof(float) * rows * d);
        for (int64_t t = 0; t < n; t++) {
            const __m256 sc = _mm256_set1_ps(widen(v_scale, bh * n + t, kind));
            const __m256 zc = _mm256_set1_ps(widen(v_zero, bh * n + t, kind));
            codes_row(v_codes + (bh * n + t) * packed, d, bits, value);
            for (int i = 0; i < nv; i++) value[i] = _mm256_add_ps(_mm256_mul_ps(value[i], sc), zc);
            for (int64_t r = 0; r < rows; r++) {
                const __m256 p = _mm256_set1_ps(ph[r * stride + t]);
                float *o = oh + r * d;
                for (int i = 0; i < nv; i++)
                    _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(p, value[i], _mm256_loadu_ps(o + 8 * i)));
            }
        }
    }
}
#define LOGITS_FAST logits_avx2
#define VALUES_FAST values_avx2
#else
#define LOGITS_FAST logits_body
#define VALUES_FAST values_body
#endif

/* Constant head_dim and bits for the shapes of today's small and 7-8B models, on the AVX2 bodies where the compiler
 * targets AVX2; anything else runs the generic bodies. */
#define DISPATCH(BODY, D, BITS, ...)                                                   \
    if ((D) == 64 && (BITS) == 2) BODY(__VA_ARGS__, FAST, 64, 2);                      \
    else if ((D) == 64 && (BITS) == 4) BODY(__VA_ARGS__, FAST, 64, 4);                 \
    else if ((D) == 128 && (BITS) == 2) BODY(__VA_ARGS__, FAST, 128, 2);               \
    else if ((D) == 128 && (BITS) == 4) BODY(__VA_ARGS__, FAST, 128, 4);               \
    else BODY(__VA_ARGS__, GENERIC, (int)(D), (int)(BITS));
#define LOGITS_GENERIC logits_body
#define VALUES_GENERIC values_body

#define LOGITS(KIND, ...) LOGITS_##KIND(q, k_codes, k_scale, k_zero, kind, ids, cos, sin, out, n, heads_per_row, h0,  \
                                        h1, rows, n, __VA_ARGS__, omega, sinks, scaling)
#define LOGITS_ONE(KIND, ...) LOGITS_##KIND(q + h * rows * d, k_codes[h], k_scale[h], k_zero[h], kind, ids[h], cos, \
                                            sin, out + h * rows * stride, stride, 1, 0, 1, rows, n[h], __VA_ARGS__,  \
                                            omega, sinks, scaling)
#define VALUES_ONE(KIND, ...) VALUES_##KIND(probs + h * rows * stride, stride, v_codes[h], v_scale[h], v_zero[h],  \
                                            kind, out + h * rows * d, 0, 1, rows, n[h], __VA_ARGS__)
#define VALUES(KIND, ...) VALUES_##KIND(probs, stride, v_codes, v_scale, v_zero, kind, out, h0, h1, rows, n, __VA_ARGS__)
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
#define LOGITS_AT(unused, KIND, D, BITS) LOGITS(KIND, D, BITS)
    DISPATCH(LOGITS_AT, d, bits, UNUSED)
    return 0;
}

/* probs (B*H, R, stride) whose first N columns belong to the quantized keys; v_codes (B*H, N, D/per);
 * v_scale, v_zero (B*H, N); out (B*H, R, D) is overwritten with probs[:, :, :N] @ dequantized values. */
int quant_values(const float *probs, int64_t stride, const uint8_t *v_codes, const void *v_scale,
                 const void *v_zero, int64_t kind, float *out, int64_t h0, int64_t h1, int64_t rows, int64_t n,
                 int64_t d, int64_t bits) {
    if (bad_shape(d, bits, kind) || stride < n) return 1;
#define VALUES_AT(unused, KIND, D, BITS) VALUES(KIND, D, BITS)
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
#define LOGITS_ONE_AT(unused, KIND, D, BITS) LOGITS_ONE(KIND, D, BITS)
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
#define VALUES_ONE_AT(unused, KIND, D, BITS) VALUES_ONE(KIND, D, BITS)
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
