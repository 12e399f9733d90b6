/* flexplan's kernels on GGUF's K-quant super-blocks (256 weights; ggml-common.h's layouts), read
 * as the file holds them. quant_gemv.c holds the entry points and the threads; this file holds,
 * per super-block, the activation quantisation, the integer dots and the exact dequantisation.
 *   Q4_K (type 12, 144 B): fp16 d, fp16 dmin, scales[12] (8 6-bit scales sc, 8 6-bit mins m),
 *                          qs[128] (4 chunks of 32 bytes: low nibbles sub-block 2c, high 2c+1);
 *                          w = d sc_j q - dmin m_j on sub-block j (32 weights)
 *   Q5_K (type 13, 176 B): Q4_K plus qh[32] before qs: bit j of qh[i] is the 5th bit of weight i of
 *                          sub-block j
 *   Q6_K (type 14, 210 B): ql[128], qh[64], int8 scales[16], fp16 d; w = d sc_g (q - 32) on group g
 *                          (16 weights); of a half h (128 weights), weight 64s + i (i < 64) has its
 *                          low 4 bits in ql[64h + i] >> 4s, weight 32k + i (i < 32) its high 2 in
 *                          qh[32h + i] >> 2k
 *
 * The activation is quantised per 256-block as llama.cpp's Q8_K (float d, 256 int8, int16 sums of
 * each 16), with the rule of quant_gemv.c's 32-blocks (d = max|x| / 127, q = roundf(x / d)) so
 * one model of the arithmetic serves both. Each super-block decodes to unsigned bytes u (Q4_K
 * 0..15, Q5_K 0..31, Q6_K 0..63), a scale per 16 weights s_g and an offset per 16 weights o_g:
 *   block . x = d_w d_x sum_g s_g sum_{i in g} u_i q_i - c_w d_x sum_g o_g bsum_g
 * with o_g = m_j, c_w = dmin (Q4_K, Q5_K: the mins) and o_g = s_g, c_w = 32 d (Q6_K: the -32).
 * Both sums are exact in int32 (the first |.| < 2^28: 16 groups * 128 * 16 * 63 * 127; the second
 * < 2^22); the float32 scaling after them rounds a few times a super-block. AVX2: maddubs (u q pairs
 * into int16: |.| <= 2 * 63 * 127, no saturation) then madd with s_g; the same code on AVX-512 /
 * VNNI machines (a dpbusd would need a 32-bit multiply for s_g: no fewer operations). Portable C
 * otherwise. The batched kernel decodes a super-block once for T activation rows.
 *
 * Dequantisation repeats gguf's reference (gguf/quants.py) in float32: d * sc and dmin * m exact
 * (at most 18 significant bits), (d sc) * q exact (at most 24 bits), then one rounding for - dmin m:
 * bit for bit whether or not the compiler fuses. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KQ_AVX2 1
#endif

#define QK_K 256
#define TYPE_Q4_K 12
#define TYPE_Q5_K 13
#define TYPE_Q6_K 14

typedef struct { /* llama.cpp's block_q8_K: one quantised 256-block of activation */
    float d;             /* x ~= d * q */
    int16_t bsums[16];   /* the sum of each 16 q: the mins' and Q6_K's -32 terms without touching q */
    int8_t qs[QK_K];
} act_k;

float flexplan_quant_fp16(const uint8_t *p); /* quant_gemv.c: exact fp16 to float32 */
float flexplan_quant_absmax(const float *x, int64_t n);  /* quant_gemv.c: the int8 activation's steps */
int32_t flexplan_quant_round_act(const float *x, float id, int8_t *q, int64_t n, int16_t *sums16);

static inline float f16(const uint8_t *p) {
#if defined(__F16C__)
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
#else
    return flexplan_quant_fp16(p);
#endif
}

int64_t flexplan_kq_block_bytes(int64_t wtype) {
    return wtype == TYPE_Q4_K ? 144 : wtype == TYPE_Q5_K ? 176 : wtype == TYPE_Q6_K ? 210 : 0;
}

int64_t flexplan_kq_act_bytes(void) { return (int64_t)sizeof(act_k); }

