"""This CPU's float32 multiply-add ceiling (and int8's, with AVX-512 VNNI): independent vector multiply-adds in
registers, on 1 and on all cores.

    python benchmarks/fma_peak.py [--seconds 1]

A loop of 24 independent fused multiply-adds on 16-lane (AVX-512) or 8-lane (AVX2) float32 vectors, compiled with
the system C++ compiler (`jaxformer.qbuild.compiler`, -O2 -march=native) into a temporary directory and run on one
thread and on one thread per core. Nothing is read from memory, so this is the most float32 products a core can
do; a GEMM reaches it only up to its loads and its bookkeeping. It sets the quantized prefill against float32's
(BENCHMARKS.md "Quantized weights, part 7"): weight-only int8/int4 does float32's multiply-adds, so where XLA's
float32 dot runs near this ceiling a quantized product can at best tie it. Where the compiler targets AVX-512 VNNI
the same loop on vpdpbusd (int8 x int8 -> int32, 64 multiply-adds an instruction) gives the ceiling of the
opt-in int8 activations' product (`model.quant_activations=int8`; part 8), and with AVX-512 BF16 the same on
vdpbf16ps (bf16 pairs into float32), counted in the same units (2 ops a multiply-add). BENCHMARKS.md part 9: on
this Zen 4 all three issue one zmm instruction a cycle, so vpdpbusd's ceiling is 4x float32's, vdpbf16ps's 2x.
"""

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxformer import qbuild  # pylint: disable=g-import-not-at-top

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#if defined(__AVX512F__)
using V = __m512; constexpr int kLanes = 16;
inline V Set(float f) { return _mm512_set1_ps(f); }
inline V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float Sum(V v) { return _mm512_reduce_add_ps(v); }
#else
using V = __m256; constexpr int kLanes = 8;
inline V Set(float f) { return _mm256_set1_ps(f); }
inline V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float Sum(V v) { float t[8], s = 0; _mm256_storeu_ps(t, v); for (float f : t) s += f; return s; }
#endif
float Loop(long steps) {  // 24 independent chains: more than the FMA units' latency x throughput
  V a[24];
  for (int i = 0; i < 24; ++i) a[i] = Set(i * 1e-3f);
  const V b = Set(1.0000001f), c = Set(1e-7f);
  for (long t = 0; t < steps; ++t)
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) a[i] = Fma(a[i], b, c);
  float s = 0;
  for (int i = 0; i < 24; ++i) s += Sum(a[i]);
  return s;
}
// The integer and bf16 loops keep 12 chains: with 24, GCC 13 kept the integer vectors on the stack (a load and a
// store around every instruction), which halved vpdpbusd's measured rate; 12 stay in registers and still exceed
// the latency x throughput of each unit (4-5 cycles x 1 a cycle here).
constexpr int kChains = 12;
#if defined(__AVX512VNNI__)
int LoopVnni(long steps) {  // vpdpbusd: 16 lanes x 4 byte products each (int8 activations' product)
  __m512i a[kChains];
  for (int i = 0; i < kChains; ++i) a[i] = _mm512_set1_epi32(i);
  const __m512i b = _mm512_set1_epi32(0x01020304), c = _mm512_set1_epi32(0x01010101);
  for (long t = 0; t < steps; ++t)
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
  int s = 0;
  for (int i = 0; i < kChains; ++i) s += _mm512_reduce_add_epi32(a[i]);
  return s;
}
#endif
#if defined(__AVX512BF16__)
float LoopBf16(long steps) {  // vdpbf16ps: 16 lanes x 2 bf16 products each, summed into float32
  __m512 a[kChains];
  for (int i = 0; i < kChains; ++i) a[i] = _mm512_set1_ps(i * 1e-3f);
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f80), c = (__m512bh)_mm512_set1_epi16(0x3380);  // 1, ~6e-8
  for (long t = 0; t < steps; ++t)
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) a[i] = _mm512_dpbf16_ps(a[i], b, c);
  float s = 0;
  for (int i = 0; i < kChains; ++i) s += _mm512_reduce_add_ps(a[i]);
  return s;
}
#endif
int main(int argc, char** argv) {
  const double seconds = atof(argv[1]);
  const int cores = atoi(argv[2]);
  long steps = 1 << 20;  // calibrate on one thread to about `seconds`
  for (;;) {
    auto t0 = std::chrono::steady_clock::now();
    volatile float r = Loop(steps); (void)r;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds / 4) break;
    steps *= 2;
  }
  steps *= 4;
  // seconds for `threads` threads each running loop(steps)
  auto timed = [steps](int threads, auto loop) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int i = 0; i < threads; ++i) pool.emplace_back([steps, loop] { volatile auto r = loop(steps); (void)r; });
    for (auto& t : pool) t.join();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (int threads : {1, cores})
    printf("%d thread%s: %.1f GFLOP/s (%d-lane FMAs)\n", threads, threads > 1 ? "s" : "",
           threads * steps * 24.0 * kLanes * 2 / timed(threads, Loop) / 1e9, kLanes);
#if defined(__AVX512VNNI__)
  for (int threads : {1, cores})
    printf("%d thread%s: %.1f GOP/s int8 (vpdpbusd: 64 multiply-adds, 128 ops, an instruction)\n", threads,
           threads > 1 ? "s" : "", threads * steps * kChains * 128.0 / timed(threads, LoopVnni) / 1e9);
#endif
#if defined(__AVX512BF16__)
  for (int threads : {1, cores})
    printf("%d thread%s: %.1f GFLOP/s bf16 (vdpbf16ps: 32 multiply-adds, 64 ops, an instruction)\n", threads,
           threads > 1 ? "s" : "", threads * steps * kChains * 64.0 / timed(threads, LoopBf16) / 1e9);
#endif
}
"""


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seconds", type=float, default=1.0)
  args = parser.parse_args(argv)
  cxx = qbuild.compiler()
  if not cxx:
    sys.exit("fma_peak: no C++ compiler found ($CXX, g++ or c++)")
  with tempfile.TemporaryDirectory() as d:
    src, exe = os.path.join(d, "fma.cc"), os.path.join(d, "fma")
    with open(src, "w") as f:
      f.write(SOURCE)
    built = subprocess.run([cxx, "-O2", "-march=native", "-std=c++17", "-pthread", src, "-o", exe],
                           capture_output=True, text=True)
    if built.returncode:
      sys.exit(f"fma_peak: {cxx} could not build the loop (an x86 CPU with AVX2 or AVX-512 is needed): "
               f"{(built.stderr.strip().splitlines() or ['no message'])[-1]}")
    out = subprocess.run([exe, str(args.seconds), str(os.cpu_count())], check=True, capture_output=True, text=True)
  print(out.stdout, end="")


if __name__ == "__main__":
  main()
