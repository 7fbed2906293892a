// Weight-only quantized products for XLA:CPU through jax.ffi (see README.md next to this file).
//
// y [M, N] float32 = x [M, K] float32 . W^T, W [N, K] stored output-major as
//   int8: q int8 [N, K] with one scale per output, s [N];
//   int4: q uint8 [N, K/2] (even k in the low nibble, odd k in the high one, signed), s [N, K/g];
//   float32 (the serving engine's layout of a float model): w float32 [N, K], s [N].
// Decode reads every weight once per token, so the loop streams each output's row of W once and
// multiplies it against all M (<= qmatmul.KERNEL_MAX_ROWS) activation rows held in cache; outputs are split
// over the kernel's own worker threads (`Workers`). AVX2 + FMA where the compiler targets them
// (-march=native), scalar otherwise.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <memory>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define JF_AVX2 1
#endif

#include "xla/ffi/api/ffi.h"
#include "workers.h"

namespace ffi = xla::ffi;

namespace {

using jaxformer::ParallelFor;

// f(std::integral_constant<int, c>{}) with c = min(n, Max), at least 1: a count known at run time as a template
// argument (the tile shapes below are templates so their accumulators stay in registers).
template <int Max, typename F>
inline void WithCount(int64_t n, F f) {
  if constexpr (Max <= 1) {
    f(std::integral_constant<int, 1>{});
  } else {
    if (n >= Max) return f(std::integral_constant<int, Max>{});
    WithCount<Max - 1>(n, f);
  }
}

constexpr int64_t kRowBlock = 4;  // activation rows per pass over a weight row (accumulators in registers)
// Software prefetch of the rows this many tiles ahead: without it GPT-2's int8 LM head (38 MB) read
// at about a third of the bandwidth it reaches with it (1 and 2 tiles measured the same).
#ifndef JF_AHEAD
#define JF_AHEAD 2
#endif
constexpr int64_t kAhead = JF_AHEAD;
// Calls of at least this many rows take the blocked product (`GemmOutputs`, AVX-512 builds); int4's streaming
// loop keeps two partial sums per (row, output), so it hands over sooner. Set from a by-hand comparison of
// the two loops on GPT-2's products at 8-64 rows (a throwaway build with JF_GEMM_ROWS=1; noisy, not kept):
// the streaming loop led at 8 rows, the blocked one from ~16 rows for int4 and ~32 for int8. Since the blocked
// product runs on XLA's pool, int8's 32-row prefill takes 0.77x float32's time through it against 0.96-1.00x
// through the streaming loop, which still led or tied at 16-24 rows (`benchmarks/prefill_rows.py --bits 8`, two
// builds alternated; BENCHMARKS.md "Quantized weights, part 7").
#ifndef JF_GEMM_ROWS
#define JF_GEMM_ROWS 25
#endif
#ifndef JF_GEMM_ROWS_INT4
#define JF_GEMM_ROWS_INT4 16
#endif
constexpr int64_t kGemmRows = JF_GEMM_ROWS, kGemmRowsInt4 = JF_GEMM_ROWS_INT4;

#ifdef JF_AVX2
inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 8 int8 weights at p -> 8 floats
inline __m256 Load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// One pass over NB weight rows (outputs n .. n + NB - 1) for R activation rows from m0: R x NB
// independent accumulators, so the FMA chains overlap and each weight load serves R rows.
template <int R, int NB>
void Int8Tile(const float* x, const int8_t* q, const float* s, float* y, int64_t m0, int64_t K, int64_t N,
              int64_t n) {
  float acc[R][NB] = {};
  int64_t k = 0;
#ifdef JF_AVX2
  __m256 a[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) a[r][b] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    if ((k & 63) == 0)  // the next tiles' rows: DRAM streams several rows at once
      for (int b = 0; b < NB; ++b) _mm_prefetch(reinterpret_cast<const char*>(q + (n + kAhead * NB + b) * K + k), _MM_HINT_T0);
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + (m0 + r) * K + k);
    for (int b = 0; b < NB; ++b) {
      const __m256 w = Load8(q + (n + b) * K + k);
      for (int r = 0; r < R; ++r) a[r][b] = _mm256_fmadd_ps(w, xv[r], a[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = Sum8(a[r][b]);
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] += static_cast<float>(q[(n + b) * K + k]) * x[(m0 + r) * K + k];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) y[(m0 + r) * N + n + b] = acc[r][b] * s[n + b];
}

template <int R, int NB>
void Int8Rows(const float* x, const int8_t* q, const float* s, float* y, int64_t m0, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) Int8Tile<R, NB>(x, q, s, y, m0, K, N, n);
  for (; n < n1; ++n) Int8Tile<R, 1>(x, q, s, y, m0, K, N, n);
}

#if defined(__AVX512F__)
#define JF_DECODE16 1
// Decode steps of several sequences (kDecode16Rows <= M < the blocked product's rows), AVX-512: NB outputs' weights
// converted once per 16 inputs and multiplied against R rows (R x NB 16-lane accumulators, in one flat array: as a
// [R][NB] array GCC stored all of them to the stack at every step, seen in objdump; K's tail in scalars). The rows
// go in groups of up to 8 over each pair of outputs, whose weights stay in L1 between groups. GPT-2's batch-8
// decode step: 0.53-0.55x of float32's, 0.64-0.66x on the 8-lane loop (BENCHMARKS.md "Quantized weights, part 9").
// Unlike that loop, a row's sum here depends on whether the call has 5+ rows (lanes of 16, not 8).
constexpr int64_t kDecode16Rows = 5;
template <int R, int NB>
void Int8Tile16(const float* x, const int8_t* q, const float* s, float* y, int64_t m0, int64_t K, int64_t N,
                int64_t n) {
  __m512 a[R * NB];
#pragma GCC unroll 16
  for (int i = 0; i < R * NB; ++i) a[i] = _mm512_setzero_ps();
  const int64_t K16 = K / 16 * 16;
  for (int64_t k = 0; k < K16; k += 16) {
    if (m0 == 0 && (k & 63) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(q + (n + kAhead * NB) * K + k), _MM_HINT_T0);
      if (NB > 1) _mm_prefetch(reinterpret_cast<const char*>(q + (n + kAhead * NB + 1) * K + k), _MM_HINT_T0);
    }
    __m512 w[NB];
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) w[b] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(q + (n + b) * K + k))));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + r) * K + k);
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) a[r * NB + b] = _mm512_fmadd_ps(w[b], xv, a[r * NB + b]);
    }
  }
  alignas(64) float t[R * NB][16];
