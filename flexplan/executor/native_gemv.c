/* flexplan's CPU GEMV for decode, on weights in a column-blocked layout, computed in float32.
 *
 * The weight of an nn.Linear, W [out, in] (out a multiple of 64), is held as P [out/64, in, 64]:
 * P[k, i, c] = W[64 k + c, i]. For each block k, y[b, 64 k + c] = sum_i P[k, i, c] * x[b, i]
 * (+ bias[64 k + c]) for every batch row b < batch. x is [batch, in] and y [batch, out], both
 * float32 and contiguous; bias is float32 or NULL. P is float32, bfloat16 or float16 (WEIGHT_*):
 * 16-bit weights are widened to float32 in registers as they are read (exactly: every bf16 and
 * f16 value is a float32 value), so a 16-bit checkpoint computes as it would after .float(), in
 * the same order, bit for bit, while DRAM delivers half the bytes. That is the point: decode
 * time is the weights' bytes over memory bandwidth, and a CPU without fast bf16 arithmetic
 * (AVX2, AVX-512 without AMX) still gets the 16-bit bytes.
 *
 * Why this layout: a batch-1 decode step is one GEMV per weight matrix and should read the
 * weights at memory bandwidth. In the blocked layout each thread reads its blocks as ONE
 * sequential stream (64 floats of row i, then of row i+1, ...), which the hardware prefetcher
 * follows at full speed; row-major GEMVs keep 4-8 row streams per thread in flight and, on the
 * development machine (2 Zen 4 cores), stall at ~50 GB/s where the memory gives ~66-70 GB/s
 * (benchmarks/bench_cpu_linear.py has the measured figures). With batch > 1 the kernel runs
 * GROUP batch rows (6 with AVX-512, 1 otherwise; AVX2 from 160 rows: 16-column panels of 6 rows,
 * see panel_rows) against an L1-sized chunk of a block, then the
 * next group against the same chunk while it is still in L1/L2, so DRAM sees the weights once
 * per step. Prefill comes here too, its tokens as the batch rows (flexplan/executor/cpu_linear.py);
 * only non-float32 inputs take torch.matmul on the blocks.
 *
 * flexplan_dense_gemv computes the same product on a dense row-major W (four row streams per
 * thread), for weights that must keep the layout an accelerator copy needs (split-points layers).
 *
 * Compiled on first use by flexplan/executor/native.py with -O3 -march=native -fopenmp (native.CFLAGS). torch
 * loads its own libgomp.so.1 first, so this library binds to the same OpenMP runtime: one
 * thread pool, sized by torch.set_num_threads. ISA paths: AVX-512F, AVX2 + FMA, plain C.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define BLOCK 64

#if defined(__AVX512F__)
#define ISA "avx512f"
#define VW 16
#define GROUP 6 /* batch rows per pass: 6 x 4 accumulators of 32 registers */
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vset1(float f) { return _mm512_set1_ps(f); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
#define DENSE_GROUP 5 /* dense rows: 4 weight rows x 5 batch rows of accumulators */
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA "avx2"
#define VW 8
#define GROUP 1 /* 8 accumulators of 16 registers */
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vset1(float f) { return _mm256_set1_ps(f); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define DENSE_GROUP 2
#else
#define ISA "generic"
#define VW 1
#define GROUP 1
typedef float vec;
static inline vec vzero(void) { return 0.0f; }
static inline vec vload(const float* p) { return *p; }
static inline void vstore(float* p, vec v) { *p = v; }
static inline vec vset1(float f) { return f; }
static inline vec vadd(vec a, vec b) { return a + b; }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
static inline float vsum(vec a) { return a; }
#define DENSE_GROUP 2
#endif

#define NV (BLOCK / VW) /* vectors per row of a block */
#define GROUP_MAX 6
#define DENSE_ROWS 4 /* weight rows per pass of the dense kernel: 4 sequential streams per thread */
/* elements ahead the row kernel prefetches in each of its rows, non-temporally, from 3 batch rows up:
 * on the development machine (Zen 5, 2 threads, slow memory state, Llama-3-8B's MLP shape) 4-16 rows
 * read 0.81-0.88 of the blocked kernel's GB/s with it, 0.75-0.85 without; 256-4096 elements ahead,
 * to L1 or L2, did no better */
#define DENSE_PREFETCH 512
#define DENSE_ROW_MAX 32 /* batch rows up to which a dense weight takes the row kernel; above, packed panels */
#define CHUNK_BYTES 16384 /* bytes of a block's rows per pass (in L1) */
/* The first batch group's pass over a block prefetches PREFETCH_BYTES ahead (8 KB) with the
 * non-temporal hint: the weights, read once per step, then displace less of the caches that the
 * rest of the decode step (norms, attention, the KV cache, the interpreter) runs from. On the
 * development machine this took a real decode step of the 1.97 GB random Llama from ~58 to
 * ~53-56 ms in the ~39 GB/s memory state and from ~40-44 to ~39-40 ms in the ~64 GB/s one (an
 * ad-hoc interleaved comparison, float32 weights; benchmarks/bench_cpu_vs_transformers.py has
 * the committed figures with it). */
#define PREFETCH_BYTES 8192

enum { WEIGHT_F32 = 0, WEIGHT_BF16 = 1, WEIGHT_F16 = 2 };
enum { PREFETCH_NONE = 0, PREFETCH_NTA = 1, PREFETCH_SPREAD = 2 };

const char* flexplan_gemv_isa(void) { return ISA; }
int flexplan_gemv_block(void) { return BLOCK; }

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__F16C__))
static inline float f16_to_f32(uint16_t h) { /* IEEE binary16 -> binary32, exact (subnormals too) */
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
  else if (exp) bits = sign | ((exp + 112u) << 23) | (man << 13);
  else if (!man) bits = sign;
  else { /* subnormal: normalise */
    int e = -1;
    uint32_t m = man;
    do { m <<= 1, ++e; } while (!(m & 0x400u));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
#endif

/* VW weights from element idx of p, as float32 (wt a constant at each call site). */
static inline __attribute__((always_inline)) vec wload(const void* p, int64_t idx, const int wt) {
  if (wt == WEIGHT_F32) return vload((const float*)p + idx);
  const uint16_t* h = (const uint16_t*)p + idx;
#if defined(__AVX512F__)
  const __m256i raw = _mm256_loadu_si256((const __m256i*)h);
  if (wt == WEIGHT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  return _mm512_cvtph_ps(raw);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m128i raw = _mm_loadu_si128((const __m128i*)h);
  if (wt == WEIGHT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
#if defined(__F16C__)
  return _mm256_cvtph_ps(raw);
#else
  float f[VW];
  for (int j = 0; j < VW; ++j) f[j] = f16_to_f32(h[j]);
  return _mm256_loadu_ps(f);
#endif
#else
  if (wt == WEIGHT_BF16) {
    const uint32_t bits = (uint32_t)h[0] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
  }
  return f16_to_f32(h[0]);
#endif
}

/* Interleave within 128-bit lanes: 32-bit elements (unpacklo/hi_ps) and 64-bit pairs (unpacklo/hi_pd). */
#if defined(__AVX512F__)
#define VUNPACK(kind, a, b) _mm512_unpack##kind##_ps(a, b)
#define VUNPACK64(kind, a, b) _mm512_castpd_ps(_mm512_unpack##kind##_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)))
#elif defined(__AVX2__) && defined(__FMA__)
#define VUNPACK(kind, a, b) _mm256_unpack##kind##_ps(a, b)
#define VUNPACK64(kind, a, b) _mm256_castpd_ps(_mm256_unpack##kind##_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)))
#endif

/* r[j] = row j of a VW x VW tile -> r[c] = column c (in registers). Two in-lane stages shared by
 * both ISAs (after them u[4k + m], 128-bit lane L, holds column 4L + m of rows 4k..4k+3), then the
 * transpose of the 128-bit lanes across the VW/4 row groups. */
static inline __attribute__((always_inline)) void transpose_tile(vec* r) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  vec t[VW], u[VW];
  _Pragma("GCC unroll 8") for (int k = 0; k < VW / 2; ++k) {
    t[2 * k] = VUNPACK(lo, r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = VUNPACK(hi, r[2 * k], r[2 * k + 1]);
  }
  _Pragma("GCC unroll 4") for (int k = 0; k < VW / 4; ++k) {
    u[4 * k] = VUNPACK64(lo, t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = VUNPACK64(hi, t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = VUNPACK64(lo, t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = VUNPACK64(hi, t[4 * k + 1], t[4 * k + 3]);
  }
#endif
#if defined(__AVX512F__)
  _Pragma("GCC unroll 4") for (int m = 0; m < 4; ++m) { /* a 4 x 4 transpose of 128-bit lanes */
    const __m512 s0 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44), s1 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
    const __m512 s2 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44);
    const __m512 s3 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_f32x4(s0, s2, 0x88);
    r[4 + m] = _mm512_shuffle_f32x4(s0, s2, 0xDD);
    r[8 + m] = _mm512_shuffle_f32x4(s1, s3, 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(s1, s3, 0xDD);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  _Pragma("GCC unroll 4") for (int m = 0; m < 4; ++m) { /* a 2 x 2 transpose of 128-bit lanes */
    r[m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x20);
    r[4 + m] = _mm256_permute2f128_ps(u[m], u[4 + m], 0x31);
  }
#else
  (void)r; /* VW = 1: a 1 x 1 tile is its own transpose */
#endif
}

/* Rows [i0, i1) of one block p [in, 64] (weights of type wt) against nb batch rows of x,
 * accumulated into y (zeroed first when `first`); nb and wt are constants at each call site. */
static inline __attribute__((always_inline)) void block_rows(const void* p, const float* x, float* y, int64_t in,
                                                             int64_t out, int64_t i0, int64_t i1, int first,
                                                             int prefetch, int pass, int passes, const int nb,
                                                             const int wt) {
  vec acc[GROUP_MAX][NV];
  _Pragma("GCC unroll 8") for (int b = 0; b < nb; ++b)
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) acc[b][v] = first ? vzero() : vload(y + b * out + v * VW);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  int64_t spread = i0 + pass; /* the next row whose counterpart in the next chunk this pass fetches */
#endif
  for (int64_t i = i0; i < i1; ++i) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    const int row_bytes = BLOCK * (wt == WEIGHT_F32 ? 4 : 2);
    if (prefetch == PREFETCH_NTA) /* the one pass over a chunk: fetch ahead, non-temporally (see PREFETCH_BYTES) */
      _Pragma("GCC unroll 4") for (int l = 0; l < row_bytes / 64; ++l)
        _mm_prefetch((const char*)p + i * row_bytes + PREFETCH_BYTES + 64 * l, _MM_HINT_NTA);
    else if (prefetch == PREFETCH_SPREAD && i == spread) { /* see gemv_block */
      _Pragma("GCC unroll 4") for (int l = 0; l < row_bytes / 64; ++l)
        _mm_prefetch((const char*)p + (i + (i1 - i0)) * row_bytes + 64 * l, _MM_HINT_T0);
      spread += passes;
    }
#endif
    vec w[NV];
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) w[v] = wload(p, i * BLOCK + v * VW, wt);
    _Pragma("GCC unroll 8") for (int b = 0; b < nb; ++b) {
      const vec xb = vset1(x[b * in + i]);
      _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) acc[b][v] = vfma(w[v], xb, acc[b][v]);
    }
  }
  _Pragma("GCC unroll 8") for (int b = 0; b < nb; ++b)
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) vstore(y + b * out + v * VW, acc[b][v]);
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* AVX2 with several batch rows: a block's 64 columns in four panels of 16, each against up to
 * PANEL_ROWS batch rows (6 x 2 accumulators, 2 weight vectors and a broadcast: 15 of the 16
 * registers), so a step of i issues 12 FMAs for 8 loads, where the full-width row (8 weight loads
 * and a broadcast for 8 FMAs) is bound by the loads. The chunk stays in L1 across the panels; each
 * output still sums over i in the same order as block_rows, bit for bit. The first panel prefetches
 * to L1 (T0), not non-temporally: the three panels after it read the same lines. From PANEL_MIN_ROWS
 * rows only: below, the row passes (which fetch the next chunk under their arithmetic) are as fast
 * or faster, the weights' read and not the arithmetic bounding the product (the figures: git log). */
#define PANEL_ROWS 6
#define PANEL_COLS 16
#define PANEL_MIN_ROWS 160
static inline __attribute__((always_inline)) void panel_rows(const void* p, const float* x, float* y, int64_t in,
                                                             int64_t out, int64_t i0, int64_t i1, int first,
                                                             int prefetch, const int nb, const int wt, const int c0) {
  vec acc[PANEL_ROWS][2];
  _Pragma("GCC unroll 6") for (int b = 0; b < nb; ++b)
    _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) acc[b][v] = first ? vzero() : vload(y + b * out + c0 + v * VW);
  const int row_bytes = BLOCK * (wt == WEIGHT_F32 ? 4 : 2);
  for (int64_t i = i0; i < i1; ++i) {
    if (prefetch)
      _Pragma("GCC unroll 4") for (int l = 0; l < row_bytes / 64; ++l)
        _mm_prefetch((const char*)p + i * row_bytes + PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
    const vec w0 = wload(p, i * BLOCK + c0, wt), w1 = wload(p, i * BLOCK + c0 + VW, wt);
    _Pragma("GCC unroll 6") for (int b = 0; b < nb; ++b) {
      const vec xb = vset1(x[b * in + i]);
      acc[b][0] = vfma(w0, xb, acc[b][0]);
      acc[b][1] = vfma(w1, xb, acc[b][1]);
    }
  }
  _Pragma("GCC unroll 6") for (int b = 0; b < nb; ++b)
    _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) vstore(y + b * out + c0 + v * VW, acc[b][v]);
}

/* Batch rows [b, b + nb) of a chunk, nb <= PANEL_ROWS, panel by panel (the first call's first panel prefetches). */
static inline __attribute__((always_inline)) void panels(const void* p, const float* x, float* y, int64_t in,
                                                         int64_t out, int64_t i0, int64_t i1, int first,
                                                         int prefetch, int64_t nb, const int wt) {
  for (int c0 = 0; c0 < BLOCK; c0 += PANEL_COLS) {
    const int pf = prefetch && c0 == 0;
    switch (nb) {
      case 6: panel_rows(p, x, y, in, out, i0, i1, first, pf, 6, wt, c0); break;
      case 5: panel_rows(p, x, y, in, out, i0, i1, first, pf, 5, wt, c0); break;
      case 4: panel_rows(p, x, y, in, out, i0, i1, first, pf, 4, wt, c0); break;
      case 3: panel_rows(p, x, y, in, out, i0, i1, first, pf, 3, wt, c0); break;
      default: panel_rows(p, x, y, in, out, i0, i1, first, pf, 2, wt, c0); break;
    }
  }
}
#endif

/* One block k of y = x P^T (+ bias), weights of type wt: the block is walked in chunks of
 * CHUNK_BYTES (in L1), and every group of GROUP batch rows runs against a chunk before the next
 * chunk is read, so the weights stream from DRAM once whatever the batch. */
static inline __attribute__((always_inline)) void gemv_block(const void* P, const float* x, float* y,
                                                             const float* bias, int64_t out, int64_t in,
                                                             int64_t batch, int64_t k, const int wt) {
  const int64_t chunk = CHUNK_BYTES / (BLOCK * (wt == WEIGHT_F32 ? 4 : 2));
  const void* p = (const char*)P + k * in * BLOCK * (wt == WEIGHT_F32 ? 4 : 2);
  for (int64_t i0 = 0; i0 < in; i0 += chunk) {
    const int64_t i1 = i0 + chunk < in ? i0 + chunk : in;
#ifdef PANEL_ROWS
    if (batch >= PANEL_MIN_ROWS) {
      for (int64_t b = 0; b < batch; b += PANEL_ROWS) {
        const int64_t nb = batch - b < PANEL_ROWS ? batch - b : PANEL_ROWS;
        float* yb = y + b * out + k * BLOCK;
        if (nb == 1) block_rows(p, x + b * in, yb, in, out, i0, i1, i0 == 0, PREFETCH_NONE, 0, 1, 1, wt);
        else panels(p, x + b * in, yb, in, out, i0, i1, i0 == 0, b == 0, nb, wt);
      }
      continue;
    }
#endif
    /* One pass (a decode step's few rows): it fetches ahead itself. Several: each fetches a share of
     * the next chunk while the passes after the first compute from L1, so DRAM stays busy under
     * their arithmetic instead of idling until the next chunk's first pass. */
    const int passes = (int)((batch + GROUP - 1) / GROUP);
    for (int64_t b = 0; b < batch; b += GROUP) {
      const float* xb = x + b * in;
      float* yb = y + b * out + k * BLOCK;
      const int first = i0 == 0, pass = (int)(b / GROUP);
      const int pf = passes > 1 ? PREFETCH_SPREAD : PREFETCH_NTA;
      switch (batch - b < GROUP ? batch - b : GROUP) {
#if GROUP >= 6
        case 6: block_rows(p, xb, yb, in, out, i0, i1, first, pf, pass, passes, 6, wt); break;
        case 5: block_rows(p, xb, yb, in, out, i0, i1, first, pf, pass, passes, 5, wt); break;
        case 4: block_rows(p, xb, yb, in, out, i0, i1, first, pf, pass, passes, 4, wt); break;
        case 3: block_rows(p, xb, yb, in, out, i0, i1, first, pf, pass, passes, 3, wt); break;
        case 2: block_rows(p, xb, yb, in, out, i0, i1, first, pf, pass, passes, 2, wt); break;
#endif
        default: block_rows(p, xb, yb, in, out, i0, i1, first, pf, pass, passes, 1, wt); break;
      }
    }
  }
  if (bias)
    for (int64_t b = 0; b < batch; ++b)
      for (int v = 0; v < NV; ++v) {
        float* yv = y + b * out + k * BLOCK + v * VW;
        vstore(yv, vadd(vload(yv), vload(bias + k * BLOCK + v * VW)));
      }
}

/* y = x P^T (+ bias) for any batch, P of weight type wtype (WEIGHT_*): each thread takes whole
 * blocks. Returns 0, or -1 for an unknown weight type. */
int flexplan_blocked_gemv(const void* P, int64_t wtype, const float* x, float* y, const float* bias, int64_t out,
                          int64_t in, int64_t batch) {
  const int64_t blocks = out / BLOCK;
  if (wtype != WEIGHT_F32 && wtype != WEIGHT_BF16 && wtype != WEIGHT_F16) return -1;
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < blocks; ++k) {
    if (wtype == WEIGHT_F32) gemv_block(P, x, y, bias, out, in, batch, k, WEIGHT_F32);
    else if (wtype == WEIGHT_BF16) gemv_block(P, x, y, bias, out, in, batch, k, WEIGHT_BF16);
    else gemv_block(P, x, y, bias, out, in, batch, k, WEIGHT_F16);
  }
  return 0;
}

/* The routed experts of one MoE layer in one call: n experts (ids experts[0..n)) of a stack of
 * blocked weights P [E, out/64, in, 64] (expert e at P + e * expert_stride elements), expert j
 * computing rows [row_start[j], row_start[j + 1]) of x [rows, in] into the same rows of y
 * [rows, out], each with its bias row (bias [E, out] float32, or NULL). The (expert, block) pairs
 * are shared among the threads in order, so each thread streams its experts' blocks one after
 * another, and one OpenMP region serves the whole layer instead of one per expert and
 * projection. Each expert's rows come out exactly as flexplan_blocked_gemv gives them. Returns 0,
 * or -1 for an unknown weight type. */
int flexplan_grouped_gemv(const void* P, int64_t wtype, int64_t expert_stride, const int64_t* experts,
                          const int64_t* row_start, int64_t n, const float* x, float* y, const float* bias,
                          int64_t out, int64_t in) {
  const int64_t blocks = out / BLOCK, esize = wtype == WEIGHT_F32 ? 4 : 2;
  if (wtype != WEIGHT_F32 && wtype != WEIGHT_BF16 && wtype != WEIGHT_F16) return -1;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < n * blocks; ++item) {
    const int64_t j = item / blocks, k = item % blocks, r0 = row_start[j], rows = row_start[j + 1] - r0;
    if (rows <= 0) continue;
    const void* Pe = (const char*)P + experts[j] * expert_stride * esize;
    const float* be = bias ? bias + experts[j] * out : NULL;
    if (wtype == WEIGHT_F32) gemv_block(Pe, x + r0 * in, y + r0 * out, be, out, in, rows, k, WEIGHT_F32);
    else if (wtype == WEIGHT_BF16) gemv_block(Pe, x + r0 * in, y + r0 * out, be, out, in, rows, k, WEIGHT_BF16);
    else gemv_block(Pe, x + r0 * in, y + r0 * out, be, out, in, rows, k, WEIGHT_F16);
  }
  return 0;
}

