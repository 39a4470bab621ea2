// CPU kernels that compute y = x W^T straight from a weight's stored bytes (AVX2 + FMA + F16C).
//
// Shape legend:
//   x [T, K] float32 (rows may be gathered through row pointers)   W [N, K] in its stored format
//   y [T, N] float32
//   pools: every weight tensor carries a leading slot dim S: data [S, N, ...], scales [S, ...]
//
// Formats (codes shared with formats.py):
//   0 f32 | 1 bf16 | 2 f16
//   3 fp8 e4m3fn, scale float32 [S, ceil(N/Bo), ceil(K/G)] (block Bo x G; channel: Bo=1, G=K; tensor: Bo=N, G=K)
//   4 int8 symmetric, scale float32 [S, N, ceil(K/G)]
//   5 int4 (two codes per byte, low nibble first), scale float32 [S, N, ceil(K/G)], zero uint8 [S, N, ceil(K/G)]
//   6 mxfp4 e2m1 (same nibble order), e8m0 scales uint8 [S, N, K/32] (passed as `zero`), G = 32
//   7..15 GGUF blocks as the file stores them (ggml_kernels.h: q8_0, q4_0, q5_0, iq4_nl, mxfp4, q4_k, q5_k,
//         q6_k, iq4_xs), data uint8 [S, N, K / QK * block bytes], no scale / zero, G = QK
// Conversion happens in registers, 8 weights at a time, group constants loaded once per group:
//   w = code * s (+ b for int4's zero point: b = -zero * s). Nothing of W is materialised in float32,
//   except in the tiled path (T > small_t), which converts one tile of rows at a time into a
//   thread-local scratch and reuses it for every token.
// fp8 is converted through float16 (the byte's exponent and mantissa land in fp16's fields; the fp16
// value is 2^-8 times the e4m3 value, folded into the scale): exact for every finite code. The NaN
// codes 0x7F/0xFF, which the encoders never write, read as +-480.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "fast_kernels.h"
#include "ggml_kernels.h"
#include "nibble_kernels.h"
#include "ops.h"
#include "registry.h"
#include "simd_math.h"
#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

enum Fmt { F32 = 0, BF16 = 1, F16 = 2, FP8 = 3, INT8 = 4, INT4 = 5, MXFP4 = 6 };

struct WView {
  int fmt = F32;
  int64_t N = 0, K = 0, G = 1, Bo = 1;
  const uint8_t* d = nullptr;  // codes
  int64_t d_slot = 0, d_row = 0;  // bytes
  const float* s = nullptr;  // float scales
  int64_t s_slot = 0, s_row = 0;  // floats
  const uint8_t* z = nullptr;  // int4 zero points or mxfp4 e8m0 scales
  int64_t z_slot = 0, z_row = 0;  // bytes
};

struct Row {
  const uint8_t* d;
  const float* s;
  const uint8_t* z;
};

inline Row row_of(const WView& w, int64_t slot, int64_t n) {
  Row r;
  r.d = w.d + slot * w.d_slot + n * w.d_row;
  r.s = w.s ? w.s + slot * w.s_slot + (n / w.Bo) * w.s_row : nullptr;
  r.z = w.z ? w.z + slot * w.z_slot + n * w.z_row : nullptr;
  return r;
}

float E8M0[256];
const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

struct Tables {
  Tables() {
    for (int e = 0; e < 256; ++e) {
      uint32_t bits = e == 0 ? 0x00400000u : (e == 255 ? 0x7FC00000u : uint32_t(e) << 23);
      std::memcpy(&E8M0[e], &bits, 4);
    }
  }
} tables_init;

// ---- per-group constants -------------------------------------------------------------------------
template <int F>
inline void group_const(const Row& r, int64_t gi, float& s, float& b) {
  s = 1.f;
  b = 0.f;
  if constexpr (F == FP8) s = r.s[gi] * 256.f;
  if constexpr (F == INT8) s = r.s[gi];
  if constexpr (F == INT4) {
    s = r.s[gi];
    b = -float(r.z[gi]) * s;
  }
  if constexpr (F == MXFP4) s = E8M0[r.z[gi]];
}

// ---- 8 weights at column k (k even for the nibble formats) -----------------------------------------
inline __m256i nibbles8(const uint8_t* p) {  // 4 bytes -> 8 int32 codes, low nibble first
  int32_t v;
  std::memcpy(&v, p, 4);
  const __m128i dup = _mm_shuffle_epi8(_mm_cvtsi32_si128(v), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1,
                                                                            -1, -1, -1, -1));
  const __m256i c = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(dup), _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
  return _mm256_and_si256(c, _mm256_set1_epi32(0xF));
}

// Scale-only formats (fp8, int8, mxfp4): Unscaled = true returns the codes' values before the group
// scale (the GEMV path scales a group's partial sums once instead).
template <int F, bool Unscaled = false>
inline __m256 dec8(const uint8_t* d, int64_t k, __m256 s, __m256 b) {
  auto scaled = [](__m256 v, __m256 sc) { return Unscaled ? v : _mm256_mul_ps(v, sc); };
  if constexpr (F == F32) {
    __m256 w = _mm256_loadu_ps(reinterpret_cast<const float*>(d) + k);
    asm("" : "+x"(w));  // one load into a register, not one memory operand per FMA
    return w;
  } else if constexpr (F == BF16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 2 * k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  } else if constexpr (F == F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 2 * k)));
  } else if constexpr (F == FP8) {
    const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(d + k)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x7F)), 7));
    return scaled(_mm256_cvtph_ps(h), s);
  } else if constexpr (F == INT8) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(d + k)));
    return scaled(_mm256_cvtepi32_ps(v), s);
  } else if constexpr (F == INT4) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(nibbles8(d + k / 2)), s, b);
  } else {  // MXFP4
    const __m256i c = nibbles8(d + k / 2);
    const __m256 mag = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f), c);
    const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28));
    return scaled(_mm256_xor_ps(mag, sign), s);
  }
}