#pragma GCC unroll 16
  for (int i = 0; i < R * NB; ++i) _mm512_store_ps(t[i], a[i]);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      const float* v = t[r * NB + b];
      float sum = Sum8(_mm256_add_ps(_mm256_load_ps(v), _mm256_load_ps(v + 8)));
      for (int64_t j = K16; j < K; ++j) sum += static_cast<float>(q[(n + b) * K + j]) * x[(m0 + r) * K + j];  // K's tail
      y[(m0 + r) * N + n + b] = sum * s[n + b];
    }
}

// Outputs [n0, n1) of all M rows: tiles of NB outputs, each over every group of up to 8 rows.
inline void Int8Rows16(const float* x, const int8_t* q, const float* s, float* y, int64_t M, int64_t K, int64_t N,
                       int64_t n0, int64_t n1) {
  constexpr int NB = 2;
  for (int64_t n = n0; n < n1; n += NB) {
    const bool full = n + NB <= n1;
    for (int64_t m = 0; m < M; m += 8)
      WithCount<8>(M - m, [&](auto R) {
        full ? Int8Tile16<R, NB>(x, q, s, y, m, K, N, n) : Int8Tile16<R, 1>(x, q, s, y, m, K, N, n);
      });
  }
}
#endif

// int4: xe/xo [M, K/2] are the even and odd columns of x (the low and high nibbles' partners). Within a
// group the integer weights meet x unscaled, in two accumulators (low and high nibbles: independent FMA
// chains); the group's sum is then scaled once into the total (sum_g s_g * (w_g . x_g), the same
// product as dequantizing first, rounded in a different order).
template <int R, int NB>
void Int4Tile(const float* xe, const float* xo, const uint8_t* q, const float* s, float* y, int64_t m0,
              int64_t K, int64_t N, int64_t groups, int64_t n) {
  const int64_t half = K / 2, gh = half / groups;  // bytes per group
  float acc[R][NB] = {};
#ifdef JF_AVX2
  __m256 a[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) a[r][b] = _mm256_setzero_ps();
#endif
  for (int64_t g = 0; g < groups; ++g) {
    int64_t j = g * gh;
    const int64_t end = j + gh;
#ifdef JF_AVX2
    if (gh >= 8) {
      __m256 pl[R][NB], ph[R][NB];
      for (int r = 0; r < R; ++r)
        for (int b = 0; b < NB; ++b) pl[r][b] = ph[r][b] = _mm256_setzero_ps();
      for (; j + 8 <= end; j += 8) {
        if ((j & 63) == 0)  // as in Int8Tile: the next tiles' rows
          for (int b = 0; b < NB; ++b)
            _mm_prefetch(reinterpret_cast<const char*>(q + (n + kAhead * NB + b) * half + j), _MM_HINT_T0);
        __m256 e[R], o[R];
        for (int r = 0; r < R; ++r) {
          e[r] = _mm256_loadu_ps(xe + (m0 + r) * half + j);
          o[r] = _mm256_loadu_ps(xo + (m0 + r) * half + j);
        }
        for (int b = 0; b < NB; ++b) {
          const __m256i v = _mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (n + b) * half + j)));  // sign-extended bytes
          // lo * 2^28 and hi * 16, exactly (the nibble left where it lies: one integer op each, not two);
          // the powers of two come off the group's sums below, exactly too
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_slli_epi32(v, 28));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(-16)));
          for (int r = 0; r < R; ++r) {
            pl[r][b] = _mm256_fmadd_ps(lo, e[r], pl[r][b]);
            ph[r][b] = _mm256_fmadd_ps(hi, o[r], ph[r][b]);
          }
        }
      }
      const __m256 lo_unit = _mm256_set1_ps(1.0f / (1 << 28)), hi_unit = _mm256_set1_ps(1.0f / 16);
      for (int b = 0; b < NB; ++b) {
        const __m256 sv = _mm256_set1_ps(s[(n + b) * groups + g]);
        for (int r = 0; r < R; ++r) {
          const __m256 sum = _mm256_fmadd_ps(pl[r][b], lo_unit, _mm256_mul_ps(ph[r][b], hi_unit));
          a[r][b] = _mm256_fmadd_ps(sum, sv, a[r][b]);
        }
      }
    }
#endif
    float part[R][NB] = {};
    for (; j < end; ++j)
      for (int b = 0; b < NB; ++b) {
        const int8_t v = static_cast<int8_t>(q[(n + b) * half + j]);
        const float lo = static_cast<float>(static_cast<int8_t>(v << 4) >> 4), hi = static_cast<float>(v >> 4);
        for (int r = 0; r < R; ++r) {
          const int64_t o = (m0 + r) * half + j;
          part[r][b] += lo * xe[o] + hi * xo[o];
        }
      }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] += part[r][b] * s[(n + b) * groups + g];
  }
#ifdef JF_AVX2
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] += Sum8(a[r][b]);
#endif
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) y[(m0 + r) * N + n + b] = acc[r][b];
}

template <int R, int NB>
void Int4Rows(const float* xe, const float* xo, const uint8_t* q, const float* s, float* y, int64_t m0, int64_t K,
              int64_t N, int64_t groups, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) Int4Tile<R, NB>(xe, xo, q, s, y, m0, K, N, groups, n);
  for (; n < n1; ++n) Int4Tile<R, 1>(xe, xo, q, s, y, m0, K, N, groups, n);
}

// float32 output-major ("bits 32"): w [N, K] float32, s [N] (ones for a float model; kept so the three
// formats share one signature). Wider vectors than the int8 path: with AVX-512 a pass of 6 rows x 4 outputs
// holds 24 accumulators, each weight vector serving 6 rows and each activation vector 4 outputs. Every
// output is the same sum whatever the row count or tile: lanes over k in steps of the vector width, the
// lanes added, then the tail; so a row's result does not depend on the other rows in the call.
#if defined(__AVX512F__)
using VecF = __m512;
constexpr int64_t kLanes = 16;
inline VecF VZero() { return _mm512_setzero_ps(); }
inline VecF VLoad(const float* p) { return _mm512_loadu_ps(p); }
inline VecF VFma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline float VSum(VecF v) { return _mm512_reduce_add_ps(v); }
#elif defined(JF_AVX2)
using VecF = __m256;
constexpr int64_t kLanes = 8;
inline VecF VZero() { return _mm256_setzero_ps(); }
inline VecF VLoad(const float* p) { return _mm256_loadu_ps(p); }
inline VecF VFma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline float VSum(VecF v) { return Sum8(v); }
#else
constexpr int64_t kLanes = 1;  // the scalar loop: a prefetch line per input
#endif