/* The routing of one MoE layer laid out for flexplan_grouped_gemv, as transformers' eager loop
 * takes it: pair p = choice * tokens + token (the [k, tokens] order of index^T) routed to expert
 * index[token, choice] (index [tokens, k] int64); the pairs stably sorted by expert (a counting
 * sort: each expert's pairs in increasing p, as torch.argsort(stable=True) orders them), those
 * whose expert is outside [0, n_experts) (sentinels: padding, expert parallelism) dropped. Writes
 * pairs[] (the kept pairs in that order), experts[] (the n selected ids, ascending), row_start[]
 * (n + 1 offsets into pairs) and, when x [tokens, in] is given, h [kept, in]: row r the token row
 * of pairs[r]. Returns n, or -1 when it cannot allocate its counters. */
int64_t flexplan_route_experts(const int64_t* index, int64_t tokens, int64_t k, int64_t n_experts, const float* x,
                               int64_t in, int64_t* pairs, int64_t* experts, int64_t* row_start, float* h) {
  int64_t* next = calloc((size_t)n_experts + 1, sizeof(int64_t));
  if (!next) return -1;
  for (int64_t p = 0; p < tokens * k; ++p) {
    const int64_t e = index[(p % tokens) * k + p / tokens];
    if (e >= 0 && e < n_experts) ++next[e];
  }
  int64_t n = 0, start = 0;
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t c = next[e];
    next[e] = start;
    if (c) {
      experts[n] = e;
      row_start[n++] = start;
    }
    start += c;
  }
  row_start[n] = start;
  for (int64_t p = 0; p < tokens * k; ++p) {
    const int64_t t = p % tokens, e = index[t * k + p / tokens];
    if (e < 0 || e >= n_experts) continue;
    const int64_t r = next[e]++;
    pairs[r] = p;
    if (x) memcpy(h + r * in, x + t * in, (size_t)in * sizeof(float));
  }
  free(next);
  return n;
}

