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

/* ---- the interleaved layout (quant_gemv.c's X8) of the K-quants ----------------------------------
 * Per row the kernel above decodes a super-block's scales for its one row and ends its sums in a
 * horizontal add: on AVX2 that work, not memory, bounds it. Interleaved, 8 rows' super-block b lie in
 * one run, the 8 rows' integer sums end as the 8 lanes of one vector (rows in X8_LANE_ROW order) and
 * one convert and multiply-add scale them all (llama.cpp's q4_K 8x8 repack likewise). The run is a
 * permutation of the 8 blocks' bytes (a GPU undoes it with an index, flexplan.quant.interleave):
 *   Q4_K / Q5_K: the 8 rows' fp16 d in lane order, their fp16 dmin likewise, their 12 scale bytes in
 *                row order, (Q5_K) qh runs (p, h), then qs runs (c, p, h): bytes 32c + 8p .. + 7 of
 *                rows 4h .. 4h + 3 (c: a pair of sub-blocks, p < 4: 8 weights of each);
 *   Q6_K:        the fp16 d in lane order, the 16 int8 scales of each row in row order, then per
 *                (half hh, p, h) three runs: ql bytes 64hh + 8p .., ql bytes 64hh + 32 + 8p .., qh
 *                bytes 32hh + 8p .. of rows 4h .. 4h + 3.
 * A run of 32 bytes is 8 weights of each of 4 rows: one activation broadcast of 8 bytes meets all
 * four, maddubs sums pairs into int16 (a sub-block's four runs: |.| <= 4 * 2 * 31 * 127, Q6_K's two:
 * 2 * 2 * 63 * 127), madd with each row's scale puts them in int32 (the exact sums of the header),
 * the mins' (Q6_K: the -32's) sums per row come from the activation's bsums. A row's result does not
 * depend on the other activation rows of the call (the same operations for every tile width). */
#if defined(KQ_AVX2) && defined(__F16C__)
#define KQ_X8 1
static const int KQ_LANE_ROW[8] = {0, 1, 4, 5, 2, 3, 6, 7}; /* quant_gemv.c's X8_LANE_ROW */
#ifndef KQ_X8_PREFETCH_BYTES
#define KQ_X8_PREFETCH_BYTES 1024
#endif
#endif

int flexplan_kq_x8_kernels(void) {
#ifdef KQ_X8
    return 1;
#else
    return 0;
#endif
}

/* src[j] = which byte of a group's 8 blocks b laid end to end (row r's at r * bb) byte j of the run
 * holds; returns the run's length, or 0 where this build has no interleaved kernel for wtype. */
int64_t flexplan_kq_x8_layout(int64_t wtype, int32_t *src) {
#ifdef KQ_X8
    const int bb = (int)flexplan_kq_block_bytes(wtype);
    if (!bb) return 0;
    int j = 0;
    const int d_at = wtype == TYPE_Q6_K ? 208 : 0;
    for (int f = 0; f < (wtype == TYPE_Q6_K ? 1 : 2); f++)  /* d (then dmin) of the 8 rows, in lane order */
        for (int l = 0; l < 8; l++) { src[j++] = KQ_LANE_ROW[l] * bb + d_at + 2 * f; src[j++] = KQ_LANE_ROW[l] * bb + d_at + 2 * f + 1; }
    const int sc_at = wtype == TYPE_Q6_K ? 192 : 4, sc_n = wtype == TYPE_Q6_K ? 16 : 12;
    for (int r = 0; r < 8; r++)
        for (int k = 0; k < sc_n; k++) src[j++] = r * bb + sc_at + k;
    if (wtype == TYPE_Q6_K) {
        for (int hh = 0; hh < 2; hh++)
            for (int p = 0; p < 4; p++)
                for (int h = 0; h < 2; h++)
                    for (int part = 0; part < 3; part++) {  /* ql low half, ql high half, qh */
                        const int at = part == 2 ? 128 + 32 * hh + 8 * p : 64 * hh + 32 * part + 8 * p;
                        for (int r = 4 * h; r < 4 * h + 4; r++)
                            for (int k = 0; k < 8; k++) src[j++] = r * bb + at + k;
                    }
        return j;
    }
    if (wtype == TYPE_Q5_K)
        for (int p = 0; p < 4; p++)
            for (int h = 0; h < 2; h++)
                for (int r = 4 * h; r < 4 * h + 4; r++)
                    for (int k = 0; k < 8; k++) src[j++] = r * bb + 16 + 8 * p + k;
    const int qs = wtype == TYPE_Q5_K ? 48 : 16;
    for (int c = 0; c < 4; c++)
        for (int p = 0; p < 4; p++)
            for (int h = 0; h < 2; h++)
                for (int r = 4 * h; r < 4 * h + 4; r++)
                    for (int k = 0; k < 8; k++) src[j++] = r * bb + qs + 32 * c + 8 * p + k;
    return j;
#else
    (void)wtype;
    (void)src;
    return 0;
#endif
}