// Pass g of G over these NB outputs (one per row group) prefetches its share of the lines of the outputs kAhead
// tiles on, one line a step: spread over every pass, DRAM keeps streaming while the cached passes compute (all
// in the first pass: 16-row decode products 30 ms; spread: 25.5 ms on GPT-2's).
template <int R, int NB>
void F32Tile(const float* x, const float* w, const float* s, float* y, int64_t m0, int64_t K, int64_t N,
             int64_t n, int64_t g, int64_t G) {
  const int64_t lines = (K + kLanes - 1) / kLanes, share = (lines + G - 1) / G;
  float acc[R][NB] = {};
  int64_t k = 0;
#ifdef JF_AVX2
  VecF a[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) a[r][b] = VZero();
  for (; k + kLanes <= K; k += kLanes) {
    if ((k / kLanes) % G == 0) {
      const int64_t line = g * share + (k / kLanes) / G;
      if (line < lines)
        for (int b = 0; b < NB; ++b)
          _mm_prefetch(reinterpret_cast<const char*>(w + (n + kAhead * NB + b) * K + line * kLanes), _MM_HINT_T1);
    }
    VecF xv[R];
    for (int r = 0; r < R; ++r) xv[r] = VLoad(x + (m0 + r) * K + k);
    for (int b = 0; b < NB; ++b) {
      const VecF wv = VLoad(w + (n + b) * K + k);
      for (int r = 0; r < R; ++r) a[r][b] = VFma(wv, xv[r], a[r][b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = VSum(a[r][b]);
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b)  // fused explicitly: the compiler's contraction may differ between tiles
        acc[r][b] = std::fma(w[(n + b) * K + k], x[(m0 + r) * K + k], acc[r][b]);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) y[(m0 + r) * N + n + b] = acc[r][b] * s[n + b];
}

// Outputs [n0, n1): NB at a time, every row group over them while their weight rows sit in L1.
template <int NB>
void F32Outputs(const float* x, const float* w, const float* s, float* y, int64_t M, int64_t K, int64_t N,
                int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += NB) {
    if (n + NB > n1) {
      for (; n < n1; ++n) F32Outputs<1>(x, w, s, y, M, K, N, n, n + 1);
      return;
    }
    const int64_t G = (M + 5) / 6;
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) F32Tile<6, NB>(x, w, s, y, m, K, N, n, m / 6, G);
    switch (M - m) {
      case 1: F32Tile<1, NB>(x, w, s, y, m, K, N, n, m / 6, G); break;
      case 2: F32Tile<2, NB>(x, w, s, y, m, K, N, n, m / 6, G); break;
      case 3: F32Tile<3, NB>(x, w, s, y, m, K, N, n, m / 6, G); break;
      case 4: F32Tile<4, NB>(x, w, s, y, m, K, N, n, m / 6, G); break;
      case 5: F32Tile<5, NB>(x, w, s, y, m, K, N, n, m / 6, G); break;
      default: break;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Many rows (prefill): a blocked product in the outer-product form, so each weight is converted once per
// block of rows and then serves every row of it from cache. The rows are packed k-major in panels of 32 ([K][32], zero
// rows past M); a tile of 12 outputs' weights, converted to float32 with their scales (int8, int4; float32
// weights keep the streaming loop: XLA's dot did better there in a model), is broadcast one k at a time
// against a panel's two 16-lane vectors: 24 accumulators, each a (row, output) pair summed over k in order.
// No transposition of the weights: their rows are read along k as stored, each broadcast a load of its own.
// int4's rows are converted with the even inputs first, then the odd ones (the nibbles as they lie), and the
// panels' k follow the same order. AVX-512 only.
#if defined(__AVX512F__)
#ifndef JF_POOL_CHUNKS
#define JF_POOL_CHUNKS 4   // pieces per pool thread, claimed as threads come free
#endif
constexpr int kTileOut = 12;   // outputs per tile (broadcast)
constexpr int kPanel = 32;     // rows per panel (two vectors)
#ifndef JF_BLOCK_KIB
#define JF_BLOCK_KIB 1024
#endif
#ifndef JF_CHUNK
#define JF_CHUNK 768
#endif
constexpr int64_t kBlockBytes = JF_BLOCK_KIB << 10;  // packed rows per block, to stay in a core's L2 (1 MiB here)
constexpr int64_t kChunk = JF_CHUNK;  // inputs per pass (GemmOutputs)
#ifndef JF_SLAB_MIB
#define JF_SLAB_MIB 16
#endif
constexpr int64_t kSlabBytes = int64_t{JF_SLAB_MIB} << 20;  // the most a call's packed rows take (GemmOnPool)

// dst[i][j] = r[j][i] for a 16 x 16 block held in registers (dst's row stride ds), rows i < rows stored.
inline void Transpose16(__m512 r[16], float* dst, int64_t ds, int rows = 16) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
  for (int i = 0; i < rows; ++i) _mm512_storeu_ps(dst + i * ds, r[i]);
}

// f(begin, end) over [0, n) in `chunks` pieces claimed one at a time by this thread and by helpers scheduled on
// XLA's intra-op pool (`ffi::ThreadPool`). The blocked product's calls take milliseconds; run on our own workers
// they left XLA's threads idle (asleep, likely), and the norms, activations and cache writes after each call ran
// at half speed (GPT-2's 128-row prefill: 13.8-15.5 ms of those ops against float32's 6.7-8.5, 6.1 on the pool;
// `benchmarks/prefill_profile.py`, BENCHMARKS.md "Quantized weights, part 6"). A helper that starts after the
// last piece was claimed finds nothing and touches only `state`; the caller waits only for pieces claimed.
template <typename F>
void PoolFor(ffi::ThreadPool& pool, int64_t n, F f, int64_t chunks) {
  chunks = std::max<int64_t>(1, std::min(n, chunks));
  struct State { std::atomic<int64_t> next{0}, done{0}; };
  auto state = std::make_shared<State>();
  auto work = [state, &f, n, chunks] {  // f is only reached through a claimed piece, which the caller waits for
    for (int64_t c; (c = state->next.fetch_add(1, std::memory_order_acq_rel)) < chunks;) {
      f(n * c / chunks, n * (c + 1) / chunks);
      state->done.fetch_add(1, std::memory_order_acq_rel);
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));  // (a copy: Schedule takes an rvalue)
  work();
  while (state->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

// x [M, K] -> panels [ceil(M / 32)][K][32] (rows past M zero), split by panel through parallel_for(n, f);
// evens_first: k in the order 0, 2, 4, ..., 1, 3, 5, ... (int4). Full 16 x 16 blocks are transposed in registers,
// int4's taken apart into evens and odds on the way in (32 inputs, two loads, one permutation); as a serial pass
// of its own, that reordering took ~10% of an int4 product at 512 rows and K = 3072.
template <typename For>
std::vector<float> PackRows(const float* x, int64_t M, int64_t K, bool evens_first, For parallel_for) {
  const int64_t panels = (M + kPanel - 1) / kPanel, half = K / 2;
  std::vector<float> out(panels * K * kPanel);
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  // where packed input k comes from in a row of x
  auto column = [&](int64_t k) { return !evens_first ? k : k < half ? 2 * k : 2 * (k - half) + 1; };
  parallel_for(panels, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t g = 0; g < kPanel; g += 16) {
        const int64_t m0 = p * kPanel + g;
        float* o = out.data() + p * K * kPanel + g;
        for (int64_t k = 0; k < K; k += 16) {
          const int64_t end = std::min(K, k + 16);
          __m512 r[16];
          if (m0 + 16 <= M && end == k + 16 && !evens_first) {
            for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(x + (m0 + i) * K + k);
          } else if (m0 + 16 <= M && evens_first && (end <= half || k >= half) && end == k + 16) {
            const float* src = x + m0 * K + 2 * (k < half ? k : k - half);  // 32 inputs, the wanted half of them
            for (int i = 0; i < 16; ++i)
              r[i] = _mm512_permutex2var_ps(_mm512_loadu_ps(src + i * K), k < half ? evens : odds,
                                            _mm512_loadu_ps(src + i * K + 16));
          } else {  // a block at an edge: rows past M, inputs past K, or across int4's halves
            for (int64_t c = k; c < end; ++c)
              for (int64_t i = 0; i < 16; ++i) o[c * kPanel + i] = m0 + i < M ? x[(m0 + i) * K + column(c)] : 0.0f;
            continue;
          }
          Transpose16(r, o + k * kPanel, kPanel);
        }
      }
  });
  return out;
}

// The cache lines of the next tile's stored weights for the current chunk of inputs, fetched into L2 a line per step
// while this tile's first panel computes: in a model's chain of
// products the weights come from DRAM, and converting a tile would otherwise wait for them (GPT-2's 48 products +
// head at 128 rows, on float32 weights when they still took this path: 131.6 ms without, 117.2 with; BENCHMARKS.md,
// "Quantized weights, part 3").
struct Ahead {
  const char* const* line = nullptr;  // the lines' addresses
  int64_t lines = 0;
};

// For r < 16 NV (rows < M) and i < MR, the (row m0 + r, output n0 + i) sum over this chunk's kn inputs of
// w[i * ws + k] * panel[k][r], continuing the sums the last chunk left in part [MR][32] (first: from zero); the
// last chunk writes them to y, the others back to part. Each sum runs over k in order whatever the chunking, so the
// result is the same bits as one pass over K. NV = 1 for a last panel of at most 16 rows (its zero half not computed).
template <int MR, int NV>
void GemmTile(const float* w, int64_t ws, const float* panel, int64_t kn, float* part, bool first, bool last,
              float* y, int64_t M, int64_t N, int64_t m0, int64_t n0, Ahead ahead) {
  __m512 acc[MR][NV];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + i * kPanel + 16 * v);
  for (int64_t k = 0; k < kn; ++k) {
    if (k < ahead.lines) _mm_prefetch(ahead.line[k], _MM_HINT_T1);
    __m512 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = _mm512_loadu_ps(panel + k * kPanel + 16 * v);
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 b = _mm512_set1_ps(w[i * ws + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(b, x[v], acc[i][v]);
    }
  }
  if (!last) {
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(part + i * kPanel + 16 * v, acc[i][v]);
    return;
  }
  alignas(64) float tile[MR][kPanel];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) _mm512_store_ps(tile[i] + 16 * v, acc[i][v]);
  const int64_t rows = std::min<int64_t>(kPanel, M - m0);
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < MR; ++i) y[(m0 + r) * N + n0 + i] = tile[i][r];
}