/* The routed experts' weighted sum, as transformers' eager loop forms it: out [tokens, width] =
 * 0, then for each routed row r in order, out[token] += h[r] * weights[token, choice] (pair
 * pairs[r] as flexplan_route_experts numbers them; weights [tokens, k] float32). Each product is
 * rounded before its sum (no fused multiply-add: torch's mul then index_add_ round twice) and
 * each element takes its sums in row order, so the result is eager's bit for bit; threads share
 * the columns, never a column. */
__attribute__((optimize("fp-contract=off"))) void flexplan_scatter_experts(
    const float* h, const float* weights, const int64_t* pairs, int64_t rows, int64_t tokens, int64_t k, float* out,
    int64_t width) {
  const int64_t chunk = 256, chunks = (width + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) if (rows * width >= (1 << 18))
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t j0 = c * chunk, j1 = j0 + chunk < width ? j0 + chunk : width;
    for (int64_t t = 0; t < tokens; ++t) memset(out + t * width + j0, 0, (size_t)(j1 - j0) * sizeof(float));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = pairs[r] % tokens;
      const float w = weights[t * k + pairs[r] / tokens];
      const float* hr = h + r * width;
      float* o = out + t * width;
      for (int64_t j = j0; j < j1; ++j) {
        const float product = hr[j] * w;
        o[j] += product;
      }
    }
  }
}

