/* flexplan's CPU kernels on compressed weights: y = x W^T with W [out, in] in GGUF blocks, read
 * as the file holds them (ggml-common.h's layouts; rows of whole blocks). Here the 32-weight blocks:
 *   Q4_0 (type 2): fp16 d, 16 bytes of nibbles;                       w = d * (q - 8)
 *   Q4_1 (type 3): fp16 d, fp16 m, 16 bytes of nibbles;               w = d * q + m
 *   Q5_0 (type 6): fp16 d, u32 qh, 16 bytes of nibbles;               w = d * (q - 16)
 *   Q5_1 (type 7): fp16 d, fp16 m, u32 qh, 16 bytes of nibbles;       w = d * q + m
 *   Q8_0 (type 8): fp16 d, 32 int8;                                   w = d * q
 *   MXFP4 (type 39): E8M0 e, 16 bytes of nibbles;                     w = 2^(e - 128) * K[q]
 *                   (K: E2M1's values doubled, 0 1 2 3 4 6 8 12 and their negatives: gpt-oss's experts)
 * A nibble byte j holds value j (low 4 bits) and value j + 16 (high 4 bits); bit j of the
 * little-endian qh is value j's fifth bit. The K-quants (256-weight super-blocks: Q4_K, Q5_K, Q6_K)
 * are quant_kquants.c's, compiled into the same library: the entry points below hand them over.
 *
 * The activation is quantised per 32-block to int8 exactly as llama.cpp's CPU kernels quantise it
 * (quantize_row_q8_0 / q8_1 on x86 and ARM: q = x * (127 / max|x|) rounded to nearest, ties to
 * even; d = max|x| / 127 rounded to fp16; Q8_1's s = d * sum q rounded to fp16): the same bytes
 * as llama.cpp's for the same input. The dot products are integer per block, scaled once per block:
 *   Q4_0 . x = sum_b d_w d_x sum u_w q_x - 8 d_w s0_x      (u_w = q_w + 8, the nibble as stored;
 *                                                          s0 = d_x sum q: Q8_0 keeps no s)
 *   Q4_1 . x = sum_b d_w d_x sum u_w q_x + m_w s_x          (s: Q8_1's fp16 s)
 *   Q5_0 . x = sum_b d_w d_x sum u_w q_x - 16 d_w s0_x     (u_w: the 5-bit value as stored)
 *   Q5_1 . x = sum_b d_w d_x sum u_w q_x + m_w s_x
 *   Q8_0 . x = sum_b d_w d_x sum q_w q_x
 *   MXFP4 . x = sum_b d_w d_x sum K[q_w] q_x                (d_w a power of two: the product exact)
 * ISA, chosen at compile time by -march=native: AVX-512 VNNI (or AVX-VNNI) dpbusd, else AVX2
 * maddubs + madd, else portable C; flexplan_quant_isa() names it. OpenMP over output rows.
 * The batched kernel (prefill) takes the activation rows 4 at a time per decoded weight block, each
 * row with the GEMV's own operations; rows past a multiple of 4 take the GEMV. With AVX2 a CPU
 * linear's blocks are interleaved 8 rows at a time (the X8 layout below; the K-quants' in
 * quant_kquants.c), whose kernels take the GEMV and the prefill alike; the file's layout stays for
 * rows past the last group of 8.
 *
 * A float-activation path (float_act = 1) dequantises each weight exactly as gguf's reference
 * (d * q rounded, then + m rounded: no fused multiply-add) and sums w * x in double: it is the
 * test path, exact up to the one final rounding to float32. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32
#define TYPE_Q4_0 2
#define TYPE_Q4_1 3
#define TYPE_Q5_0 6
#define TYPE_Q5_1 7
#define TYPE_Q8_0 8
#define TYPE_MXFP4 39
#define TILE 4 /* activation rows that share one decode of a weight block in the batched kernel */
#ifndef QUANT_PREFETCH_BYTES
#define QUANT_PREFETCH_BYTES 4096
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define ISA "avx512vnni"
#elif defined(__AVXVNNI__)
#define ISA "avxvnni"
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA "avx2"
#else
#define ISA "portable"
#endif

typedef struct { /* one quantised 32-block of activation */
    float d;   /* scale, fp16-exact: x ~= d * q */
    float ds;  /* d * (sum of q), for the offset of Q4_0 / Q5_0 (their integer sum of (u - 8) q) */
    float s;   /* Q8_1's s, fp16(d * sum of q) with d before its rounding: the m of Q4_1 / Q5_1 */
    int8_t qs[QK];
} act_block;

/* quant_kquants.c: the 256-weight super-blocks (its header says how) */
int64_t flexplan_kq_block_bytes(int64_t wtype);  /* 0 for a type that is not a K-quant */
int64_t flexplan_kq_act_bytes(void);
void flexplan_kq_quantize_act(const float *x, void *a, int64_t nb);
void flexplan_kq_dot(int64_t wtype, const uint8_t *w, const void *const *a, int64_t nb, int64_t T, float *out);
void flexplan_kq_dequantize_block(int64_t wtype, const uint8_t *w, float *out);
double flexplan_kq_dot_float(int64_t wtype, const uint8_t *w, const float *x, int64_t nb);
int64_t flexplan_kq_x8_layout(int64_t wtype, int32_t *src);  /* their interleaved layout: 0 where none */
int flexplan_kq_x8_kernels(void);  /* 1 where this build has their interleaved kernels */
void flexplan_kq_x8_dot(int64_t wtype, const uint8_t *w, const void *const *a, int64_t nb, int64_t T, float *out);
#define QK_K 256

const char *flexplan_quant_isa(void) { return ISA; }
int64_t flexplan_quant_act_block_bytes(void) { return (int64_t)sizeof(act_block); }

static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);  /* inf / nan */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

float flexplan_quant_fp16(const uint8_t *p) { return fp16_to_f32(p); }  /* for quant_kquants.c without F16C */

/* f rounded to the nearest float16 (ties to even, as F16C's conversion and ggml's software one),
 * back in float32; f within float16's range (an activation's scale). */
