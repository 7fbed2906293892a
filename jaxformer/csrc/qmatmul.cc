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
#include <cstdint>
#include <mutex>
#include <thread>
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

constexpr int64_t kRowBlock = 4;  // activation rows per pass over a weight row (accumulators in registers)
// Software prefetch of the rows this many tiles ahead: without it GPT-2's int8 LM head (38 MB) read
// at about a third of the bandwidth it reaches with it (1 and 2 tiles measured the same).
#ifndef JF_AHEAD
#define JF_AHEAD 2
#endif
constexpr int64_t kAhead = JF_AHEAD;

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
                    ffi::Buffer<ffi::F32> s, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = q.dimensions()[0];
  if (q.dimensions()[1] != K || s.element_count() != N)
    return ffi::Error::InvalidArgument("qmatmul int8: shapes do not match x [M, K], q [N, K], s [N]");
  const float* xp = x.typed_data();
  const int8_t* qp = q.typed_data();
  const float* sp = s.typed_data();
  float* yp = y->typed_data();
  ParallelFor(N, N * K, [&](int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += kRowBlock) JF_DISPATCH(std::min(kRowBlock, M - m), Int8Rows, xp, qp, sp, yp, m, K, N, n0, n1)
  });
  return ffi::Error::Success();
}

ffi::Error Int4Impl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                    ffi::Buffer<ffi::F32> s, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = q.dimensions()[0];
  if (s.dimensions().size() != 2) return ffi::Error::InvalidArgument("qmatmul int4: scales must be [N, groups]");
  const int64_t groups = s.dimensions()[1];
  if (K % 2 || q.dimensions()[1] != K / 2 || s.dimensions()[0] != N || groups < 1 || (K / 2) % groups)
    return ffi::Error::InvalidArgument("qmatmul int4: shapes do not match x [M, K], q [N, K/2], s [N, K/g]");
  const int64_t half = K / 2;
  std::vector<float> xe(M * half), xo(M * half);
  const float* xp = x.typed_data();
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
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfQmatmulInt4, Int4Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfMatmulF32, F32Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int JfQmatmulHasAvx2() {
#ifdef JF_AVX2
  return 1;
#else
  return 0;
#endif
}
