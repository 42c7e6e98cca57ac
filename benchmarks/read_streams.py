"""How fast a core reads memory as 1, 2, 4 or 8 sequential streams at once: the
measurement behind the CPU kernels' 4-stream row order (xlm/ops/cpu_kernels/
float_matmul.cc, docs/engine.md "Float and half weights on CPU"); and the float32 FMA peak
of 1 and 2 threads, the ceiling of a compute-bound step (a batch's matmuls).

    python benchmarks/read_streams.py [--mib 256] [--repeats 5] [--out FILE]

A small C++ program (compiled here with the kernels' flags, -O3 -march=native) reads a
buffer of `--mib` MiB (past the caches) with AVX2 loads, on 1 thread and on 2 (each its
half), each thread's part read as S streams far apart (stream s covers the s-th S-th of
the part; one 64-byte line of each in turn). GB/s = bytes / best time of `--repeats`.
Only the read: no arithmetic on the bytes besides an add that keeps the loads.
FMA peak: each thread runs 12 independent chains of fused multiply-adds (enough to cover
the FMA latency on 2 pipes) from registers, in the widest vectors the CPU has (16 lanes
with AVX-512, as the kernels use it; 8 with AVX2), 2 flops a lane; GFLOP/s = flops / best
time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

template <int S>
int64_t read_streams(const int8_t* p, int64_t n) {
  __m256i acc[S];
  for (int s = 0; s < S; ++s) acc[s] = _mm256_setzero_si256();
  const int64_t len = n / S;
  for (int64_t i = 0; i + 64 <= len; i += 64) {
    for (int s = 0; s < S; ++s) {
      const int8_t* q = p + s * len + i;
      acc[s] = _mm256_add_epi8(acc[s], _mm256_add_epi8(
          _mm256_load_si256((const __m256i*)q), _mm256_load_si256((const __m256i*)(q + 32))));
    }
  }
  __m256i t = acc[0];
  for (int s = 1; s < S; ++s) t = _mm256_add_epi8(t, acc[s]);
  return _mm256_extract_epi64(t, 0);
}

using Reader = int64_t (*)(const int8_t*, int64_t);

// The FMA chains in the widest vectors the CPU has (what the kernels use, -march=native).
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kBits = 512;
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float first(Vec v) { return _mm512_cvtss_f32(v); }
#else
using Vec = __m256;
constexpr int kBits = 256;
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float first(Vec v) { return _mm256_cvtss_f32(v); }
#endif

float fma_chains(int64_t iters) {
  Vec acc[12];
  const Vec b = vset1(1.0000001f), c = vset1(1e-7f);
  for (int i = 0; i < 12; ++i) acc[i] = vset1(static_cast<float>(i));
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = vfma(acc[i], b, c);
  float s = 0;
  for (int i = 0; i < 12; ++i) s += first(acc[i]);
  return s;
}

int main(int argc, char** argv) {
  const int64_t bytes = atoll(argv[1]) << 20;
  const int repeats = atoi(argv[2]);
  int8_t* buf = (int8_t*)aligned_alloc(64, bytes);
  for (int64_t i = 0; i < bytes; ++i) buf[i] = (int8_t)(i * 7);
  const Reader readers[] = {read_streams<1>, read_streams<2>, read_streams<4>, read_streams<8>};
  const int counts[] = {1, 2, 4, 8};
  volatile int64_t sink = 0;
  for (int threads = 1; threads <= 2; ++threads) {
    for (int r = 0; r < 4; ++r) {
      double best = 1e30;
      for (int rep = 0; rep < repeats; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        const int64_t part = bytes / threads;
        std::vector<std::thread> pool;
        for (int t = 1; t < threads; ++t)
          pool.emplace_back([&, t] { sink += readers[r](buf + t * part, part); });
        sink += readers[r](buf, part);
        for (auto& th : pool) th.join();
        const double s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = s < best ? s : best;
      }
      printf("%d %d %.3f\n", threads, counts[r], bytes / best / 1e9);
    }
  }
  const int64_t iters = 100000000;
  float fsinks[2] = {0, 0};
  for (int threads = 1; threads <= 2; ++threads) {
    double best = 1e30;
    for (int rep = 0; rep < repeats; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<std::thread> pool;
      for (int t = 1; t < threads; ++t) {
        pool.emplace_back([&, t] { fsinks[t] += fma_chains(iters); });
      }
      fsinks[0] += fma_chains(iters);
      for (auto& th : pool) th.join();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = s < best ? s : best;
    }
    const double flops = threads * iters * 12.0 * (kBits / 32) * 2;  // lanes x (mul + add)
    printf("fma %d %.3f %d\n", threads, flops / best / 1e9, kBits);
  }
  printf("sink %g\n", fsinks[0] + fsinks[1]);  // keeps the chains' results
  return 0;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise SystemExit("no C++ compiler (c++ or g++) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "read.cc"), os.path.join(tmp, "read")
        with open(src, "w") as f:
            f.write(SOURCE)
        flags = ["-O3", "-march=native", "-std=c++17", "-pthread"]
        subprocess.run([compiler, *flags, src, "-o", exe], check=True)
        load = os.getloadavg()[0]
        out = subprocess.run(
            [exe, str(args.mib), str(args.repeats)], check=True, capture_output=True, text=True
        ).stdout
    rows, peaks = [], []
    print(f"load average before: {load:.2f}")
    print("| threads | streams a thread | GB/s |\n|---|---|---|")
    for line in out.split("\n"):
        if line.startswith("sink "):
            continue
        if line.startswith("fma "):
            _, threads, gflops, bits = line.split()
            peaks.append(
                {"threads": int(threads), "fma_gflops": float(gflops), "vector_bits": int(bits)}
            )
        elif line.strip():
            threads, streams, gbps = line.split()
            rows.append({"threads": int(threads), "streams": int(streams), "gbps": float(gbps)})
            print(f"| {threads} | {streams} | {float(gbps):.1f} |")
    print("\n| threads | float32 FMA peak, GFLOP/s | vector bits |\n|---|---|---|")
    for peak in peaks:
        print(f"| {peak['threads']} | {peak['fma_gflops']:.1f} | {peak['vector_bits']} |")
    if args.out:
        record = {
            "command": f"python benchmarks/read_streams.py --mib {args.mib} "
            f"--repeats {args.repeats}",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_before": load,
            "rows": rows,
            "fma_peak": peaks,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