static inline float round_fp16(float f) {
#if defined(__F16C__)
    return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
    /* ggml_compute_fp32_to_fp16's arithmetic (Maratyszcza's FP16): the add rounds the mantissa */
    const float scale_to_inf = 0x1.0p+112f, scale_to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * scale_to_inf) * scale_to_zero;
    uint32_t w, bits;
    memcpy(&w, &f, 4);
    const uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    float bias_f;
    memcpy(&bias_f, &bias_bits, 4);
    base = bias_f + base;
    memcpy(&bits, &base, 4);
    const uint16_t h = (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u
                                                  : (((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu))));
    uint8_t hb[2];
    memcpy(hb, &h, 2);
    return fp16_to_f32(hb);
#endif
}

static int64_t block_bytes(int64_t wtype) { /* the 32-weight blocks; 0 for any other type */
    return wtype == TYPE_Q4_0 ? 18 : wtype == TYPE_Q4_1 ? 20 : wtype == TYPE_Q5_0 ? 22 : wtype == TYPE_Q5_1 ? 24
         : wtype == TYPE_Q8_0 ? 34 : wtype == TYPE_MXFP4 ? 17 : 0;
}

/* MXFP4: ggml's kvalues_mxfp4 (E2M1 doubled) and its scale 2^(e - 127) / 2 (ggml_e8m0_to_fp32_half) */
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline void mxfp4_values(const uint8_t *blk, int8_t *q) { /* a block's 32 K[q], in order */
    for (int j = 0; j < QK / 2; j++) {
        q[j] = MXFP4_VALUES[blk[1 + j] & 0x0F];
        q[j + QK / 2] = MXFP4_VALUES[blk[1 + j] >> 4];
    }
}

/* The int8 activation's two steps, shared with quant_kquants.c (its Q8_K): the largest |x| of n
 * values, and x * id rounded to nearest, ties to even (llama.cpp's SIMD quantisers and its
 * nearest_int) into q, n a multiple of 32, the sum of each 16 q into sums16 where given, the sum of
 * all returned. Vectorised with AVX2 (a decode step quantises every GEMV's input on one thread): |x|
 * by clearing the sign, the same products in float32 and the conversion's own rounding (nearest,
 * ties to even), so both paths give the same bytes. */
static inline float absmax(const float *x, int64_t n) {
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
#else
    float amax = 0.0f;
    for (int64_t j = 0; j < n; j++) amax = fmaxf(amax, fabsf(x[j]));
    return amax;
#endif
}

static inline int32_t round_act(const float *x, float id, int8_t *q, int64_t n, int16_t *sums16) {
    int32_t total = 0;
#if defined(__AVX2__)
    const __m256 idv = _mm256_set1_ps(id);
    for (int64_t g = 0; g < n; g += 32) {
        __m256i q4[4];
        for (int i = 0; i < 4; i++) {
            const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(x + g + 8 * i), idv);
            q4[i] = _mm256_cvtps_epi32(_mm256_round_ps(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        /* int32 -> int8 in order: packs interleave 128-bit lanes, the permute puts them back */
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q4[0], q4[1]), _mm256_packs_epi32(q4[2], q4[3]));
        _mm256_storeu_si256((__m256i *)(q + g), _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        for (int h = 0; h < 2; h++) {  /* each 16 */
            const __m256i s8 = _mm256_add_epi32(q4[2 * h], q4[2 * h + 1]);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            const int32_t s = _mm_cvtsi128_si32(s4);
            if (sums16) sums16[g / 16 + h] = (int16_t)s;
            total += s;
        }
    }
#else
    for (int64_t g = 0; g < n; g += 16) {
        int32_t s = 0;
        for (int64_t j = g; j < g + 16; j++) {
            const int v = (int)nearbyintf(x[j] * id);  /* the default rounding mode: nearest, ties to even */
            q[j] = (int8_t)v;
            s += v;
        }
        if (sums16) sums16[g / 16] = (int16_t)s;
        total += s;
    }
#endif
    return total;
}

/* the two for quant_kquants.c (inlined here, called there once per 256 values) */
float flexplan_quant_absmax(const float *x, int64_t n) { return absmax(x, n); }
int32_t flexplan_quant_round_act(const float *x, float id, int8_t *q, int64_t n, int16_t *sums16) {
    return round_act(x, id, q, n, sums16);
}

/* llama.cpp's quantize_row_q8_0 and q8_1 (x86 / ARM): id = 127 / max|x| in one rounding, d and s to fp16 */
static void quantize_act(const float *x, act_block *a, int64_t nb) {
    for (int64_t b = 0; b < nb; b++) {
        const float *v = x + b * QK;
        const float amax = absmax(v, QK), d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        const int32_t sum = round_act(v, id, a[b].qs, QK, NULL);
        a[b].d = round_fp16(d);
        a[b].ds = a[b].d * (float)sum;
        a[b].s = round_fp16(d * (float)sum);
    }
}

/* ---- integer dots of one weight row with T activation rows ---------------------------------------
 * kind: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (compile-time after inlining). Two blocks per step into two sets
 * of accumulators: the fused multiply-add's latency is the bound with one. */
enum { KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q5_1, KIND_Q8_0, KIND_MXFP4, N_KINDS };
static const int64_t KIND_BYTES[N_KINDS] = {18, 20, 22, 24, 34, 17};
static const int KIND_QS[N_KINDS] = {2, 4, 6, 8, 2, 1};  /* where the nibbles (Q8_0: the int8 values) start */

/* a block's scale d: its float16 d, or MXFP4's E8M0 exponent */
static inline float block_d(const uint8_t *blk, int kind) {
    return kind == KIND_MXFP4 ? e8m0_half(blk[0]) : fp16_to_f32(blk);
}

/* the activation block's sum that multiplies block_min: Q8_1's s for Q4_1 / Q5_1, d sum q for the rest */
#define ACT_S(kind, blk) (((kind) == KIND_Q4_1 || (kind) == KIND_Q5_1) ? (blk).s : (blk).ds)

/* the value a block's u is offset by, times d (Q4_0, Q5_0), or its fp16 minimum (Q4_1, Q5_1) */
static inline float block_min(const uint8_t *blk, int kind, float dw) {
    return kind == KIND_Q4_0 ? -8.0f * dw : kind == KIND_Q5_0 ? -16.0f * dw : fp16_to_f32(blk + 2);
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256i nibbles32(const uint8_t *p) { /* 32 values 0..15, in order */
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

/* 32 bytes, byte j 0x10 where bit j of the little-endian uint32 at p is set: Q5's fifth bits in place */
static inline __m256i fifth_bits32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v),  /* byte j <- source byte j / 8 */
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);  /* byte j tests bit j % 8 */
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

/* a Q4 / Q5 block's 32 unsigned values u, in order */
static inline __m256i decode_u(const uint8_t *blk, int kind) {
    const __m256i u = nibbles32(blk + KIND_QS[kind]);
    return kind == KIND_Q5_0 || kind == KIND_Q5_1 ? _mm256_or_si256(u, fifth_bits32(blk + KIND_QS[kind] - 4)) : u;
}

static inline __m256i dot_u8s8(__m256i u, __m256i s) { /* 8 int32 lanes of sum u * s (u 0..255, s int8) */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else  /* pairs of u * s into int16 (no saturation: u <= 128 and |s| <= 127 here), then pairs into int32 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One block b of the row into accumulator set p: the weight block decoded once to unsigned bytes u
 * (Q4: 0..15, Q5: 0..31, the offset of Q4_0 / Q5_0 and the m of Q4_1 / Q5_1 applied through the
 * activation's block sum; Q8_0: |q| with q's sign moved onto the activation), then one integer dot
 * per activation row. */
static inline __attribute__((always_inline)) void step(const uint8_t *blk, int kind, const act_block *const *a,
                                                       int64_t b, int T, __m256 *acc, float *ex) {
    const float dw = block_d(blk, kind);
    if (kind == KIND_Q8_0 || kind == KIND_MXFP4) {  /* signed values: Q8_0's int8, MXFP4's K[q] by one shuffle */
        const __m256i q = kind == KIND_Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2))
            : _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_VALUES)),
                                  nibbles32(blk + 1));
        const __m256i u = _mm256_sign_epi8(q, q);
        for (int t = 0; t < T; t++) {
            const __m256i s = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a[t][b].qs), q);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a[t][b].d), _mm256_cvtepi32_ps(dot_u8s8(u, s)), acc[t]);
        }
        return;
    }
    const __m256i u = decode_u(blk, kind);
    const float mw = block_min(blk, kind, dw);
    for (int t = 0; t < T; t++) {
        const __m256i s = _mm256_loadu_si256((const __m256i *)a[t][b].qs);
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a[t][b].d), _mm256_cvtepi32_ps(dot_u8s8(u, s)), acc[t]);
        ex[t] = fmaf(mw, ACT_S(kind, a[t][b]), ex[t]);  /* explicit: the same rounding in every tile width */
    }
}