template <int F>
inline float dec1(const uint8_t* d, int64_t k, float s, float b) {
  if constexpr (F == F32) {
    return reinterpret_cast<const float*>(d)[k];
  } else if constexpr (F == BF16) {
    uint16_t h;
    std::memcpy(&h, d + 2 * k, 2);
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else if constexpr (F == F16) {
    uint16_t h;
    std::memcpy(&h, d + 2 * k, 2);
    return _cvtsh_ss(h);
  } else if constexpr (F == FP8) {
    const uint16_t v = d[k];
    return _cvtsh_ss(uint16_t(((v & 0x80) << 8) | ((v & 0x7F) << 7))) * s;
  } else if constexpr (F == INT8) {
    return float(int8_t(d[k])) * s;
  } else {
    const int q = (d[k >> 1] >> ((k & 1) * 4)) & 0xF;
    if constexpr (F == INT4) return float(q) * s + b;
    return E2M1[q] * s;
  }
}

// byte offset of column k in a row
template <int F>
constexpr int64_t byte_at(int64_t k) {
  return F == F32 ? 4 * k : (F == BF16 || F == F16) ? 2 * k : (F == FP8 || F == INT8) ? k : k / 2;
}

inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// Formats whose per-group constant is a pure scale (no offset): the GEMV path sums their codes
// against x unscaled within a group and scales the group's partial sums once at its end.
template <int F>
constexpr bool scale_after() {
  return F == FP8 || F == INT8 || F == MXFP4;
}

template <int F>
inline __m256 raw8(const uint8_t* d, int64_t k, __m256 s, __m256 b) {
  return dec8<F, scale_after<F>()>(d, k, s, b);
}

// ---- micro kernel: one row x TT tokens, dot products over K ----------------------------------------
// y[t * ldy] = sum_k W[n, k] * xr[t][k]. One row at a time is one sequential stream through memory
// (measured: ~2.5x the bandwidth of 4 interleaved rows on one core); U independent accumulators per
// token hide the FMA latency (U * TT chains).
template <int F, int TT>
inline void micro(const WView& W, int64_t slot, int64_t n, const float* const* xr, float* y, int64_t ldy) {
  constexpr int U = TT == 1 ? 4 : TT == 2 ? 2 : 1;
  const int64_t K = W.K, G = W.G;
  const Row rp = row_of(W, slot, n);
  __m256 tot[TT];
  float tail[TT];
  for (int t = 0; t < TT; ++t) {
    tot[t] = _mm256_setzero_ps();
    tail[t] = 0.f;
  }
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, ++gi) {
    const int64_t g1 = std::min(g0 + G, K);
    float ss, bs;
    group_const<F>(rp, gi, ss, bs);
    const __m256 sv = _mm256_set1_ps(ss), bv = _mm256_set1_ps(bs);
    __m256 acc[TT][U];
    for (int t = 0; t < TT; ++t)
      for (int u = 0; u < U; ++u) acc[t][u] = _mm256_setzero_ps();
    int64_t k = g0;
    for (; k + 8 * U <= g1; k += 8 * U)
      for (int u = 0; u < U; ++u) {
        const __m256 w = raw8<F>(rp.d, k + 8 * u, sv, bv);
        for (int t = 0; t < TT; ++t) acc[t][u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr[t] + k + 8 * u), acc[t][u]);
      }
    for (; k + 8 <= g1; k += 8) {
      const __m256 w = raw8<F>(rp.d, k, sv, bv);
      for (int t = 0; t < TT; ++t) acc[t][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr[t] + k), acc[t][0]);
    }
    for (int t = 0; t < TT; ++t) {
      for (int u = 1; u < U; ++u) acc[t][0] = _mm256_add_ps(acc[t][0], acc[t][u]);
      tot[t] = scale_after<F>() ? _mm256_fmadd_ps(acc[t][0], sv, tot[t]) : _mm256_add_ps(tot[t], acc[t][0]);
    }
    for (; k < g1; ++k) {
      const float w = dec1<F>(rp.d, k, ss, bs);
      for (int t = 0; t < TT; ++t) tail[t] += w * xr[t][k];
    }
  }
  for (int t = 0; t < TT; ++t) y[t * ldy] = hsum(tot[t]) + tail[t];
}

// ---- register block: R rows x TT tokens (several tokens: more FMAs per weight load) ---------------
// y[t * ldy + r] = sum_k W[n0 + r, k] * xr[t][k]
template <int F, int R, int TT>
inline void block(const WView& W, int64_t slot, int64_t n0, const float* const* xr, float* y, int64_t ldy) {
  const int64_t K = W.K, G = W.G;
  Row rp[R];
  for (int r = 0; r < R; ++r) rp[r] = row_of(W, slot, n0 + r);
  __m256 acc[R][TT];
  float tail[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      acc[r][t] = _mm256_setzero_ps();
      tail[r][t] = 0.f;
    }
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, ++gi) {
    const int64_t g1 = std::min(g0 + G, K);
    float ss[R], bs[R];
    __m256 sv[R], bv[R];
    for (int r = 0; r < R; ++r) {
      group_const<F>(rp[r], gi, ss[r], bs[r]);
      sv[r] = _mm256_set1_ps(ss[r]);
      bv[r] = _mm256_set1_ps(bs[r]);
    }
    int64_t k = g0;
    for (; k + 8 <= g1; k += 8) {  // live: R weight vectors, one x vector, R x TT accumulators
      __m256 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = dec8<F>(rp[r].d, k, sv[r], bv[r]);
      for (int t = 0; t < TT; ++t) {
        const __m256 xv = _mm256_loadu_ps(xr[t] + k);
        for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
      }
    }
    for (; k < g1; ++k)
      for (int r = 0; r < R; ++r) {
        const float w = dec1<F>(rp[r].d, k, ss[r], bs[r]);
        for (int t = 0; t < TT; ++t) tail[r][t] += w * xr[t][k];
      }
  }
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r) y[t * ldy + r] = hsum(acc[r][t]) + tail[r][t];
}

// fewer than 4 tokens: one row at a time (memory-bound); else blocks of 4 rows kept hot in L1 while
// every chunk of 6 tokens passes over them in 2-row x 6-token register blocks (12 accumulators; a
// chunk of 4-5 tokens in 2 x 4-5, the rest row by row)
template <int F>
void gemv_rows(const WView& W, int64_t slot, int64_t n0, int64_t n1, const float* const* xr, int64_t T, float* y,
               int64_t ldy) {
  auto rows = [&](int64_t a, int64_t b, int64_t t0, int64_t tt) {
    float* yt = y + t0 * ldy;
    for (int64_t n = a; n < b; ++n) switch (tt) {
        case 1: micro<F, 1>(W, slot, n, xr + t0, yt + (n - n0), ldy); break;
        case 2: micro<F, 2>(W, slot, n, xr + t0, yt + (n - n0), ldy); break;
        case 3: micro<F, 3>(W, slot, n, xr + t0, yt + (n - n0), ldy); break;
        default: micro<F, 4>(W, slot, n, xr + t0, yt + (n - n0), ldy); break;
      }
  };
  if (T < 4) {
    rows(n0, n1, 0, T);
    return;
  }
  constexpr int64_t RB = 4;
  for (int64_t a = n0; a < n1; a += RB) {
    const int64_t b = std::min(a + RB, n1);
    for (int64_t t0 = 0; t0 < T; t0 += 6) {
      const int64_t tt = std::min<int64_t>(6, T - t0);
      int64_t n = a;
      for (; tt >= 4 && n + 2 <= b; n += 2) {
        float* yt = y + t0 * ldy + (n - n0);
        if (tt == 6) block<F, 2, 6>(W, slot, n, xr + t0, yt, ldy);
        else if (tt == 5) block<F, 2, 5>(W, slot, n, xr + t0, yt, ldy);
        else block<F, 2, 4>(W, slot, n, xr + t0, yt, ldy);
      }
      for (int64_t t = t0; t < t0 + tt; t += 3) rows(n, b, t, std::min<int64_t>(3, t0 + tt - t));
    }
  }
}

std::vector<float>& scratch(int which) {
  static thread_local std::vector<float> bufs[5];
  return bufs[which];
}