// Rows [m0, m1) (whole panels from m0) of a tile of MR outputs from n0, over one chunk of inputs: packed is the
// rows' panels at the chunk's first input (panels K * 32 floats apart), part the tile's partial sums, a panel's
// [kTileOut][32] each.
template <int MR>
void GemmPanels(const float* w, int64_t ws, const float* packed, int64_t K, int64_t kn, float* part, bool first,
                bool last, float* y, int64_t m0, int64_t m1, int64_t M, int64_t N, int64_t n0, Ahead ahead) {
  for (int64_t m = m0; m < m1; m += kPanel) {
    const float* panel = packed + (m / kPanel) * K * kPanel;
    float* p = part + ((m - m0) / kPanel) * kTileOut * kPanel;
    if (m1 - m <= 16)
      GemmTile<MR, 1>(w, ws, panel, kn, p, first, last, y, M, N, m, n0, ahead);
    else
      GemmTile<MR, 2>(w, ws, panel, kn, p, first, last, y, M, N, m, n0, ahead);
    ahead.lines = 0;  // fetched during the first panel
  }
}

// Outputs [n0, n1) over all rows. The rows go in blocks of kBlockBytes of packed floats (a chunk's worth), each
// block's inputs in chunks of at most kChunk (the packed order's [0, split) and [split, K) apart: int4's even and
// odd inputs, as its nibbles lie), and each chunk's outputs in tiles of kTileOut: convert(n, mr, k0, k1, buf, ws) fills buf [mr][ws] with
// inputs [k0, k1) of outputs n .. n + mr - 1 as float32 with their scales, read from `stored` [N][row_bytes] at byte
// k0 % split. So a tile's converted chunk (12 x 768 floats: 36 KiB, L1 where it is 48 KiB; chunks of 256-512,
// which fit a 32 KiB L1, measured the same here) stays near the core while every panel of the block passes under
// it, the block's panels stay in L2 while every tile passes over them, and each weight is converted once per
// block: GPT-2's FFN output product (K = 3072) was converted once per 64 rows when the whole of K went in one
// pass, since a block then held 64 rows of 3072 inputs. Partial sums between chunks wait in `part`, in the
// tiles' register order. The rows of buf are kChunk + 16 floats apart: rows a multiple of 4 KiB apart all fall in
// one L1 set (8 or 12 ways), and the broadcast streams could evict each other.
template <typename Convert>
void GemmOutputs(const float* packed, int64_t M, int64_t K, int64_t split, int64_t N, float* y, int64_t n0,
                 int64_t n1, const char* stored, int64_t row_bytes, Convert convert) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (const auto& [a, b] : {std::pair<int64_t, int64_t>(0, split), std::pair<int64_t, int64_t>(split, K)})
    for (int64_t i = 0, count = (b - a + kChunk - 1) / kChunk; i < count; ++i)  // equal chunks
      chunks.emplace_back(a + (b - a) * i / count, a + (b - a) * (i + 1) / count);
  int64_t longest = 0;
  for (const auto& [a, b] : chunks) longest = std::max(longest, b - a);
  const int64_t ws = longest + 16, tiles = (n1 - n0 + kTileOut - 1) / kTileOut;
  const int64_t block = std::min((M + kPanel - 1) / kPanel * kPanel,
                                 std::max<int64_t>(kPanel, (kBlockBytes / (longest * 4)) / kPanel * kPanel));
  std::vector<float> buf(kTileOut * ws), part(chunks.size() > 1 ? tiles * block * kTileOut : 0);
  std::vector<const char*> lines(kTileOut * ((longest + 63) / 64));
  for (int64_t mb = 0; mb < M; mb += block)
    for (size_t c = 0; c < chunks.size(); ++c) {
      const auto [k0, k1] = chunks[c];
      const bool first = c == 0, last = c + 1 == chunks.size();
      for (int64_t n = n0; n < n1; n += kTileOut) {
        const int mr = static_cast<int>(std::min<int64_t>(kTileOut, n1 - n));
        convert(n, mr, k0, k1, buf.data(), ws);
        Ahead ahead{lines.data(), 0};
        const int64_t row_lines = (k1 - k0 + 63) / 64;
        for (int64_t i = n + mr; i < std::min(n1, n + mr + kTileOut); ++i)
          for (int64_t l = 0; l < row_lines; ++l) lines[ahead.lines++] = stored + i * row_bytes + k0 % split + 64 * l;
        const float* w = buf.data();
        const float* rows = packed + k0 * kPanel;
        float* p = part.empty() ? nullptr : part.data() + ((n - n0) / kTileOut) * block * kTileOut;  // one chunk: unused
        const int64_t m1 = std::min(M, mb + block);
        WithCount<kTileOut>(mr, [&](auto MR) {
          GemmPanels<MR>(w, ws, rows, K, k1 - k0, p, first, last, y, mb, m1, M, N, n, ahead);
        });
      }
    }
}

