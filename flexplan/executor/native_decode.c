/* flexplan's fused CPU ops for the decode step of a Llama-style decoder layer, float32.
 *
 * A batch-1 decode step reads every weight once. Between its GEMVs, transformers runs a few dozen
 * small PyTorch ops per layer (RMSNorm is 7 ops, rotary embedding 14, residual adds, SiLU,
 * SDPA), each a dispatch from Python; after a GEMV has streamed megabytes of weights through the
 * caches each of them starts cold. On the development machine (2 Zen 4 cores), timed ad hoc, that
 * was ~8-10 ms of a ~40 ms step of a 2 GB model.
 *
 * Ops (each a single call; all tensors float32, contiguous unless strides are given):
 *   flexplan_rmsnorm_f32      y = w * x / sqrt(mean(x^2) + eps) per row          (LlamaRMSNorm)
 *   flexplan_rope_f32         x = x cos + rotate_half(x) sin, in place             (apply_rotary_pos_emb)
 *   flexplan_decode_attention_f32 / _bf16
 *                             softmax(q k^T scale, masked) v for ONE query per sequence,
 *                             grouped-query heads, reading the KV cache through its strides
 *                             (float32, or bfloat16 widened as read: q and the output float32)
 *   flexplan_layer_pre_attention_f32 / flexplan_layer_post_attention_f32
 *                             a whole decoder layer for one decode step, in two halves around
 *                             the KV-cache update (which stays the cache's own Python method):
 *                             RMSNorm, q/k/v GEMVs, rotary | attention, o GEMV + residual,
 *                             RMSNorm, gate/up GEMVs, SiLU * up, down GEMV + residual (or, for
 *                             a MoE layer, the router's top-k softmax and the routed experts on
 *                             their GGUF blocks: moe_ffn).
 *   flexplan_decode_stack_f32 every layer of a decode step in one call, appending each layer's new
 *                             k and v to its KV cache itself (no Python between the layers)
 *   flexplan_moe_silu_f32 / flexplan_quant_moe_silu
 *                             a MoE layer's routed experts with the default SiLU(gate) * up gate:
 *                             routing, grouped GEMVs, SiLU, weighted scatter (cpu-experts policy)
 *
 * The GEMVs are native_gemv.c's flexplan_blocked_gemv (compiled into the same library), on
 * weights in its blocked layout [out/64, in, 64], float32 or 16-bit (a layer's blocked ones in one
 * type, flexplan_layer.wtype), or quant_gemv.c's flexplan_quant_gemm (also compiled in) on a GGUF
 * file's raw blocks, each linear its own format (flexplan_layer.qtype); activations, norms, biases and the KV cache are float32 throughout, but
 * for the decode attention's bfloat16 variant (a bf16 cache: the executor's bf16 CPU layers and
 * the host caches of a bf16 model's cpu-attention and split layers).
 *
 * Attention splits the keys of each sequence into chunks of CHUNK_T positions, one work item per
 * (sequence, chunk), so each thread reads a contiguous stretch of the cache (all heads of a
 * position are adjacent in flexplan's [capacity, batch, kv heads, d] cache) instead of every
 * kv-head-th row; the chunks' partial softmaxes are merged afterwards (the flash-decoding
 * scheme). exp is a vectorisable Cody-Waite range reduction + Cephes expf's degree-6 polynomial;
 * reductions sum in another order than PyTorch's. The results differ from transformers' in the
 * last float32 bits (tests/test_native_decode.py holds them to 1e-5 relative of PyTorch's).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int flexplan_blocked_gemv(const void* P, int64_t wtype, const float* x, float* y, const float* bias, int64_t out,
                          int64_t in, int64_t batch);
int flexplan_grouped_gemv(const void* P, int64_t wtype, int64_t expert_stride, const int64_t* experts,
                          const int64_t* row_start, int64_t n, const float* x, float* y, const float* bias,
                          int64_t out, int64_t in);
int64_t flexplan_route_experts(const int64_t* index, int64_t tokens, int64_t k, int64_t n_experts, const float* x,
                               int64_t in, int64_t* pairs, int64_t* experts, int64_t* row_start, float* h);
int flexplan_quant_gemm(const uint8_t* w, int64_t wtype, const float* x, float* y, const float* bias, int64_t out,
                        int64_t in, int64_t batch, int64_t float_act); /* quant_gemv.c, compiled in */
int flexplan_quant_gemv_shared(int64_t n, const uint8_t* const* w, const int64_t* wtype, const float* x, int64_t in,
                               float* const* y, const float* const* bias, const int64_t* out);
int flexplan_quant_gemv_list(int64_t n, const uint8_t* const* w, const int64_t* wtype, const float* const* x,
                             float* const* y, const int64_t* out, const int64_t* in, const float* const* bias);
void flexplan_scatter_experts(const float* h, const float* weights, const int64_t* pairs, int64_t rows,
                              int64_t tokens, int64_t k, float* out, int64_t width);

#define CHUNK_T 32 /* key positions per attention work item */