template <int F>
void decode_rows(const WView& W, int64_t slot, int64_t n0, int64_t n1, float* dst, int64_t ld) {
  const int64_t K = W.K, G = W.G;
  for (int64_t n = n0; n < n1; ++n) {
    const Row r = row_of(W, slot, n);
    float* o = dst + (n - n0) * ld;
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, ++gi) {
      const int64_t g1 = std::min(g0 + G, K);
      float s, b;
      group_const<F>(r, gi, s, b);
      const __m256 sv = _mm256_set1_ps(s), bv = _mm256_set1_ps(b);
      int64_t k = g0;
      for (; k + 8 <= g1; k += 8) _mm256_storeu_ps(o + k, dec8<F>(r.d, k, sv, bv));
      for (; k < g1; ++k) o[k] = dec1<F>(r.d, k, s, b);
    }
  }
}

// ---- tiled path (many tokens): a tile of TN rows is converted once into float32, transposed to
// [k][TN] blocks of KC columns, and every token passes over it with an outer-product kernel
// (TT tokens x TN rows of accumulators; x broadcast, two weight vectors per column).
constexpr int64_t TN = 16, KC = 256;

template <int TT>
inline void outer(const float* pk, int64_t kc, const float* const* xr, int64_t k0, float* y, int64_t ldy, int64_t nn,
                  bool add) {
  __m256 acc[TT][2];
  for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 w0 = _mm256_loadu_ps(pk + k * TN), w1 = _mm256_loadu_ps(pk + k * TN + 8);
    for (int t = 0; t < TT; ++t) {
      const __m256 xb = _mm256_broadcast_ss(xr[t] + k0 + k);
      acc[t][0] = _mm256_fmadd_ps(w0, xb, acc[t][0]);
      acc[t][1] = _mm256_fmadd_ps(w1, xb, acc[t][1]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    alignas(32) float v[TN];
    _mm256_store_ps(v, acc[t][0]);
    _mm256_store_ps(v + 8, acc[t][1]);
    float* o = y + t * ldy;
    if (add)
      for (int64_t j = 0; j < nn; ++j) o[j] += v[j];
    else
      for (int64_t j = 0; j < nn; ++j) o[j] = v[j];
  }
}

// y[t * ldy + (n - n0)] = sum_k W[n, k] * xr[t][k] for n in [n0, n1), t < T, rows a..b-1 decoded to float32
// by decode(a, b, dst, ld) a tile at a time
template <class Decode>
void tiled_rows(const WView& W, int64_t n0, int64_t n1, const float* const* xr, int64_t T, float* y, int64_t ldy,
                Decode decode) {
  const int64_t K = W.K;
  std::vector<float>& rowsbuf = scratch(3);
  std::vector<float>& packed = scratch(4);
  rowsbuf.assign(TN * K, 0.f);
  packed.resize(KC * TN);
  for (int64_t a = n0; a < n1; a += TN) {
    const int64_t b = std::min(a + TN, n1), nn = b - a;
    decode(a, b, rowsbuf.data(), K);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      for (int64_t j = 0; j < TN; ++j) {
        const float* src = rowsbuf.data() + j * K + k0;
        for (int64_t k = 0; k < kc; ++k) packed[k * TN + j] = j < nn ? src[k] : 0.f;
      }
      for (int64_t t0 = 0; t0 < T; t0 += 6) {
        float* yt = y + t0 * ldy + (a - n0);
        const bool add = k0 > 0;
        switch (std::min<int64_t>(6, T - t0)) {
          case 1: outer<1>(packed.data(), kc, xr + t0, k0, yt, ldy, nn, add); break;
          case 2: outer<2>(packed.data(), kc, xr + t0, k0, yt, ldy, nn, add); break;
          case 3: outer<3>(packed.data(), kc, xr + t0, k0, yt, ldy, nn, add); break;
          case 4: outer<4>(packed.data(), kc, xr + t0, k0, yt, ldy, nn, add); break;
          case 5: outer<5>(packed.data(), kc, xr + t0, k0, yt, ldy, nn, add); break;
          default: outer<6>(packed.data(), kc, xr + t0, k0, yt, ldy, nn, add); break;
        }
      }
    }
  }
}

// y[t * ldy + (n - n0)] = sum_k W[n, k] * xr[t][k] for n in [n0, n1), t < T
template <int F>
void gemm_rows(const WView& W, int64_t slot, int64_t n0, int64_t n1, const float* const* xr, int64_t T, float* y,
               int64_t ldy, int64_t small_t) {
  if (T <= small_t) gemv_rows<F>(W, slot, n0, n1, xr, T, y, ldy);
  else tiled_rows(W, n0, n1, xr, T, y, ldy, [&](int64_t a, int64_t b, float* dst, int64_t ld) {
    decode_rows<F>(W, slot, a, b, dst, ld);
  });
}

void ggml_gemm(const WView& W, int64_t slot, int64_t n0, int64_t n1, const float* const* xr, int64_t T, float* y,
               int64_t ldy, int64_t small_t);

void gemm_any(const WView& W, int64_t slot, int64_t n0, int64_t n1, const float* const* xr, int64_t T, float* y,
              int64_t ldy, int64_t small_t) {
  if (ggml::is_type(W.fmt)) return ggml_gemm(W, slot, n0, n1, xr, T, y, ldy, small_t);
  switch (W.fmt) {
    case F32: gemm_rows<F32>(W, slot, n0, n1, xr, T, y, ldy, small_t); break;
    case BF16: gemm_rows<BF16>(W, slot, n0, n1, xr, T, y, ldy, small_t); break;
    case F16: gemm_rows<F16>(W, slot, n0, n1, xr, T, y, ldy, small_t); break;
    case FP8: gemm_rows<FP8>(W, slot, n0, n1, xr, T, y, ldy, small_t); break;
    case INT8: gemm_rows<INT8>(W, slot, n0, n1, xr, T, y, ldy, small_t); break;
    case INT4: gemm_rows<INT4>(W, slot, n0, n1, xr, T, y, ldy, small_t); break;
    default: gemm_rows<MXFP4>(W, slot, n0, n1, xr, T, y, ldy, small_t); break;
  }
}

using pool::run_units;  // units handed out dynamically, so uneven units balance across threads

// ---- activations prepared once per call: the fast math (fast_kernels.h) and the 4-bit kernels -------
// math 0 (exact): float32 activations; math 1 (fast): bf16 and int8 weights go through fastk with
// rounded / quantized activations. MXFP4 and int4 (groups a multiple of 32) weights go through nib
// (nibble_kernels.h, AVX-512) in both maths, float32 activations reordered for exact, int8 per block
// of 32 for fast, where the CPU has AVX-512 and the AVX2 kernels are not forced
// (set_avx512(false): kernels.isa.avx512, EXPERTCACHE_CPU_ISA=avx2); every other weight is computed from float32
// activations by the AVX2 kernels above.
enum Math { EXACT = 0, FAST = 1 };
// GGUF blocks (ggml_kernels.h) go through ggml's AVX-512 kernels (or AVX2 where those are not allowed) in
// exact math; through its VNNI kernels in fast math (P_GA32 + ggml::act_of(type): activations as llama.cpp's
// Q8_0 / Q8_K), where the AVX-512 kernels are allowed.
enum Prep { NONE = -1, P_BF16 = 0, P_Q8 = 1, P_MXF = 2, P_MXQ = 3, P_I4F = 4, P_I4Q = 5, P_GA32 = 6, P_GA256 = 7, P_GA32N = 8 };
inline bool nibble_prep(int kind) { return kind >= P_MXF && kind <= P_I4Q; }
inline bool ggml_prep(int kind) { return kind >= P_GA32 && kind <= P_GA32N; }
inline int ggml_act(int kind) { return kind - P_GA32; }  // ggml::Act

