/* flexplan's CPU GEMV for decode, on float32 weights in a column-blocked layout.
 *
 * The weight of an nn.Linear, W [out, in] (out a multiple of 64), is held as P [out/64, in, 64]:
 * P[k, i, c] = W[64 k + c, i]. For each block k, y[b, 64 k + c] = sum_i P[k, i, c] * x[b, i]
 * (+ bias[64 k + c]) for every batch row b < batch. x is [batch, in] and y [batch, out], both
 * float32 and contiguous; bias is float32 or NULL.
 *
 * Why this layout: a batch-1 decode step is one GEMV per weight matrix and should read the
 * weights at memory bandwidth. In the blocked layout each thread reads its blocks as ONE
 * sequential stream (64 floats of row i, then of row i+1, ...), which the hardware prefetcher
 * follows at full speed; row-major GEMVs keep 4-8 row streams per thread in flight and, on the
 * development machine (2 Zen 4 cores), stall at ~50 GB/s where the memory gives ~66-70 GB/s
 * (benchmarks/bench_cpu_linear.py has the measured figures). With batch > 1 the kernel runs
 * GROUP batch rows (6 with AVX-512, 1 otherwise) against an L1-sized chunk of a block, then the
 * next group against the same chunk while it is still in L1/L2, so DRAM sees the weights once
 * per step. Prefill comes here too, its tokens as the batch rows (flexplan/executor/cpu_linear.py);
 * only non-float32 inputs take torch.matmul on the blocks.
 *
 * Compiled on first use by flexplan/executor/native.py with -O3 -march=native -fopenmp. torch
 * loads its own libgomp.so.1 first, so this library binds to the same OpenMP runtime: one
 * thread pool, sized by torch.set_num_threads. ISA paths: AVX-512F, AVX2 + FMA, plain C.
 */
#include <stdint.h>
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
#endif

#define NV (BLOCK / VW) /* vectors per row of a block */
#define GROUP_MAX 6
#define CHUNK (16384 / (BLOCK * 4)) /* rows of a block per pass: 16 KB */
/* The first batch group's pass over a block prefetches the rows PREFETCH_ROWS ahead (8 KB) with
 * the non-temporal hint: the weights, read once per step, then displace less of the caches that
 * the rest of the decode step (norms, attention, the KV cache, the interpreter) runs from. On the
 * development machine this took a real decode step of the 1.97 GB random Llama from ~58 to
 * ~53-56 ms in the ~39 GB/s memory state and from ~40-44 to ~39-40 ms in the ~64 GB/s one (an
 * ad-hoc interleaved comparison; benchmarks/bench_cpu_vs_transformers.py has the committed
 * figures with it). */
#define PREFETCH_ROWS 32

const char* flexplan_gemv_isa(void) { return ISA; }
int flexplan_gemv_block(void) { return BLOCK; }

/* Rows [i0, i1) of one block p [in, 64] against nb (a constant at each call site) batch rows of
 * x, accumulated into y (zeroed first when `first`). */
static inline __attribute__((always_inline)) void block_rows(const float* p, const float* x, float* y,
                                                             int64_t in, int64_t out, int64_t i0, int64_t i1,
                                                             int first, int prefetch, const int nb) {
  vec acc[GROUP_MAX][NV];
  _Pragma("GCC unroll 8") for (int b = 0; b < nb; ++b)
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) acc[b][v] = first ? vzero() : vload(y + b * out + v * VW);
  for (int64_t i = i0; i < i1; ++i) {
    const float* row = p + i * BLOCK;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if (prefetch) /* the first pass over a chunk: fetch ahead, non-temporally (see PREFETCH_ROWS) */
      _Pragma("GCC unroll 4") for (int l = 0; l < BLOCK * 4 / 64; ++l)
        _mm_prefetch((const char*)(row + PREFETCH_ROWS * BLOCK) + 64 * l, _MM_HINT_NTA);
#endif
    vec w[NV];
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) w[v] = vload(row + v * VW);
    _Pragma("GCC unroll 8") for (int b = 0; b < nb; ++b) {
      const vec xb = vset1(x[b * in + i]);
      _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) acc[b][v] = vfma(w[v], xb, acc[b][v]);
    }
  }
  _Pragma("GCC unroll 8") for (int b = 0; b < nb; ++b)
    _Pragma("GCC unroll 64") for (int v = 0; v < NV; ++v) vstore(y + b * out + v * VW, acc[b][v]);
}

/* y = x P^T (+ bias) for any batch: each thread takes whole blocks; a block is walked in chunks
 * of CHUNK rows (16 KB, in L1), and every group of GROUP batch rows runs against a chunk before
 * the next chunk is read, so the weights stream from DRAM once whatever the batch. */
void flexplan_blocked_gemv_f32(const float* P, const float* x, float* y, const float* bias, int64_t out,
                               int64_t in, int64_t batch) {
  const int64_t blocks = out / BLOCK;
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < blocks; ++k) {
    const float* p = P + k * in * BLOCK;
    for (int64_t i0 = 0; i0 < in; i0 += CHUNK) {
      const int64_t i1 = i0 + CHUNK < in ? i0 + CHUNK : in;
      for (int64_t b = 0; b < batch; b += GROUP) {
        const float* xb = x + b * in;
        float* yb = y + b * out + k * BLOCK;
        const int first = i0 == 0;
        switch (batch - b < GROUP ? batch - b : GROUP) {
#if GROUP >= 6
          case 6: block_rows(p, xb, yb, in, out, i0, i1, first, b == 0, 6); break;
          case 5: block_rows(p, xb, yb, in, out, i0, i1, first, b == 0, 5); break;
          case 4: block_rows(p, xb, yb, in, out, i0, i1, first, b == 0, 4); break;
          case 3: block_rows(p, xb, yb, in, out, i0, i1, first, b == 0, 3); break;
          case 2: block_rows(p, xb, yb, in, out, i0, i1, first, b == 0, 2); break;
#endif
          default: block_rows(p, xb, yb, in, out, i0, i1, first, b == 0, 1); break;
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
}