static inline __attribute__((always_inline)) void dot_rows(const uint8_t *w, int kind, const act_block *const *a,
                                                           int64_t nb, int T, float *out) {
    const int64_t bb = KIND_BYTES[kind];
    __m256 acc0[TILE], acc1[TILE];
    float ex0[TILE], ex1[TILE];
    for (int t = 0; t < T; t++) { acc0[t] = acc1[t] = _mm256_setzero_ps(); ex0[t] = ex1[t] = 0.0f; }
    if (T == 1) /* a thread's rows are contiguous: fetch the stream QUANT_PREFETCH_BYTES ahead of this row */
        for (int64_t off = 0; off < nb * bb; off += 64) _mm_prefetch((const char *)w + QUANT_PREFETCH_BYTES + off, _MM_HINT_T0);
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        step(w + b * bb, kind, a, b, T, acc0, ex0);
        step(w + (b + 1) * bb, kind, a, b + 1, T, acc1, ex1);
    }
    if (b < nb) step(w + b * bb, kind, a, b, T, acc0, ex0);
    for (int t = 0; t < T; t++) out[t] = hsum8(_mm256_add_ps(acc0[t], acc1[t])) + (ex0[t] + ex1[t]);
}

#else
static inline void dot_rows(const uint8_t *w, int kind, const act_block *const *a, int64_t nb, int T, float *out) {
    const int64_t bb = KIND_BYTES[kind];
    for (int t = 0; t < T; t++) out[t] = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += bb) {
        const float dw = block_d(w, kind);
        int8_t q[QK];
        float mw = 0.0f;
        if (kind == KIND_Q8_0) memcpy(q, w + 2, QK);
        else if (kind == KIND_MXFP4) mxfp4_values(w, q);
        else {
            const uint8_t *p = w + KIND_QS[kind];
            for (int j = 0; j < QK / 2; j++) { q[j] = p[j] & 0x0F; q[j + QK / 2] = p[j] >> 4; }
            if (kind == KIND_Q5_0 || kind == KIND_Q5_1) {
                uint32_t qh;
                memcpy(&qh, p - 4, 4);
                for (int j = 0; j < QK; j++) q[j] |= ((qh >> j) & 1) << 4;
            }
            mw = block_min(w, kind, dw);
        }
        for (int t = 0; t < T; t++) {
            int32_t s = 0;
            for (int j = 0; j < QK; j++) s += (int32_t)q[j] * a[t][b].qs[j];
            out[t] += dw * a[t][b].d * (float)s + mw * ACT_S(kind, a[t][b]);
        }
    }
}
#endif

/* the instances: a constant kind and tile each, so the branches above fold away */
#define INSTANCE(KIND)                                                                                   \
    static void dot1_##KIND(const uint8_t *w, const act_block *const *a, int64_t nb, float *out) {        \
        dot_rows(w, KIND, a, nb, 1, out);                                                                 \
    }                                                                                                     \
    static void dotT_##KIND(const uint8_t *w, const act_block *const *a, int64_t nb, float *out) {        \
        dot_rows(w, KIND, a, nb, TILE, out);                                                              \
    }
INSTANCE(KIND_Q4_0)
INSTANCE(KIND_Q4_1)
INSTANCE(KIND_Q5_0)
INSTANCE(KIND_Q5_1)
INSTANCE(KIND_Q8_0)
INSTANCE(KIND_MXFP4)
typedef void (*dot_fn)(const uint8_t *, const act_block *const *, int64_t, float *);
static const dot_fn DOT1[N_KINDS] = {dot1_KIND_Q4_0, dot1_KIND_Q4_1, dot1_KIND_Q5_0, dot1_KIND_Q5_1, dot1_KIND_Q8_0,
                                     dot1_KIND_MXFP4};
static const dot_fn DOTT[N_KINDS] = {dotT_KIND_Q4_0, dotT_KIND_Q4_1, dotT_KIND_Q5_0, dotT_KIND_Q5_1, dotT_KIND_Q8_0,
                                     dotT_KIND_MXFP4};