/* e^x for x <= 0 (softmax) and SiLU's e^-x, vectorisable: x = n ln2 + r, |r| <= ln2/2. */
#pragma omp declare simd
static inline float exp_f32(float x) {
    x = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* GCC/Clang vector extensions of one register: 16 floats with AVX-512, 8 with AVX, else 4 (SSE,
 * NEON): a vector wider than the registers goes through the stack at every step; aligned(4) makes
 * loads and stores unaligned ones. */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

static inline float hsumv(vf a) { /* pairwise: halves, quarters, then four lanes */
    v4 s4;
#if LANES >= 8
    v8 s8;
#if LANES == 16
    v8 lo, hi;
    memcpy(&lo, &a, sizeof lo), memcpy(&hi, (const char*)&a + sizeof lo, sizeof hi);
    s8 = lo + hi;
#else
    memcpy(&s8, &a, sizeof s8);
#endif
    v4 l4, h4;
    memcpy(&l4, &s8, sizeof l4), memcpy(&h4, (const char*)&s8 + sizeof l4, sizeof h4);
    s4 = l4 + h4;
#else
    memcpy(&s4, &a, sizeof s4);
#endif
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* bfloat16 -> float32, exact: the 16 high bits of the float. */
static inline float bf16_f32(uint16_t h) {
    union { uint32_t i; float f; } u = {.i = (uint32_t)h << 16};
    return u.f;
}

typedef uint16_t u16xl __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t u32xl __attribute__((vector_size(LANES * 4)));

static inline vf loadv_f32(const float* p) { return *(const vf*)p; }

static inline vf loadv_bf16(const uint16_t* p) { /* LANES bf16 widened to float32 in a register */
    u16xl h;
    memcpy(&h, p, sizeof h);
    const u32xl w = __builtin_convertvector(h, u32xl) << 16;
    vf f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline float load1_f32(const float* p) { return *p; }
static inline float load1_bf16(const uint16_t* p) { return bf16_f32(*p); }

/* sum_j a[j] b[j], b float32 (_f32) or bfloat16 widened as read (_bf16: the keys of a bf16 cache):
 * LANES partial sums, folded pairwise at the end. */
#define DEFINE_DOT(SUFFIX, KT)                                                                               \
static inline float dot_##SUFFIX(const float* a, const KT* b, int64_t n) {                                   \
    vf acc = {0}, acc2 = {0};                                                                               \
    int64_t j = 0;                                                                                           \
    for (; j + 2 * LANES <= n; j += 2 * LANES) {                                                             \
        acc += *(const vf*)(a + j) * loadv_##SUFFIX(b + j);                                                \
        acc2 += *(const vf*)(a + j + LANES) * loadv_##SUFFIX(b + j + LANES);                               \
    }                                                                                                        \
    acc += acc2;                                                                                             \
    for (; j + LANES <= n; j += LANES) acc += *(const vf*)(a + j) * loadv_##SUFFIX(b + j);                 \
    float tail = 0.0f;                                                                                       \
    for (; j < n; j++) tail += a[j] * load1_##SUFFIX(b + j);                                                 \
    return hsumv(acc) + tail;                                                                               \
}

DEFINE_DOT(f32, float)
DEFINE_DOT(bf16, uint16_t)

/* y[r, :] = w * (x[r, :] / sqrt(mean(x[r, :]^2) + eps)); x, y [rows, n] (y may be x). */
void flexplan_rmsnorm_f32(const float* x, const float* w, float* y, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * n;
        float* yr = y + r * n;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < n; j++) ss += xr[j] * xr[j];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
        for (int64_t j = 0; j < n; j++) yr[j] = w[j] * (xr[j] * inv);
    }
}

/* Rotary embedding in place: x [rows, heads, d], cos/sin [rows, d] (one row per token).
 * out[j] = x[j] cos[j] - x[j + d/2] sin[j] (j < d/2); out[j] = x[j] cos[j] + x[j - d/2] sin[j]. */
void flexplan_rope_f32(float* x, const float* cos_, const float* sin_, int64_t rows, int64_t heads, int64_t d) {
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (rows * heads >= 256)
    for (int64_t rh = 0; rh < rows * heads; rh++) {
        float* v = x + rh * d;
        const float* c = cos_ + (rh / heads) * d;
        const float* s = sin_ + (rh / heads) * d;
#pragma omp simd
        for (int64_t j = 0; j < half; j++) {
            const float a = v[j], b = v[j + half];
            v[j] = a * c[j] - b * s[j];
            v[j + half] = b * c[j + half] + a * s[j + half];
        }
    }
}

/* Prefetch `rows` rows of `bytes` bytes, `stride` bytes apart, into the cache. */
static inline void prefetch_rows(const void* p, int64_t rows, int64_t stride, int64_t bytes) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char*)p + r * stride + off, 0, 3);
}

#define PREFETCH_T 4 /* key positions ahead that the scores loop prefetches */

/* Partial attention of every query head of sequence b over keys [t0, t1): per head its max
 * score m, sum of e^(s - m) l, and unnormalised output o (d floats), into part[h * (d + 2)].
 * One definition per KV element type KT (float32, bfloat16 widened as read). */