#ifdef KQ_X8
/* 16-bit lane i of a 128-bit half takes byte j of its row's 8 (lanes 0-3: the half's first row, 4-7:
 * its second): into the low byte (unsigned 6-bit scales) or the high byte (Q6_K's int8, then >> 8);
 * a table, not built per use (a shuffle control from a run-time j costs more than the shuffle) */
#define PICK_LO(j) {j, 0x80, j, 0x80, j, 0x80, j, 0x80, 8 + j, 0x80, 8 + j, 0x80, 8 + j, 0x80, 8 + j, 0x80}
#define PICK_HI(j) {0x80, j, 0x80, j, 0x80, j, 0x80, j, 0x80, 8 + j, 0x80, 8 + j, 0x80, 8 + j, 0x80, 8 + j}
static const uint8_t SCALE_PICK[2][8][16] = {
    {PICK_LO(0), PICK_LO(1), PICK_LO(2), PICK_LO(3), PICK_LO(4), PICK_LO(5), PICK_LO(6), PICK_LO(7)},
    {PICK_HI(0), PICK_HI(1), PICK_HI(2), PICK_HI(3), PICK_HI(4), PICK_HI(5), PICK_HI(6), PICK_HI(7)}};
static inline __m256i scale_pick(int j, int high) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)SCALE_PICK[high][j]));
}

/* per-row int32 sums v[s] (8 lanes each) of slots s = rows 0, 1, 4, 5, 2, 3, 6, 7: one lane per row in X8_LANE_ROW order */
static inline __m256i lanes_of_rows(const __m256i *v) {
    __m128i half[2];
    for (int k = 0; k < 2; k++) {
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4 * k], v[4 * k + 1]), _mm256_hadd_epi32(v[4 * k + 2], v[4 * k + 3]));
        half[k] = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    }
    return _mm256_set_m128i(half[1], half[0]);
}

/* scales_mins_k4 of two rows' 12 bytes at once (row p in the low 128-bit lane, q in the high), in
 * vector ops: each lane's bytes 0-7 the scales, 8-15 the mins. Reads 4 bytes past each row's 12
 * (within the run: the qs follow). */
static inline __m256i scales_mins_k4x2(const uint8_t *p, const uint8_t *q) {
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                              _mm_loadu_si128((const __m128i *)q), 1);
    /* low bits: sc_j = q_j & 63, sc_4+j = q_8+j & 15, m_j = q_4+j & 63, m_4+j = q_8+j >> 4 (j < 4) */
    const __m256i lo_src = _mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11)));
    const __m256i lo = _mm256_or_si256(
        _mm256_and_si256(lo_src, _mm256_broadcastsi128_si256(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0))),
        _mm256_and_si256(_mm256_srli_epi16(lo_src, 4), _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15))));
    /* high bits 4-5 of sc_4+j and m_4+j: bits 6-7 of q_j and q_4+j */
    const __m256i hi_src = _mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(_mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7)));
    return _mm256_or_si256(lo, _mm256_and_si256(_mm256_srli_epi16(hi_src, 2), _mm256_set1_epi8(0x30)));
}