bool fast_reads(const WView& W) {
  return W.fmt == BF16 || (W.fmt == INT8 && W.Bo == 1 && (W.G >= W.K || W.G % fastk::BLOCK == 0));
}

// Allowed until the caller says otherwise: the Python side hands in its ISA choice when the module loads
// (kernels.isa, from EXPERTCACHE_CPU_ISA there); nothing here reads the environment.
std::atomic<bool> avx512_allowed{true};

bool nibble_avx512() {
  static const bool cpu = nib::supported();
  return cpu && avx512_allowed.load(std::memory_order_relaxed);
}

bool ggml_avx512() {
  static const bool cpu = ggml::avx512_supported();
  return cpu && avx512_allowed.load(std::memory_order_relaxed);
}

int64_t check_math(int64_t math) {
  TORCH_CHECK(math == EXACT || math == FAST, "math must be 0 (exact) or 1 (fast), got ", math);
  TORCH_CHECK(math == EXACT || fastk::supported(), "the fast CPU math needs AVX-512 F/BW/VL/BF16/VNNI");
  return math;
}

// how weight W's activations are prepared in CPU math `math` (NONE: read as float32 rows)
int prep_of(const WView& W, int64_t math) {
  if (W.fmt == MXFP4 && W.G == nib::BLOCK && W.Bo == 1 && nibble_avx512()) return math == FAST ? P_MXQ : P_MXF;
  if (W.fmt == INT4 && W.G % nib::BLOCK == 0 && W.Bo == 1 && nibble_avx512()) return math == FAST ? P_I4Q : P_I4F;
  if (ggml::is_type(W.fmt)) {
    const int act = ggml::act_of(W.fmt);
    return math == FAST && act >= 0 && ggml_avx512() && ggml::fast_supported() ? P_GA32 + act
                                                                              : NONE;
  }
  if (math == FAST && fast_reads(W)) return W.fmt == BF16 ? P_BF16 : P_Q8;
  return NONE;
}

// features per piece a prepared row is built from (FastX::part)
int64_t prep_unit(int kind) {
  return nibble_prep(kind) ? nib::GROUP : ggml_prep(kind) ? ggml::act_unit(ggml_act(kind))
                                                          : fastk::BLOCK;
}

// the 4-bit fast kernels' prefill part of a kernel name: strips (on AMX or on VNNI), or none
const char* strips_name() { return nib::strip_tokens() == 0 ? "" : nib::amx() ? "+strips-amx" : "+strips"; }

// which kernel computes a weight of `spec` in CPU math `math` (benchmarks print it)
std::string kernel_of(const WView& W, int64_t math) {
  const int kind = prep_of(W, check_math(math));
  if (ggml::is_type(W.fmt)) {
    const std::string t = ggml::type_name(W.fmt);
    if (ggml_prep(kind))
      return "avx512vnni-" + t + (ggml_act(kind) == ggml::A256 ? "-q8_kact" : "-q8_0act") +
             (ggml::has_strips(W.fmt) && nib::strip_tokens() != 0 ? "+strips" : "");
    return (ggml_avx512() ? "avx512-" : "avx2-") + t + "-f32act";
  }
  switch (kind) {
    case P_BF16: return "avx512bf16-bf16act";
    case P_Q8: return "avx512vnni-q8act64";
    case P_MXF: return "avx512-mxfp4-f32act";
    case P_MXQ: return std::string("avx512vnni-mxfp4-q8act32") + strips_name();
    case P_I4F: return "avx512-int4-f32act";
    case P_I4Q: return std::string("avx512vnni-int4-q8act32") + strips_name();
    default: return "avx2-f32act";
  }
}

// T rows of activations [K] in the form prep kind `kind` reads
struct FastX {
  int kind;
  int64_t K, Kp;
  std::vector<uint16_t> bf;  // P_BF16 [T, Kp]
  std::vector<uint8_t> q;    // P_Q8 [T, Kp]
  std::vector<float> s;      // P_Q8 [T, Kp / 64]; P_MXQ, P_I4Q [T, Kp / 8]
  std::vector<float> f;      // P_MXF, P_I4F [T, Kp]
  std::vector<float> fs;     // P_I4F [T, Kp / 8]
  std::vector<int8_t> mq;    // P_MXQ, P_I4Q [T, Kp]
  std::vector<int32_t> mc;   // P_MXQ, P_I4Q [T, Kp / 8]
  std::vector<int16_t> gb;   // P_GA256 [T, Kp / 16] (P_GA*: codes in q, scales in s, ggml_kernels.h)

  static int64_t padded(int kind, int64_t K) {
    return nibble_prep(kind) ? nib::padded(K)
           : ggml_prep(kind) ? ggml::act_padded(ggml_act(kind), K)
                             : fastk::padded(K);
  }
  FastX(int kind_, int64_t T, int64_t K_)  // allocated, not prepared
      : kind(kind_), K(K_), Kp(padded(kind_, K_)) {
    if (ggml_prep(kind)) {
      q.resize(T * Kp);
      s.resize(T * (Kp / ggml::act_scale_div(ggml_act(kind))));
      if (kind == P_GA256) gb.resize(T * (Kp / 16));
    } else if (kind == P_BF16) {
      bf.resize(T * Kp);
    } else if (kind == P_Q8) {
      q.resize(T * Kp);
      s.resize(T * (Kp / fastk::BLOCK));
    } else if (kind == P_MXF || kind == P_I4F) {
      f.resize(T * Kp);
      if (kind == P_I4F) fs.resize(T * (Kp / 8));
    } else {
      mq.resize(T * Kp);
      s.resize(T * (Kp / 8));
      mc.resize(T * (Kp / 8));
    }
  }
  FastX(int kind_, const float* const* xr, int64_t T, int64_t K_) : FastX(kind_, T, K_) {  // every row prepared
    constexpr int64_t per = 16;
    if (T <= per) for (int64_t t = 0; t < T; ++t) part(t, xr[t], 0, K);
    else run_units((T + per - 1) / per, [&](int64_t u) {
      for (int64_t t = u * per; t < std::min(T, (u + 1) * per); ++t) part(t, xr[t], 0, K);
    });
  }
  // row t's features [k0, k1) from x (the row's start); k0 a multiple of prep_unit(kind), k1 one too or K
  void part(int64_t t, const float* x, int64_t k0, int64_t k1) {
    const int64_t o = t * Kp + k0;
    if (ggml_prep(kind))
      ggml::prep_q8(ggml_act(kind), x + k0, k1 - k0, q.data() + o, s.data() + o / ggml::act_scale_div(ggml_act(kind)),
                    kind == P_GA256 ? gb.data() + o / 16 : nullptr);
    else if (kind == P_BF16) fastk::prep_bf16(x + k0, k1 - k0, bf.data() + o);
    else if (kind == P_Q8) fastk::prep_q8(x + k0, k1 - k0, q.data() + o, s.data() + o / fastk::BLOCK);
    else if (kind == P_MXF || kind == P_I4F)
      nib::prep_f32(x + k0, k1 - k0, f.data() + o, kind == P_I4F ? fs.data() + o / 8 : nullptr);
    else nib::prep_q8(kind == P_MXQ ? nib::MXFP4 : nib::INT4, x + k0, k1 - k0, mq.data() + o, s.data() + o / 8,
                      mc.data() + o / 8);
  }
};