// The blocked product of x [M, K] with the stored weights (row_bytes a row; split and convert as GemmOutputs takes
// them), in slabs of rows whose packed copy takes at most kSlabBytes: each slab's rows packed, then its outputs in
// tiles, both in pieces on XLA's pool (PoolFor).
template <typename Convert>
void GemmOnPool(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N, float* y, const void* stored,
                int64_t row_bytes, int64_t split, Convert convert) {
  const int64_t chunks = JF_POOL_CHUNKS * std::max<int64_t>(pool.num_threads(), 1);
  const int64_t slab = std::max<int64_t>(kPanel, kSlabBytes / (K * 4) / kPanel * kPanel);
  for (int64_t m = 0; m < M; m += slab) {
    const int64_t rows = std::min(slab, M - m);
    const std::vector<float> packed = PackRows(x + m * K, rows, K, split < K,
                                               [&](int64_t n, auto f) { PoolFor(pool, n, f, chunks); });
    PoolFor(pool, (N + kTileOut - 1) / kTileOut, [&](int64_t t0, int64_t t1) {
      GemmOutputs(packed.data(), rows, K, split, N, y + m * N, t0 * kTileOut, std::min(N, t1 * kTileOut),
                  static_cast<const char*>(stored), row_bytes, convert);
    }, chunks);
  }
}

// int8 weights q [n] times their scale -> n floats.
inline void ConvertInt8(const int8_t* q, float s, int64_t n, float* out) {
  const __m512 sv = _mm512_set1_ps(s);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k)))), sv));
  for (; k < n; ++k) out[k] = static_cast<float>(q[k]) * s;
}