/* The same product on a DENSE row-major W [out, in] (the layout a weight keeps where it must also
 * cross to an accelerator as it is: the split-points policy's pinned layers). Up to
 * DENSE_ROW_MAX batch rows: each thread takes groups of DENSE_ROWS rows and walks them together
 * (DENSE_ROWS sequential streams) against DENSE_GROUP batch rows of x at a time, y[b, o] = sum_i
 * W[o, i] x[b, i] summed in VW lanes, then across them; the rows of a group are re-read from L1/L2
 * for each further batch group, so DRAM sees them once per step. `in` must be a multiple of VW. */
static inline __attribute__((always_inline)) void dense_rows(const void* W, const float* x, float* y, int64_t in,
                                                             int64_t out, int64_t o0, const int nr, const int nb,
                                                             const int prefetch, const int wt) {
  vec acc[DENSE_ROWS][DENSE_GROUP];
  _Pragma("GCC unroll 4") for (int r = 0; r < nr; ++r)
    _Pragma("GCC unroll 6") for (int b = 0; b < nb; ++b) acc[r][b] = vzero();
  for (int64_t i = 0; i < in; i += VW) {
    vec w[DENSE_ROWS];
    _Pragma("GCC unroll 4") for (int r = 0; r < nr; ++r) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
      if (prefetch && nb > 2 && (i * (wt == WEIGHT_F32 ? 4 : 2)) % 64 == 0)
        _mm_prefetch((const char*)W + ((o0 + r) * in + i + DENSE_PREFETCH) * (wt == WEIGHT_F32 ? 4 : 2), _MM_HINT_NTA);
#endif
      w[r] = wload(W, (o0 + r) * in + i, wt);
    }
    _Pragma("GCC unroll 6") for (int b = 0; b < nb; ++b) {
      const vec xb = vload(x + b * in + i);
      _Pragma("GCC unroll 4") for (int r = 0; r < nr; ++r) acc[r][b] = vfma(w[r], xb, acc[r][b]);
    }
  }
  _Pragma("GCC unroll 4") for (int r = 0; r < nr; ++r)
    _Pragma("GCC unroll 6") for (int b = 0; b < nb; ++b) y[b * out + o0 + r] = vsum(acc[r][b]);
}

