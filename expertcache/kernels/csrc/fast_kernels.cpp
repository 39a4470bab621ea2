// The "fast" CPU math (fast_kernels.h): bf16 x bf16 products by vdpbf16ps, int8 x int8 by vpdpbusd.
//
// Everything below the target pragma is compiled for AVX-512 and reached only through the entry
// points at the bottom, which the caller calls only when supported(). The region uses no inline
// function of a header (no torch, no std templates): a copy of one compiled here could be the copy
// the linker keeps for the whole module, and would then run AVX-512 code on any CPU.
//
// Loop shapes follow expert_kernels.cpp: fewer than 4 tokens, one row at a time (one sequential
// stream, U independent accumulators per token); more, blocks of 4 rows kept in L1 while chunks of
// 6 tokens pass over them (R x TT accumulators, reduced four at a time at the end of the row).
// int8: vpdpbusd multiplies unsigned by signed bytes, so an activation code q is stored as q + 128
// and 128 * sum(w) (one more vpdpbusd against ones, shared by all tokens) is taken off again.

#include "fast_kernels.h"

#include <immintrin.h>

#include <cstdint>

namespace fastk {

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
         __builtin_cpu_supports("avx512vnni");
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")

namespace {

inline int64_t lo(int64_t a, int64_t b) { return a < b ? a : b; }

// the sums of a, b, c, d's 16 lanes, in that order
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a02 b02 a13 b13 per lane
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));  // a b c d per lane
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// out[i] = the sum of v[i]'s lanes, i < n (always inlined, so that v stays in registers)
__attribute__((always_inline)) inline void sums(const __m512* v, int n, float* out) {
  int i = 0;
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(out + i, sum4(v[i], v[i + 1], v[i + 2], v[i + 3]));
  for (; i < n; ++i) out[i] = _mm512_reduce_add_ps(v[i]);
}

// y[t * ldy] = the sum of token t's U accumulators' lanes
template <int TT, int U>
__attribute__((always_inline)) inline void store_tokens(const __m512 (&acc)[TT][U], float* y, int64_t ldy) {
  __m512 tot[TT];
  for (int t = 0; t < TT; ++t) {
    tot[t] = acc[t][0];
    for (int u = 1; u < U; ++u) tot[t] = _mm512_add_ps(tot[t], acc[t][u]);
  }
  float s[TT];
  sums(tot, TT, s);
  for (int t = 0; t < TT; ++t) y[t * ldy] = s[t];
}

inline __mmask32 mask32(int64_t n) { return n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1; }
inline __mmask64 mask64(int64_t n) { return n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1; }

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// ---- bf16 ----------------------------------------------------------------------------------------
// 32 weights of a row at feature k (zero past K)
inline __m512i wbf(const uint16_t* r, int64_t k, int64_t K) {
  return k + 32 <= K ? _mm512_loadu_si512(r + k) : _mm512_maskz_loadu_epi16(mask32(K - k), r + k);
}

template <int TT, int U>
void bf_row(const uint16_t* r, int64_t K, const uint16_t* const* xb, float* y, int64_t ldy, int64_t ahead) {
  __m512 acc[TT][U];
  for (int t = 0; t < TT; ++t)
    for (int u = 0; u < U; ++u) acc[t][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 * U <= K; k += 32 * U)
    for (int u = 0; u < U; ++u) {
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(r + k + 32 * u) + ahead, _MM_HINT_T0);
      const __m512bh w = as_bh(_mm512_loadu_si512(r + k + 32 * u));
      for (int t = 0; t < TT; ++t)
        acc[t][u] = _mm512_dpbf16_ps(acc[t][u], w, as_bh(_mm512_loadu_si512(xb[t] + k + 32 * u)));
    }
  for (; k < K; k += 32) {  // at most U - 1 full chunks and a partial one
    const __m512bh w = as_bh(wbf(r, k, K));
    for (int t = 0; t < TT; ++t) acc[t][0] = _mm512_dpbf16_ps(acc[t][0], w, as_bh(_mm512_loadu_si512(xb[t] + k)));
  }
  store_tokens(acc, y, ldy);
}