#define DEFINE_ATTENTION_CHUNK(SUFFIX, KT)                                                                   \
static void attention_chunk_##SUFFIX(const float* q, const KT* k, const KT* v, const uint8_t* m, int64_t b,  \
                                     int64_t hq, int64_t hk, int64_t d, int64_t sb, int64_t sh, int64_t st,   \
                                     float scale, int64_t t0, int64_t t1, float* part, float* s) {            \
    const int64_t group = hq / hk, n = t1 - t0;                                                               \
    for (int64_t t = t0; t < t1; t++) {                                                                       \
        const int64_t i = t - t0;                                                                             \
        /* the keys a few positions on, and this position's values (the second pass reads them): the \
         * rows of one sequence in a token-major cache are strided, and left to the hardware         \
         * prefetcher they ran at 0.47-0.63 of a sequence-major cache's rate at batch 4-8 (2 Zen 4    \
         * cores, SmolLM2's heads, 1040 keys; with this, 0.61-0.82; grouping a chunk's sequences into one \
         * work item did not help, nor prefetching 8 or 16 positions ahead) */                                \
        if (t + PREFETCH_T < t1)                                                                              \
            prefetch_rows(k + b * sb + (t + PREFETCH_T) * st, hk, sh * (int64_t)sizeof(KT), d * (int64_t)sizeof(KT)); \
        prefetch_rows(v + b * sb + t * st, hk, sh * (int64_t)sizeof(KT), d * (int64_t)sizeof(KT));           \
        if (m && !m[t]) {                                                                                     \
            for (int64_t h = 0; h < hq; h++) s[h * CHUNK_T + i] = -INFINITY;                                  \
            continue;                                                                                         \
        }                                                                                                     \
        for (int64_t h = 0; h < hq; h++) {                                                                    \
            const KT* kt = k + b * sb + (h / group) * sh + t * st;                                            \
            const float* qh = q + (b * hq + h) * d;                                                           \
            s[h * CHUNK_T + i] = dot_##SUFFIX(qh, kt, d) * scale;                                             \
        }                                                                                                     \
    }                                                                                                         \
    for (int64_t h = 0; h < hq; h++) {                                                                        \
        float* sh_ = s + h * CHUNK_T;                                                                         \
        float* ph = part + h * (d + 2);                                                                       \
        float mx = -INFINITY, l = 0.0f;                                                                       \
        for (int64_t i = 0; i < n; i++) mx = sh_[i] > mx ? sh_[i] : mx;                                       \
        if (mx != -INFINITY) {                                                                                \
            _Pragma("omp simd reduction(+ : l)")                                                              \
            for (int64_t i = 0; i < n; i++) {                                                                 \
                sh_[i] = sh_[i] == -INFINITY ? 0.0f : exp_f32(sh_[i] - mx);                                   \
                l += sh_[i];                                                                                  \
            }                                                                                                 \
        }                                                                                                     \
        ph[0] = mx, ph[1] = l;                                                                                \
        float* o = ph + 2;                                                                                    \
        const KT* vh = v + b * sb + (h / group) * sh + t0 * st;                                               \
        if (mx == -INFINITY) {                                                                                \
            for (int64_t j = 0; j < d; j++) o[j] = 0.0f;                                                      \
            continue;                                                                                         \
        }                                                                                                     \
        int64_t j0 = 0;                                                                                       \
        for (; j0 + 4 * LANES <= d; j0 += 4 * LANES) { /* 4 x LANES outputs in registers: 4 FMA chains */    \
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                       \
            for (int64_t i = 0; i < n; i++) {                                                                 \
                const float p = sh_[i];                                                                       \
                const KT* vt = vh + i * st + j0;                                                              \
                a0 += p * loadv_##SUFFIX(vt), a1 += p * loadv_##SUFFIX(vt + LANES);                         \
                a2 += p * loadv_##SUFFIX(vt + 2 * LANES), a3 += p * loadv_##SUFFIX(vt + 3 * LANES);         \
            }                                                                                                 \
            *(vf*)(o + j0) = a0, *(vf*)(o + j0 + LANES) = a1;                                               \
            *(vf*)(o + j0 + 2 * LANES) = a2, *(vf*)(o + j0 + 3 * LANES) = a3;                               \
        }                                                                                                     \
        for (; j0 + LANES <= d; j0 += LANES) { /* LANES outputs in a register over the chunk */              \
            vf acc = {0};                                                                                    \
            for (int64_t i = 0; i < n; i++) acc += sh_[i] * loadv_##SUFFIX(vh + i * st + j0);               \
            *(vf*)(o + j0) = acc;                                                                            \
        }                                                                                                     \
        for (; j0 < d; j0++) {                                                                                \
            float acc = 0.0f;                                                                                 \
            for (int64_t i = 0; i < n; i++) acc += sh_[i] * load1_##SUFFIX(vh + i * st + j0);                \
            o[j0] = acc;                                                                                      \
        }                                                                                                     \
    }                                                                                                         \
}

DEFINE_ATTENTION_CHUNK(f32, float)
DEFINE_ATTENTION_CHUNK(bf16, uint16_t)

/* Chunks per sequence: enough for CHUNK_T keys each, and where a step has few work items (a batch-1
 * decode over a short past), as many more as make them a multiple of the threads, each a span of
 * equal keys, so no thread waits on another's longer share (74 keys on 2 threads: 4 spans of 19,
 * not 32 + 32 + 10). */
