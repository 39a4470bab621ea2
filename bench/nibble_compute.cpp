// The 4-bit kernels' compute rate (csrc/nibble_kernels.cpp), and the int8 fast kernel's (csrc/fast_kernels.cpp,
// CODE 2), without Python or threads: one thread runs nib::rows_q8 (fast math) or nib::rows_f32 (exact,
// MATH 0), or fastk::rows_q8, over the same weight again and again, so a weight that fits in L2 (256 x 2048
// int4: 0.28 MB) gives the rate the kernel's instructions allow, and a large one (65536 rows) the rate from
// memory with one weight streamed in order. Best of 7 rounds of 2000 calls (20 for a weight over 64 Mi elements), CPU time of the thread. One
// line: GB/s of codes + scales (+ zero points), ns per row and 128-feature group, and y[0] (the same for
// every build of the same kernel maths, up to float rounding order).
//
//   g++ -O3 -mavx2 -mfma -std=c++17 -Iexpertcache/kernels/csrc bench/nibble_compute.cpp
//       expertcache/kernels/csrc/nibble_kernels.cpp expertcache/kernels/csrc/fast_kernels.cpp
//       -o /tmp/nibble_compute    (one command line)
//   /tmp/nibble_compute CODE N K [T] [MATH]   (CODE 0 mxfp4 / 1 int4 group 128 / 2 int8 group 128 (fast math
//                                            only); MATH 1 fast (default) / 0 exact; e.g. 1 256 2048 1,
//                                            1 512 768 1, 0 256 2880 1, 0 256 2880 1 0, 2 256 2048 1, 2 151936 2048 1)
#include "fast_kernels.h"
#include "nibble_kernels.h"

#include <algorithm>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <vector>

static double cpu_now() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// int8 group 128, fast math (fastk::rows_q8): the best seconds per call over `calls` calls, 7 rounds
static int run_int8(int64_t N, int64_t K, int64_t T, int calls) {
  const int64_t G = 128, Kp = fastk::padded(K), ng = (K + G - 1) / G;
  std::mt19937 rng(0);
  std::vector<uint8_t> w(N * K);
  for (auto& b : w) b = uint8_t(rng());
  std::vector<float> s(N * ng, 0.01f), x(K);
  for (auto& v : x) v = float(rng() % 1000) / 500.f - 1.f;
  std::vector<uint8_t> xq(T * Kp);
  std::vector<float> xs(T * Kp / fastk::BLOCK);
  std::vector<const uint8_t*> pq;
  std::vector<const float*> ps;
  for (int64_t t = 0; t < T; ++t) {
    fastk::prep_q8(x.data(), K, xq.data() + t * Kp, xs.data() + t * Kp / fastk::BLOCK);
    pq.push_back(xq.data() + t * Kp);
    ps.push_back(xs.data() + t * Kp / fastk::BLOCK);
  }
  std::vector<float> y(T * N);
  double best = 1e30;
  for (int round = 0; round < 7; ++round) {
    const double t0 = cpu_now();
    for (int i = 0; i < calls; ++i) fastk::rows_q8(w.data(), K, s.data(), ng, G, N, K, pq.data(), ps.data(), T, y.data(), N, 4);
    best = std::min(best, (cpu_now() - t0) / calls);
  }
  std::printf("nibble_compute: code=int8 math=fast N=%ld K=%ld T=%ld GBps=%.1f ns_per_row_group=%.2f y0=%g\n", long(N),
              long(K), long(T), (N * K + N * ng * 4.0) / best / 1e9, best / double(N * ng) * 1e9, y[0]);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s CODE(0 mxfp4, 1 int4, 2 int8) N K [T] [MATH(1 fast, 0 exact)]\n", argv[0]);
    return 2;
  }
  const int code = std::atoi(argv[1]);
  const int64_t N = std::atoll(argv[2]), K = std::atoll(argv[3]), T = argc > 4 ? std::atoll(argv[4]) : 1;
  const bool fast = argc > 5 ? std::atoi(argv[5]) != 0 : true;
  if (code < 0 || code > 2 || K % 32 != 0 || N < 1 || T < 1 || (code == 2 && !fast)) {
    std::fprintf(stderr, "nibble_compute: CODE 0, 1 or 2 (int8: fast math only), K a multiple of 32, N and T at "
                         "least 1\n");
    return 2;
  }
  if (code == 2) {
    if (!fastk::supported()) {
      std::fprintf(stderr, "nibble_compute: this CPU lacks AVX-512 BF16/VNNI (the int8 fast kernel)\n");
      return 1;
    }
    return run_int8(N, K, T, N * K > (64 << 20) ? 20 : 2000);
  }
  if (!nib::supported()) {
    std::fprintf(stderr, "nibble_compute: this CPU lacks AVX-512 F/BW/VL/VNNI\n");
    return 1;
  }
  const int64_t G = 128, nb = K / 32, ng = (K + G - 1) / G, zrow = code ? ng : nb, Kp = nib::padded(K);
  std::mt19937 rng(0);
  std::vector<uint8_t> w(N * K / 2), z(N * zrow);
  std::vector<float> s(N * ng, 0.01f);
  for (auto& b : w) b = uint8_t(rng());
  for (auto& b : z) b = code ? uint8_t(rng() % 16) : uint8_t(120 + rng() % 4);
  const nib::Rows rows{w.data(), K / 2, z.data(), zrow, code ? s.data() : nullptr, code ? ng : 0, code ? G : 32};
  std::vector<float> x(K);
  for (auto& v : x) v = float(rng() % 1000) / 500.f - 1.f;
  std::vector<int8_t> xq(T * Kp);
  std::vector<float> xs(T * Kp / 8);
  std::vector<int32_t> xc(T * Kp / 8);
  std::vector<float> xf(T * Kp), xsum(T * Kp / 8);
  std::vector<const int8_t*> pq;
  std::vector<const float*> ps, pf, psum;
  std::vector<const int32_t*> pc;
  for (int64_t t = 0; t < T; ++t) {
    nib::prep_q8(code, x.data(), K, xq.data() + t * Kp, xs.data() + t * Kp / 8, xc.data() + t * Kp / 8);
    nib::prep_f32(x.data(), K, xf.data() + t * Kp, code ? xsum.data() + t * Kp / 8 : nullptr);
    pq.push_back(xq.data() + t * Kp);
    ps.push_back(xs.data() + t * Kp / 8);
    pc.push_back(xc.data() + t * Kp / 8);
    pf.push_back(xf.data() + t * Kp);
    psum.push_back(xsum.data() + t * Kp / 8);
  }
  std::vector<float> y(T * N);
  double best = 1e30;
  for (int round = 0; round < 7; ++round) {
    const int calls = N * K > (64 << 20) ? 20 : 2000;  // a large weight: fewer calls, the same few seconds
    const double t0 = cpu_now();
    for (int i = 0; i < calls; ++i)
      if (fast) nib::rows_q8(code, rows, N, K, pq.data(), ps.data(), pc.data(), T, y.data(), N, 4);
      else nib::rows_f32(code, rows, N, K, pf.data(), psum.data(), T, y.data(), N, 4);
    best = std::min(best, (cpu_now() - t0) / calls);
  }
  const double bytes = N * K / 2.0 + (code ? N * ng * 5.0 : double(N * nb));
  std::printf("nibble_compute: code=%s math=%s N=%ld K=%ld T=%ld GBps=%.1f ns_per_row_group=%.2f y0=%g\n", code ? "int4" : "mxfp4",
              fast ? "fast" : "exact", long(N), long(K), long(T), bytes / best / 1e9, best / double(N * ng) * 1e9, y[0]);
}