/* one group's 8 rows with T activation rows (1, 2 or 4): out[8t + row] */
static inline __attribute__((always_inline)) void x8_dot_k(const uint8_t *w, int64_t wtype, const act_k *const *a,
                                                           int64_t nb, int T, float *out) {
    const int64_t run = 8 * flexplan_kq_block_bytes(wtype);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[4], ex[4];
    for (int t = 0; t < T; t++) acc[t] = ex[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * run;
        for (int64_t p = 0; p < run; p += 64) _mm_prefetch((const char *)blk + KQ_X8_PREFETCH_BYTES + p, _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256i s[4][2], off[4];
        for (int t = 0; t < T; t++) s[t][0] = s[t][1] = _mm256_setzero_si256();
        if (wtype == TYPE_Q6_K) {
            const uint8_t *sc = blk + 16, *runs = blk + 16 + 128;
            __m256i S[2][2];  /* [h][scales 0-7 / 8-15] of rows 4h .. 4h + 3 in its 64-bit lanes */
            for (int h = 0; h < 2; h++) {
                const __m256i r01 = _mm256_loadu_si256((const __m256i *)(sc + 64 * h)),
                              r23 = _mm256_loadu_si256((const __m256i *)(sc + 64 * h + 32));
                /* unpack gives rows 0, 2, 1, 3 in the 64-bit lanes: the permute puts them in order */
                S[h][0] = _mm256_permute4x64_epi64(_mm256_unpacklo_epi64(r01, r23), 0xD8);
                S[h][1] = _mm256_permute4x64_epi64(_mm256_unpackhi_epi64(r01, r23), 0xD8);
            }
            for (int hh = 0; hh < 2; hh++)
                for (int h = 0; h < 2; h++)
                    for (int e = 0; e < 2; e++) {  /* groups 8hh + 2q + e: runs p = 2e, 2e + 1 */
                        __m256i u[2][4];
                        for (int i = 0; i < 2; i++) {
                            const uint8_t *r = runs + (((hh * 4 + 2 * e + i) * 2 + h) * 3) * 32;
                            const __m256i A = _mm256_loadu_si256((const __m256i *)r), B = _mm256_loadu_si256((const __m256i *)(r + 32)),
                                          H = _mm256_loadu_si256((const __m256i *)(r + 64));
                            /* bits 4-5 of each u from its 2 bits of H (16-bit shifts: the mask drops what crosses a byte) */
                            u[i][0] = _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_and_si256(_mm256_slli_epi16(H, 4), m30));
                            u[i][1] = _mm256_or_si256(_mm256_and_si256(B, m4), _mm256_and_si256(_mm256_slli_epi16(H, 2), m30));
                            u[i][2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_and_si256(H, m30));
                            u[i][3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4), _mm256_and_si256(_mm256_srli_epi16(H, 2), m30));
                        }
                        __m256i sv[4];
                        for (int q = 0; q < 4; q++) {
                            const int g = 8 * hh + 2 * q + e;
                            sv[q] = _mm256_srai_epi16(_mm256_shuffle_epi8(S[h][g / 8], scale_pick(g % 8, 1)), 8);
                        }
                        for (int t = 0; t < T; t++) {
                            const int64_t *aq = (const int64_t *)a[t][b].qs;
                            for (int q = 0; q < 4; q++) {
                                const int at = 16 * hh + 4 * q + 2 * e;
                                const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(u[0][q], _mm256_set1_epi64x(aq[at])),
                                                                      _mm256_maddubs_epi16(u[1][q], _mm256_set1_epi64x(aq[at + 1])));
                                s[t][h] = _mm256_add_epi32(s[t][h], _mm256_madd_epi16(pair, sv[q]));
                            }
                        }
                    }
            static const int slot[8] = {0, 1, 4, 5, 2, 3, 6, 7};
            for (int t = 0; t < T; t++) {  /* sum_g sc_g bsum_g per row, for the -32 */
                const __m256i bs = _mm256_loadu_si256((const __m256i *)a[t][b].bsums);
                __m256i v[8];
                for (int k = 0; k < 8; k++)
                    v[k] = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(sc + 16 * slot[k]))), bs);
                off[t] = lanes_of_rows(v);
            }
        } else {
            const uint8_t *scales = blk + 32, *qh = blk + 128, *qs = blk + 128 + (wtype == TYPE_Q5_K ? 256 : 0);
            __m256i S[2], M[4];  /* S[h]: the scales of rows 4h .. 4h + 3 in its 64-bit lanes; M: the mins as int16 of
                                  * rows (0, 2), (1, 3), (4, 6), (5, 7), whose hadds end in X8_LANE_ROW order */
            for (int h = 0; h < 2; h++) {
                const __m256i a02 = scales_mins_k4x2(scales + 12 * (4 * h), scales + 12 * (4 * h + 2));
                const __m256i a13 = scales_mins_k4x2(scales + 12 * (4 * h + 1), scales + 12 * (4 * h + 3));
                S[h] = _mm256_unpacklo_epi64(a02, a13);
                const __m256i mins = _mm256_unpackhi_epi64(a02, a13);
                M[2 * h] = _mm256_unpacklo_epi8(mins, _mm256_setzero_si256());
                M[2 * h + 1] = _mm256_unpackhi_epi8(mins, _mm256_setzero_si256());
            }
            for (int c = 0; c < 4; c++)
                for (int h = 0; h < 2; h++) {
                    __m256i lo[4], hi[4];
                    for (int p = 0; p < 4; p++) {
                        const __m256i r = _mm256_loadu_si256((const __m256i *)(qs + ((c * 4 + p) * 2 + h) * 32));
                        lo[p] = _mm256_and_si256(r, m4);
                        hi[p] = _mm256_and_si256(_mm256_srli_epi16(r, 4), m4);
                        if (wtype == TYPE_Q5_K) {  /* bits 2c and 2c + 1 of each qh byte to bit 4 */
                            const __m256i q5 = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(qh + (p * 2 + h) * 32)), 2 * c);
                            lo[p] = _mm256_or_si256(lo[p], _mm256_and_si256(_mm256_slli_epi16(q5, 4), _mm256_set1_epi8(0x10)));
                            hi[p] = _mm256_or_si256(hi[p], _mm256_and_si256(_mm256_slli_epi16(q5, 3), _mm256_set1_epi8(0x10)));
                        }
                    }
                    const __m256i sv_lo = _mm256_shuffle_epi8(S[h], scale_pick(2 * c, 0));
                    const __m256i sv_hi = _mm256_shuffle_epi8(S[h], scale_pick(2 * c + 1, 0));
                    for (int t = 0; t < T; t++) {
                        const int64_t *aq = (const int64_t *)a[t][b].qs;
                        __m256i tl = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi64x(aq[8 * c]));
                        __m256i th = _mm256_maddubs_epi16(hi[0], _mm256_set1_epi64x(aq[8 * c + 4]));
                        for (int p = 1; p < 4; p++) {
                            tl = _mm256_add_epi16(tl, _mm256_maddubs_epi16(lo[p], _mm256_set1_epi64x(aq[8 * c + p])));
                            th = _mm256_add_epi16(th, _mm256_maddubs_epi16(hi[p], _mm256_set1_epi64x(aq[8 * c + 4 + p])));
                        }
                        s[t][h] = _mm256_add_epi32(s[t][h], _mm256_add_epi32(_mm256_madd_epi16(tl, sv_lo), _mm256_madd_epi16(th, sv_hi)));
                    }
                }
            for (int t = 0; t < T; t++) {  /* sum_j m_j (bsum_2j + bsum_2j+1) per row */
                const __m128i b16 = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)a[t][b].bsums),
                                                   _mm_loadu_si128((const __m128i *)a[t][b].bsums + 1));
                const __m256i bs = _mm256_broadcastsi128_si256(b16);
                off[t] = _mm256_hadd_epi32(_mm256_hadd_epi32(_mm256_madd_epi16(M[0], bs), _mm256_madd_epi16(M[1], bs)),
                                           _mm256_hadd_epi32(_mm256_madd_epi16(M[2], bs), _mm256_madd_epi16(M[3], bs)));
            }
        }
        const __m256 cw = wtype == TYPE_Q6_K ? dw : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        for (int t = 0; t < T; t++) {
            __m256i sum = _mm256_hadd_epi32(s[t][0], s[t][1]);
            const __m256 dx = _mm256_set1_ps(a[t][b].d);
            if (wtype == TYPE_Q6_K)  /* the -32 in integers, exact */
                sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(off[t], 5));
            else
                ex[t] = _mm256_fmadd_ps(_mm256_mul_ps(cw, dx), _mm256_cvtepi32_ps(off[t]), ex[t]);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(sum), acc[t]);
        }
    }
    const __m256i rows = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); /* lanes back to row order */
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out + 8 * t, _mm256_permutevar8x32_ps(_mm256_sub_ps(acc[t], ex[t]), rows));
}