void flexplan_kq_quantize_act(const float *x, void *out, int64_t nb) {
    act_k *a = (act_k *)out;
    for (int64_t b = 0; b < nb; b++) {  /* quant_gemv.c's two steps, the sums per 16 kept */
        const float *v = x + b * QK_K;
        /* llama.cpp's quantize_row_q8_K_ref: iscale = -127 / max, d = 1 / iscale; with |iscale| = 127 / max|x|
         * in one rounding and ties to even, d q is the same product with the signs of both flipped */
        const float amax = flexplan_quant_absmax(v, QK_K), id = amax != 0.0f ? 127.0f / amax : 0.0f;
        flexplan_quant_round_act(v, id, a[b].qs, QK_K, a[b].bsums);
        a[b].d = amax != 0.0f ? 1.0f / id : 0.0f;
    }
}

/* Q4_K / Q5_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4) */
static inline void scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* The unsigned value u of weight i (0..255) of a super-block: the portable decode and the exact
 * dequantisation read it here. */
static inline int weight_u(const uint8_t *blk, int64_t wtype, int i) {
    if (wtype == TYPE_Q6_K) {
        const int h = i / 128, r = i % 128;
        const int lo = (blk[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
        const int hi = (blk[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
        return lo | (hi << 4);
    }
    const int j = i / 32, k = i % 32;
    const uint8_t *qs = blk + (wtype == TYPE_Q5_K ? 48 : 16);
    int u = (qs[32 * (j / 2) + k] >> (4 * (j % 2))) & 0x0F;
    if (wtype == TYPE_Q5_K) u |= ((blk[16 + k] >> j) & 1) << 4;
    return u;
}

/* ---- dots of one weight row with T activation rows --------------------------------------------- */
#ifdef KQ_AVX2
/* Q4_K / Q5_K's 12 scale bytes as 8 scales then 8 mins, one byte each (ggml's utmp shuffle of scale_min) */
static inline __m128i scales_mins_k4(const uint8_t *q) {
    uint32_t t[4];
    memcpy(t, q, 12);
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    t[3] = ((t[2] >> 4) & m4) | (((t[1] >> 6) & m2) << 4);
    const uint32_t mins_lo = t[1] & m6;
    t[1] = (t[2] & m4) | (((t[0] >> 6) & m2) << 4);
    t[2] = mins_lo;
    t[0] &= m6;
    return _mm_set_epi32((int)t[3], (int)t[2], (int)t[1], (int)t[0]);
}

/* One super-block decoded: u[k] the unsigned values of weights 32k..32k+31; sv[k] their scales as
 * int16 lanes (0-7: weights 32k..32k+15, 8-15: the next 16); ov the 16 offsets o_g; dw, cw. */
typedef struct { __m256i u[8], sv[8], ov; float dw, cw; } decoded;

static inline __attribute__((always_inline)) void decode(const uint8_t *blk, int64_t wtype, decoded *D) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (wtype == TYPE_Q6_K) {
        for (int h = 0; h < 2; h++) {
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i b2 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            /* 16-bit shifts move no bit across a byte once masked */
            D->u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(b1, m4),
                                              _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(3)), 4));
            D->u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(b2, m4),
                                              _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(12)), 2));
            D->u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4),
                                              _mm256_and_si256(hb, _mm256_set1_epi8(48)));
            D->u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4),
                                              _mm256_srli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8((char)0xC0)), 2));
        }
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));  /* 16 int8 scales */
        for (int k = 0; k < 8; k++)  /* bytes 0-7 scale 2k, 8-15 scale 2k + 1, widened */
            D->sv[k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, _mm_set_epi64x(0x0101010101010101LL * (2 * k + 1),
                                                                                0x0101010101010101LL * (2 * k))));
        D->ov = _mm256_cvtepi8_epi16(sc);
        D->dw = f16(blk + 208);
        D->cw = 32.0f * D->dw;
        return;
    }
    const __m128i sm = scales_mins_k4(blk + 4);                  /* 8 scales, 8 mins */
    const __m256i s16 = _mm256_cvtepu8_epi16(sm);                /* as int16: lanes 0-7 scales, 8-15 mins */
    const __m256i scales = _mm256_permute2x128_si256(s16, s16, 0x00);  /* scales in both halves */
    for (int k = 0; k < 8; k++)  /* every lane: scale k (bytes 2k, 2k + 1 of a half) */
        D->sv[k] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((2 * k + 1) << 8 | 2 * k)));
    const __m128i mins = _mm256_extracti128_si256(s16, 1);
    D->ov = _mm256_set_m128i(_mm_unpackhi_epi16(mins, mins), _mm_unpacklo_epi16(mins, mins));  /* o_g = m_{g/2} */
    D->dw = f16(blk);
    D->cw = f16(blk + 2);
    const uint8_t *qs = blk + (wtype == TYPE_Q5_K ? 48 : 16);
    for (int c = 0; c < 4; c++) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        D->u[2 * c] = _mm256_and_si256(bits, m4);
        D->u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
    }
    if (wtype == TYPE_Q5_K) {  /* bit j of each qh byte to bit 4 of sub-block j's byte */
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 16));
        for (int j = 0; j < 8; j++) {
            const __m256i b = _mm256_and_si256(hb, _mm256_set1_epi8((char)(1 << j)));
            D->u[j] = _mm256_or_si256(D->u[j], j < 4 ? _mm256_slli_epi16(b, 4 - j) : _mm256_srli_epi16(b, j - 4));
        }
    }
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __attribute__((always_inline)) void dot_rows(int64_t wtype, const uint8_t *w, const act_k *const *a,
                                                           int64_t nb, int T, float *out) {
    const int64_t bb = flexplan_kq_block_bytes(wtype);
    __m256 acc[4];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    if (T == 1) /* a thread's rows are contiguous: fetch the stream 4 KB ahead of this row (as quant_gemv.c) */
        for (int64_t off = 0; off < nb * bb; off += 64) _mm_prefetch((const char *)w + 4096 + off, _MM_HINT_T0);
    for (int64_t b = 0; b < nb; b++) {
        decoded D;
        decode(w + b * bb, wtype, &D);
        for (int t = 0; t < T; t++) {
            const act_k *x = &a[t][b];
            __m256i sumi = _mm256_setzero_si256();
            for (int k = 0; k < 8; k++) {
                const __m256i p = _mm256_maddubs_epi16(D.u[k], _mm256_loadu_si256((const __m256i *)(x->qs + 32 * k)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, D.sv[k]));
            }
            const __m256i off = _mm256_madd_epi16(D.ov, _mm256_loadu_si256((const __m256i *)x->bsums));
            if (wtype == TYPE_Q6_K)  /* cw = 32 dw: the offset subtracted in integers, exact */
                sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(off, 5));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(D.dw * x->d), _mm256_cvtepi32_ps(sumi), acc[t]);
            if (wtype != TYPE_Q6_K)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(-D.cw * x->d), _mm256_cvtepi32_ps(off), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) out[t] = hsum8(acc[t]);
}
#else
/* The portable path's super-block scales: s[16] per 16 weights, o[16] offsets, dw and cw as in the header. */
static inline void superblock_scales(const uint8_t *blk, int64_t wtype, int16_t *s, int16_t *o, float *dw,
                                     float *cw) {
    if (wtype == TYPE_Q6_K) {
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int g = 0; g < 16; g++) s[g] = o[g] = sc[g];
        *dw = f16(blk + 208);
        *cw = 32.0f * *dw;  /* exact: a power of two */
        return;
    }
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min(blk + 4, j, &sc, &m);
        s[2 * j] = s[2 * j + 1] = (int16_t)sc;
        o[2 * j] = o[2 * j + 1] = (int16_t)m;
    }
    *dw = f16(blk);
    *cw = f16(blk + 2);
}