// y[t * ldy + i] for rows r[i], i < R
template <int R, int TT>
void bf_block(const uint16_t* const* r, int64_t K, const uint16_t* const* xb, float* y, int64_t ldy,
              const uint16_t* ahead) {
  __m512 acc[R * TT];
  for (int i = 0; i < R * TT; ++i) acc[i] = _mm512_setzero_ps();
  auto step = [&](int64_t k, bool tail) __attribute__((always_inline)) {
    if (ahead)
      for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(ahead + i * K + k), _MM_HINT_T0);
    __m512bh w[R];
    for (int i = 0; i < R; ++i)
      w[i] = as_bh(tail ? _mm512_maskz_loadu_epi16(mask32(K - k), r[i] + k) : _mm512_loadu_si512(r[i] + k));
    for (int t = 0; t < TT; ++t) {
      const __m512bh xv = as_bh(_mm512_loadu_si512(xb[t] + k));
      for (int i = 0; i < R; ++i) acc[i * TT + t] = _mm512_dpbf16_ps(acc[i * TT + t], w[i], xv);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, false);
  if (k < K) step(k, true);
  float s[R * TT];
  sums(acc, R * TT, s);
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < TT; ++t) y[t * ldy + i] = s[i * TT + t];
}

template <int R>
void bf_block_n(int tt, const uint16_t* const* r, int64_t K, const uint16_t* const* xb, float* y, int64_t ldy,
                const uint16_t* ahead) {
  switch (tt) {
    case 1: bf_block<R, 1>(r, K, xb, y, ldy, ahead); break;
    case 2: bf_block<R, 2>(r, K, xb, y, ldy, ahead); break;
    case 3: bf_block<R, 3>(r, K, xb, y, ldy, ahead); break;
    case 4: bf_block<R, 4>(r, K, xb, y, ldy, ahead); break;
    case 5: bf_block<R, 5>(r, K, xb, y, ldy, ahead); break;
    default: bf_block<R, 6>(r, K, xb, y, ldy, ahead); break;
  }
}

// ---- int8 ----------------------------------------------------------------------------------------
inline __m512i wq8(const uint8_t* r, int64_t k, int64_t K) {
  return k + 64 <= K ? _mm512_loadu_si512(r + k) : _mm512_maskz_loadu_epi8(mask64(K - k), r + k);
}

// 128 * (the sums of w's signed bytes, four per lane): what the +128 of the activation codes adds
inline __m512i bias_of(__m512i w) {
  return _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), w), 7);
}

// acc += (dot of codes x and w in blocks of four, less the bias) * scale
inline __m512 q8_fma(__m512 acc, __m512i x, __m512i w, __m512i bias, __m512 scale) {
  const __m512i d = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), x, w), bias);
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc);
}

struct Q8Row {
  const uint8_t* w;
  const float* s;
};

// the scale of 64-feature chunk c is s[c >> shift] when G is a power-of-two multiple of 64 (or G >= K: shift
// 62, every chunk in scale 0), else s[c * 64 / G]: no 64-bit division per 64-byte load in the usual case
// (one thread, int8 T = 1, bench/nibble_compute.cpp: 256 x 2048 in L2 36-37 -> 60-63 GB/s; 151936 x 2048 from
// memory 30-31 -> 31-34)
inline int group_shift(int64_t G, int64_t K) {
  if (G >= K) return 62;
  const int64_t c = G / BLOCK;
  return G % BLOCK == 0 && (c & (c - 1)) == 0 ? __builtin_ctzll(uint64_t(c)) : -1;
}

inline float scale_at(const float* s, int64_t c, int shift, int64_t G) { return s[shift >= 0 ? c >> shift : c * BLOCK / G]; }

template <int TT, int U>
void q8_row(Q8Row r, int64_t G, int64_t K, const uint8_t* const* xq, const float* const* xs, float* y, int64_t ldy,
            int64_t ahead) {
  __m512 acc[TT][U];
  for (int t = 0; t < TT; ++t)
    for (int u = 0; u < U; ++u) acc[t][u] = _mm512_setzero_ps();
  const int shift = group_shift(G, K);
  auto chunk = [&](int64_t k, int64_t c, int u) {
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(r.w + k) + ahead, _MM_HINT_T0);
    const __m512i w = wq8(r.w, k, K), bias = bias_of(w);
    const float sw = scale_at(r.s, c, shift, G);
    for (int t = 0; t < TT; ++t)
      acc[t][u] = q8_fma(acc[t][u], _mm512_loadu_si512(xq[t] + k), w, bias, _mm512_set1_ps(xs[t][c] * sw));
  };
  int64_t k = 0, c = 0;
  for (; k + 64 * U <= K; k += 64 * U, c += U)
    for (int u = 0; u < U; ++u) chunk(k + 64 * u, c + u, u);
  for (; k < K; k += 64, ++c) chunk(k, c, 0);
  store_tokens(acc, y, ldy);
}

