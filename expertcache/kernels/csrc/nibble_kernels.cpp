// 4-bit weights at memory speed (nibble_kernels.h): codes decoded through a table held in a register.
//
// As in fast_kernels.cpp, everything below the target pragma is AVX-512 code reached only through the
// entry points at the bottom, called only when supported(); no inline function of a header is
// used there (a copy compiled here could be the one the linker keeps for the whole module).
//
// Loop shapes: fewer than 4 tokens, 1, 2 or 4 rows at a time (drive; in exact math several independent
// accumulators per token hide the FMA latency); more, pairs of rows kept in L1 while
// chunks of 6 tokens pass over them (2 x 6 accumulators). C: the format (Code), R rows, TT tokens.

#include "nibble_kernels.h"

#include <immintrin.h>

#include <cstdint>

namespace nib {

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

namespace {

inline int64_t lo(int64_t a, int64_t b) { return a < b ? a : b; }

inline __mmask16 mask16(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); }
inline __mmask64 mask64(int64_t n) { return n >= 64 ? ~__mmask64(0) : n <= 0 ? __mmask64(0) : (__mmask64(1) << n) - 1; }

// the 16 e2m1 values, indexed by code (sign in bit 3)
inline __m512 e2m1_table() {
  return _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
}

// lanes 4j..4j+3: 2^(e_j - 127) for the 4 e8m0 bytes of e4 (byte j: the group's block j)
__attribute__((noinline)) __m512 scales4_special(uint32_t e4) {  // a byte 0 (2^-127) or 255 (NaN)
  const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
  const __m512i e = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(int(e4)), sh), _mm512_set1_epi32(0xFF));
  __m512i bits = _mm512_slli_epi32(e, 23);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(bits);
}

inline bool has_zero_byte(uint32_t v) { return ((v - 0x01010101u) & ~v & 0x80808080u) != 0; }

inline __m512 scales4(uint32_t e4) {
  if (__builtin_expect(has_zero_byte(e4) || has_zero_byte(~e4), 0)) return scales4_special(e4);
  // byte j moved to the exponent field (bits 23..30) by one rotate per lane
  const __m512i rot = _mm512_setr_epi32(23, 23, 23, 23, 15, 15, 15, 15, 7, 7, 7, 7, 31, 31, 31, 31);
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_rolv_epi32(_mm512_set1_epi32(int(e4)), rot), _mm512_set1_epi32(0x7F800000)));
}

// the e8m0 bytes of blocks 4g.. of a row with nb blocks (missing ones 0: 2^-127, against zero activations)
inline uint32_t e4_at(const uint8_t* z, int64_t g, int64_t nb) {
  const int64_t b = 4 * g;
  if (b + 4 <= nb) {
    uint32_t e;
    __builtin_memcpy(&e, z + b, 4);
    return e;
  }
  uint32_t e = 0;
  for (int64_t i = b; i < nb; ++i) e |= uint32_t(z[i]) << (8 * (i - b));
  return e;
}

// int4: lanes 4b..4b+3 hold the scale / zero point of block b of group g (blocks past K: the last one's)
inline void int4_consts(const Rows& W, int64_t r, int64_t g, int64_t nb, __m512& sv, __m512& zv) {
  const float* s = W.s + r * W.s_row;
  const uint8_t* z = W.z + r * W.z_row;
  if (W.G % GROUP == 0) {
    const int64_t i = GROUP * g / W.G;
    sv = _mm512_set1_ps(s[i]);
    zv = _mm512_set1_ps(float(z[i]));
    return;
  }
  alignas(16) float s4[4], z4[4];
  for (int64_t b = 0; b < 4; ++b) {
    const int64_t i = lo(4 * g + b, nb - 1) * BLOCK / W.G;
    s4[b] = s[i];
    z4[b] = float(z[i]);
  }
  const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  sv = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_load_ps(s4)));
  zv = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_load_ps(z4)));
}

template <int C>
inline __m512 value_table() {  // the value of each code before scaling
  if constexpr (C == MXFP4) return e2m1_table();
  return _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
}