#define KQ_X8_INSTANCE(TYPE)                                                                                        \
    static void x8_##TYPE##_1(const uint8_t *w, const act_k *const *a, int64_t nb, float *o) { x8_dot_k(w, TYPE, a, nb, 1, o); } \
    static void x8_##TYPE##_2(const uint8_t *w, const act_k *const *a, int64_t nb, float *o) { x8_dot_k(w, TYPE, a, nb, 2, o); } \
    static void x8_##TYPE##_4(const uint8_t *w, const act_k *const *a, int64_t nb, float *o) { x8_dot_k(w, TYPE, a, nb, 4, o); }
KQ_X8_INSTANCE(TYPE_Q4_K)
KQ_X8_INSTANCE(TYPE_Q5_K)
KQ_X8_INSTANCE(TYPE_Q6_K)
#endif

/* One interleaved group (its 8 rows' nb super-blocks) with T activation rows a[t] (T 1, 2 or 4):
 * out[8t + row]; NaN where this build or type has no interleaved kernel. */
void flexplan_kq_x8_dot(int64_t wtype, const uint8_t *w, const void *const *a, int64_t nb, int64_t T, float *out) {
#ifdef KQ_X8
    const act_k *const *rows = (const act_k *const *)a;
    switch (wtype * 8 + T) {
    case TYPE_Q4_K * 8 + 1: x8_TYPE_Q4_K_1(w, rows, nb, out); return;
    case TYPE_Q4_K * 8 + 2: x8_TYPE_Q4_K_2(w, rows, nb, out); return;
    case TYPE_Q4_K * 8 + 4: x8_TYPE_Q4_K_4(w, rows, nb, out); return;
    case TYPE_Q5_K * 8 + 1: x8_TYPE_Q5_K_1(w, rows, nb, out); return;
    case TYPE_Q5_K * 8 + 2: x8_TYPE_Q5_K_2(w, rows, nb, out); return;
    case TYPE_Q5_K * 8 + 4: x8_TYPE_Q5_K_4(w, rows, nb, out); return;
    case TYPE_Q6_K * 8 + 1: x8_TYPE_Q6_K_1(w, rows, nb, out); return;
    case TYPE_Q6_K * 8 + 2: x8_TYPE_Q6_K_2(w, rows, nb, out); return;
    case TYPE_Q6_K * 8 + 4: x8_TYPE_Q6_K_4(w, rows, nb, out); return;
    }
#else
    (void)w; (void)a; (void)nb;
#endif
    for (int64_t i = 0; i < 8 * T; i++) out[i] = NAN;
    (void)wtype;
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