template <int R, int TT>
void q8_block(const Q8Row* r, int64_t G, int64_t K, const uint8_t* const* xq, const float* const* xs, float* y,
              int64_t ldy) {
  __m512 acc[R * TT];
  for (int i = 0; i < R * TT; ++i) acc[i] = _mm512_setzero_ps();
  const int shift = group_shift(G, K);
  auto step = [&](int64_t k, int64_t c, bool tail) __attribute__((always_inline)) {
    __m512i w[R], bias[R];
    __m512 sw[R];
    for (int i = 0; i < R; ++i) {
      w[i] = tail ? _mm512_maskz_loadu_epi8(mask64(K - k), r[i].w + k) : _mm512_loadu_si512(r[i].w + k);
      bias[i] = bias_of(w[i]);
      sw[i] = _mm512_set1_ps(scale_at(r[i].s, c, shift, G));
    }
    for (int t = 0; t < TT; ++t) {
      const __m512i xv = _mm512_loadu_si512(xq[t] + k);
      const __m512 sx = _mm512_set1_ps(xs[t][c]);
      for (int i = 0; i < R; ++i) acc[i * TT + t] = q8_fma(acc[i * TT + t], xv, w[i], bias[i], _mm512_mul_ps(sx, sw[i]));
    }
  };
  int64_t k = 0, c = 0;
  for (; k + 64 <= K; k += 64, ++c) step(k, c, false);
  if (k < K) step(k, c, true);
  float s[R * TT];
  sums(acc, R * TT, s);
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < TT; ++t) y[t * ldy + i] = s[i * TT + t];
}

template <int R>
void q8_block_n(int tt, const Q8Row* r, int64_t G, int64_t K, const uint8_t* const* xq, const float* const* xs,
                float* y, int64_t ldy) {
  switch (tt) {
    case 1: q8_block<R, 1>(r, G, K, xq, xs, y, ldy); break;
    case 2: q8_block<R, 2>(r, G, K, xq, xs, y, ldy); break;
    case 3: q8_block<R, 3>(r, G, K, xq, xs, y, ldy); break;
    case 4: q8_block<R, 4>(r, G, K, xq, xs, y, ldy); break;
    case 5: q8_block<R, 5>(r, G, K, xq, xs, y, ldy); break;
    default: q8_block<R, 6>(r, G, K, xq, xs, y, ldy); break;
  }
}

constexpr int64_t RB = 4, TB = 6;  // rows kept in L1 per block, tokens per register block
// bf16 blocks ask for the rows PF blocks ahead during their first pass. MoE layer at the yardstick's
// prefill shape (128 tokens, 64 experts top-8, bf16, 2 threads; one run per setting, alternating):
// none 22.7-23.3 ms, 1 block ahead 17.6, 2 blocks 17.9-19.5, 3 blocks 17.6.
constexpr int64_t PF = 2;

}  // namespace

// ---- entry points --------------------------------------------------------------------------------
void prep_bf16(const float* x, int64_t K, uint16_t* out) {
  for (int64_t k = 0; k < padded(K); k += 16) {
    const __mmask16 m = k + 16 <= K ? __mmask16(0xFFFF) : k < K ? __mmask16((1u << (K - k)) - 1) : __mmask16(0);
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + k));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), (__m256i)b);
  }
}

void prep_q8(const float* x, int64_t K, uint8_t* q, float* scales) {
  for (int64_t k0 = 0, b = 0; k0 < padded(K); k0 += BLOCK, ++b) {
    __m512 v[4];
    __m512 amax = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      const int64_t k = k0 + 16 * j;
      const __mmask16 m = k + 16 <= K ? __mmask16(0xFFFF) : k < K ? __mmask16((1u << (K - k)) - 1) : __mmask16(0);
      v[j] = _mm512_maskz_loadu_ps(m, x + k);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[j]));  // NaN and inf: caught below
    }
    float a = _mm512_reduce_max_ps(amax);
    bool finite = true;
    for (int j = 0; j < 4; ++j)  // x - x is 0 for a finite x, NaN for NaN and +-inf
      finite = finite && _mm512_cmp_ps_mask(_mm512_sub_ps(v[j], v[j]), _mm512_setzero_ps(), _CMP_EQ_OQ) == 0xFFFF;
    const float s = finite ? a / 127.f : __builtin_nanf("");
    scales[b] = s;
    for (int j = 0; j < 4; ++j) {
      __m512i c = _mm512_setzero_si512();
      if (finite && a > 0.f) c = _mm512_cvtps_epi32(_mm512_div_ps(v[j], _mm512_set1_ps(s)));  // nearest even
      const __m128i b8 = _mm_xor_si128(_mm512_cvtsepi32_epi8(c), _mm_set1_epi8(char(0x80)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16 * j), b8);
    }
  }
}