static inline __attribute__((always_inline)) void dense_group(const void* W, const float* x, float* y, int64_t in,
                                                              int64_t out, int64_t batch, int64_t o0, const int nr,
                                                              const int wt) {
  for (int64_t b = 0; b < batch; b += DENSE_GROUP) {
    const int64_t nb = batch - b < DENSE_GROUP ? batch - b : DENSE_GROUP;
    const float* xb = x + b * in;
    float* yb = y + b * out;
    switch (nb) {
#if DENSE_GROUP >= 5
      case 5: dense_rows(W, xb, yb, in, out, o0, nr, 5, b == 0, wt); break;
      case 4: dense_rows(W, xb, yb, in, out, o0, nr, 4, b == 0, wt); break;
      case 3: dense_rows(W, xb, yb, in, out, o0, nr, 3, b == 0, wt); break;
#endif
      case 2: dense_rows(W, xb, yb, in, out, o0, nr, 2, b == 0, wt); break;
      default: dense_rows(W, xb, yb, in, out, o0, nr, 1, b == 0, wt); break;
    }
  }
}

/* More batch rows (above DENSE_ROW_MAX): each thread takes panels of 64 rows of W and packs each
 * chunk of a panel (CHUNK_BYTES of float32) into the blocked layout in a buffer of its own,
 * transposing VW x VW tiles in registers (16-bit weights widened), then runs the blocked kernel's
 * inner loop (block_rows) on it for every batch group: the packing is paid once per weight and
 * step, the compute at the blocked kernel's rate (on the development machine the row kernel
 * above topped at about half of it, ~230 against ~460 GFLOP/s at 128 rows, whatever its chunking;
 * stock F.linear ~160). */