// Bytes [j0, j1) of an int4 row (even k low, groups of gh bytes with scales s) -> j1 - j0 floats: the low nibbles
// (the even inputs) or, if high, the high ones (the odd inputs).
inline void ConvertInt4(const uint8_t* q, const float* s, int64_t gh, int64_t j0, int64_t j1, bool high, float* out) {
  for (int64_t j = j0; j < j1;) {
    const int64_t g = j / gh, end = std::min(j1, (g + 1) * gh);
    const __m512 sv = _mm512_set1_ps(s[g]);
    for (; j + 16 <= end; j += 16) {
      const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j)));
      const __m512i nib = high ? _mm512_srai_epi32(v, 4) : _mm512_srai_epi32(_mm512_slli_epi32(v, 28), 28);
      _mm512_storeu_ps(out + j - j0, _mm512_mul_ps(_mm512_cvtepi32_ps(nib), sv));
    }
    for (; j < end; ++j) {
      const int8_t v = static_cast<int8_t>(q[j]);
      out[j - j0] = static_cast<float>(high ? v >> 4 : static_cast<int8_t>(v << 4) >> 4) * s[g];
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Integer activations (`model.quant_activations=int8|int16`, int16 what jaxformer.quantize writes unless told;
// AVX-512 VNNI): a call's rows quantized in blocks of 32 inputs, a float32 scale each (llama.cpp's Q8_0 blocks;
// int16 the same with 32767 levels a side), and multiplied with the int8 (or unpacked int4) weights by an integer
// dot instruction. int8 rows: vpdpbusd, 64
// multiply-adds an instruction where a float32 FMA does 16 (on this Zen 4 both issue one a cycle: 4x float32's
// rate, `benchmarks/fma_peak.py`); it multiplies unsigned by signed bytes, so the weights go in as w + 128 (u8)
// and each block's sum loses 128 * (the block's sum of its int8 inputs), exactly, in int32. int16 rows: vpdpwssd,
// 32 multiply-adds (2x float32's rate), signed by signed, the weights sign-extended to 16 bits; its rounding of the
// rows is 258x finer than int8's, far below the weights' own. Per (row, output): y = sum over blocks b of
// (s_x[b] * s_w[b]) * (integer dot of block b), the integer dots exact (int16: at most 32 * 32767 * 127 < 2^31),
// the blocks summed in float32 in order (int8 weights: s_w applied once at the end). The reference this is
// tested against: `tests/test_quantize.py::_a8_reference`.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define JF_VNNI 1
constexpr int64_t kA8Block = 32;  // inputs per activation scale
constexpr int kA8Rows = 6;        // rows per register tile (each word broadcast)
constexpr int64_t kA8Out = 64;    // outputs per tile (4 vectors of 16): 24 int32 accumulators

// A = 8 or 16 (activation bits): inputs per 4-byte word, words per block, the largest quantized magnitude.
template <int A>
struct Act {
  static constexpr int64_t kPerWord = A == 8 ? 4 : 2;
  static constexpr int64_t kWords = kA8Block / kPerWord;
  static constexpr float kMax = A == 8 ? 127.0f : 32767.0f;
};

// Rows [0, M) of x [M, K] quantized: q [panels][words][kA8Rows] words of 4 int8 or 2 int16 inputs (rows past M
// zero), and per row ([panels * kA8Rows][blocks]) its blocks' scales and (int8) corrections (128 * the block's sum
// of int8 inputs).
struct RowsA8 {
  int64_t blocks = 0, words = 0;
  std::vector<int32_t> q, corr;
  std::vector<float> scale;
};

template <int A, typename For>
RowsA8 QuantizeRows(const float* x, int64_t M, int64_t K, For parallel_for) {
  RowsA8 a;
  a.blocks = (K + kA8Block - 1) / kA8Block;
  a.words = a.blocks * Act<A>::kWords;
  const int64_t panels = (M + kA8Rows - 1) / kA8Rows;
  a.q.assign(panels * a.words * kA8Rows, 0);
  a.corr.assign(panels * kA8Rows * a.blocks, 0);
  a.scale.assign(panels * kA8Rows * a.blocks, 0.0f);
  parallel_for(panels, [&](int64_t p0, int64_t p1) {
    for (int64_t m = p0 * kA8Rows; m < std::min(M, p1 * kA8Rows); ++m) {
      const int64_t p = m / kA8Rows, r = m % kA8Rows;
      for (int64_t b = 0; b < a.blocks; ++b) {
        const int64_t k = b * kA8Block, n = std::min(kA8Block, K - k);
        const __mmask16 lo = n >= 16 ? 0xFFFF : (1u << n) - 1, hi = n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0;
        const __m512 v0 = _mm512_maskz_loadu_ps(lo, x + m * K + k), v1 = _mm512_maskz_loadu_ps(hi, x + m * K + k + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const __m512 inv = _mm512_set1_ps(amax > 0 ? Act<A>::kMax / amax : 0.0f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        alignas(64) int8_t bytes[kA8Block * A / 8];
        if constexpr (A == 8) {
          _mm_store_si128(reinterpret_cast<__m128i*>(bytes), _mm512_cvtsepi32_epi8(q0));
          _mm_store_si128(reinterpret_cast<__m128i*>(bytes + 16), _mm512_cvtsepi32_epi8(q1));
          a.corr[m * a.blocks + b] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        } else {
          _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), _mm512_cvtsepi32_epi16(q0));
          _mm256_store_si256(reinterpret_cast<__m256i*>(bytes + 32), _mm512_cvtsepi32_epi16(q1));
        }
        int32_t* dst = a.q.data() + (p * a.words + b * Act<A>::kWords) * kA8Rows + r;
        for (int64_t w = 0; w < Act<A>::kWords; ++w) std::memcpy(dst + w * kA8Rows, bytes + 4 * w, 4);
        a.scale[m * a.blocks + b] = amax / Act<A>::kMax;
      }
    }
  });
  return a;
}

// Output n's weights from input k, 16 words (zero weights past K), int8 rows or int4 rows unpacked (byte j: input
// 2j in the low nibble, 2j + 1 in the high one, signed): A = 8, 64 inputs as w + 128 (u8); A = 16, 32 inputs as
// int16.
template <int A>
inline __m512i WeightsA8(const void* stored, int bits, int64_t K, int64_t n, int64_t k) {
  const int64_t half = K / 2, j = k / 2;
  if constexpr (A == 16) {
    if (bits == 8) {
      const int64_t left = std::max<int64_t>(0, K - k);
      const __mmask32 mask = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
      return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, static_cast<const int8_t*>(stored) + n * K + k));
    }
    const int64_t left = std::max<int64_t>(0, half - j);
    const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const uint8_t* row = static_cast<const uint8_t*>(stored) + n * half;
    const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, row + j));
    // each 32-bit lane: its byte's low nibble in the low 16 bits (input 2j), the high one in the high 16 (2j + 1);
    // a nibble u holds the signed value (u ^ 8) - 8
    const __m512i u = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)),
                                      _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0xF0)), 12));
    return _mm512_sub_epi16(_mm512_xor_si512(u, _mm512_set1_epi32(0x00080008)), _mm512_set1_epi16(8));
  } else {
    if (bits == 8) {
      const int64_t left = std::max<int64_t>(0, K - k);
      const __mmask64 mask = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
      const __m512i w = _mm512_maskz_loadu_epi8(mask, static_cast<const int8_t*>(stored) + n * K + k);
      return _mm512_xor_si512(w, _mm512_set1_epi8(-128));  // w + 128 mod 256: 0..255 for -128..127
    }
    const int64_t left = std::max<int64_t>(0, half - j);
    const __mmask32 mask = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, static_cast<const uint8_t*>(stored) + n * half + j));
    // each 16-bit lane: its byte's low nibble in the low byte (input 2j), the high nibble in the high byte (2j + 1);
    // u ^ 8 + 120 is the value + 128
    const __m512i u = _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi16(0x0F)),
                                      _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0xF0)), 4));
    return _mm512_add_epi8(_mm512_xor_si512(u, _mm512_set1_epi16(0x0808)), _mm512_set1_epi16(0x7878));
  }
}

// A tile's weights, outputs [n0, n0 + 64) (past N: zero weights), as w [words][64] int32: for each word, the 64
// outputs' words as the dot instruction takes them (16 x 16 blocks of words transposed in registers).
template <int A>
inline void PackWeightsA8(const void* stored, int bits, int64_t K, int64_t N, int64_t n0, int64_t words, int32_t* w) {
  const __m512i zero = A == 8 ? _mm512_set1_epi8(-128) : _mm512_setzero_si512();  // a zero weight as stored here
  for (int64_t v = 0; v < 4; ++v)
    for (int64_t c = 0; c < words; c += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = n0 + 16 * v + i;
        r[i] = _mm512_castsi512_ps(n < N ? WeightsA8<A>(stored, bits, K, n, Act<A>::kPerWord * c) : zero);
      }
      Transpose16(r, reinterpret_cast<float*>(w + c * kA8Out + 16 * v), kA8Out, static_cast<int>(std::min<int64_t>(16, words - c)));
    }
}

// One panel of kA8Rows rows against a tile over blocks [b0, b1) (of `blocks`, the stride of as and corr): out
// [kA8Rows][64] += the rows' products over those blocks (first: from zero), before the int8 weights' scale. ws:
// int4's scales per block [blocks][64], or null (int8).
template <int A>
inline void PanelA8(const int32_t* a, const float* as, const int32_t* corr, int64_t blocks, int64_t b0, int64_t b1,
                    const int32_t* w, const float* ws, float* out, bool first) {
  constexpr int64_t kWords = Act<A>::kWords;
  __m512 acc[kA8Rows][4];
  for (int r = 0; r < kA8Rows; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(out + r * kA8Out + 16 * v);
  for (int64_t b = b0; b < b1; ++b) {
    __m512i dot[kA8Rows][4];
    for (int r = 0; r < kA8Rows; ++r)
      for (int v = 0; v < 4; ++v) dot[r][v] = _mm512_setzero_si512();
    const int32_t* ab = a + b * kWords * kA8Rows;
    const int32_t* wb = w + b * kWords * kA8Out;
#pragma GCC unroll 16
    for (int64_t i = 0; i < kWords; ++i) {
      __m512i wv[4];
      for (int v = 0; v < 4; ++v) wv[v] = _mm512_loadu_si512(wb + i * kA8Out + 16 * v);
      for (int r = 0; r < kA8Rows; ++r) {
        const __m512i xv = _mm512_set1_epi32(ab[i * kA8Rows + r]);
        for (int v = 0; v < 4; ++v)
          dot[r][v] = A == 8 ? _mm512_dpbusd_epi32(dot[r][v], wv[v], xv) : _mm512_dpwssd_epi32(dot[r][v], wv[v], xv);
      }
    }
    for (int r = 0; r < kA8Rows; ++r) {
      const __m512i c = _mm512_set1_epi32(A == 8 ? corr[r * blocks + b] : 0);
      const __m512 s = _mm512_set1_ps(as[r * blocks + b]);
      for (int v = 0; v < 4; ++v) {
        const __m512 sv = ws ? _mm512_mul_ps(s, _mm512_loadu_ps(ws + b * kA8Out + 16 * v)) : s;
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][v], c)), sv, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < kA8Rows; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + r * kA8Out + 16 * v, acc[r][v]);
}