static inline void dot_rows(int64_t wtype, const uint8_t *w, const act_k *const *a, int64_t nb, int T, float *out) {
    const int64_t bb = flexplan_kq_block_bytes(wtype);
    for (int t = 0; t < T; t++) out[t] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        int16_t s[16], o[16];
        float dw, cw;
        superblock_scales(blk, wtype, s, o, &dw, &cw);
        uint8_t u[QK_K];
        for (int i = 0; i < QK_K; i++) u[i] = (uint8_t)weight_u(blk, wtype, i);
        for (int t = 0; t < T; t++) {
            const act_k *x = &a[t][b];
            int32_t sumi = 0, off = 0;
            for (int g = 0; g < 16; g++) {
                int32_t sg = 0;
                for (int i = 16 * g; i < 16 * g + 16; i++) sg += (int32_t)u[i] * x->qs[i];
                sumi += s[g] * sg;
                off += o[g] * x->bsums[g];
            }
            out[t] += dw * x->d * (float)sumi - cw * x->d * (float)off;
        }
    }
}
#endif

/* the instances: T = 1 (the GEMV) and T = 4 (a tile of prefill rows), per type, branches folded */
#define KQ_INSTANCE(TYPE)                                                                              \
    static void dot1_##TYPE(const uint8_t *w, const act_k *const *a, int64_t nb, float *o) {            \
        dot_rows(TYPE, w, a, nb, 1, o);                                                                  \
    }                                                                                                    \
    static void dot4_##TYPE(const uint8_t *w, const act_k *const *a, int64_t nb, float *o) {            \
        dot_rows(TYPE, w, a, nb, 4, o);                                                                  \
    }