static int64_t attention_chunks(int64_t batch, int64_t T) {
    const int64_t threads = omp_get_max_threads();
    int64_t chunks = (T + CHUNK_T - 1) / CHUNK_T;
    if (batch * chunks < 4 * threads)
        while ((batch * chunks) % threads && chunks < T) chunks++;
    return chunks;
}

/* Merge the chunks' partial softmaxes of every (sequence, head) into out [batch, hq, d]. */
static void merge_chunks(const float* part, float* out, int64_t batch, int64_t chunks, int64_t hq, int64_t d) {
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < hq; h++) {
            float mx = -INFINITY, l = 0.0f;
            for (int64_t c = 0; c < chunks; c++) {
                const float mc = part[((b * chunks + c) * hq + h) * (d + 2)];
                mx = mc > mx ? mc : mx;
            }
            float* o = out + (b * hq + h) * d;
            for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
            if (mx == -INFINITY) continue;
            for (int64_t c = 0; c < chunks; c++) {
                const float* ph = part + ((b * chunks + c) * hq + h) * (d + 2);
                if (ph[0] == -INFINITY) continue;
                const float w = exp_f32(ph[0] - mx);
                l += w * ph[1];
#pragma omp simd
                for (int64_t j = 0; j < d; j++) o[j] += w * ph[2 + j];
            }
            const float inv = 1.0f / l;
#pragma omp simd
            for (int64_t j = 0; j < d; j++) o[j] *= inv;
        }
}

/* One query position per sequence against T cached keys.
 *   q    [batch, hq, d] float32;  out [batch, hq, d] float32
 *   k, v element (b, h, t, j) at b*sb + h*sh + t*st + j   (j contiguous), float32 (_f32) or
 *        bfloat16 (_bf16: a bf16 cache read as it is, each element widened exactly in a register)
 *   mask [batch, T] bytes, nonzero = attend, or NULL (attend to all T)
 * Query head i reads key/value head i / (hq / hk). A row with every key masked gets zeros.
 * Returns 0, or -1 when the partials could not be allocated. */
#define DEFINE_DECODE_ATTENTION(SUFFIX, KT)                                                                  \
int flexplan_decode_attention_##SUFFIX(const float* q, const KT* k, const KT* v, const uint8_t* mask,        \
                                       float* out, int64_t batch, int64_t hq, int64_t hk, int64_t T,          \
                                       int64_t d, int64_t sb, int64_t sh, int64_t st, float scale) {          \
    const int64_t chunks = attention_chunks(batch, T);                                                        \
    const int64_t span = (T + chunks - 1) / chunks; /* keys per chunk, <= CHUNK_T */                          \
    float* part = (float*)malloc(sizeof(float) * (size_t)(batch * chunks * hq * (d + 2)));                    \
    float* scores = (float*)malloc(sizeof(float) * (size_t)(batch * chunks * hq * CHUNK_T));                  \
    if (!part || !scores) {                                                                                   \
        free(part), free(scores);                                                                             \
        return -1;                                                                                            \
    }                                                                                                         \
    _Pragma("omp parallel for schedule(static)")                                                              \
    for (int64_t item = 0; item < batch * chunks; item++) {                                                   \
        const int64_t b = item / chunks, c = item % chunks;                                                   \
        const int64_t t0 = c * span < T ? c * span : T, t1 = t0 + span < T ? t0 + span : T;                 \
        attention_chunk_##SUFFIX(q, k, v, mask ? mask + b * T : NULL, b, hq, hk, d, sb, sh, st, scale, t0, t1, \
                                 part + item * hq * (d + 2), scores + item * hq * CHUNK_T);                   \
    }                                                                                                         \
    merge_chunks(part, out, batch, chunks, hq, d);                                                            \
    free(part), free(scores);                                                                                 \
    return 0;                                                                                                 \
}

DEFINE_DECODE_ATTENTION(f32, float)
DEFINE_DECODE_ATTENTION(bf16, uint16_t)

/* The blocked weights (and biases or NULL) of one decoder layer, and its sizes. */
typedef struct {
    const float *ln1, *ln2;                 /* RMSNorm weights [hidden] */
    const void *wq, *wk, *wv, *wo;          /* blocked [out/64, in, 64], of type wtype */
    const float *bq, *bk, *bv, *bo;
    const void *wg, *wu, *wd;
    const float *bg, *bu, *bd;
    int64_t hidden, inter, hq, hk, d;
    int64_t wtype;                          /* native_gemv.c's WEIGHT_F32, _BF16 or _F16 */
    float eps1, eps2, scale;
    /* per linear, in the order q k v o gate up down: 0 = blocked of type wtype, else a GGUF block
     * type (ggml's type id) whose raw rows [out, in / block] quant_gemv.c's flexplan_quant_gemm reads */
    int64_t qtype[7];
    int64_t float_act;                      /* quantised linears: the exact float-activation path */
    /* QK-norm (Qwen3, OLMo 2), or NULL: RMSNorm of q and k before the rotary embedding, over the
     * last qn_width (kn_width) elements of each row (a head's d, or a projection's whole width) */
    const float *qn, *kn;
    int64_t qn_width, kn_width;
    float eps_q, eps_k;
    /* A routed mixture of experts in place of the gate/up/down MLP where n_experts > 0 (moe_ffn):
     * router [n_experts, hidden] float32; each expert's gate_up [2 moe_inter rows] and down [hidden
     * rows] on GGUF blocks of types egu_type / ed_type (quant_gemv.c's, interleaved or not), expert
     * strides in bytes; biases [E, rows] or NULL; moe_float_act their exact float-activation path. */
    const float* router;
    const void *egu, *ed;
    const float *begu, *bed;
    int64_t n_experts, top_k, norm_topk, moe_inter, egu_type, ed_type, egu_stride, ed_stride, moe_float_act;
    /* a MoE layer's shared expert (Qwen2-MoE's): the gate/up/down linears (wg, wu, wd: NULL for none),
     * its output scaled per row by sigmoid(sgate . n) where sgate [hidden] float32 is given */
    const float* sgate;
} flexplan_layer;