static int kind_of(int64_t wtype) {
    return wtype == TYPE_Q4_0 ? KIND_Q4_0 : wtype == TYPE_Q4_1 ? KIND_Q4_1 : wtype == TYPE_Q5_0 ? KIND_Q5_0
         : wtype == TYPE_Q5_1 ? KIND_Q5_1 : wtype == TYPE_Q8_0 ? KIND_Q8_0 : wtype == TYPE_MXFP4 ? KIND_MXFP4 : -1;
}

/* ---- the interleaved layout (wtype | X8): the CPU's own arrangement of a matrix's blocks ----------
 * One GEMV step of the file's layout decodes one row's block and ends in 8 lanes of partial sums,
 * each converted, scaled and finally summed across: on AVX2 that arithmetic, not memory, bounds it.
 * Interleaved, 8 rows' block b lie in one run, their 8 integer dots end as the
 * 8 lanes of one vector (two horizontal adds of 4 rows each) and one convert and one multiply-add
 * scale them all (llama.cpp repacks Q4_0 for its AVX2 GEMV likewise). Rows [0, 8 * (out / 8)) in
 * groups of 8; a group's block b is one run of 8 * bb bytes: the 8 rows' fp16 d, then (Q4_1) their
 * fp16 m, each in lane order (X8_LANE_ROW; MXFP4: the 8 rows' exponent bytes), then (Q5) the fifth bits of each value run in run order,
 * 8 bytes a run (qh byte c of its 4 rows, then qh byte 2 + c), then the values in 32-byte runs, run
 * (c, h) = bytes 8c .. 8c + 7 of rows 4h .. 4h + 3 (Q4 / Q5: c < 2, each byte two values; Q8_0: c < 4), c major. The
 * rows after the last group keep the file's layout; every row's bytes keep their offset range, a
 * group's at 8 rows. A row's result is the same whatever the count of activation rows (one
 * arithmetic per row in the GEMV and the batched kernel): a request's tokens do not depend on what
 * shares its batch. flexplan_quant_x8_layout is the one statement of the layout (Python permutes
 * with it, the float path here reads raw blocks through it). */
#define X8 0x100
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define X8_KERNELS 1
#endif
#ifndef X8_PREFETCH_BYTES
#define X8_PREFETCH_BYTES 1024
#endif
#define X8_MAX_RUN (8 * 210) /* 8 Q6_K super-blocks */
static const int X8_LANE_ROW[8] = {0, 1, 4, 5, 2, 3, 6, 7}; /* what _mm256_hadd_epi32 of rows 0-3 and 4-7 gives (its own inverse) */

static int is_k(int64_t wtype) { return flexplan_kq_block_bytes(wtype) != 0; }
static int x8_kind(int64_t wtype) { /* the kind of an interleaved 32-block type with a kernel here, else -1 */
#ifdef X8_KERNELS
    return (wtype & X8) ? kind_of(wtype & ~(int64_t)X8) : -1;
#else
    (void)wtype;
    return -1;
#endif
}

/* src[j] = which byte of the group's 8 blocks b laid end to end (row r's at r * bb) byte j of its
 * interleaved run holds; returns the run's length 8 * bb, or 0 where wtype has no interleaved kernel
 * here (another format, or no AVX2): such blocks stay as the file holds them. */
int64_t flexplan_quant_x8_layout(int64_t wtype, int32_t *src) {
    if (is_k(wtype & ~(int64_t)X8)) return flexplan_kq_x8_layout(wtype & ~(int64_t)X8, src);
    const int kind = x8_kind(wtype | X8);
    if (kind < 0) return 0;
    const int bb = (int)KIND_BYTES[kind], qs = KIND_QS[kind], runs = kind == KIND_Q8_0 ? 4 : 2;
    const int fields = kind == KIND_Q4_1 || kind == KIND_Q5_1 ? 2 : 1, q5 = kind == KIND_Q5_0 || kind == KIND_Q5_1;
    int j = 0;
    if (kind == KIND_MXFP4) /* its one-byte exponent */
        for (int l = 0; l < 8; l++) src[j++] = X8_LANE_ROW[l] * bb;
    else
        for (int f = 0; f < 2 * fields; f += 2) /* d, then m */
            for (int l = 0; l < 8; l++) { src[j++] = X8_LANE_ROW[l] * bb + f; src[j++] = X8_LANE_ROW[l] * bb + f + 1; }
    for (int c = 0; c < 2 * q5; c++) /* Q5: each value run's fifth bits, qh byte c then byte 2 + c of its 4 rows */
        for (int h = 0; h < 2; h++)
            for (int hi = 0; hi < 2; hi++)
                for (int r = 4 * h; r < 4 * h + 4; r++) src[j++] = r * bb + qs - 4 + 2 * hi + c;
    for (int c = 0; c < runs; c++)
        for (int r = 0; r < 8; r++) /* h = r / 4 */
            for (int k = 0; k < 8; k++) src[j++] = r * bb + qs + 8 * c + k;
    return j;
}

/* dst [rows, row_bytes] = src in the interleaved layout (unpack 0) or back in the file's (unpack 1), the
 * rows past the groups copied as they are; the layout's contiguous pieces (a field, 8 bytes of values)
 * copied whole, the groups in parallel: a loader packs every linear of a model. Returns 0, or 1 for a
 * type without an interleaved layout here or rows of no whole blocks. */
int flexplan_quant_x8_pack(const uint8_t *src, uint8_t *dst, int64_t wtype, int64_t rows, int64_t row_bytes,
                           int64_t unpack) {
    int32_t map[X8_MAX_RUN], first[X8_MAX_RUN], len[X8_MAX_RUN];
    const int64_t run = flexplan_quant_x8_layout(wtype, map), bb = run / 8;
    if (!run || row_bytes % bb) return 1;
    int pieces = 0;
    for (int64_t j = 0; j < run;) { /* a piece: consecutive bytes of one row's block */
        int64_t e = j + 1;
        while (e < run && map[e] == map[e - 1] + 1 && map[e] % bb) e++;
        first[pieces] = (int32_t)j;
        len[pieces++] = (int32_t)(e - j);
        j = e;
    }
    const int64_t nb = row_bytes / bb, groups = rows / 8;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *s = src + g * 8 * row_bytes;
        uint8_t *d = dst + g * 8 * row_bytes;
        for (int64_t b = 0; b < nb; b++)
            for (int k = 0; k < pieces; k++) {
                const int64_t m = map[first[k]], file = (m / bb) * row_bytes + b * bb + m % bb, packed = b * run + first[k];
                if (unpack) memcpy(d + file, s + packed, (size_t)len[k]);
                else memcpy(d + packed, s + file, (size_t)len[k]);
            }
    }
    memcpy(dst + groups * 8 * row_bytes, src + groups * 8 * row_bytes, (size_t)((rows - groups * 8) * row_bytes));
    return 0;
}