// row pointers into a FastX, one per entry of `rows` (a pair's token, or 0..T-1)
struct FastRows {
  int kind;
  std::vector<const uint16_t*> bf;
  std::vector<const uint8_t*> q;
  std::vector<const float*> s, f, fs;
  std::vector<const int8_t*> mq;
  std::vector<const int32_t*> mc;
  std::vector<const int16_t*> gb;
  FastRows(const FastX& x, const std::vector<int64_t>& rows) : kind(x.kind) {
    for (int64_t i : rows) {
      const int64_t o = i * x.Kp;
      if (ggml_prep(kind)) {
        q.push_back(x.q.data() + o);
        s.push_back(x.s.data() + o / ggml::act_scale_div(ggml_act(kind)));
        gb.push_back(kind == P_GA256 ? x.gb.data() + o / 16 : nullptr);
      } else if (kind == P_BF16) {
        bf.push_back(x.bf.data() + o);
      } else if (kind == P_Q8) {
        q.push_back(x.q.data() + o);
        s.push_back(x.s.data() + o / fastk::BLOCK);
      } else if (kind == P_MXF || kind == P_I4F) {
        f.push_back(x.f.data() + o);
        if (kind == P_I4F) fs.push_back(x.fs.data() + o / 8);
      } else {
        mq.push_back(x.mq.data() + o);
        s.push_back(x.s.data() + o / 8);
        mc.push_back(x.mc.data() + o / 8);
      }
    }
  }
};

// Rows past a pass's next one that a row stream asks for (fewer than 4 tokens; 0: no prefetch). MXFP4 experts of
// gpt-oss-20b's shape, one thread, CPU time (bench/stream_bench.py --format mxfp4): none 6.1 GB/s,
// 4 rows ahead 16.6 GB/s; see docs/real-scale.md for the other formats (`--prefetch 0 4`).
std::atomic<int64_t> prefetch_rows{4};

// y[t * ldy + (n - n0)] = W[slot, n] . (prepared row off + t), n in [n0, n1), t < T
void fast_gemm(const WView& W, int64_t slot, int64_t n0, int64_t n1, const FastRows& fr, int64_t off, int64_t T,
               float* y, int64_t ldy) {
  const int64_t pf = prefetch_rows.load(std::memory_order_relaxed);
  const uint8_t* d = W.d + slot * W.d_slot + n0 * W.d_row;
  if (ggml_prep(fr.kind)) {
    ggml::rows_q8(W.fmt, d, W.d_row, n1 - n0, W.K, fr.q.data() + off, fr.s.data() + off, fr.gb.data() + off, T, y, ldy,
                  T < 4 ? pf : 0, nib::strip_tokens());
  } else if (fr.kind == P_BF16) {
    fastk::rows_bf16(d, W.d_row, n1 - n0, W.K, fr.bf.data() + off, T, y, ldy, 0);  // prefetch: slower (below)
  } else if (fr.kind == P_Q8) {
    const float* s = W.s + slot * W.s_slot + n0 * W.s_row;
    fastk::rows_q8(d, W.d_row, s, W.s_row, std::min(W.G, W.K), n1 - n0, W.K, fr.q.data() + off, fr.s.data() + off, T,
                   y, ldy, pf);
  } else {
    const bool i4 = fr.kind == P_I4F || fr.kind == P_I4Q;
    const nib::Rows R{d, W.d_row, W.z + slot * W.z_slot + n0 * W.z_row, W.z_row,
                      i4 ? W.s + slot * W.s_slot + n0 * W.s_row : nullptr, W.s_row, W.G};
    const int code = i4 ? nib::INT4 : nib::MXFP4;
    if (fr.kind == P_MXF || fr.kind == P_I4F)
      nib::rows_f32(code, R, n1 - n0, W.K, fr.f.data() + off, i4 ? fr.fs.data() + off : nullptr, T, y, ldy, pf);
    else nib::rows_q8(code, R, n1 - n0, W.K, fr.mq.data() + off, fr.s.data() + off, fr.mc.data() + off, T, y, ldy,
                      pf);
  }
}

// GGUF blocks, exact math: a row at a time up to small_t tokens, else the tiled path over rows decoded to float32
void ggml_gemm(const WView& W, int64_t slot, int64_t n0, int64_t n1, const float* const* xr, int64_t T, float* y,
               int64_t ldy, int64_t small_t) {
  const bool v512 = ggml_avx512();
  const uint8_t* d = W.d + slot * W.d_slot;
  if (T <= small_t) {
    const int64_t pf = T < 4 ? prefetch_rows.load(std::memory_order_relaxed) : 0;
    ggml::rows_f32(W.fmt, v512, d + n0 * W.d_row, W.d_row, n1 - n0, W.K, xr, T, y, ldy, pf);
    return;
  }
  tiled_rows(W, n0, n1, xr, T, y, ldy, [&](int64_t a, int64_t b, float* dst, int64_t ld) {
    ggml::dequant(W.fmt, v512, d + a * W.d_row, W.d_row, b - a, W.K, dst, ld);
  });
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

// ---- argument unpacking ------------------------------------------------------------------------------
// spec = (fmt, data [S, N, ...], scale [S, *, ng] or None, zero [S, N, ng] or None, N, K, G, Bo)
WView view_of(const py::tuple& spec, const char* what) {
  TORCH_CHECK(spec.size() == 8, what, ": weight spec must have 8 fields");
  WView w;
  w.fmt = spec[0].cast<int>();
  TORCH_CHECK((w.fmt >= F32 && w.fmt <= MXFP4) || ggml::is_type(w.fmt), what, ": unknown weight format code ", w.fmt);
  const at::Tensor d = spec[1].cast<at::Tensor>();
  w.N = spec[4].cast<int64_t>();
  w.K = spec[5].cast<int64_t>();
  w.G = spec[6].cast<int64_t>();
  w.Bo = spec[7].cast<int64_t>();
  TORCH_CHECK(d.device().is_cpu() && d.dim() >= 2 && d.size(1) == w.N, what, ": data must be a CPU tensor [S, N, ...]");
  TORCH_CHECK(w.G >= 1 && w.Bo >= 1 && w.K >= 1, what, ": group and block sizes must be positive");
  const int64_t its = d.element_size();
  for (int64_t i = d.dim() - 1, expect = 1; i >= 2; expect *= d.size(i), --i)
    TORCH_CHECK(d.stride(i) == expect, what, ": rows of the data must be contiguous");
  TORCH_CHECK(d.dim() > 2 || d.stride(1) == 1 || d.size(1) == 1, what, ": 2-D data must be [S, N] bytes");
  w.d = static_cast<const uint8_t*>(d.data_ptr());
  w.d_slot = d.stride(0) * its;
  w.d_row = d.stride(1) * its;
  if ((w.fmt == INT4 || w.fmt == MXFP4)) TORCH_CHECK(w.G % 2 == 0 && w.K % 2 == 0, what, ": nibble formats need even K and G");
  if (!spec[2].is_none()) {
    const at::Tensor s = spec[2].cast<at::Tensor>();
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 3 && s.stride(2) == 1, what,
                ": scale must be float32 [S, rows, groups] with contiguous groups");
    TORCH_CHECK(s.size(1) * w.Bo >= w.N && s.size(2) * w.G >= w.K, what, ": scale shape too small");
    w.s = s.data_ptr<float>();
    w.s_slot = s.stride(0);
    w.s_row = s.size(1) == 1 ? 0 : s.stride(1);
  }
  if (!spec[3].is_none()) {
    const at::Tensor z = spec[3].cast<at::Tensor>();
    TORCH_CHECK(z.scalar_type() == at::kByte && z.dim() == 3 && z.stride(2) == 1 && z.size(1) == w.N, what,
                ": zero points / e8m0 scales must be uint8 [S, N, groups]");
    TORCH_CHECK(z.size(2) * w.G >= w.K, what, ": zero point shape too small");
    w.z = z.data_ptr<uint8_t>();
    w.z_slot = z.stride(0);
    w.z_row = z.stride(1);
  }
  if (ggml::is_type(w.fmt)) {
    const int64_t qk = ggml::block_elems(w.fmt), bytes = w.K / qk * ggml::block_bytes(w.fmt);
    TORCH_CHECK(w.G == qk && w.Bo == 1 && w.K % qk == 0, what, ": ", ggml::type_name(w.fmt), " needs G = ", qk,
                " and K a multiple of it, got G = ", w.G, ", K = ", w.K);
    TORCH_CHECK(d.scalar_type() == at::kByte && d.dim() == 3 && d.size(2) == bytes, what, ": ",
                ggml::type_name(w.fmt), " data must be uint8 [S, N, ", bytes, "], got ", d.sizes());
  }
  const bool needs_s = w.fmt == FP8 || w.fmt == INT8 || w.fmt == INT4;
  TORCH_CHECK(!needs_s || w.s, what, ": format needs a float32 scale");
  TORCH_CHECK(!(w.fmt == INT4 || w.fmt == MXFP4) || w.z, what, ": format needs uint8 zero points / e8m0 scales");
  return w;
}