static inline __attribute__((always_inline)) void dense_panel(const void* W, const float* x, float* y,
                                                              const float* bias, int64_t in, int64_t out,
                                                              int64_t batch, int64_t o0, float* buf, const int wt) {
  const int64_t chunk = CHUNK_BYTES / (BLOCK * 4);
  for (int64_t i0 = 0; i0 < in; i0 += chunk) {
    const int64_t i1 = i0 + chunk < in ? i0 + chunk : in;
    for (int64_t i = i0; i < i1; i += VW)
      _Pragma("GCC unroll 4") for (int c0 = 0; c0 < BLOCK; c0 += VW) {
        vec r[VW];
        _Pragma("GCC unroll 16") for (int j = 0; j < VW; ++j) r[j] = wload(W, (o0 + c0 + j) * in + i, wt);
        transpose_tile(r);
        _Pragma("GCC unroll 16") for (int j = 0; j < VW; ++j) vstore(buf + (i - i0 + j) * BLOCK + c0, r[j]);
      }
    for (int64_t b = 0; b < batch; b += GROUP) {
      const float* xb = x + b * in + i0;
      float* yb = y + b * out + o0;
      const int first = i0 == 0;
      switch (batch - b < GROUP ? batch - b : GROUP) {
#if GROUP >= 6
        case 6: block_rows(buf, xb, yb, in, out, 0, i1 - i0, first, PREFETCH_NONE, 0, 1, 6, WEIGHT_F32); break;
        case 5: block_rows(buf, xb, yb, in, out, 0, i1 - i0, first, PREFETCH_NONE, 0, 1, 5, WEIGHT_F32); break;
        case 4: block_rows(buf, xb, yb, in, out, 0, i1 - i0, first, PREFETCH_NONE, 0, 1, 4, WEIGHT_F32); break;
        case 3: block_rows(buf, xb, yb, in, out, 0, i1 - i0, first, PREFETCH_NONE, 0, 1, 3, WEIGHT_F32); break;
        case 2: block_rows(buf, xb, yb, in, out, 0, i1 - i0, first, PREFETCH_NONE, 0, 1, 2, WEIGHT_F32); break;
#endif
        default: block_rows(buf, xb, yb, in, out, 0, i1 - i0, first, PREFETCH_NONE, 0, 1, 1, WEIGHT_F32); break;
      }
    }
  }
  if (bias)
    for (int64_t b = 0; b < batch; ++b)
      for (int v = 0; v < NV; ++v) {
        float* yv = y + b * out + o0 + v * VW;
        vstore(yv, vadd(vload(yv), vload(bias + o0 + v * VW)));
      }
}