enum { LIN_Q, LIN_K, LIN_V, LIN_O, LIN_G, LIN_U, LIN_D };
/* elements from which an element-wise step is shared among the threads: a prefill's rows, not a
 * decode step's few (a fork and join costs more than a few thousand additions) */
#define ELEMENTWISE_PARALLEL (1 << 15)

/* The element-wise steps, on both threads for a prefill's rows (one thread would leave the other
 * spinning), on this one for a decode step's, outside any parallel region: one with a false if()
 * still pays its set-up, and GCC did not vectorise the SiLU loop inside it. */
static void add_rows(float* y, const float* a, const float* b, int64_t n) {
    if (n >= ELEMENTWISE_PARALLEL) {
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; i++) y[i] = a[i] + b[i];
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) y[i] = a[i] + b[i];
    }
}

static void silu_mul(float* g, const float* u, int64_t n) { /* g = SiLU(g) * u */
    if (n >= ELEMENTWISE_PARALLEL) {
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    } else {
#pragma omp simd
        for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
    }
}

/* y [batch, out] = x [batch, in] W^T (+ bias) for the layer's linear j, by the kernel of its layout:
 * a mixed-format layer (a K-quant file keeps some tensors in other types) takes each one's own. */
static inline int linear(const flexplan_layer* L, int j, const void* P, const float* bias, const float* x, float* y,
                         int64_t out, int64_t in, int64_t batch) {
    if (L->qtype[j]) return flexplan_quant_gemm(P, L->qtype[j], x, y, bias, out, in, batch, L->float_act) ? -1 : 0;
    return flexplan_blocked_gemv(P, L->wtype, x, y, bias, out, in, batch);
}

/* Linears j[0..n) of the layer on one input x [batch, in] (q/k/v, or gate/up): for one row with every
 * one of them on GGUF blocks (int8 activation), one call that quantises x once and shares all their
 * rows among the threads in one parallel region (a decode step's small matrices pay a fork and join,
 * and a quantisation, per call otherwise); else one call each. The same results either way. */
static int linears_on(const flexplan_layer* L, int n, const int* j, const void* const* P, const float* const* bias,
                      const float* x, float* const* y, const int64_t* out, int64_t in, int64_t batch) {
    int shared = batch == 1 && !L->float_act;
    for (int i = 0; i < n; i++) shared &= L->qtype[j[i]] != 0;
    if (shared) {
        int64_t types[3];
        for (int i = 0; i < n; i++) types[i] = L->qtype[j[i]];
        return flexplan_quant_gemv_shared(n, (const uint8_t* const*)P, types, x, in, y, bias, out) ? -1 : 0;
    }
    for (int i = 0; i < n; i++)
        if (linear(L, j[i], P[i], bias[i], x, y[i], out[i], in, batch)) return -1;
    return 0;
}

/* RMSNorm, q/k/v projections and rotary embedding of x [batch, hidden]: q [batch, hq, d],
 * k and v [batch, hk, d]; xn [batch, hidden] is scratch. Returns 0, or -1 (a linear failed: no
 * memory for a quantised activation). */
int flexplan_layer_pre_attention_f32(const flexplan_layer* L, const float* x, const float* cos_,
                                     const float* sin_, int64_t batch, float* xn, float* q, float* k, float* v) {
    flexplan_rmsnorm_f32(x, L->ln1, xn, batch, L->hidden, L->eps1);
    const int j[3] = {LIN_Q, LIN_K, LIN_V};
    const void* P[3] = {L->wq, L->wk, L->wv};
    const float* b[3] = {L->bq, L->bk, L->bv};
    float* y[3] = {q, k, v};
    const int64_t out[3] = {L->hq * L->d, L->hk * L->d, L->hk * L->d};
    if (linears_on(L, 3, j, P, b, xn, y, out, L->hidden, batch)) return -1;
    if (L->qn) flexplan_rmsnorm_f32(q, L->qn, q, batch * out[0] / L->qn_width, L->qn_width, L->eps_q);
    if (L->kn) flexplan_rmsnorm_f32(k, L->kn, k, batch * out[1] / L->kn_width, L->kn_width, L->eps_k);
    flexplan_rope_f32(q, cos_, sin_, batch, L->hq, L->d);
    flexplan_rope_f32(k, cos_, sin_, batch, L->hk, L->d);
    return 0;
}

static int moe_ffn(const flexplan_layer* L, const float* xn, float* out, int64_t batch);