KQ_INSTANCE(TYPE_Q4_K)
KQ_INSTANCE(TYPE_Q5_K)
KQ_INSTANCE(TYPE_Q6_K)

/* out[t] = row w . activation rows a[t] (nb super-blocks each), t < T; T is 1 or 4. */
void flexplan_kq_dot(int64_t wtype, const uint8_t *w, const void *const *a, int64_t nb, int64_t T, float *out) {
    const act_k *const *rows = (const act_k *const *)a;
    switch (wtype * 8 + T) {
    case TYPE_Q4_K * 8 + 1: dot1_TYPE_Q4_K(w, rows, nb, out); break;
    case TYPE_Q4_K * 8 + 4: dot4_TYPE_Q4_K(w, rows, nb, out); break;
    case TYPE_Q5_K * 8 + 1: dot1_TYPE_Q5_K(w, rows, nb, out); break;
    case TYPE_Q5_K * 8 + 4: dot4_TYPE_Q5_K(w, rows, nb, out); break;
    case TYPE_Q6_K * 8 + 1: dot1_TYPE_Q6_K(w, rows, nb, out); break;
    case TYPE_Q6_K * 8 + 4: dot4_TYPE_Q6_K(w, rows, nb, out); break;
    default: for (int64_t t = 0; t < T; t++) out[t] = NAN;
    }
}

/* ---- exact dequantisation (gguf's reference, bit for bit) ----------------------------------------- */
void flexplan_kq_dequantize_block(int64_t wtype, const uint8_t *blk, float *out) {
    if (wtype == TYPE_Q6_K) {
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = f16(blk + 208);
        for (int g = 0; g < 16; g++) {
            const float ds = d * (float)sc[g];
            for (int i = 16 * g; i < 16 * g + 16; i++) out[i] = ds * (float)(weight_u(blk, wtype, i) - 32);
        }
        return;
    }
    const float d = f16(blk), dmin = f16(blk + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min(blk + 4, j, &sc, &m);
        const float ds = d * (float)sc, dm = dmin * (float)m;
        for (int i = 32 * j; i < 32 * j + 32; i++) {
            volatile float p = ds * (float)weight_u(blk, wtype, i);  /* rounded (exact) before the - dm, as gguf */
            out[i] = p - dm;
        }
    }
}

/* A row of nb super-blocks dotted with float x in double, each weight exactly dequantised. */
double flexplan_kq_dot_float(int64_t wtype, const uint8_t *w, const float *x, int64_t nb) {
    const int64_t bb = flexplan_kq_block_bytes(wtype);
    double acc = 0.0;
    float f[QK_K];
    for (int64_t b = 0; b < nb; b++) {
        flexplan_kq_dequantize_block(wtype, w + b * bb, f);
        for (int i = 0; i < QK_K; i++) acc += (double)f[i] * (double)x[b * QK_K + i];
    }
    return acc;
}