/* y = x W^T (+ bias) for a dense W [out, in] of weight type wtype: above DENSE_ROW_MAX batch rows
 * its whole 64-row panels packed chunk by chunk (dense_panel), the rows left (all of them up to
 * DENSE_ROW_MAX batch rows) by the row kernel. Returns 0, or -1 for an unknown weight type or `in`
 * not a multiple of the vector width. */
int flexplan_dense_gemv(const void* W, int64_t wtype, const float* x, float* y, const float* bias, int64_t out,
                        int64_t in, int64_t batch) {
  if (wtype != WEIGHT_F32 && wtype != WEIGHT_BF16 && wtype != WEIGHT_F16) return -1;
  if (in % VW) return -1;
  const int64_t panels = batch > DENSE_ROW_MAX ? out / BLOCK : 0, first_row = panels * BLOCK;
  if (panels) {
#pragma omp parallel
    {
      float buf[CHUNK_BYTES / 4] __attribute__((aligned(64))); /* this thread's packed chunk */
#pragma omp for schedule(static)
      for (int64_t k = 0; k < panels; ++k) {
        if (wtype == WEIGHT_F32) dense_panel(W, x, y, bias, in, out, batch, k * BLOCK, buf, WEIGHT_F32);
        else if (wtype == WEIGHT_BF16) dense_panel(W, x, y, bias, in, out, batch, k * BLOCK, buf, WEIGHT_BF16);
        else dense_panel(W, x, y, bias, in, out, batch, k * BLOCK, buf, WEIGHT_F16);
      }
    }
  }
  const int64_t groups = (out - first_row + DENSE_ROWS - 1) / DENSE_ROWS;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t o0 = first_row + g * DENSE_ROWS;
    const int nr = out - o0 < DENSE_ROWS ? (int)(out - o0) : DENSE_ROWS;
    for (int r0 = 0; r0 < nr; r0 += (nr == DENSE_ROWS ? DENSE_ROWS : 1)) {
      if (nr == DENSE_ROWS) {
        if (wtype == WEIGHT_F32) dense_group(W, x, y, in, out, batch, o0, DENSE_ROWS, WEIGHT_F32);
        else if (wtype == WEIGHT_BF16) dense_group(W, x, y, in, out, batch, o0, DENSE_ROWS, WEIGHT_BF16);
        else dense_group(W, x, y, in, out, batch, o0, DENSE_ROWS, WEIGHT_F16);
      } else {
        if (wtype == WEIGHT_F32) dense_group(W, x, y, in, out, batch, o0 + r0, 1, WEIGHT_F32);
        else if (wtype == WEIGHT_BF16) dense_group(W, x, y, in, out, batch, o0 + r0, 1, WEIGHT_BF16);
        else dense_group(W, x, y, in, out, batch, o0 + r0, 1, WEIGHT_F16);
      }
    }
  }
  if (bias)
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t o = first_row; o < out; ++o) y[b * out + o] += bias[o];
  return 0;
}