/* The rest of the layer: y = x + o_proj(attention); y += down(silu(gate(n)) * up(n)), n = RMSNorm(y)
 * (or, with n_experts, y += the routed experts of n: moe_ffn, then the shared expert if any).
 * With keys == NULL, attn already holds the attention output [batch, hq * d]. Scratch: attn
 * [batch, hq d], tmp and xn [batch, hidden], g and u [batch, inter]. Returns 0 or -1 (no memory for
 * attention's partials or a quantised activation). */
int flexplan_layer_post_attention_f32(const flexplan_layer* L, const float* x, float* y, const float* q,
                                      const float* keys, const float* values, const uint8_t* mask, int64_t T,
                                      int64_t sb, int64_t sh, int64_t st, int64_t batch, float* attn, float* tmp,
                                      float* xn, float* g, float* u) {
    const int64_t H = L->hidden, I = L->inter;
    if (keys && flexplan_decode_attention_f32(q, keys, values, mask, attn, batch, L->hq, L->hk, T, L->d, sb, sh,
                                              st, L->scale) != 0)
        return -1;
    if (linear(L, LIN_O, L->wo, L->bo, attn, tmp, H, L->hq * L->d, batch)) return -1;
    add_rows(y, x, tmp, batch * H);
    flexplan_rmsnorm_f32(y, L->ln2, xn, batch, H, L->eps2);
    if (L->n_experts > 0) {
        if (moe_ffn(L, xn, tmp, batch)) return -1;
        add_rows(y, y, tmp, batch * H);
        if (!L->wg) return 0;  /* no shared expert: the routed ones are the feed-forward */
    }
    const int j[2] = {LIN_G, LIN_U};
    const void* P[2] = {L->wg, L->wu};
    const float* b[2] = {L->bg, L->bu};
    float* gu[2] = {g, u};
    const int64_t out[2] = {I, I};
    if (linears_on(L, 2, j, P, b, xn, gu, out, H, batch)) return -1;
    silu_mul(g, u, batch * I);
    if (linear(L, LIN_D, L->wd, L->bd, g, tmp, H, I, batch)) return -1;
    if (L->n_experts > 0 && L->sgate)  /* the shared expert's gate: sigmoid of one dot per row */
        for (int64_t r = 0; r < batch; r++) {
            const float s = 1.0f / (1.0f + expf(-dot_f32(L->sgate, xn + r * H, H)));
            for (int64_t i = 0; i < H; i++) tmp[r * H + i] *= s;
        }
    add_rows(y, y, tmp, batch * H);
    return 0;
}

/* A whole decode step of a stack of n decoder layers with the same sizes: for each layer, the
 * pre-attention half writes this step's k and v straight into the layer's KV cache at position
 * pos (rotary applied there), attention reads positions [0, pos], then the post-attention half.
 *   kc[l], vc[l]: layer l's cache, flexplan's layout [capacity, batch, hk, d] (position-major)
 *   x [batch, hidden]: the embeddings in (or, with embed, their rows are looked up first: embed
 *     [vocab, hidden], ids [batch]), the last layer's output out; y [batch, hidden] scratch
 *   mask [batch, pos + 1] bytes or NULL; cos/sin [batch, d]; other scratch as
 *   flexplan_layer_post_attention_f32's, q [batch, hq d]
 *   norm_w [hidden] or NULL: the final RMSNorm of x into out [batch, hidden] (eps norm_eps).
 * The embedding and the final norm are here for the step's Python, not its arithmetic: after the
 * weights' stream every small torch op starts with cold caches.
 * Returns 0, -1 (no memory for attention's partials or a quantised activation) or -2 (an id not
 * in [0, vocab): nothing written). */
int flexplan_decode_stack_f32(const flexplan_layer* const* layers, int64_t n, float* const* kc, float* const* vc,
                              int64_t pos, int64_t batch, const float* cos_, const float* sin_, const uint8_t* mask,
                              float* x, float* y, float* q, float* attn, float* tmp, float* xn, float* g, float* u,
                              const float* embed, const int64_t* ids, int64_t vocab, const float* norm_w,
                              float norm_eps, float* out) {
    const int64_t H = n > 0 ? layers[0]->hidden : 0;
    if (embed) {
        for (int64_t b = 0; b < batch; b++)
            if (ids[b] < 0 || ids[b] >= vocab) return -2;
        for (int64_t b = 0; b < batch; b++) memcpy(x + b * H, embed + ids[b] * H, sizeof(float) * (size_t)H);
    }
    for (int64_t l = 0; l < n; l++) {
        const flexplan_layer* L = layers[l];
        const int64_t row = batch * L->hk * L->d; /* floats per cache position */
        if (flexplan_layer_pre_attention_f32(L, x, cos_, sin_, batch, xn, q, kc[l] + pos * row, vc[l] + pos * row) ||
            flexplan_layer_post_attention_f32(L, x, y, q, kc[l], vc[l], mask, pos + 1, L->hk * L->d, L->d, row,
                                              batch, attn, tmp, xn, g, u) != 0)
            return -1;
        memcpy(x, y, sizeof(float) * (size_t)(batch * L->hidden));
    }
    if (norm_w) flexplan_rmsnorm_f32(x, norm_w, out, batch, H, norm_eps);
    return 0;
}