// y [M, N] = x [M, K] (int8 or int16 in blocks: A) . the stored int8 (bits 8: s [N]) or int4 (bits 4: s [N, groups],
// a group a multiple of 32 inputs) weights, on XLA's pool: rows quantized in slabs of at most kSlabBytes, then the
// outputs in tiles of 64, each tile's weights packed once per slab and run against every panel of its rows, in
// chunks of kA8ChunkBytes of packed weights (256 int8 / 128 int16 inputs), so that a chunk stays in L1 while every
// panel passes under it. (Whole tiles per panel streamed up to 393 KiB of weights from L2 for 6 rows each: GPT-2's
// prefill with int16 rows took 0.89x / 0.94x / 0.99x of float32's time at 256 / 512 / 1024 rows, 0.77x / 0.79x /
// 0.85x in chunks; int8 rows, half the bytes, unchanged: BENCHMARKS.md "Quantized weights, part 9".)
constexpr int64_t kA8ChunkBytes = 16 << 10;
template <int A>
void GemmA8(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N, float* y, const void* stored,
            int bits, const float* s, int64_t groups) {
  const int64_t chunks = JF_POOL_CHUNKS * std::max<int64_t>(pool.num_threads(), 1);
  const int64_t blocks = (K + kA8Block - 1) / kA8Block, words = blocks * Act<A>::kWords;
  const int64_t slab = std::max<int64_t>(kA8Rows, kSlabBytes / (words * 4) / kA8Rows * kA8Rows);
  const int64_t group_blocks = bits == 4 ? K / groups / kA8Block : 0;  // blocks per int4 group
  for (int64_t m0 = 0; m0 < M; m0 += slab) {
    const int64_t rows = std::min(slab, M - m0);
    const RowsA8 a = QuantizeRows<A>(x + m0 * K, rows, K, [&](int64_t n, auto f) { PoolFor(pool, n, f, chunks); });
    const int64_t panels = (rows + kA8Rows - 1) / kA8Rows;
    const int64_t chunk = std::max<int64_t>(1, kA8ChunkBytes / (Act<A>::kWords * kA8Out * 4));  // blocks a chunk
    PoolFor(pool, (N + kA8Out - 1) / kA8Out, [&](int64_t t0, int64_t t1) {
      std::vector<int32_t> w(words * kA8Out);
      std::vector<float> ws(bits == 4 ? blocks * kA8Out : 0);
      std::vector<float> sums(panels * kA8Rows * kA8Out);  // each panel's [kA8Rows][64]
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * kA8Out, nn = std::min(kA8Out, N - n0);
        PackWeightsA8<A>(stored, bits, K, N, n0, words, w.data());
        for (int64_t b = 0; b < static_cast<int64_t>(ws.size()) / kA8Out; ++b)
          for (int64_t j = 0; j < kA8Out; ++j) ws[b * kA8Out + j] = j < nn ? s[(n0 + j) * groups + b / group_blocks] : 0.0f;
        for (int64_t b0 = 0; b0 < blocks; b0 += chunk)
          for (int64_t p = 0; p < panels; ++p)
            PanelA8<A>(a.q.data() + p * words * kA8Rows, a.scale.data() + p * kA8Rows * blocks,
                       a.corr.data() + p * kA8Rows * blocks, blocks, b0, std::min(blocks, b0 + chunk), w.data(),
                       ws.empty() ? nullptr : ws.data(), sums.data() + p * kA8Rows * kA8Out, b0 == 0);
        for (int64_t p = 0; p < panels; ++p) {
          const float* out = sums.data() + p * kA8Rows * kA8Out;
          for (int64_t r = 0; r < std::min<int64_t>(kA8Rows, rows - p * kA8Rows); ++r)
            for (int64_t v = 0; 16 * v < nn; ++v) {
              const __mmask16 mask = nn - 16 * v >= 16 ? 0xFFFF : (1u << (nn - 16 * v)) - 1;
              __m512 o = _mm512_loadu_ps(out + r * kA8Out + 16 * v);
              if (bits == 8) o = _mm512_mul_ps(o, _mm512_maskz_loadu_ps(mask, s + n0 + 16 * v));  // the int8 scale
              _mm512_mask_storeu_ps(y + (m0 + p * kA8Rows + r) * N + n0 + 16 * v, mask, o);
            }
        }
      }
    }, chunks);
  }
}
#endif  // VNNI
#endif

// Rows [m, m + rows) (rows <= kRowBlock) of outputs [n0, n1): the tile shape for that many rows.
#define JF_DISPATCH(rows, FN, ...)      \
  switch (rows) {                       \
    case 1: FN<1, 4>(__VA_ARGS__); break; \
    case 2: FN<2, 4>(__VA_ARGS__); break; \
    case 3: FN<3, 2>(__VA_ARGS__); break; \
    default: FN<4, 2>(__VA_ARGS__); break; \
  }
// int4 keeps two partial sums per (row, output): half the outputs per pass.
#define JF_DISPATCH4(rows, FN, ...)     \
  switch (rows) {                       \
    case 1: FN<1, 4>(__VA_ARGS__); break; \
    case 2: FN<2, 2>(__VA_ARGS__); break; \
    case 3: FN<3, 1>(__VA_ARGS__); break; \
    default: FN<4, 1>(__VA_ARGS__); break; \
  }

ffi::Error Int8Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                    ffi::Buffer<ffi::F32> s, ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = q.dimensions()[0];
  if (q.dimensions()[1] != K || s.element_count() != N)
    return ffi::Error::InvalidArgument("qmatmul int8: shapes do not match x [M, K], q [N, K], s [N]");
  const float* xp = x.typed_data();
  const int8_t* qp = q.typed_data();
  const float* sp = s.typed_data();
  float* yp = y->typed_data();