void check_x(const at::Tensor& x, int64_t K, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), what,
              ": x must be contiguous float32 [T, K] on the CPU");
  TORCH_CHECK(x.size(1) == K, what, ": x has ", x.size(1), " features, the weight expects ", K);
}

// y [..., N] = x [..., K] @ W[slot]^T (x contiguous: its leading dims are T rows)
// A float32 weight of many tokens (a GGUF file's router at prefill) goes to torch's float32 matmul on the
// calling thread, as F.linear would inside a forward: the register-tiled kernels here are written for
// weights narrower than their activations (3x slower at 512 tokens); split into blocks of tokens on the
// pool's threads the matmul ran slower still (MKL's small-M GEMMs, 2 threads).
constexpr int64_t F32_MM_T = 16;

at::Tensor linear(const at::Tensor& x, const py::tuple& spec, int64_t slot, int64_t small_t, int64_t rows_per_unit,
                  int64_t math) {
  const WView W = view_of(spec, "linear");
  const int kind = prep_of(W, check_math(math));
  const bool fast = kind != NONE;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.is_contiguous(),
              "linear: x must be contiguous float32 [..., K] on the CPU");
  TORCH_CHECK(x.size(-1) == W.K, "linear: x has ", x.size(-1), " features, the weight expects ", W.K);
  const int64_t T = W.K ? x.numel() / W.K : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = W.N;
  at::Tensor y = at::empty(shape, x.options());
  if (T == 0) return y;  // no rows (an expert-parallel worker's lm_head)
  if (W.fmt == F32 && T >= F32_MM_T) {
    const at::Tensor w = at::from_blob(const_cast<uint8_t*>(W.d + slot * W.d_slot), {W.N, W.K},
                                       {W.d_row / int64_t(sizeof(float)), 1}, x.options());
    at::Tensor y2 = y.view({T, W.N});
    at::mm_out(y2, x.view({T, W.K}), w.t());
    return y;
  }
  std::vector<const float*> xr(T);
  for (int64_t t = 0; t < T; ++t) xr[t] = x.data_ptr<float>() + t * W.K;
  float* yp = y.data_ptr<float>();
  const int64_t units = (W.N + rows_per_unit - 1) / rows_per_unit;
  {
    pybind11::gil_scoped_release nogil;
    std::unique_ptr<FastX> fx;
    std::unique_ptr<FastRows> fr;
    if (fast) {
      fx.reset(new FastX(kind, xr.data(), T, W.K));
      fr.reset(new FastRows(*fx, iota(T)));
    }
    run_units(units, [&](int64_t u) {
      const int64_t n0 = u * rows_per_unit, n1 = std::min(n0 + rows_per_unit, W.N);
      if (fast) fast_gemm(W, slot, n0, n1, *fr, 0, T, yp + n0, W.N);
      else gemm_any(W, slot, n0, n1, xr.data(), T, yp + n0, W.N, small_t);
    });
  }
  return y;
}

constexpr int64_t SERIAL_ADD = 1 << 16;  // outputs of the pairs added on the calling thread alone

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// h[j] = act(g[j] (+ bg[j]), u[j] (+ bu[j])) for j < n (act codes as in moe(); biases may be null)
void activate(const float* g, const float* u, const float* bg, const float* bu, int64_t n, int64_t act, float a,
              float lim, float* h) {
  int64_t j = 0;
  const __m256 one = _mm256_set1_ps(1.f), av = _mm256_set1_ps(-a), lv = _mm256_set1_ps(lim),
               nlv = _mm256_set1_ps(-lim);
  for (; j + 8 <= n; j += 8) {
    __m256 gv = _mm256_loadu_ps(g + j), uv = _mm256_loadu_ps(u + j);
    if (bg) gv = _mm256_add_ps(gv, _mm256_loadu_ps(bg + j));
    if (bu) uv = _mm256_add_ps(uv, _mm256_loadu_ps(bu + j));
    __m256 hv;
    if (act == 0) {
      hv = _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, simd::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)))), uv);
    } else {
      gv = _mm256_min_ps(lv, gv);  // NaN stays NaN (the second operand), as std::min(gv, lim) keeps it
      uv = _mm256_max_ps(nlv, _mm256_min_ps(lv, uv));
      hv = _mm256_div_ps(_mm256_mul_ps(_mm256_add_ps(uv, one), gv), _mm256_add_ps(one, simd::exp8(_mm256_mul_ps(av, gv))));
    }
    _mm256_storeu_ps(h + j, hv);
  }
  for (; j < n; ++j) {
    float gv = g[j] + (bg ? bg[j] : 0.f), uv = u[j] + (bu ? bu[j] : 0.f);
    if (act == 0) {
      h[j] = silu(gv) * uv;
    } else {
      gv = std::min(gv, lim);
      uv = std::max(-lim, std::min(uv, lim));
      h[j] = (uv + 1.f) * gv / (1.f + std::exp(-a * gv));
    }
  }
}