// ---- exact: float32 activations ----------------------------------------------------------------
// A group of 128 features is one 64-byte load of codes: dword L holds features 8L..8L+7, nibble j of
// it feature 8L + j, so vpermps of the dword shifted by 4j (it reads the index's low 4 bits) gives
// feature 8L + j in lane L, against the prepared activations' vector j. Lane L is in block L / 4.
// Several (row, token) pairs share a decoded vector: it is scaled once (int4: and offset) and each
// pair takes one FMA; a single row of few tokens sums the group's unscaled products in NC chains and
// scales the sum (int4: less zero * scale * the activations' lane sums).
template <int C, int R, int TT>
void f32_block(const Rows& W, int64_t K, const float* const* xf, const float* const* xsum, float* y, int64_t ldy,
               int64_t ahead) {
  constexpr bool PRE = TT >= 2 && R * TT >= 4;
  constexpr int NC = R * TT == 1 ? 4 : 2;
  const __m512 tab = value_table<C>();
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t nbytes = K / 2, nb = (K + BLOCK - 1) / BLOCK, ng = (K + GROUP - 1) / GROUP, full = nbytes / 64;
  auto group = [&](int64_t g, bool tail) __attribute__((always_inline)) {
    __m512i v[R];
    __m512 ws[R], wb[R];  // per lane: scale, and int4's offset -zero * scale
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = W.w + r * W.w_row + 64 * g;
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
      v[r] = tail ? _mm512_maskz_loadu_epi8(mask64(nbytes - 64 * g), p) : _mm512_loadu_si512(p);
      if constexpr (C == MXFP4) {
        ws[r] = scales4(e4_at(W.z + r * W.z_row, g, nb));
      } else {
        __m512 zv;
        int4_consts(W, r, g, nb, ws[r], zv);
        wb[r] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(zv, ws[r]));
      }
    }
    if constexpr (PRE) {
      for (int j = 0; j < 8; ++j)
        for (int r = 0; r < R; ++r) {
          const __m512 code = _mm512_permutexvar_ps(_mm512_srli_epi32(v[r], 4 * j), tab);
          const __m512 wj = C == MXFP4 ? _mm512_mul_ps(code, ws[r]) : _mm512_fmadd_ps(code, ws[r], wb[r]);
          for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(xf[t] + GROUP * g + 16 * j), acc[r][t]);
        }
    } else {
      __m512 sum[NC][R][TT];
      for (int c = 0; c < NC; ++c)
        for (int r = 0; r < R; ++r)
          for (int t = 0; t < TT; ++t) sum[c][r][t] = _mm512_setzero_ps();
      for (int j = 0; j < 8; ++j)
        for (int r = 0; r < R; ++r) {
          const __m512 wj = _mm512_permutexvar_ps(_mm512_srli_epi32(v[r], 4 * j), tab);
          for (int t = 0; t < TT; ++t)
            sum[j % NC][r][t] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(xf[t] + GROUP * g + 16 * j), sum[j % NC][r][t]);
        }
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) {
          __m512 s = sum[0][r][t];
          for (int c = 1; c < NC; ++c) s = _mm512_add_ps(s, sum[c][r][t]);
          acc[r][t] = _mm512_fmadd_ps(s, ws[r], acc[r][t]);
          if constexpr (C == INT4) acc[r][t] = _mm512_fmadd_ps(_mm512_loadu_ps(xsum[t] + 16 * g), wb[r], acc[r][t]);
        }
    }
  };
  for (int64_t g = 0; g < full; ++g) group(g, false);
  if (full < ng) group(full, true);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// ---- fast: int8 activations per block of 32 -----------------------------------------------------
template <int C, int R, int TT>
void q8_block(const Rows& W, int64_t K, const int8_t* const* xq, const float* const* xs, const int32_t* const* xc,
              float* y, int64_t ldy, int64_t ahead) {
  // MXFP4: 2 x e2m1 + 12 by code, an unsigned byte for vpdpbusd (the activations are the signed side)
  const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t nbytes = K / 2, nb = (K + BLOCK - 1) / BLOCK, ng = (K + GROUP - 1) / GROUP, full = nbytes / 64;
  auto group = [&](int64_t g, bool tail) __attribute__((always_inline)) {
    __m512i wl[R], wh[R];
    __m512 ws[R], zv[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = W.w + r * W.w_row + 64 * g;
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
      const __m512i v = tail ? _mm512_maskz_loadu_epi8(mask64(nbytes - 64 * g), p) : _mm512_loadu_si512(p);
      wl[r] = _mm512_and_si512(v, nib);
      wh[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      if constexpr (C == MXFP4) {
        wl[r] = _mm512_shuffle_epi8(tab, wl[r]);
        wh[r] = _mm512_shuffle_epi8(tab, wh[r]);
        ws[r] = scales4(e4_at(W.z + r * W.z_row, g, nb));
      } else {
        int4_consts(W, r, g, nb, ws[r], zv[r]);
      }
    }
    for (int t = 0; t < TT; ++t) {
      const __m512i xe = _mm512_loadu_si512(xq[t] + GROUP * g), xo = _mm512_loadu_si512(xq[t] + GROUP * g + 64);
      const __m512i c = _mm512_loadu_si512(xc[t] + 16 * g);
      const __m512 sx = _mm512_loadu_ps(xs[t] + 16 * g);
      for (int r = 0; r < R; ++r) {
        if constexpr (C == MXFP4) {
          const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, wl[r], xe), wh[r], xo);
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[r], sx), acc[r][t]);
        } else {  // sum (code - zero) x = sum code x - zero * (the block's code sum)
          const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wl[r], xe), wh[r], xo);
          const __m512 e = _mm512_fnmadd_ps(zv[r], _mm512_cvtepi32_ps(c), _mm512_cvtepi32_ps(d));
          acc[r][t] = _mm512_fmadd_ps(e, _mm512_mul_ps(ws[r], sx), acc[r][t]);
        }
      }
    }
  };
  for (int64_t g = 0; g < full; ++g) group(g, false);
  if (full < ng) group(full, true);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