/* row o's blocks as the file holds them: in place for a plain type or a row past the groups, else
 * gathered from its group into buf (nb * bb bytes) */
static const uint8_t *x8_raw_row(const uint8_t *w, int64_t wtype, int64_t o, int64_t rows, int64_t nb, int64_t rb,
                                 uint8_t *buf) {
    if (!(wtype & X8) || o >= rows / 8 * 8) return w + o * rb;
    const int64_t bb = rb / nb;
    int32_t src[X8_MAX_RUN];
    const int64_t run = flexplan_quant_x8_layout(wtype, src), r = o % 8;
    const uint8_t *g = w + (o / 8) * 8 * rb;
    for (int64_t j = 0; j < run; j++)
        if (src[j] / bb == r)
            for (int64_t b = 0; b < nb; b++) buf[b * bb + src[j] % bb] = g[b * run + j];
    return buf;
}

#ifdef X8_KERNELS
/* acc + the four u8 x s8 products of each int32 lane: VNNI's one instruction where the CPU has it
 * (no saturation: a product fits int16, the sum int32), else none (the kernels below sum in int16) */
#if defined(X8_DPBUSD)  /* given by the build (a test emulates it with AVX2) */
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define X8_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define X8_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
/* one group's 8 rows with T activation rows (1..4, a constant after inlining): out[t * 8 + row].
 * Per row and block: the integer dot (exact), acc = fma(dw * dx, dot, acc), ex = fma(m, s, ex);
 * then acc + ex: the same operations for every T. */
static inline __attribute__((always_inline)) void x8_dot(const uint8_t *w, int kind, const act_block *const *a,
                                                         int64_t nb, int T, float *out) {
    const int64_t run = 8 * KIND_BYTES[kind];
    const __m256i low = _mm256_set1_epi8(0x0F);
#ifndef X8_DPBUSD
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 acc[4], ex[4];
    for (int t = 0; t < T; t++) acc[t] = ex[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * run;
        for (int64_t p = 0; p < run; p += 64) _mm_prefetch((const char *)blk + X8_PREFETCH_BYTES + p, _MM_HINT_T0);
        const int q5 = kind == KIND_Q5_0 || kind == KIND_Q5_1, fp4 = kind == KIND_MXFP4;
        __m256 dw;
        if (fp4) { /* ggml_e8m0_to_fp32_half of the 8 exponents: (e - 1) << 23, below 2 the subnormal 0x00200000 << e */
            int64_t e8;
            memcpy(&e8, blk, 8);
            const __m256i e = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(e8));
            const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
            const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
            dw = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
        } else {
            dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        }
        const __m256 mw = kind == KIND_Q4_1 || kind == KIND_Q5_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
                                                                 : _mm256_mul_ps(dw, _mm256_set1_ps(q5 ? -16.0f : -8.0f)); /* Q8_0: unused */
        const uint8_t *vals = blk + 8 * KIND_QS[kind];
        __m256i u[8]; /* Q4 / Q5: run (c, h)'s low values at 4c + 2h, high at 4c + 2h + 1; Q8_0: run (c, h) at 2c + h */
        __m256i mag[8]; /* MXFP4: |K[q]|, the values' signs moved onto the activation per row */
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)MXFP4_VALUES));
        for (int i = 0; i < (kind == KIND_Q8_0 ? 8 : 4); i++) {
            const __m256i r = _mm256_loadu_si256((const __m256i *)vals + i);
            if (kind == KIND_Q8_0) u[i] = r;
            else { u[2 * i] = _mm256_and_si256(r, low); u[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(r, 4), low); }
            if (fp4) {
                for (int k = 2 * i; k < 2 * i + 2; k++) {
                    u[k] = _mm256_shuffle_epi8(table, u[k]);
                    mag[k] = _mm256_sign_epi8(u[k], u[k]);
                }
            }
            if (q5) { /* byte 8r + k gets 0x10 where bit k of its row's qh byte is set: low values', then high values' */
                int64_t bits;
                memcpy(&bits, vals - 32 + 8 * i, 8);
                const __m256i spread = _mm256_set1_epi64x(bits), sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
                const __m256i at_lo = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
                const __m256i at_hi = _mm256_add_epi8(at_lo, _mm256_set1_epi8(4));
                for (int hi = 0; hi < 2; hi++) {
                    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(spread, hi ? at_hi : at_lo), sel);
                    u[2 * i + hi] = _mm256_or_si256(u[2 * i + hi], _mm256_and_si256(_mm256_cmpeq_epi8(b, sel), _mm256_set1_epi8(0x10)));
                }
            }
        }
        for (int t = 0; t < T; t++) {
            const int64_t *aq = (const int64_t *)a[t][b].qs;
            __m256i s[2];
            if (kind == KIND_Q8_0) /* |q_w| times q_x carrying q_w's sign, each pair into int32 (int16 holds one pair) */
                for (int h = 0; h < 2; h++) {
                    s[h] = _mm256_setzero_si256();
                    for (int c = 0; c < 4; c++) {
                        const __m256i q = u[2 * c + h], x = _mm256_set1_epi64x(aq[c]);
#ifdef X8_DPBUSD
                        s[h] = X8_DPBUSD(s[h], _mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
#else
                        s[h] = _mm256_add_epi32(s[h], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q),
                                                                                             _mm256_sign_epi8(x, q)), ones));
#endif
                    }
                }
            else if (fp4) { /* |K[q]| <= 12: four pairs' sums stay within int16 (4 * 2 * 12 * 127) */
                const __m256i x[4] = {_mm256_set1_epi64x(aq[0]), _mm256_set1_epi64x(aq[1]), _mm256_set1_epi64x(aq[2]),
                                      _mm256_set1_epi64x(aq[3])};
                for (int h = 0; h < 2; h++) { /* the Q4 runs' order: low values with x0 / x1, high with x2 / x3 */
                    const int at[4] = {2 * h, 2 * h + 1, 4 + 2 * h, 4 + 2 * h + 1}, xs[4] = {0, 2, 1, 3};
#ifdef X8_DPBUSD
                    s[h] = _mm256_setzero_si256();
                    for (int k = 0; k < 4; k++) s[h] = X8_DPBUSD(s[h], mag[at[k]], _mm256_sign_epi8(x[xs[k]], u[at[k]]));
#else
                    __m256i p[4];
                    for (int k = 0; k < 4; k++)
                        p[k] = _mm256_maddubs_epi16(mag[at[k]], _mm256_sign_epi8(x[xs[k]], u[at[k]]));
                    s[h] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])), ones);