// out [T, H] += sum_k weights[t, k] * down(act(gate(x[t]), up(x[t]))) over the pool slot slots[t, k] (-1: skip).
// act 0: silu(g) * u;  act 1 (clamped SwiGLU): g = min(g, limit), u = clamp(u, -limit, limit),
// (u + 1) * g * sigmoid(alpha * g). Biases (float32 [S, I] / [S, H], or None) are added to the projections.
// x, slots and weights are made contiguous here (weights float32): no Python calls for it per layer.
void moe_into(const at::Tensor& x_in, const at::Tensor& slots_in, const at::Tensor& weights_in, const py::tuple& gate_spec,
         const py::tuple& up_spec, const py::tuple& down_spec, int64_t act, double alpha, double limit,
         const py::object& gate_bias, const py::object& up_bias, const py::object& down_bias, at::Tensor& out,
         int64_t small_t, int64_t rows_per_unit, int64_t math) {
  const at::Tensor x = x_in.contiguous(), slots = slots_in.contiguous();
  const at::Tensor weights = (weights_in.scalar_type() == at::kFloat ? weights_in : weights_in.to(at::kFloat)).contiguous();
  const WView Wg = view_of(gate_spec, "gate"), Wu = view_of(up_spec, "up"), Wd = view_of(down_spec, "down");
  check_math(math);
  const int kind_gu = prep_of(Wg, math) == prep_of(Wu, math) ? prep_of(Wg, math) : NONE, kind_d = prep_of(Wd, math);
  const bool fast_gu = kind_gu != NONE, fast_d = kind_d != NONE;
  const int64_t H = Wg.K, I = Wg.N;
  check_x(x, H, "moe");
  TORCH_CHECK(Wu.N == I && Wu.K == H && Wd.N == H && Wd.K == I, "moe: gate/up [I, H] and down [H, I] disagree");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == x.size(0) && slots.is_contiguous(),
              "moe: slots must be contiguous int64 [T, K]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == slots.sizes() && weights.is_contiguous(),
              "moe: weights must be contiguous float32 [T, K]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == x.sizes(),
              "moe: out must be contiguous float32 [T, H]");
  TORCH_CHECK(act == 0 || act == 1, "moe: activation code must be 0 (silu) or 1 (clamped swiglu)");
  const py::tuple& dspec = down_spec;
  const int64_t S = dspec[1].cast<at::Tensor>().size(0);
  auto bias_of = [&](const py::object& o, int64_t n, const char* what) -> const float* {
    if (o.is_none()) return nullptr;
    const at::Tensor b = o.cast<at::Tensor>();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.dim() == 2 && b.size(0) == S && b.size(1) == n,
                what, ": bias must be contiguous float32 [S, ", n, "]");
    return b.data_ptr<float>();
  };
  const float* bg = bias_of(gate_bias, I, "gate");
  const float* bu = bias_of(up_bias, I, "up");
  const float* bd = bias_of(down_bias, H, "down");

  // group the routed pairs by slot (counting sort): pair p has token tok[p] and weight pw[p]
  const int64_t T = slots.size(0), Kt = slots.size(1), P = T * Kt;
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float* wt = weights.data_ptr<float>();
  std::vector<int64_t> count(S + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(sl[p] >= -1 && sl[p] < S, "moe: slot ", sl[p], " out of range [0, ", S, ")");
    count[sl[p] + 1] += sl[p] >= 0;
  }
  std::vector<int64_t> gslot, goff{0};
  for (int64_t s = 0; s < S; ++s)
    if (count[s + 1]) {
      gslot.push_back(s);
      goff.push_back(goff.back() + count[s + 1]);
    }
  const int64_t NG = gslot.size(), NP = goff.back();
  if (NG == 0) return;
  std::vector<int64_t> pos(S, -1);
  for (int64_t g = 0; g < NG; ++g) pos[gslot[g]] = goff[g];
  std::vector<int64_t> tok(NP);
  std::vector<float> pw(NP);
  for (int64_t p = 0; p < P; ++p)
    if (sl[p] >= 0) {
      const int64_t q = pos[sl[p]]++;
      tok[q] = p / Kt;
      pw[q] = wt[p];
    }
  const float* xp = x.data_ptr<float>();
  std::vector<const float*> xr(NP), hr(NP);
  std::vector<float> h(NP * I);
  for (int64_t q = 0; q < NP; ++q) {
    xr[q] = xp + tok[q] * H;
    hr[q] = h.data() + q * I;
  }
  float* op = out.data_ptr<float>();
  const float a = float(alpha), lim = float(limit);

  pybind11::gil_scoped_release nogil;
  // One job of two kinds of units, handed out in order. Phase 1, units (group, block of I rows):
  // h = act(gate x, up x) for the group's pairs (in fast math also h's prepared form, block by block).
  // Phase 2, units (group, block of H rows) in expert order, so a thread's consecutive units stream one
  // expert's rows (against units of H rows over every group, one thread, busy machine, yardstick
  // layer: +7% bandwidth at T=1, +10% at T=8): y[q] = down h[q] per pair; a phase-2 unit of group g
  // first waits until g's phase-1 units are done. Those were all handed out before it, so it only ever waits for running units, and
  // the end of phase 1 overlaps the start of phase 2 instead of ending at a barrier. Against two jobs
  // and a threaded final add, alternating in one process (yardstick MoE layers, 2 threads, us per
  // layer): int8 fast math T=1 519 -> 494, bf16 exact T=1 989 -> 970, bf16 fast T=8 5383 -> 5206.
  const int64_t pu = fast_d ? prep_unit(kind_d) : 1, rb = (rows_per_unit + pu - 1) / pu * pu;
  const int64_t per_g = (I + rb - 1) / rb, per_h = (H + rb - 1) / rb, U1 = NG * per_g;
  std::vector<const float*> xt(T);
  for (int64_t t = 0; t < T; ++t) xt[t] = xp + t * H;
  std::unique_ptr<FastX> fx, fh;
  std::unique_ptr<FastRows> fr, frh;
  if (fast_gu) {  // x once per token; a pair's row is its token's
    fx.reset(new FastX(kind_gu, xt.data(), T, H));
    fr.reset(new FastRows(*fx, tok));
  }
  if (fast_d) {  // h per pair, prepared by the phase-1 units
    fh.reset(new FastX(kind_d, NP, I));
    frh.reset(new FastRows(*fh, iota(NP)));
  }
  std::unique_ptr<std::atomic<int64_t>[]> ready(new std::atomic<int64_t>[NG]);
  for (int64_t g = 0; g < NG; ++g) ready[g].store(0);
  std::vector<float> yq(NP * H);
  auto unit = [&](int64_t u) {
    if (u < U1) {
      const int64_t g = u / per_g, n0 = (u % per_g) * rb, n1 = std::min(n0 + rb, I), nb = n1 - n0;
      const int64_t n = goff[g + 1] - goff[g], slot = gslot[g];
      std::vector<float>& tg = scratch(0);
      std::vector<float>& tu = scratch(1);
      tg.resize(n * nb);
      tu.resize(n * nb);
      if (fast_gu) {
        fast_gemm(Wg, slot, n0, n1, *fr, goff[g], n, tg.data(), nb);
        fast_gemm(Wu, slot, n0, n1, *fr, goff[g], n, tu.data(), nb);
      } else {
        gemm_any(Wg, slot, n0, n1, xr.data() + goff[g], n, tg.data(), nb, small_t);
        gemm_any(Wu, slot, n0, n1, xr.data() + goff[g], n, tu.data(), nb, small_t);
      }
      for (int64_t t = 0; t < n; ++t) {
        float* hq = h.data() + (goff[g] + t) * I;
        activate(tg.data() + t * nb, tu.data() + t * nb, bg ? bg + slot * I + n0 : nullptr,
                 bu ? bu + slot * I + n0 : nullptr, nb, act, a, lim, hq + n0);
        if (fast_d) fh->part(goff[g] + t, hq, n0, n1);
      }
      ready[g].fetch_add(1, std::memory_order_release);
      return;
    }
    const int64_t g = (u - U1) / per_h, n0 = ((u - U1) % per_h) * rb, n1 = std::min(n0 + rb, H);
    while (ready[g].load(std::memory_order_acquire) < per_g) _mm_pause();
    float* yg = yq.data() + goff[g] * H + n0;
    if (fast_d) fast_gemm(Wd, gslot[g], n0, n1, *frh, goff[g], goff[g + 1] - goff[g], yg, H);
    else gemm_any(Wd, gslot[g], n0, n1, hr.data() + goff[g], goff[g + 1] - goff[g], yg, H, small_t);
  };
  run_units(U1 + NG * per_h, unit);
  // then out[tok] += w * y, units = blocks of H columns (each owns its columns of out: no races); a
  // decode step's few pairs on the calling thread alone
  std::vector<int64_t> slot_of(NP);
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t q = goff[g]; q < goff[g + 1]; ++q) slot_of[q] = gslot[g];
  auto add = [&](int64_t u) {
    const int64_t n0 = u * rb, n1 = std::min(n0 + rb, H);
    for (int64_t q = 0; q < NP; ++q) {
      float* o = op + tok[q] * H;
      const float w = pw[q];
      const float* yv = yq.data() + q * H;
      if (bd) {
        const float* bb = bd + slot_of[q] * H;
        for (int64_t j = n0; j < n1; ++j) o[j] += w * (yv[j] + bb[j]);
      } else {
        for (int64_t j = n0; j < n1; ++j) o[j] += w * yv[j];
      }
    }
  };
  if (NP * H <= SERIAL_ADD) for (int64_t u = 0; u < per_h; ++u) add(u);
  else run_units(per_h, add);
}