/* One projection of every selected expert i < n: rows [row_start[i], row_start[i + 1]) of y [rows, out]
 * = those rows of x [rows, in] times expert experts[i]'s W^T (+ its bias row of bias [E, out] if given),
 * W at W + experts[i] * stride (elements of the blocked layout, or bytes of GGUF blocks).
 * Returns 0, or nonzero when a GEMM could not run (out of memory). */
typedef int (*experts_projection)(const void* W, int64_t wtype, int64_t stride, const int64_t* experts,
                                  const int64_t* row_start, int64_t n, const float* x, float* y, const float* bias,
                                  int64_t out, int64_t in, int64_t float_act);

static int blocked_projection(const void* W, int64_t wtype, int64_t stride, const int64_t* experts,
                              const int64_t* row_start, int64_t n, const float* x, float* y, const float* bias,
                              int64_t out, int64_t in, int64_t float_act) {
    (void)float_act;
    flexplan_grouped_gemv(W, wtype, stride, experts, row_start, n, x, y, bias, out, in);
    return 0;
}

/* a GGUF file's blocks (quant_gemv.c's types, interleaved or not): one quantised GEMM per expert,
 * its rows at once (llama.cpp's int8 activations, or exact with float_act) */
#define LIST_MAX 64 /* selected experts a one-row-each projection runs in one flexplan_quant_gemv_list */
static int quant_projection(const void* W, int64_t wtype, int64_t stride, const int64_t* experts,
                            const int64_t* row_start, int64_t n, const float* x, float* y, const float* bias,
                            int64_t out, int64_t in, int64_t float_act) {
    if (!float_act && n <= LIST_MAX && row_start[n] == n) {
        /* a decode step's experts, one row each: one parallel region for all of them, not a fork and a
         * join per expert (the same results: gemv_list equals the GEMM of one row bit for bit) */
        const uint8_t* w[LIST_MAX];
        const float *xs[LIST_MAX], *bs[LIST_MAX];
        float* ys[LIST_MAX];
        int64_t types[LIST_MAX], outs[LIST_MAX], ins[LIST_MAX];
        for (int64_t i = 0; i < n; i++) {
            w[i] = (const uint8_t*)W + experts[i] * stride;
            xs[i] = x + i * in, ys[i] = y + i * out, bs[i] = bias ? bias + experts[i] * out : NULL;
            types[i] = wtype, outs[i] = out, ins[i] = in;
        }
        return flexplan_quant_gemv_list(n, w, types, xs, ys, outs, ins, bs) ? -1 : 0;
    }
    for (int64_t i = 0; i < n; i++) {
        const int64_t r0 = row_start[i], rows = row_start[i + 1] - r0;
        if (flexplan_quant_gemm((const uint8_t*)W + experts[i] * stride, wtype, x + r0 * in, y + r0 * out,
                                bias ? bias + experts[i] * out : NULL, out, in, rows, float_act))
            return -1;
    }
    return 0;
}

/* The routed experts of one MoE layer whose gate is transformers' default, SiLU(gate) * up over the
 * two halves of each expert's gate_up projection, in one call with no Python between its steps: the
 * routing grouped by expert (flexplan_route_experts), the selected experts' gate_up projections,
 * SiLU(gate) * up, their down projections, and the weighted scatter (flexplan_scatter_experts).
 * biases [E, 2 inter] and [E, hidden] float32 or NULL; index [tokens, k] int64, weights [tokens, k]
 * float32, x [tokens, hidden] and out [tokens, hidden] float32. SiLU uses exp_f32 (as the dense
 * decode layer does), within an ulp or two of PyTorch's. Returns 0, or -1 when the scratch cannot
 * be allocated. */
static int moe_silu(experts_projection project, const void* Wgu, int64_t gu_type, int64_t gu_stride, const void* Wd,
                    int64_t d_type, int64_t d_stride, const float* bgu, const float* bd, const int64_t* index,
                    const float* weights, int64_t tokens, int64_t k, int64_t n_experts, const float* x, int64_t hidden,
                    int64_t inter, float* out, int64_t float_act) {
    const int64_t slots = tokens * k, n_ids = slots < n_experts ? slots : n_experts;
    if (slots == 0) { /* no token, or no choice: nothing routed (malloc(0) may return NULL) */
        memset(out, 0, sizeof(float) * (size_t)(tokens * hidden));
        return 0;
    }
    int64_t* ints = malloc(sizeof(int64_t) * (size_t)(slots + 2 * n_ids + 1));
    float* h = malloc(sizeof(float) * (size_t)(slots * (hidden + 2 * inter + inter + hidden)));
    if (!ints || !h) {
        free(ints);
        free(h);
        return -1;
    }
    int64_t *pairs = ints, *experts = ints + slots, *row_start = ints + slots + n_ids;
    float *gu = h + slots * hidden, *act = gu + slots * 2 * inter, *dn = act + slots * inter;
    const int64_t n = flexplan_route_experts(index, tokens, k, n_experts, x, hidden, pairs, experts, row_start, h);
    int rc = n < 0 ? -1 : project(Wgu, gu_type, gu_stride, experts, row_start, n, h, gu, bgu, 2 * inter, hidden, float_act);
    if (rc == 0) {
        const int64_t rows = row_start[n];
#pragma omp parallel for schedule(static) if (rows * inter >= (1 << 16))
        for (int64_t r = 0; r < rows; r++) {
            const float* g = gu + r * 2 * inter;
            float* a = act + r * inter;
#pragma omp simd
            for (int64_t j = 0; j < inter; j++) a[j] = g[j] / (1.0f + exp_f32(-g[j])) * g[inter + j];
        }
        rc = project(Wd, d_type, d_stride, experts, row_start, n, act, dn, bd, hidden, inter, float_act);
        if (rc == 0) flexplan_scatter_experts(dn, weights, pairs, rows, tokens, k, out, hidden);
    }
    free(ints);
    free(h);
    return rc ? -1 : 0;
}