#endif
                }
            }
            else { /* values 0..31: four pairs' sums stay within int16 (4 * 2 * 31 * 127) */
                const __m256i x0 = _mm256_set1_epi64x(aq[0]), x1 = _mm256_set1_epi64x(aq[1]),
                              x2 = _mm256_set1_epi64x(aq[2]), x3 = _mm256_set1_epi64x(aq[3]);
                for (int h = 0; h < 2; h++)
#ifdef X8_DPBUSD
                    s[h] = X8_DPBUSD(X8_DPBUSD(X8_DPBUSD(X8_DPBUSD(_mm256_setzero_si256(), u[2 * h], x0), u[2 * h + 1], x2),
                                               u[4 + 2 * h], x1), u[4 + 2 * h + 1], x3);
#else
                    s[h] = _mm256_madd_epi16(
                        _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u[2 * h], x0), _mm256_maddubs_epi16(u[2 * h + 1], x2)),
                                         _mm256_add_epi16(_mm256_maddubs_epi16(u[4 + 2 * h], x1),
                                                          _mm256_maddubs_epi16(u[4 + 2 * h + 1], x3))),
                        ones);
#endif
            }
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_hadd_epi32(s[0], s[1]));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(a[t][b].d)), dot, acc[t]);
            if (kind != KIND_Q8_0 && !fp4) ex[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(ACT_S(kind, a[t][b])), ex[t]);
        }
    }
    const __m256i rows = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); /* X8_LANE_ROW: lanes back to row order */
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + 8 * t, _mm256_permutevar8x32_ps(_mm256_add_ps(acc[t], ex[t]), rows));
}
#define X8_INSTANCES(KIND)                                                                               \
    static void x8_##KIND##_1(const uint8_t *w, const act_block *const *a, int64_t nb, float *o) { x8_dot(w, KIND, a, nb, 1, o); } \
    static void x8_##KIND##_2(const uint8_t *w, const act_block *const *a, int64_t nb, float *o) { x8_dot(w, KIND, a, nb, 2, o); } \
    static void x8_##KIND##_4(const uint8_t *w, const act_block *const *a, int64_t nb, float *o) { x8_dot(w, KIND, a, nb, 4, o); }
X8_INSTANCES(KIND_Q4_0)
X8_INSTANCES(KIND_Q4_1)
X8_INSTANCES(KIND_Q5_0)
X8_INSTANCES(KIND_Q5_1)
X8_INSTANCES(KIND_Q8_0)
X8_INSTANCES(KIND_MXFP4)
typedef void (*x8_fn)(const uint8_t *, const act_block *const *, int64_t, float *);
static const x8_fn X8_FNS[N_KINDS][3] = {{x8_KIND_Q4_0_1, x8_KIND_Q4_0_2, x8_KIND_Q4_0_4},
                                         {x8_KIND_Q4_1_1, x8_KIND_Q4_1_2, x8_KIND_Q4_1_4},
                                         {x8_KIND_Q5_0_1, x8_KIND_Q5_0_2, x8_KIND_Q5_0_4},
                                         {x8_KIND_Q5_1_1, x8_KIND_Q5_1_2, x8_KIND_Q5_1_4},
                                         {x8_KIND_Q8_0_1, x8_KIND_Q8_0_2, x8_KIND_Q8_0_4},
                                         {x8_KIND_MXFP4_1, x8_KIND_MXFP4_2, x8_KIND_MXFP4_4}};

/* group g's 8 rows with activation rows [0, T) (any T, in steps of 4, 2, 1): y[t * ldy + 8g + row] (+ bias);
 * kind -1: a K-quant (type base), quant_kquants.c's kernel on its own activation blocks */
static void x8_group(const uint8_t *w, int64_t base, int kind, const void *const *a, int64_t nb, int64_t T, int64_t g,
                     float *y, int64_t ldy, const float *bias) {
    const uint8_t *wg = w + g * 8 * nb * (kind < 0 ? flexplan_kq_block_bytes(base) : KIND_BYTES[kind]);
    for (int64_t t = 0; t < T;) {
        const int n = T - t >= 4 ? 4 : T - t >= 2 ? 2 : 1;
        float v[32];
        if (kind < 0) flexplan_kq_x8_dot(base, wg, a + t, nb, n, v);
        else X8_FNS[kind][n == 4 ? 2 : n - 1](wg, (const act_block *const *)a + t, nb, v);
        for (int i = 0; i < n; i++)
            for (int r = 0; r < 8; r++) y[(t + i) * ldy + 8 * g + r] = v[8 * i + r] + (bias ? bias[8 * g + r] : 0.0f);
        t += n;
    }
}
#endif

/* ---- float-activation path: exact dequantisation, double sums ------------------------------------- */
static void dequant_block(const uint8_t *w, int64_t wtype, float *out) {
    if (wtype == TYPE_MXFP4) {  /* gguf's reference: d * K[q], exact (d a power of two) */
        const float d = e8m0_half(w[0]);
        int8_t q[QK];
        mxfp4_values(w, q);
        for (int j = 0; j < QK; j++) out[j] = d * (float)q[j];
        return;
    }
    const float d = fp16_to_f32(w);
    if (wtype == TYPE_Q8_0) {
        for (int j = 0; j < QK; j++) out[j] = (float)(int8_t)w[2 + j] * d;
        return;
    }
    const int kind = kind_of(wtype), with_min = kind == KIND_Q4_1 || kind == KIND_Q5_1;
    const int offset = kind == KIND_Q4_0 ? 8 : kind == KIND_Q5_0 ? 16 : 0;
    const uint8_t *p = w + KIND_QS[kind];
    uint32_t qh = 0;
    if (kind == KIND_Q5_0 || kind == KIND_Q5_1) memcpy(&qh, p - 4, 4);
    const float m = with_min ? fp16_to_f32(w + 2) : 0.0f;
    for (int j = 0; j < QK; j++) {
        const int u = ((j < QK / 2 ? p[j] : p[j - QK / 2] >> 4) & 0x0F) | (((qh >> j) & 1) << 4);
        volatile float v = d * (float)(u - offset);  /* d * q rounded before the + m (no fused multiply-add), as gguf's reference */
        out[j] = with_min ? v + m : v;
    }
}