// moe_into with out None: a zeroed output made here, saving a torch call per layer -> out
at::Tensor moe(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& weights, const py::tuple& gate_spec,
               const py::tuple& up_spec, const py::tuple& down_spec, int64_t act, double alpha, double limit,
               const py::object& gate_bias, const py::object& up_bias, const py::object& down_bias,
               const c10::optional<at::Tensor>& out, int64_t small_t, int64_t rows_per_unit, int64_t math) {
  at::Tensor o;
  if (out.has_value()) {
    o = *out;
  } else {
    o = at::empty(x.sizes(), x.options().dtype(at::kFloat));
    std::memset(o.data_ptr(), 0, o.nbytes());
  }
  moe_into(x, slots, weights, gate_spec, up_spec, down_spec, act, alpha, limit, gate_bias, up_bias, down_bias, o,
           small_t, rows_per_unit, math);
  return o;
}

bool cpu_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); }

}  // namespace

at::Tensor ops::linear(const at::Tensor& x, const py::tuple& spec, int64_t slot, int64_t small_t,
                       int64_t rows_per_unit, int64_t math) {
  return ::linear(x, spec, slot, small_t, rows_per_unit, math);
}

void ops::moe(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& weights, const py::tuple& gate_spec,
              const py::tuple& up_spec, const py::tuple& down_spec, int64_t act, double alpha, double limit,
              const py::object& gate_bias, const py::object& up_bias, const py::object& down_bias, at::Tensor& out,
              int64_t small_t, int64_t rows_per_unit, int64_t math) {
  moe_into(x, slots, weights, gate_spec, up_spec, down_spec, act, alpha, limit, gate_bias, up_bias, down_bias, out,
           small_t, rows_per_unit, math);
}

void register_expert_kernels(py::module_& m) {
  m.def("linear", &linear, "y [T, N] = x [T, K] @ W[slot]^T", py::arg("x"), py::arg("spec"), py::arg("slot"),
        py::arg("small_t"), py::arg("rows_per_unit"), py::arg("math"));
  m.def("fast_supported", &fastk::supported, "the CPU has what the fast math needs (AVX-512 F/BW/VL/BF16/VNNI)");
  m.def("moe", &moe, "grouped expert FFN of one MoE layer, accumulated into out (None: a zeroed one) -> out");
  m.def("set_threads", [](int64_t n) { pool::instance().set_threads(n); }, "kernel threads (0: torch's count)");
  m.def("get_threads", [] { return pool::instance().threads(); }, "kernel threads set (0: torch's count)");
  m.def("cpu_supported", &cpu_supported, "AVX2, FMA and F16C present");
  m.def("avx512_supported", &nib::supported, "the CPU has what the AVX-512 4-bit kernels need (F/BW/VL/VNNI)");
  m.def("set_avx512", [](bool on) { avx512_allowed.store(on); },
        "allow the AVX-512 4-bit (MXFP4, int4) kernels where the CPU has them (false: the AVX2 kernels; "
        "set at load from kernels.isa: false when EXPERTCACHE_CPU_ISA=avx2)");
  m.def("get_avx512", [] { return avx512_allowed.load(); }, "whether the AVX-512 4-bit kernels are allowed");
  m.def("set_prefetch_rows", [](int64_t n) {
          TORCH_CHECK(n >= 0, "set_prefetch_rows: rows ahead must be >= 0, got ", n);
          prefetch_rows.store(n);
        }, "rows ahead a single row's stream prefetches in the AVX-512 kernels (0: none; default 4)");
  m.def("get_prefetch_rows", [] { return prefetch_rows.load(); }, "rows ahead the AVX-512 kernels prefetch");
  m.def("set_strip_tokens", [](int64_t n) {
          TORCH_CHECK(n >= 0, "set_strip_tokens: tokens must be >= 0 (0: never), got ", n);
          nib::set_strip_tokens(n);
        }, "tokens of a weight from which the AVX-512 4-bit kernels of the fast math run 32-row strips (rows in "
           "the lanes; 0: never, always pairs of rows; default 4)");
  m.def("get_strip_tokens", [] { return nib::strip_tokens(); }, "tokens from which the 4-bit strips run (0: never)");
  m.def("amx_supported", &nib::amx_supported, "the CPU has AMX-TILE/INT8 and Linux grants this process the tile state");
  m.def("set_amx", &nib::set_amx, "allow the 4-bit strips' products on AMX where supported (false: AVX-512 VNNI; "
        "set at load from kernels.isa: false when EXPERTCACHE_CPU_ISA is avx2 or avx512)");
  m.def("get_amx", &nib::amx, "whether the 4-bit strips run on AMX (allowed and supported)");
  m.def("kernel_of", [](const py::tuple& spec, int64_t math) { return kernel_of(view_of(spec, "kernel_of"), math); },
        "the kernel that computes a weight of this spec in CPU math `math`");
}