#if defined(__AVX512F__)
  if (M >= kGemmRows) {
    GemmOnPool(pool, xp, M, K, N, yp, qp, K, K, [&](int64_t n, int mr, int64_t k0, int64_t k1, float* buf, int64_t ws) {
      for (int i = 0; i < mr; ++i) ConvertInt8(qp + (n + i) * K + k0, sp[n + i], k1 - k0, buf + i * ws);
    });
    return ffi::Error::Success();
  }
#endif
#ifdef JF_DECODE16
  if (M >= kDecode16Rows) {
    ParallelFor(N, N * K, [&](int64_t n0, int64_t n1) { Int8Rows16(xp, qp, sp, yp, M, K, N, n0, n1); });
    return ffi::Error::Success();
  }
#endif
  ParallelFor(N, N * K, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kRowBlock) JF_DISPATCH(std::min(kRowBlock, M - m), Int8Rows, xp, qp, sp, yp, m, K, N, n0, n1)
  });
  return ffi::Error::Success();
}

ffi::Error Int4Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                    ffi::Buffer<ffi::F32> s, ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = q.dimensions()[0];
  if (s.dimensions().size() != 2) return ffi::Error::InvalidArgument("qmatmul int4: scales must be [N, groups]");
  const int64_t groups = s.dimensions()[1];
  if (K % 2 || q.dimensions()[1] != K / 2 || s.dimensions()[0] != N || groups < 1 || (K / 2) % groups)
    return ffi::Error::InvalidArgument("qmatmul int4: shapes do not match x [M, K], q [N, K/2], s [N, K/g]");
  const int64_t half = K / 2;
  const float* xp = x.typed_data();
#if defined(__AVX512F__)
  if (M >= kGemmRowsInt4) {
    const uint8_t* qp = q.typed_data();
    const float* sp = s.typed_data();
    float* yp = y->typed_data();
    const int64_t gh = half / groups;  // bytes per group
    GemmOnPool(pool, xp, M, K, N, yp, qp, half, half, [&](int64_t n, int mr, int64_t k0, int64_t k1, float* buf, int64_t ws) {
      const bool high = k0 >= half;  // the odd inputs (chunks do not cross half)
      for (int i = 0; i < mr; ++i)
        ConvertInt4(qp + (n + i) * half, sp + (n + i) * groups, gh, k0 - high * half, k1 - high * half, high, buf + i * ws);
    });
    return ffi::Error::Success();
  }
#endif
  std::vector<float> xe(M * half), xo(M * half);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < half; ++j) {
      xe[m * half + j] = xp[m * K + 2 * j];
      xo[m * half + j] = xp[m * K + 2 * j + 1];
    }
  const uint8_t* qp = q.typed_data();
  const float* sp = s.typed_data();
  float* yp = y->typed_data();
  ParallelFor(N, N * half, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kRowBlock)
      JF_DISPATCH4(std::min(kRowBlock, M - m), Int4Rows, xe.data(), xo.data(), qp, sp, yp, m, K, N, groups, n0, n1)
  });
  return ffi::Error::Success();
}

// Integer activations (GemmA8, act_bits 8 or 16): built where the compiler targets AVX-512 VNNI, else an error
// (`JfQmatmulHasVnni` tells jaxformer.qkernel not to call them).
ffi::Error RunA8(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, int64_t N, float* y, const void* q,
                 int bits, const float* s, int64_t groups, int32_t act_bits) {
  if (act_bits != 8 && act_bits != 16)
    return ffi::Error::InvalidArgument("qmatmul: integer activations are 8 or 16 bits (act_bits)");
#ifdef JF_VNNI
  if (act_bits == 8)
    GemmA8<8>(pool, x, M, K, N, y, q, bits, s, groups);
  else
    GemmA8<16>(pool, x, M, K, N, y, q, bits, s, groups);
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "qmatmul: integer activations need an AVX-512 VNNI build");
#endif
}

ffi::Error Int8A8Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> s,
                      ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool, int32_t act_bits) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = q.dimensions()[0];
  if (q.dimensions()[1] != K || s.element_count() != N)
    return ffi::Error::InvalidArgument("qmatmul int8 (integer activations): shapes do not match x [M, K], q [N, K], s [N]");
  return RunA8(pool, x.typed_data(), M, K, N, y->typed_data(), q.typed_data(), 8, s.typed_data(), 1, act_bits);
}

ffi::Error Int4A8Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::F32> s,
                      ffi::ResultBuffer<ffi::F32> y, ffi::ThreadPool pool, int32_t act_bits) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = q.dimensions()[0];
  const int64_t groups = s.dimensions().size() == 2 ? s.dimensions()[1] : 0;
  if (K % 2 || q.dimensions()[1] != K / 2 || s.dimensions()[0] != N || groups < 1 || K % groups || (K / groups) % 32)
    return ffi::Error::InvalidArgument(
        "qmatmul int4 (integer activations): shapes do not match x [M, K], q [N, K/2], s [N, K/g] with g a multiple of 32");
  return RunA8(pool, x.typed_data(), M, K, N, y->typed_data(), q.typed_data(), 4, s.typed_data(), groups, act_bits);
}

ffi::Error F32Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::Buffer<ffi::F32> s, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  if (w.dimensions()[1] != K || s.element_count() != N)
    return ffi::Error::InvalidArgument("matmul f32: shapes do not match x [M, K], w [N, K], s [N]");
  const float *xp = x.typed_data(), *wp = w.typed_data(), *sp = s.typed_data();
  float* yp = y->typed_data();
  ParallelFor(N, N * K * 4, [&](int64_t n0, int64_t n1) { F32Outputs<4>(xp, wp, sp, yp, M, K, N, n0, n1); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfQmatmulInt8, Int8Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfQmatmulInt4, Int4Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfMatmulF32, F32Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfQmatmulInt8A8, Int8A8Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int32_t>("act_bits"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfQmatmulInt4A8, Int4A8Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int32_t>("act_bits"));

// 1 where the int8-activation products (JfQmatmulInt8A8, JfQmatmulInt4A8) run: AVX-512 VNNI builds.
extern "C" int JfQmatmulHasVnni() {
#ifdef JF_VNNI
  return 1;
#else
  return 0;
#endif
}

// Rows from which a call takes the blocked product (0: not in this build: AVX-512 only); `jaxformer.qkernel` reads it.
extern "C" int JfQmatmulGemmRows() {
#if defined(__AVX512F__)
  return static_cast<int>(std::min(kGemmRows, kGemmRowsInt4));
#else
  return 0;
#endif
}

extern "C" int JfQmatmulHasAvx2() {
#ifdef JF_AVX2
  return 1;
#else
  return 0;
#endif
}