constexpr int64_t TB = 6;  // tokens per register block when rows go in pairs

inline Rows offset(const Rows& W, int64_t n) {  // rows from n on
  Rows o = W;
  o.w += n * W.w_row;
  o.z += n * W.z_row;
  if (o.s) o.s += n * W.s_row;
  return o;
}

// rows: fewer than 4 tokens, passes of 1, 2 or 4 rows, each row asking for the codes of the row R + pf
// below it (prefetch: a single row's stream alone leaves the memory idle between rows; gpt-oss-20b
// MXFP4 fast, T = 1, 4 rows a pass, one thread: 28 GB/s 4 rows ahead, 31 GB/s 8, 29 GB/s 16); else pairs of rows kept in L1 under chunks
// of TB tokens, the first chunk asking for the codes pf rows ahead. run(Slot<R>, Slot<TT>, rows, t0, y, ahead) computes R rows from `rows` for tokens
// t0..t0+TT-1, prefetching `ahead` bytes past each load of codes (0: none).

template <int R>
struct Slot {
  static constexpr int value = R;
};

// Fewer than 4 tokens: R1 rows at a time for T = 1, R23 for T = 2, 3, so that one load of the activations
// serves R rows (set per format and math by rows_f32 / rows_q8 below).
template <int R1, int R23, class Run>
void drive(const Rows& W, int64_t N, int64_t T, float* y, int64_t ldy, int64_t pf, Run run) {
  auto tokens = [&](auto rc, int64_t tt, const Rows& Wn, int64_t t0, float* yt, int64_t ahead)
                    __attribute__((always_inline)) {
    switch (tt) {
      case 1: run(rc, Slot<1>{}, Wn, t0, yt, ahead); break;
      case 2: run(rc, Slot<2>{}, Wn, t0, yt, ahead); break;
      case 3: run(rc, Slot<3>{}, Wn, t0, yt, ahead); break;
      case 4: run(rc, Slot<4>{}, Wn, t0, yt, ahead); break;
      case 5: run(rc, Slot<5>{}, Wn, t0, yt, ahead); break;
      default: run(rc, Slot<6>{}, Wn, t0, yt, ahead); break;
    }
  };
  if (T < 4) {
    int64_t n = 0;
    auto run_rows = [&](auto rc) __attribute__((always_inline)) {
      constexpr int R = decltype(rc)::value;
      const int64_t ahead = R + pf;  // rows: the pass pf rows past the next one
      for (; n + R <= N; n += R) tokens(rc, T, offset(W, n), 0, y + n, pf && n + R + ahead <= N ? ahead * W.w_row : 0);
    };
    if (T == 1) run_rows(Slot<R1>{});
    else run_rows(Slot<R23>{});
    run_rows(Slot<1>{});
    return;
  }
  for (int64_t a = 0; a < N; a += 2) {
    const Rows Wa = offset(W, a);
    for (int64_t t0 = 0; t0 < T; t0 += TB) {
      const int64_t tt = lo(TB, T - t0);
      // the first chunk of tokens over a pair asks for the pair pf rows ahead
      const int64_t ahead = t0 == 0 && pf && a + 2 + pf <= N ? pf * W.w_row : 0;
      if (a + 2 <= N) tokens(Slot<2>{}, tt, Wa, t0, y + t0 * ldy + a, ahead);
      else tokens(Slot<1>{}, tt, Wa, t0, y + t0 * ldy + a, 0);
    }
  }
}

}  // namespace

// ---- entry points --------------------------------------------------------------------------------
void prep_f32(const float* x, int64_t K, float* out, float* lane_sums) {
  for (int64_t g = 0; g < padded(K); g += GROUP) {
    for (int64_t L = 0; L < 16; ++L)
      for (int64_t j = 0; j < 8; ++j) {
        const int64_t k = g + 8 * L + j;
        out[g + 16 * j + L] = k < K ? x[k] : 0.f;
      }
    if (lane_sums) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t j = 0; j < 8; ++j) s = _mm512_add_ps(s, _mm512_loadu_ps(out + g + 16 * j));
      _mm512_storeu_ps(lane_sums + g / 8, s);
    }
  }
}

