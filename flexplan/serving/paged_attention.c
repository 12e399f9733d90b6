/* flexplan's paged decode attention on the CPU: one query per request against the keys and
 * values its block table names in a paged KV pool (flexplan/serving/kv_blocks.py), read where
 * they lie: no gathered copy of the past (the copy cost twice the attention it fed).
 *
 *   flexplan_paged_decode_f32 / _bf16
 *       q       [n, hq, d] float32; out [n, hq, d] float32
 *       k, v    pool slots: element (slot, h, j) at slot * ss + h * sh + j, slot = block * bs + t;
 *               float32 (_f32) or bfloat16 (_bf16, widened exactly as read)
 *       tables  [n, max_blocks] int64 block ids;  kv_len [n] keys of each request;
 *       kv_lo   [n] first key each request attends (a sliding window's start; 0 for all)
 *   Query head i reads key/value head i / (hq / hk). Returns 0, or -1 when the partials could
 *   not be allocated.
 *
 * The work items are (request, block) pairs, each a partial softmax over its block's keys (the
 * flash-decoding scheme), merged per request afterwards. exp is a Cody-Waite range reduction and
 * Cephes expf's polynomial (relative error near 1e-7), vectorisable.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float exp_neg(float x) { /* exp(x) for x <= 0 */
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } s = {((int32_t)n + 127) << 23};
    return p * s.f;
}

static inline float load_f32(const float* p) { return *p; }
static inline float load_bf16(const uint16_t* p) {
    union { uint32_t i; float f; } u = {(uint32_t)*p << 16};
    return u.f;
}

/* merge the partials (max, sum, unnormalised output) of items lo..hi-1 into out [hq, d] */
static void merge(const float* part, int64_t lo, int64_t hi, int64_t hq, int64_t d, float* out) {
    for (int64_t h = 0; h < hq; h++) {
        float mx = -INFINITY, l = 0.0f;
        for (int64_t it = lo; it < hi; it++) {
            const float m = part[(it * hq + h) * (d + 2)];
            mx = m > mx ? m : mx;
        }
        float* o = out + h * d;
        for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
        if (mx == -INFINITY) continue;
        for (int64_t it = lo; it < hi; it++) {
            const float* p = part + (it * hq + h) * (d + 2);
            if (p[0] == -INFINITY) continue;
            const float w = exp_neg(p[0] - mx);
            l += w * p[1];
#pragma omp simd
            for (int64_t j = 0; j < d; j++) o[j] += w * p[2 + j];
        }
        const float inv = 1.0f / l;
#pragma omp simd
        for (int64_t j = 0; j < d; j++) o[j] *= inv;
    }
}

#define DEFINE_PAGED_DECODE(SUFFIX, KT)                                                                       \
int flexplan_paged_decode_##SUFFIX(const float* q, const KT* k, const KT* v, const int64_t* tables,          \
                                   int64_t max_blocks, const int64_t* kv_len, const int64_t* kv_lo,          \
                                   float* out, int64_t n, int64_t hq, int64_t hk, int64_t d, int64_t bs,     \
                                   int64_t ss, int64_t sh, float scale) {                                     \
    int64_t* first = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n + 1));                                    \
    if (!first) return -1;                                                                                    \
    first[0] = 0;                                                                                             \
    for (int64_t r = 0; r < n; r++) first[r + 1] = first[r] + (kv_len[r] + bs - 1) / bs;                      \
    const int64_t items = first[n], group = hq / hk;                                                          \
    float* part = (float*)malloc(sizeof(float) * (size_t)(items * hq * (d + 2) + 1));                         \
    int64_t* owner = (int64_t*)malloc(sizeof(int64_t) * (size_t)(items + 1));                                 \
    if (!part || !owner) {                                                                                    \
        free(first), free(part), free(owner);                                                                 \
        return -1;                                                                                            \
    }                                                                                                         \
    for (int64_t r = 0; r < n; r++)                                                                           \
        for (int64_t it = first[r]; it < first[r + 1]; it++) owner[it] = r;                                   \
    _Pragma("omp parallel for schedule(dynamic, 4)")                                                          \
        for (int64_t it = 0; it < items; it++) {                                                              \
            float s[bs]; /* one block's scores: bs is a page (16 by default), on the stack */                  \
            const int64_t r = owner[it], c = it - first[r];                                                   \
            const int64_t t0 = c * bs, t1 = t0 + bs < kv_len[r] ? t0 + bs : kv_len[r];                        \
            const int64_t i0 = kv_lo[r] > t0 ? kv_lo[r] - t0 : 0, cnt = t1 - t0;                              \
            const int64_t base = tables[r * max_blocks + c] * bs * ss;                                        \
            for (int64_t h = 0; h < hq; h++) {                                                                \
                float* p = part + (it * hq + h) * (d + 2);                                                    \
                float* o = p + 2;                                                                             \
                for (int64_t j = 0; j < d; j++) o[j] = 0.0f;                                                  \
                if (i0 >= cnt) {                                                                        \
                    p[0] = -INFINITY, p[1] = 0.0f;                                                            \
                    continue;                                                                                 \
                }                                                                                             \
                const float* qh = q + (r * hq + h) * d;                                                       \
                const KT* kh = k + base + (h / group) * sh;                                                   \
                const KT* vh = v + base + (h / group) * sh;                                                   \
                float mx = -INFINITY, l = 0.0f;                                                               \
                for (int64_t i = i0; i < cnt; i++) {                                                          \
                    const KT* kt = kh + i * ss;                                                               \
                    float acc = 0.0f;                                                                         \
                    _Pragma("omp simd reduction(+ : acc)")                                                    \
                    for (int64_t j = 0; j < d; j++) acc += qh[j] * load_##SUFFIX(kt + j);                     \
                    s[i] = acc * scale;                                                                       \
                    mx = s[i] > mx ? s[i] : mx;                                                               \
                }                                                                                             \
                for (int64_t i = i0; i < cnt; i++) {                                                          \
                    s[i] = exp_neg(s[i] - mx);                                                                \
                    l += s[i];                                                                                \
                }                                                                                             \
                for (int64_t i = i0; i < cnt; i++) {                                                          \
                    const KT* vt = vh + i * ss;                                                               \
                    const float w = s[i];                                                                     \
                    _Pragma("omp simd")                                                                       \
                    for (int64_t j = 0; j < d; j++) o[j] += w * load_##SUFFIX(vt + j);                        \
                }                                                                                             \
                p[0] = mx, p[1] = l;                                                                          \
            }                                                                                                 \
        }                                                                                                     \
    _Pragma("omp parallel for schedule(static)")                                                              \
    for (int64_t r = 0; r < n; r++) merge(part, first[r], first[r + 1], hq, d, out + r * hq * d);             \
    free(first), free(part), free(owner);                                                                     \
    return 0;                                                                                                 \
}

DEFINE_PAGED_DECODE(f32, float)
DEFINE_PAGED_DECODE(bf16, uint16_t)
