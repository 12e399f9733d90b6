/* A serving iteration of decodes only, every layer in one call: the native decoder layer halves
 * (native_decode.c) around the new K/V written into a float32 paged pool and the paged decode
 * attention reading it where it lies (paged_attention.c), all compiled into one library with the
 * GEMV and flexplan.quant's kernels: no Python between the layers, which a small model's decode
 * step pays for per layer otherwise (flexplan/serving/fused_step.py runs them per layer then).
 *
 *   flexplan_paged_decode_stack_f32 / _bf16
 *     layers[n]      the decoder layers' weights (flexplan_layer, native_decode.c), one geometry
 *     k, v           the pool [n layers, slots, hk, d] contiguous (layer l at l * layer_stride): float32
 *                    (_f32), or bfloat16 (_bf16: the new K/V rounded to nearest even as torch's .to()
 *                    rounds, so this path and the per-layer writes fill the pool alike)
 *     slots [b]      the slot each request's new token's K and V go to
 *     tables [b, max_blocks], kv_len [b] (the new token included), kv_lo [b]: as paged_attention.c's
 *     x [b, hidden]  the embeddings in, the last layer's output out; cos/sin [b, d] per request
 *     scratch        y, xn, tmp [b, hidden]; q, attn [b, hq d]; kn, vn [b, hk d]; g, u [b, inter]
 *   Returns 0, or -1 (no memory for the attention's partials or a quantised activation).
 */
#include <stdint.h>
#include <string.h>


int flexplan_layer_pre_attention_f32(const void* L, const float* x, const float* cos_, const float* sin_,
                                     int64_t batch, float* xn, float* q, float* k, float* v);
int flexplan_layer_post_attention_f32(const void* L, const float* x, float* y, const float* q, const float* keys,
                                      const float* values, const uint8_t* mask, int64_t T, int64_t sb, int64_t sh,
                                      int64_t st, int64_t batch, float* attn, float* tmp, float* xn, float* g,
                                      float* u);
int flexplan_paged_decode_f32(const float* q, const float* k, const float* v, const int64_t* tables,
                              int64_t max_blocks, const int64_t* kv_len, const int64_t* kv_lo, float* out,
                              int64_t n, int64_t hq, int64_t hk, int64_t d, int64_t bs, int64_t ss, int64_t sh,
                              float scale);
int flexplan_paged_decode_bf16(const float* q, const uint16_t* k, const uint16_t* v, const int64_t* tables,
                               int64_t max_blocks, const int64_t* kv_len, const int64_t* kv_lo, float* out,
                               int64_t n, int64_t hq, int64_t hk, int64_t d, int64_t bs, int64_t ss, int64_t sh,
                               float scale);

/* c10's float -> bfloat16: round to nearest even, NaN to 0x7FC0 */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void put_f32(float* dst, const float* src, int64_t n) { memcpy(dst, src, sizeof(float) * (size_t)n); }
static inline void put_bf16(uint16_t* dst, const float* src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_of(src[i]);
}

#define DEFINE_PAGED_STACK(SUFFIX, KT)                                                                          \
int flexplan_paged_decode_stack_##SUFFIX(const void* const* layers, int64_t n, KT* k, KT* v, int64_t layer_stride,    \
                                         const int64_t* slots, const int64_t* tables, int64_t max_blocks,             \
                                         const int64_t* kv_len, const int64_t* kv_lo, int64_t bs, int64_t batch,      \
                                         int64_t hidden, int64_t hq, int64_t hk, int64_t d, const float* scales,      \
                                         const float* cos_, const float* sin_, float* x, float* y, float* xn,         \
                                         float* tmp, float* q, float* attn, float* kn, float* vn, float* g,           \
                                         float* u) {                                                                  \
    const int64_t row = hk * d; /* elements of one slot: its heads' K (or V) */                                   \
    for (int64_t l = 0; l < n; l++) {                                                                             \
        if (flexplan_layer_pre_attention_f32(layers[l], x, cos_, sin_, batch, xn, q, kn, vn)) return -1;          \
        KT* kl = k + l * layer_stride;                                                                            \
        KT* vl = v + l * layer_stride;                                                                            \
        for (int64_t r = 0; r < batch; r++) {                                                                     \
            put_##SUFFIX(kl + slots[r] * row, kn + r * row, row);                                                 \
            put_##SUFFIX(vl + slots[r] * row, vn + r * row, row);                                                 \
        }                                                                                                         \
        if (flexplan_paged_decode_##SUFFIX(q, kl, vl, tables, max_blocks, kv_len, kv_lo, attn, batch, hq, hk, d,  \
                                           bs, row, d, scales[l]) ||                                              \
            flexplan_layer_post_attention_f32(layers[l], x, y, q, NULL, NULL, NULL, 0, 0, 0, 0, batch, attn, tmp,  \
                                              xn, g, u))                                                          \
            return -1;                                                                                            \
        memcpy(x, y, sizeof(float) * (size_t)(batch * hidden));                                                   \
    }                                                                                                             \
    return 0;                                                                                                     \
}

DEFINE_PAGED_STACK(f32, float)
DEFINE_PAGED_STACK(bf16, uint16_t)