static double dot_row_float(const uint8_t *w, int64_t wtype, const float *x, int64_t nb) {
    const int64_t bb = block_bytes(wtype);
    double acc = 0.0;
    float f[QK];
    for (int64_t b = 0; b < nb; b++, w += bb) {
        dequant_block(w, wtype, f);
        for (int j = 0; j < QK; j++) acc += (double)f[j] * (double)x[b * QK + j];
    }
    return acc;
}

/* ---- the entry points: every format, the 32-blocks here and the K-quants from quant_kquants.c -------- */
/* 0 for a type no kernel here reads: an unknown one, or the interleaved flag on a format without its kernel */
static int64_t weights_per_block(int64_t wtype) {
    if (wtype & X8) return x8_kind(wtype) >= 0 ? QK : (is_k(wtype & ~(int64_t)X8) && flexplan_kq_x8_kernels()) ? QK_K : 0;
    return is_k(wtype) ? QK_K : block_bytes(wtype) ? QK : 0;
}
static int64_t any_block_bytes(int64_t wtype) {
    wtype &= ~(int64_t)X8;
    return is_k(wtype) ? flexplan_kq_block_bytes(wtype) : block_bytes(wtype);
}
static int64_t act_bytes(int64_t wtype) { return is_k(wtype) ? flexplan_kq_act_bytes() : (int64_t)sizeof(act_block); }

static void quantize_any(int64_t wtype, const float *x, uint8_t *a, int64_t nb) {
    if (is_k(wtype)) flexplan_kq_quantize_act(x, a, nb);
    else quantize_act(x, (act_block *)a, nb);
}

/* one weight row with one quantised activation row (its blocks at a) */
static inline void dot1_any(int64_t wtype, int kind, const uint8_t *wr, const uint8_t *a, int64_t nb, float *v) {
    const void *row = a;
    if (kind < 0) flexplan_kq_dot(wtype, wr, &row, nb, 1, v);
    else DOT1[kind](wr, (const act_block *const *)&row, nb, v);
}

/* Dequantise rows [0, rows) of W into out [rows, in] float32 (exact, as gguf's reference). */
int flexplan_quant_dequantize(const uint8_t *w, int64_t wtype, float *out, int64_t rows, int64_t in) {
    const int64_t qk = weights_per_block(wtype), bb = any_block_bytes(wtype);
    if (!qk || in % qk) return 1;
    const int64_t nb = in / qk;
    #pragma omp parallel
    {
        uint8_t buf[(wtype & X8) ? nb * bb : 1];  /* an interleaved row gathered (a row's bytes: kilobytes) */
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *wr = (wtype & X8) ? x8_raw_row(w, wtype, r, rows, nb, nb * bb, buf) : w + r * nb * bb;
            for (int64_t b = 0; b < nb; b++) {
                if (is_k(wtype & ~(int64_t)X8)) flexplan_kq_dequantize_block(wtype & ~(int64_t)X8, wr + b * bb, out + r * in + b * qk);
                else dequant_block(wr + b * bb, wtype & ~(int64_t)X8, out + r * in + b * qk);
            }
        }
    }
    return 0;
}

/* y [batch, out] = x [batch, in] W^T (+ bias [out] if given); W [out, in] in blocks of wtype.
 * Returns 0, 1 for an unknown type or an in not a multiple of the block, 2 out of memory. */
int flexplan_quant_gemm(const uint8_t *w, int64_t wtype, const float *x, float *y, const float *bias, int64_t out,
                        int64_t in, int64_t batch, int64_t float_act) {
    const int64_t qk = weights_per_block(wtype);
    if (!qk || in % qk || out < 0 || batch < 0) return 1;
    const int64_t base = wtype & ~(int64_t)X8, groups = (wtype & X8) ? out / 8 : 0;
    const int64_t nb = in / qk, row_bytes = nb * any_block_bytes(base), ab = act_bytes(base) * nb;
    const int kind = kind_of(base);  /* -1: a K-quant */
    if (float_act) {
        #pragma omp parallel
        {
            uint8_t buf[groups ? row_bytes : 1];
            #pragma omp for schedule(static)
            for (int64_t o = 0; o < out; o++) {
                const uint8_t *wr = x8_raw_row(w, wtype, o, out, nb, row_bytes, buf);
                for (int64_t r = 0; r < batch; r++)
                    y[r * out + o] = (float)((kind < 0 ? flexplan_kq_dot_float(base, wr, x + r * in, nb)
                                                       : dot_row_float(wr, base, x + r * in, nb))
                                             + (bias ? (double)bias[o] : 0.0));
            }
        }
        return 0;
    }
    uint8_t *a = (uint8_t *)malloc((size_t)(batch * ab + 1));
    if (!a) return 2;
    #pragma omp parallel for schedule(static) if (batch > 1)  /* a prefill's rows: quantised in parallel too */
    for (int64_t r = 0; r < batch; r++) quantize_any(base, x + r * in, a + r * ab, nb);
    /* the interleaved groups' activation rows (a prefill's: too many for the stack) */
    const void **act_rows = groups ? (const void **)malloc((size_t)(batch + 1) * sizeof(void *)) : NULL;
    if (groups && !act_rows) { free(a); return 2; }
    for (int64_t r = 0; groups && r < batch; r++) act_rows[r] = a + r * ab;
    #pragma omp parallel
    {
#ifdef X8_KERNELS
    if (groups) { /* every activation row per group, one arithmetic per row */
        #pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < groups; g++) x8_group(w, base, kind, act_rows, nb, batch, g, y, out, bias);
    }
#endif
    #pragma omp for schedule(static)
    for (int64_t o = groups * 8; o < out; o++) {
        const uint8_t *wr = w + o * row_bytes;
        const float bo = bias ? bias[o] : 0.0f;
        int64_t r = 0;
        for (; r + TILE <= batch; r += TILE) {  /* a tile of activation rows per decoded weight block */
            const void *rows[TILE];
            float v[TILE];
            for (int t = 0; t < TILE; t++) rows[t] = a + (r + t) * ab;
            if (kind < 0) flexplan_kq_dot(base, wr, rows, nb, TILE, v);
            else DOTT[kind](wr, (const act_block *const *)rows, nb, v);
            for (int t = 0; t < TILE; t++) y[(r + t) * out + o] = v[t] + bo;
        }
        for (; r < batch; r++) {
            float v;
            dot1_any(base, kind, wr, a + r * ab, nb, &v);
            y[r * out + o] = v + bo;
        }
    }
    }
    free(act_rows);
    free(a);
    return 0;
}

