/* A serving iteration of decodes only, every layer in one call: the native decoder layer halves
 * (native_decode.c) around the new K/V written into a float32 paged pool and the paged decode
 * attention reading it where it lies (paged_attention.c), all compiled into one library with the
 * GEMV and flexplan.quant's kernels: no Python between the layers, which a small model's decode
 * step pays for per layer otherwise (flexplan/serving/fused_step.py runs them per layer then).
 *
 *   flexplan_paged_decode_stack_f32
 *     layers[n]      the decoder layers' weights (flexplan_layer, native_decode.c), one geometry
 *     k, v           the pool [n layers, slots, hk, d] float32 contiguous (layer l at l * layer_stride)
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

int flexplan_paged_decode_stack_f32(const void* const* layers, int64_t n, float* k, float* v, int64_t layer_stride,
                                    const int64_t* slots, const int64_t* tables, int64_t max_blocks,
                                    const int64_t* kv_len, const int64_t* kv_lo, int64_t bs, int64_t batch,
                                    int64_t hidden, int64_t hq, int64_t hk, int64_t d, const float* scales,
                                    const float* cos_, const float* sin_, float* x, float* y, float* xn, float* tmp,
                                    float* q, float* attn, float* kn, float* vn, float* g, float* u) {
    const int64_t row = hk * d; /* floats of one slot: its heads' K (or V) */
    for (int64_t l = 0; l < n; l++) {
        if (flexplan_layer_pre_attention_f32(layers[l], x, cos_, sin_, batch, xn, q, kn, vn)) return -1;
        float* kl = k + l * layer_stride;
        float* vl = v + l * layer_stride;
        for (int64_t r = 0; r < batch; r++) {
            memcpy(kl + slots[r] * row, kn + r * row, sizeof(float) * (size_t)row);
            memcpy(vl + slots[r] * row, vn + r * row, sizeof(float) * (size_t)row);
        }
        if (flexplan_paged_decode_f32(q, kl, vl, tables, max_blocks, kv_len, kv_lo, attn, batch, hq, hk, d, bs, row,
                                      d, scales[l]) ||
            flexplan_layer_post_attention_f32(layers[l], x, y, q, NULL, NULL, NULL, 0, 0, 0, 0, batch, attn, tmp, xn,
                                              g, u))
            return -1;
        memcpy(x, y, sizeof(float) * (size_t)(batch * hidden));
    }
    return 0;
}