void prep_q8(int code, const float* x, int64_t K, int8_t* q, float* scales, int32_t* corr) {
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
  const float sm = code == MXFP4 ? 0.5f : 1.f;  // the MXFP4 table holds 2 x e2m1
  const int32_t cm = code == MXFP4 ? -12 : 1;   // MXFP4: the table's +12 taken off; int4: the code sum
  for (int64_t g = 0; g < padded(K) / GROUP; ++g) {
    alignas(64) float sc[16];
    alignas(64) int32_t cr[16];
    for (int j = 0; j < 4; ++j) {
      const int64_t k = GROUP * g + BLOCK * j;
      const __m512 a = _mm512_maskz_loadu_ps(mask16(K - k), x + k), b = _mm512_maskz_loadu_ps(mask16(K - k - 16), x + k + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      // x - x is 0 for a finite x, NaN for NaN and +-inf
      const bool finite = _mm512_cmp_ps_mask(_mm512_sub_ps(a, a), _mm512_setzero_ps(), _CMP_EQ_OQ) == 0xFFFF &&
                          _mm512_cmp_ps_mask(_mm512_sub_ps(b, b), _mm512_setzero_ps(), _CMP_EQ_OQ) == 0xFFFF;
      const float s = finite ? amax / 127.f : __builtin_nanf("");
      __m512i ca = _mm512_setzero_si512(), cb = _mm512_setzero_si512();
      if (finite && amax > 0.f) {  // nearest even
        ca = _mm512_cvtps_epi32(_mm512_div_ps(a, _mm512_set1_ps(s)));
        cb = _mm512_cvtps_epi32(_mm512_div_ps(b, _mm512_set1_ps(s)));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + GROUP * g + 16 * j),
                       _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(ca, ev, cb)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + GROUP * g + 64 + 16 * j),
                       _mm512_cvtsepi32_epi8(_mm512_permutex2var_epi32(ca, od, cb)));
      for (int l = 0; l < 4; ++l) {
        sc[4 * j + l] = s * sm;
        cr[4 * j + l] = 0;
      }
      cr[4 * j] = cm * _mm512_reduce_add_epi32(_mm512_add_epi32(ca, cb));
    }
    _mm512_storeu_ps(scales + 16 * g, _mm512_load_ps(sc));
    _mm512_storeu_si512(corr + 16 * g, _mm512_load_si512(cr));
  }
}

void rows_f32(int code, const Rows& W, int64_t N, int64_t K, const float* const* xf, const float* const* xsum,
              int64_t T, float* y, int64_t ldy, int64_t pf) {
  auto run = [&](auto rc, auto tc, const Rows& Wn, int64_t t0, float* yt, int64_t ahead) __attribute__((always_inline)) {
    constexpr int R = decltype(rc)::value, TT = decltype(tc)::value;
    if (code == MXFP4) f32_block<MXFP4, R, TT>(Wn, K, xf + t0, nullptr, yt, ldy, ahead);
    else f32_block<INT4, R, TT>(Wn, K, xf + t0, xsum + t0, yt, ldy, ahead);
  };
  // MXFP4, T = 1: 4 rows share each activation vector (gpt-oss-20b expert shapes, one thread, kernel alone:
  // 15 -> 19-25 GB/s, docs/real-scale.md); T = 2, 3 and int4 stay one row at a time (2 or 4 rows: slower)
  if (code == MXFP4) drive<4, 1>(W, N, T, y, ldy, pf, run);
  else drive<1, 1>(W, N, T, y, ldy, pf, run);
}

void rows_q8(int code, const Rows& W, int64_t N, int64_t K, const int8_t* const* xq, const float* const* xs,
             const int32_t* const* xc, int64_t T, float* y, int64_t ldy, int64_t pf) {
  auto run = [&](auto rc, auto tc, const Rows& Wn, int64_t t0, float* yt, int64_t ahead) __attribute__((always_inline)) {
    constexpr int R = decltype(rc)::value, TT = decltype(tc)::value;
    if (code == MXFP4) q8_block<MXFP4, R, TT>(Wn, K, xq + t0, xs + t0, xc + t0, yt, ldy, ahead);
    else q8_block<INT4, R, TT>(Wn, K, xq + t0, xs + t0, xc + t0, yt, ldy, ahead);
  };
  // MXFP4: 4 rows share the activations at T = 1, 2 rows at T = 2, 3 (gpt-oss-20b expert shapes, one thread,
  // kernel alone: 17-19 -> 27-33 GB/s at T = 1, 13 -> 14-18 at T = 2, docs/real-scale.md); int4 one row at a
  // time (2 or 4 rows measured slower)
  if (code == MXFP4) drive<4, 2>(W, N, T, y, ldy, pf, run);
  else drive<1, 1>(W, N, T, y, ldy, pf, run);
}

#pragma GCC pop_options

}  // namespace nib