/* A GEMV's units of work: an interleaved matrix's groups of 8 rows, then its rows past them (a plain
 * matrix: its rows); unit u of W [out, nb blocks] with one quantised activation row a into y (+ bias). */
static int64_t gemv_units(int64_t wtype, int64_t out) { return (wtype & X8) ? out / 8 + out % 8 : out; }

static inline void gemv_unit(const uint8_t *w, int64_t wtype, int64_t u, int64_t out, const uint8_t *a, int64_t nb,
                             float *y, const float *bias) {
    const int64_t base = wtype & ~(int64_t)X8, groups = (wtype & X8) ? out / 8 : 0;
    const int kind = kind_of(base);
#ifdef X8_KERNELS
    if (u < groups) {
        const void *row = a;
        x8_group(w, base, kind, &row, nb, 1, u, y, out, bias);
        return;
    }
#endif
    const int64_t o = u - groups + groups * 8;
    float v;
    dot1_any(base, kind, w + o * nb * any_block_bytes(base), a, nb, &v);
    y[o] = v + (bias ? bias[o] : 0.0f);
}

/* n independent GEMVs y_i [out_i] = W_i x_i (+ bias_i, where bias and bias[i] are not NULL) in one
 * parallel region (no fork and no Python call per matrix): a decode step's selected experts, or a
 * token's matrices for the benchmark; any formats mixed. Each x_i is quantised as flexplan_quant_gemm
 * does, then each matrix's rows are shared out without a barrier between matrices; every y_i equals
 * flexplan_quant_gemm's for batch 1 bit for bit.
 * Returns 0, 1 for an unknown type or an in not a multiple of the block, 2 out of memory. */
int flexplan_quant_gemv_list(int64_t n, const uint8_t *const *w, const int64_t *wtype, const float *const *x,
                             float *const *y, const int64_t *out, const int64_t *in, const float *const *bias) {
    int64_t *start = (int64_t *)malloc((size_t)(n + 1) * sizeof(int64_t));  /* byte offsets of each x_i's blocks */
    if (!start) return 2;
    start[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t qk = weights_per_block(wtype[i]);
        if (!qk || in[i] % qk || out[i] < 0) { free(start); return 1; }
        start[i + 1] = start[i] + in[i] / qk * act_bytes(wtype[i] & ~(int64_t)X8);
    }
    uint8_t *a = (uint8_t *)malloc((size_t)(start[n] + 1));
    if (!a) { free(start); return 2; }
    #pragma omp parallel
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; i++)
            quantize_any(wtype[i] & ~(int64_t)X8, x[i], a + start[i], in[i] / weights_per_block(wtype[i]));
        for (int64_t i = 0; i < n; i++) {
            const int64_t nb = in[i] / weights_per_block(wtype[i]);
            #pragma omp for schedule(static) nowait
            for (int64_t u = 0; u < gemv_units(wtype[i], out[i]); u++)
                gemv_unit(w[i], wtype[i], u, out[i], a + start[i], nb, y[i], bias ? bias[i] : NULL);
        }
    }
    free(a);
    free(start);
    return 0;
}

/* n GEMVs on ONE input x [in]: y_i [out_i] = W_i x (+ bias_i), any formats mixed (q/k/v of a layer,
 * or gate/up), in one parallel region: x quantised once per activation kind (the 32-blocks' or the
 * K-quants'), the rows of all matrices shared out in one loop (no fork and join per matrix). Each
 * y_i equals flexplan_quant_gemm's for batch 1 bit for bit. Returns 0, 1 for an unknown type, an in
 * not a multiple of a block or n outside 1..SHARED_MAX, 2 out of memory. */
#define SHARED_MAX 8 /* matrices one shared-input call takes (a layer's q/k/v: 3) */
int flexplan_quant_gemv_shared(int64_t n, const uint8_t *const *w, const int64_t *wtype, const float *x, int64_t in,
                               float *const *y, const float *const *bias, const int64_t *out) {
    int64_t need_q = 0, need_k = 0;
    if (n < 1 || n > SHARED_MAX) return 1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t qk = weights_per_block(wtype[i]);
        if (!qk || in % qk || out[i] < 0) return 1;
        if (is_k(wtype[i] & ~(int64_t)X8)) need_k = 1; else need_q = 1;
    }
    const int64_t nq = in / QK, nk = in / QK_K;
    uint8_t *aq = need_q ? (uint8_t *)malloc((size_t)(nq * (int64_t)sizeof(act_block))) : NULL;
    uint8_t *ak = need_k ? (uint8_t *)malloc((size_t)(nk * flexplan_kq_act_bytes())) : NULL;
    if ((need_q && !aq) || (need_k && !ak)) { free(aq); free(ak); return 2; }
    if (aq) quantize_act(x, (act_block *)aq, nq);
    if (ak) flexplan_kq_quantize_act(x, ak, nk);
    /* each matrix's kernel, blocks per row, row bytes and quantised input: found once, not per row */
    int64_t nb[SHARED_MAX], units[SHARED_MAX], total = 0;
    const uint8_t *act[SHARED_MAX];
    for (int64_t i = 0; i < n; i++) {
        const int k = is_k(wtype[i] & ~(int64_t)X8);
        nb[i] = k ? nk : nq;
        act[i] = k ? ak : aq;
        units[i] = gemv_units(wtype[i], out[i]);
        total += units[i];
    }
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < total; r++) {
        int64_t i = 0, u = r;
        while (u >= units[i]) u -= units[i++];  /* n is 2 or 3: a scan beats a search */
        gemv_unit(w[i], wtype[i], u, out[i], act[i], nb[i], y[i], bias[i]);
    }
    free(aq);
    free(ak);
    return 0;
}