void rows_bf16(const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const uint16_t* const* xb, int64_t T, float* y,
               int64_t ldy, int64_t pf) {
  auto row = [&](int64_t n) { return reinterpret_cast<const uint16_t*>(w + n * w_row); };
  if (T < 4) {
    for (int64_t n = 0; n < N; ++n) switch (T) {
        case 1: bf_row<1, 4>(row(n), K, xb, y + n, ldy, pf && n + pf < N ? pf * w_row : 0); break;
        case 2: bf_row<2, 2>(row(n), K, xb, y + n, ldy, pf && n + pf < N ? pf * w_row : 0); break;
        default: bf_row<3, 2>(row(n), K, xb, y + n, ldy, pf && n + pf < N ? pf * w_row : 0); break;
      }
    return;
  }
  for (int64_t a = 0; a < N; a += RB) {
    const int64_t nr = lo(RB, N - a);
    const uint16_t* r[RB];
    for (int64_t i = 0; i < nr; ++i) r[i] = row(a + i);
    for (int64_t t0 = 0; t0 < T; t0 += TB) {
      const int tt = int(lo(TB, T - t0));
      float* yt = y + t0 * ldy + a;
      // the first pass over a block's rows also asks for the rows PF blocks ahead (rows are contiguous)
      const uint16_t* ahead = PF && t0 == 0 && a + (PF + 1) * RB <= N && w_row == 2 * K ? row(a + PF * RB) : nullptr;
      switch (nr) {
        case 1: bf_block_n<1>(tt, r, K, xb + t0, yt, ldy, ahead); break;
        case 2: bf_block_n<2>(tt, r, K, xb + t0, yt, ldy, ahead); break;
        case 3: bf_block_n<3>(tt, r, K, xb + t0, yt, ldy, ahead); break;
        default: bf_block_n<4>(tt, r, K, xb + t0, yt, ldy, ahead); break;
      }
    }
  }
}

void rows_q8(const uint8_t* w, int64_t w_row, const float* s, int64_t s_row, int64_t G, int64_t N, int64_t K,
             const uint8_t* const* xq, const float* const* xs, int64_t T, float* y, int64_t ldy, int64_t pf) {
  auto row = [&](int64_t n) { return Q8Row{w + n * w_row, s + n * s_row}; };
  if (T < 4) {
    for (int64_t n = 0; n < N; ++n) switch (T) {
        case 1: q8_row<1, 2>(row(n), G, K, xq, xs, y + n, ldy, pf && n + pf < N ? pf * w_row : 0); break;
        case 2: q8_row<2, 1>(row(n), G, K, xq, xs, y + n, ldy, pf && n + pf < N ? pf * w_row : 0); break;
        default: q8_row<3, 1>(row(n), G, K, xq, xs, y + n, ldy, pf && n + pf < N ? pf * w_row : 0); break;
      }
    return;
  }
  for (int64_t a = 0; a < N; a += RB) {
    const int64_t nr = lo(RB, N - a);
    for (int64_t t0 = 0; t0 < T; t0 += TB) {
      const int tt = int(lo(TB, T - t0));
      for (int64_t i = 0; i < nr; i += 2) {
        const Q8Row r[2] = {row(a + i), row(a + lo(i + 1, nr - 1))};
        float* yt = y + t0 * ldy + a + i;
        if (i + 2 <= nr) q8_block_n<2>(tt, r, G, K, xq + t0, xs + t0, yt, ldy);
        else q8_block_n<1>(tt, r, G, K, xq + t0, xs + t0, yt, ldy);
      }
    }
  }
}

#pragma GCC pop_options

}  // namespace fastk

// The thread pool's per-site timing (thread_pool.h; EXPERTCACHE_POOL_STATS=1), for ctypes: 9 int64 a site
// (site address, jobs, units, helper units, ns, caller's work ns, caller's wait ns, ns to a helper's
// first unit, CPU ns in units) into out, at most max sites -> the sites written; reset: zero the sums after.
#include "thread_pool.h"

extern "C" __attribute__((visibility("default"))) int expertcache_pool_stats(int64_t* out, int max, int reset) {
  pool::SiteStats st[pool::MAX_SITES];
  const int k = pool::instance().copy_stats(st, max < pool::MAX_SITES ? max : pool::MAX_SITES, reset != 0);
  for (int i = 0; i < k; ++i) {
    const int64_t v[9] = {int64_t(reinterpret_cast<uintptr_t>(st[i].site)), st[i].jobs,   st[i].units,
                          st[i].helper_units, st[i].ns, st[i].caller_work_ns, st[i].wait_ns, st[i].helper_start_ns,
                          st[i].work_cpu_ns};
    for (int j = 0; j < 9; ++j) out[i * 9 + j] = v[j];
  }
  return k;
}