/* moe_silu on blocked float experts: Wgu [E, 2 inter/64, hidden, 64] and Wd [E, hidden/64, inter, 64]
 * of weight type wtype, expert strides gu_stride and d_stride elements. Every step but SiLU is the
 * grouped path's (flexplan_grouped_gemv), bit for bit. */
int flexplan_moe_silu_f32(const void* Wgu, const void* Wd, int64_t wtype, int64_t gu_stride, int64_t d_stride,
                          const float* bgu, const float* bd, const int64_t* index, const float* weights,
                          int64_t tokens, int64_t k, int64_t n_experts, const float* x, int64_t hidden,
                          int64_t inter, float* out) {
    return moe_silu(blocked_projection, Wgu, wtype, gu_stride, Wd, wtype, d_stride, bgu, bd, index, weights, tokens,
                    k, n_experts, x, hidden, inter, out, 0);
}

/* moe_silu on a GGUF file's blocks (flexplan.quant.quant_experts): Wgu [E, 2 inter, gate_up row bytes]
 * of quant_gemv.c type gu_type and Wd [E, hidden, down row bytes] of d_type, expert strides in bytes;
 * each expert's rows one flexplan_quant_gemm, as the per-expert path computes them. */
int flexplan_quant_moe_silu(const uint8_t* Wgu, int64_t gu_type, int64_t gu_stride, const uint8_t* Wd, int64_t d_type,
                            int64_t d_stride, const float* bgu, const float* bd, const int64_t* index,
                            const float* weights, int64_t tokens, int64_t k, int64_t n_experts, const float* x,
                            int64_t hidden, int64_t inter, float* out, int64_t float_act) {
    return moe_silu(quant_projection, Wgu, gu_type, gu_stride, Wd, d_type, d_stride, bgu, bd, index, weights, tokens,
                    k, n_experts, x, hidden, inter, out, float_act);
}

/* multiply-adds from which the router's logits are shared among the threads (a large router's:
 * Qwen3-30B-A3B's 128 x 2048; a small one costs less than the fork and join) */
#define ROUTER_PARALLEL (1 << 17)

/* A MoE layer's feed-forward on xn [batch, hidden] into out [batch, hidden] (L->n_experts > 0):
 * transformers' top-k softmax router (Qwen3-MoE's and Mixtral's: logits = xn router^T, softmax over
 * the experts, the top_k largest probabilities, largest first and ties to the lower id, renormalised
 * to sum 1 with norm_topk), then moe_silu on the experts' blocks. The softmax takes libm's expf, not
 * exp_f32: the router's probabilities are the routing weights, E of them a token. Returns 0, or -1
 * (no memory). */
static int moe_ffn(const flexplan_layer* L, const float* xn, float* out, int64_t batch) {
    const int64_t E = L->n_experts, k = L->top_k, H = L->hidden;
    float* logits = malloc(sizeof(float) * (size_t)(batch * (E + k)));
    int64_t* index = malloc(sizeof(int64_t) * (size_t)(batch * k));
    if (!logits || !index) {
        free(logits);
        free(index);
        return -1;
    }
    float* weights = logits + batch * E;
#pragma omp parallel for schedule(static) if (batch * E * H >= ROUTER_PARALLEL)
    for (int64_t i = 0; i < batch * E; i++) logits[i] = dot_f32(xn + (i / E) * H, L->router + (i % E) * H, H);
    for (int64_t b = 0; b < batch; b++) {
        const float* l = logits + b * E;
        int64_t* id = index + b * k;
        float* w = weights + b * k;
        for (int64_t c = 0; c < k; c++) { /* the c-th largest, by a scan: k and E are small */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t j = 0; j < c; j++) taken |= id[j] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            id[c] = best;
        }
        const float m = l[id[0]];
        float sum = 0.0f, kept = 0.0f;
        for (int64_t e = 0; e < E; e++) sum += expf(l[e] - m);
        for (int64_t c = 0; c < k; c++) kept += (w[c] = expf(l[id[c]] - m) / sum);
        if (L->norm_topk)
            for (int64_t c = 0; c < k; c++) w[c] /= kept;
    }
    const int rc = moe_silu(quant_projection, L->egu, L->egu_type, L->egu_stride, L->ed, L->ed_type, L->ed_stride,
                            L->begu, L->bed, index, weights, batch, k, E, xn, H, L->moe_inter, out, L->moe_float_act);
    free(logits);
    free(index);
    return rc;
}
