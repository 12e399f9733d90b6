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

/* One register of floats (GCC/Clang vector extensions): 16 with AVX-512, 8 with AVX, else 4; a
 * head's d floats as d / LANES of them. aligned(4): unaligned loads and stores. */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define MAX_DV 16 /* registers a head's q or output takes at most on the vector path (d <= 16 LANES) */
typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t u16xl __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t u32xl __attribute__((vector_size(LANES * 4)));

static inline vf loadv_f32(const float* p) { return *(const vf*)p; }
static inline vf loadv_bf16(const uint16_t* p) { /* LANES bfloat16 widened exactly in a register */
    const u32xl w = __builtin_convertvector(*(const u16xl*)p, u32xl) << 16;
    vf f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline float hsum(vf a) { /* halves folded pairwise, then the last lanes */
    float s[LANES];
    memcpy(s, &a, sizeof s);
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) s[i] += s[i + w];
    return s[0];
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

/* One head's partial softmax over keys [i0, cnt) of a block on the vector path (d = NV LANES):
 * scores into s, the unnormalised output into o (d floats); returns the max score, *l the sum of
 * e^(score - max). q is held in NV registers; a dot is NV multiply-adds into two registers, folded
 * once; the output's NV registers take each value row's multiple and are stored once. NV a constant
 * per instance: a run-time count left the loops compare-and-branch at every step and q on the stack. */
#define DEFINE_HEAD_VECTOR(SUFFIX, KT, NAME, NV)                                                              \
static inline float NAME(const float* qh, const KT* kh, const KT* vh, int64_t i0, int64_t cnt, int64_t ss,    \
                         int64_t nv, float scale, float* s, float* o, float* l) {                             \
    const int64_t n_v = (NV) ? (NV) : nv;                                                                     \
    vf qv[MAX_DV];                                                                                            \
    for (int64_t j = 0; j < n_v; j++) qv[j] = loadv_f32(qh + j * LANES);                                     \
    float mx = -INFINITY;                                                                                     \
    for (int64_t i = i0; i < cnt; i++) {                                                                      \
        const KT* kt = kh + i * ss;                                                                           \
        vf a = {0}, b = {0};                                                                                  \
        int64_t j = 0;                                                                                        \
        for (; j + 2 <= n_v; j += 2) {                                                                        \
            a += qv[j] * loadv_##SUFFIX(kt + j * LANES);                                                      \
            b += qv[j + 1] * loadv_##SUFFIX(kt + (j + 1) * LANES);                                            \
        }                                                                                                     \
        if (j < n_v) a += qv[j] * loadv_##SUFFIX(kt + j * LANES);                                             \
        s[i] = hsum(a + b) * scale;                                                                           \
        mx = s[i] > mx ? s[i] : mx;                                                                           \
    }                                                                                                         \
    /* the exponentials in a loop of their own: with the sum in it, whose order must stay, GCC left it scalar */ \
    for (int64_t i = i0; i < cnt; i++) s[i] = exp_neg(s[i] - mx);                                             \
    float sum = 0.0f;                                                                                         \
    for (int64_t i = i0; i < cnt; i++) sum += s[i];                                                           \
    vf acc[MAX_DV];                                                                                           \
    for (int64_t j = 0; j < n_v; j++) acc[j] = (vf){0};                                                       \
    for (int64_t i = i0; i < cnt; i++) {                                                                      \
        const KT* vt = vh + i * ss;                                                                           \
        const float w = s[i];                                                                                 \
        for (int64_t j = 0; j < n_v; j++) acc[j] += w * loadv_##SUFFIX(vt + j * LANES);                      \
    }                                                                                                         \
    for (int64_t j = 0; j < n_v; j++) memcpy(o + j * LANES, &acc[j], sizeof(vf));                            \
    *l = sum;                                                                                                 \
    return mx;                                                                                                \
}

/* head dims 64 and 128 (most models') with the loops unrolled; any other multiple of LANES by count */
DEFINE_HEAD_VECTOR(f32, float, head_f32_64, 64 / LANES)
DEFINE_HEAD_VECTOR(f32, float, head_f32_128, 128 / LANES)
DEFINE_HEAD_VECTOR(f32, float, head_f32_any, 0)
DEFINE_HEAD_VECTOR(bf16, uint16_t, head_bf16_64, 64 / LANES)
DEFINE_HEAD_VECTOR(bf16, uint16_t, head_bf16_128, 128 / LANES)
DEFINE_HEAD_VECTOR(bf16, uint16_t, head_bf16_any, 0)

#define DEFINE_HEAD_DISPATCH(SUFFIX, KT)                                                                      \
static inline float head_vector_##SUFFIX(const float* qh, const KT* kh, const KT* vh, int64_t i0, int64_t cnt, \
                                         int64_t ss, int64_t nv, float scale, float* s, float* o, float* l) { \
    if (nv == 64 / LANES) return head_##SUFFIX##_64(qh, kh, vh, i0, cnt, ss, nv, scale, s, o, l);             \
    if (nv == 128 / LANES) return head_##SUFFIX##_128(qh, kh, vh, i0, cnt, ss, nv, scale, s, o, l);           \
    return head_##SUFFIX##_any(qh, kh, vh, i0, cnt, ss, nv, scale, s, o, l);                                  \
}

DEFINE_HEAD_DISPATCH(f32, float)
DEFINE_HEAD_DISPATCH(bf16, uint16_t)

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
    const int vector = d % LANES == 0 && d / LANES <= MAX_DV;                                                 \
    _Pragma("omp parallel for schedule(dynamic, 4)")                                                          \
        for (int64_t it = 0; it < items; it++) {                                                              \
            float s[bs]; /* one block's scores: bs is a page (16 by default), on the stack */                  \
            const int64_t r = owner[it], c = it - first[r];                                                   \
            const int64_t t0 = c * bs, t1 = t0 + bs < kv_len[r] ? t0 + bs : kv_len[r];                        \
            const int64_t i0 = kv_lo[r] > t0 ? kv_lo[r] - t0 : 0, cnt = t1 - t0;                              \
            const int64_t base = tables[r * max_blocks + c] * bs * ss;                                        \
            /* the next item's block (this thread's next, mostly), fetched a share per head during this one's: \
             * its lines lie where the block table put them, which no prefetcher guesses */                     \
            const char *k1 = NULL, *v1 = NULL;                                                                \
            int64_t n1 = 0;                                                                                   \
            if (it + 1 < items) {                                                                             \
                const int64_t r1 = owner[it + 1], c1 = it + 1 - first[r1];                                     \
                n1 = (c1 * bs + bs < kv_len[r1] ? bs : kv_len[r1] - c1 * bs) * ss * (int64_t)sizeof(KT);       \
                k1 = (const char*)(k + tables[r1 * max_blocks + c1] * bs * ss);                               \
                v1 = (const char*)(v + tables[r1 * max_blocks + c1] * bs * ss);                               \
            }                                                                                                 \
            const int64_t share = (n1 / 64 + hq - 1) / hq * 64; /* bytes of each a head fetches */            \
            for (int64_t h = 0; h < hq; h++) {                                                                \
                for (int64_t off = h * share; off < (h + 1) * share && off < n1; off += 64)                   \
                    __builtin_prefetch(k1 + off, 0, 3), __builtin_prefetch(v1 + off, 0, 3);                   \
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
                if (vector) { /* q and the output in registers (head_vector_ below) */                          \
                    p[0] = head_vector_##SUFFIX(qh, kh, vh, i0, cnt, ss, d / LANES, scale, s, o, &p[1]);     \
                    continue;                                                                                 \
                }                                                                                             \
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
