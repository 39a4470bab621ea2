// 4-bit weights at memory speed (nibble_kernels.h): codes decoded through a table held in a register.
//
// As in fast_kernels.cpp, everything below the target pragma is AVX-512 code reached only through the
// entry points at the bottom, called only when supported(); no inline function of a header is
// used there (a copy compiled here could be the one the linker keeps for the whole module).
//
// Loop shapes: fewer than 4 tokens, 1, 2 or 4 rows at a time (drive; in exact math several independent
// accumulators per token hide the FMA latency); more, in exact math (and in fast math with the strips
// off), pairs of rows kept in L1 while chunks of 6 tokens pass over them (2 x 6 accumulators); in fast
// math from strip_tokens() tokens, strips of 32 rows decoded once per 512 features into a tile with the
// rows in the lanes (tile_strip), chunks of up to 6 tokens passing over it (2 x 6 accumulators of 16
// rows), or on AMX passes of 16 tokens (amx_tokens; its instructions run only where amx() says the CPU
// has AMX and the tile state was granted). C: the format (Code), R rows, TT tokens.

#include "nibble_kernels.h"
#include "amx_tiles.h"

#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

namespace nib {

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

namespace {
std::atomic<int64_t> strips_from{4};
}
void set_strip_tokens(int64_t tokens) { strips_from.store(tokens, std::memory_order_relaxed); }
int64_t strip_tokens() { return strips_from.load(std::memory_order_relaxed); }

// AMX: the CPU has AMX-TILE and AMX-INT8 and Linux grants this process the tile state (arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA, asked once; the grant holds for every thread of the process)
bool amx_supported() {
  static const bool ok = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
                         syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}
namespace {
std::atomic<bool> amx_allowed{true};
}
void set_amx(bool on) { amx_allowed.store(on, std::memory_order_relaxed); }
bool amx() { return amx_allowed.load(std::memory_order_relaxed) && amx_supported(); }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")

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

// scales4 for 4 bytes none of which is 0 or 255 (the caller checked the row: plain_scales)
inline __m512 scales4_plain(uint32_t e4) {
  // byte j moved to the exponent field (bits 23..30) by one rotate per lane
  const __m512i rot = _mm512_setr_epi32(23, 23, 23, 23, 15, 15, 15, 15, 7, 7, 7, 7, 31, 31, 31, 31);
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_rolv_epi32(_mm512_set1_epi32(int(e4)), rot), _mm512_set1_epi32(0x7F800000)));
}

inline __m512 scales4(uint32_t e4) {
  if (__builtin_expect(has_zero_byte(e4) || has_zero_byte(~e4), 0)) return scales4_special(e4);
  return scales4_plain(e4);
}

// true when none of the n e8m0 bytes of each of the R rows at z (row stride z_row) is 0 or 255: their
// scales then go through scales4_plain, without the per-load check (gpt-oss-20b expert rows, one thread,
// bench/nibble_compute.cpp: fast T = 1 40-41 -> 44-46 GB/s in L2, T = 2 22 -> 25, from memory 35-37 -> 37-40)
template <int R>
inline bool plain_scales(const uint8_t* z, int64_t z_row, int64_t n) {
  __mmask64 bad = 0;
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < n; i += 64) {
      const __mmask64 m = mask64(n - i);
      const __m512i v = _mm512_maskz_loadu_epi8(m, z + r * z_row + i);
      bad |= _mm512_mask_cmpeq_epi8_mask(m, v, _mm512_setzero_si512()) |
             _mm512_mask_cmpeq_epi8_mask(m, v, _mm512_set1_epi8(char(0xFF)));
    }
  return bad == 0;
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
    const int64_t i = W.G == GROUP ? g : GROUP * g / W.G;  // no 64-bit division per load in the usual case
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
  const bool plain = C == MXFP4 && plain_scales<R>(W.z, W.z_row, nb);
  auto group = [&](int64_t g, bool tail) __attribute__((always_inline)) {
    __m512i v[R];
    __m512 ws[R], wb[R];  // per lane: scale, and int4's offset -zero * scale
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = W.w + r * W.w_row + 64 * g;
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
      v[r] = tail ? _mm512_maskz_loadu_epi8(mask64(nbytes - 64 * g), p) : _mm512_loadu_si512(p);
      if constexpr (C == MXFP4) {
        const uint32_t e4 = e4_at(W.z + r * W.z_row, g, nb);
        ws[r] = plain ? scales4_plain(e4) : scales4(e4);
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
// int4 with G a multiple of GROUP (one scale and zero point per 64-byte load of codes) keeps the zero
// point out of the inner loop: sum_k (code - z) x = sum_k code x - sum_g z_g s_g qz_g, the second sum
// taken once per row at the end from qz ([TT, ng]: per token and group, the sum over its 4 blocks of code
// sum x scale; made by rows_q8). Per row, token and 64-byte load: 2 vpdpbusd + 3 float ops, against 5
// and a zero point broadcast per load before. Other int4 groups take the zero point per block.
template <int C, int R, int TT>
void q8_block(const Rows& W, int64_t K, const int8_t* const* xq, const float* const* xs, const int32_t* const* xc,
              const float* qz, float* y, int64_t ldy, int64_t ahead) {
  // MXFP4: 2 x e2m1 + 12 by code, an unsigned byte for vpdpbusd (the activations are the signed side)
  const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const bool hoist = C == INT4 && qz != nullptr;
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t nbytes = K / 2, nb = (K + BLOCK - 1) / BLOCK, ng = (K + GROUP - 1) / GROUP, full = nbytes / 64;
  const bool plain = C == MXFP4 && plain_scales<R>(W.z, W.z_row, nb);
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
        const uint32_t e4 = e4_at(W.z + r * W.z_row, g, nb);
        ws[r] = plain ? scales4_plain(e4) : scales4(e4);
      } else if (hoist) {
        ws[r] = _mm512_set1_ps(W.s[r * W.s_row + (W.G == GROUP ? g : GROUP * g / W.G)]);
      } else {
        int4_consts(W, r, g, nb, ws[r], zv[r]);
      }
    }
    for (int t = 0; t < TT; ++t) {
      const __m512i xe = _mm512_loadu_si512(xq[t] + GROUP * g), xo = _mm512_loadu_si512(xq[t] + GROUP * g + 64);
      const __m512 sx = _mm512_loadu_ps(xs[t] + 16 * g);
      for (int r = 0; r < R; ++r) {
        if constexpr (C == MXFP4) {
          const __m512i c = _mm512_loadu_si512(xc[t] + 16 * g);
          const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, wl[r], xe), wh[r], xo);
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[r], sx), acc[r][t]);
        } else {
          const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wl[r], xe), wh[r], xo);
          if (hoist) {
            acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[r], sx), acc[r][t]);
          } else {  // sum (code - zero) x = sum code x - zero * (the block's code sum)
            const __m512i c = _mm512_loadu_si512(xc[t] + 16 * g);
            const __m512 e = _mm512_fnmadd_ps(zv[r], _mm512_cvtepi32_ps(c), _mm512_cvtepi32_ps(d));
            acc[r][t] = _mm512_fmadd_ps(e, _mm512_mul_ps(ws[r], sx), acc[r][t]);
          }
        }
      }
    }
  };
  for (int64_t g = 0; g < full; ++g) group(g, false);
  if (full < ng) group(full, true);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      float v = _mm512_reduce_add_ps(acc[r][t]);
      if (hoist) {  // less sum_g z_g s_g qz_g
        const float* sr = W.s + r * W.s_row;
        const uint8_t* zr = W.z + r * W.z_row;
        if (W.G == GROUP) {
          __m512 cv = _mm512_setzero_ps();
          for (int64_t g = 0; g < ng; g += 16) {
            const __mmask16 m = mask16(ng - g);
            const __m512 zf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, zr + g)));
            cv = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + g), zf), _mm512_maskz_loadu_ps(m, qz + t * ng + g), cv);
          }
          v -= _mm512_reduce_add_ps(cv);
        } else {
          for (int64_t g = 0; g < ng; ++g) v -= sr[GROUP * g / W.G] * float(zr[GROUP * g / W.G]) * qz[t * ng + g];
        }
      }
      y[t * ldy + r] = v;
    }
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

// ---- fast, many tokens: a strip of rows decoded once, rows in the lanes ------------------------------
// A strip of SR = 32 rows and KC groups of 128 features is decoded into a Tile in L1: a 16 x 16 transpose
// of the code dwords of 16 rows puts dword q of row n in lane n, so one vpdpbusd against 4 activation
// bytes broadcast (m32bcst) makes 64 MACs of 16 rows at once, and the per-block float work (cvtdq2ps,
// weight scale x activation scale, fma) serves 16 rows instead of one: per 16 rows, token and block of 32,
// 8 vpdpbusd + 3 float ops, against 8 + 12 in q8_block. Weights as unsigned bytes: MXFP4 2 x e2m1 + 12
// (the +12 taken off by the block's code sum x -12, as in q8_block), int4 code - zero + 16 (the +16
// taken off by the code sum x -16; a strip with a zero point above 16 goes to q8_block). Each token
// chunk of TT tokens accumulates into y over the K chunks of the strip.
constexpr int64_t SR = 32;  // rows per strip: 2 vectors of 16
constexpr int64_t KC = 4;   // groups per K chunk (the Tile: 16 KiB of codes, 2 KiB of scales; its 16 blocks: one transpose)

struct Tile {
  // [group][block of the group][step k of the block][row vector] 64 bytes: lane n = 4 bytes of row n at
  // the prepared positions of step k (k < 4: 16 j + 4 k, the block's even features; k >= 4: 64 + 16 j + 4 (k - 4))
  alignas(64) uint8_t w[KC][4][8][2][64];
  alignas(64) float ws[KC][4][2][16];  // per block and row vector: lane n's weight scale
};

// rows 0..15 of r -> 16 vectors, vector q lane n = dword q of r[n]
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4q + c]: 128-bit lane L holds dword 4L + c of rows 4q..4q+3
  for (int q = 0; q < 4; ++q) {
    u[4 * q + 0] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// decodes groups g0 .. g0 + ng - 1 of rows a .. a + SR - 1 (rows past N: row N - 1's codes, never stored);
// false when an int4 zero point of the strip is above 16 (its weights would not fit the unsigned bytes)
template <int C>
bool decode_tile(const Rows& W, int64_t N, int64_t K, int64_t a, int64_t g0, int64_t ng, Tile& tl) {
  const int64_t nbytes = K / 2, nb = (K + BLOCK - 1) / BLOCK, ng_all = (K + GROUP - 1) / GROUP;
  const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int v = 0; v < 2; ++v) {
    alignas(64) uint32_t off[4][4][16];  // int4: 16 - zero in each byte, per group, block, lane
    if constexpr (C == MXFP4) {  // the chunk's 16 e8m0 bytes of each row, transposed (blocks past K: 0)
      __m512i e[16];
      for (int n = 0; n < 16; ++n)
        e[n] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask16(nb - 4 * g0), W.z + lo(a + 16 * v + n, N - 1) * W.z_row + 4 * g0));
      transpose16(e);  // e[b] lane n: row n's block b of the chunk
      for (int b = 0; b < 4 * ng; ++b) {
        __m512i bits = _mm512_slli_epi32(e[b], 23);
        bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e[b], _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
        bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e[b], _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000));
        _mm512_store_si512(tl.ws[b / 4][b % 4][v], bits);
      }
    } else {  // the chunk's (at most 16) scales and zero points of each row, transposed
      // the chunk's scale groups i0 .. i0 + count - 1 (at most 16: groups of at least 32 features)
      const int64_t i0 = 4 * g0 * BLOCK / W.G, count = lo(4 * (g0 + ng) - 1, nb - 1) * BLOCK / W.G + 1 - i0;
      __m512i zt[16], st[16], zmax = _mm512_setzero_si512();
      if (count <= 4) {  // groups of 128 or more: each row's (at most) 4 in a 128-bit lane, 4 rows a vector
        for (int i = 0; i < 4; ++i) {
          zt[i] = st[i] = _mm512_setzero_si512();
          for (int q = 0; q < 4; ++q) {  // 128-bit lane q of zt[i], st[i]: row 4q + i's
            const int64_t r = lo(a + 16 * v + 4 * q + i, N - 1);
            const __mmask16 lane = __mmask16(0xF << (4 * q));
            zt[i] = _mm512_mask_broadcast_i32x4(zt[i], lane, _mm_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask16(count), W.z + r * W.z_row + i0)));
            st[i] = _mm512_mask_broadcast_i32x4(st[i], lane, _mm_castps_si128(_mm_maskz_loadu_ps(__mmask8(mask16(count)), W.s + r * W.s_row + i0)));
          }
          zmax = _mm512_max_epu32(zmax, zt[i]);
        }
        auto transpose4 = [](__m512i* x) __attribute__((always_inline)) {  // in each 128-bit lane
          const __m512i t0 = _mm512_unpacklo_epi32(x[0], x[1]), t1 = _mm512_unpackhi_epi32(x[0], x[1]);
          const __m512i t2 = _mm512_unpacklo_epi32(x[2], x[3]), t3 = _mm512_unpackhi_epi32(x[2], x[3]);
          x[0] = _mm512_unpacklo_epi64(t0, t2);
          x[1] = _mm512_unpackhi_epi64(t0, t2);
          x[2] = _mm512_unpacklo_epi64(t1, t3);
          x[3] = _mm512_unpackhi_epi64(t1, t3);
        };
        transpose4(zt);  // zt[c] lane 4q + i: row 4q + i's zero point i0 + c
        transpose4(st);
      } else {
        for (int n = 0; n < 16; ++n) {
          const int64_t r = lo(a + 16 * v + n, N - 1);
          zt[n] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask16(count), W.z + r * W.z_row + i0));
          st[n] = _mm512_castps_si512(_mm512_maskz_loadu_ps(mask16(count), W.s + r * W.s_row + i0));
          zmax = _mm512_max_epu32(zmax, zt[n]);
        }
        transpose16(zt);  // zt[i] lane n: row n's zero point i0 + i
        transpose16(st);
      }
      if (_mm512_cmpgt_epu32_mask(zmax, _mm512_set1_epi32(16))) return false;
      const __m512i rep = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
      for (int64_t g = 0; g < ng; ++g)
        for (int j = 0; j < 4; ++j) {
          const int64_t i = lo(4 * (g0 + g) + j, nb - 1) * BLOCK / W.G - i0;
          _mm512_store_si512(tl.ws[g][j][v], st[i]);
          _mm512_store_si512(off[g][j], _mm512_shuffle_epi8(_mm512_sub_epi32(_mm512_set1_epi32(16), zt[i]), rep));
        }
    }
    // byte offsets of the vector's 16 rows (rows past N: row N - 1's), made once for all its groups
    int64_t at[16];
    for (int n = 0; n < 16; ++n) at[n] = lo(a + 16 * v + n, N - 1) * W.w_row;
    const int64_t next = lo(16, N - SR - (a + 16 * v));  // rows whose next strip exists (n < next)
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t gg = g0 + g;
      const bool tail = 64 * (gg + 1) > nbytes;
      __m512i r[16];
      const uint8_t* p[16];
      const uint8_t* base = W.w + 64 * gg;
      for (int n = 0; n < 16; ++n) p[n] = base + at[n];
      // the codes the next chunk reads: these rows', or at the rows' last chunk the next strip's
      if (gg + KC < ng_all) {
        for (int n = 0; n < 16; ++n) _mm_prefetch(reinterpret_cast<const char*>(p[n] + 64 * KC), _MM_HINT_T0);
      } else {
        for (int n = 0; n < next; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(p[n] + SR * W.w_row - 64 * g0), _MM_HINT_T0);
      }
      if (!tail) {
        // 128-bit lane q of y[i] = 128-bit lane L of row 4q + i (broadcast loads), then a 4 x 4 transpose of dwords
        // in each 128-bit lane (against 16 loads and transpose16: 4-12% faster at T = 4..8 on the
        // gpt-oss-20b and Qwen3-30B-A3B expert shapes, one thread)
        for (int L = 0; L < 4; ++L) {
          __m512i y[4];
          for (int i = 0; i < 4; ++i) {
            y[i] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p[i] + 16 * L)));
            y[i] = _mm512_mask_broadcast_i32x4(y[i], 0x00F0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[4 + i] + 16 * L)));
            y[i] = _mm512_mask_broadcast_i32x4(y[i], 0x0F00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[8 + i] + 16 * L)));
            y[i] = _mm512_mask_broadcast_i32x4(y[i], 0xF000, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p[12 + i] + 16 * L)));
          }
          const __m512i t0 = _mm512_unpacklo_epi32(y[0], y[1]), t1 = _mm512_unpackhi_epi32(y[0], y[1]);
          const __m512i t2 = _mm512_unpacklo_epi32(y[2], y[3]), t3 = _mm512_unpackhi_epi32(y[2], y[3]);
          r[4 * L + 0] = _mm512_unpacklo_epi64(t0, t2);
          r[4 * L + 1] = _mm512_unpackhi_epi64(t0, t2);
          r[4 * L + 2] = _mm512_unpacklo_epi64(t1, t3);
          r[4 * L + 3] = _mm512_unpackhi_epi64(t1, t3);
        }
      } else {
        for (int n = 0; n < 16; ++n) r[n] = _mm512_maskz_loadu_epi8(mask64(nbytes - 64 * gg), p[n]);
        transpose16(r);
      }
      // r[q] lane n: code dword q of row n (features 8q..8q+7 of the group, block q / 4)
      for (int q = 0; q < 16; ++q) {
        __m512i lo4 = _mm512_and_si512(r[q], nib), hi4 = _mm512_and_si512(_mm512_srli_epi16(r[q], 4), nib);
        if constexpr (C == MXFP4) {
          lo4 = _mm512_shuffle_epi8(tab, lo4);
          hi4 = _mm512_shuffle_epi8(tab, hi4);
        } else {
          const __m512i o = _mm512_load_si512(off[g][q / 4]);
          lo4 = _mm512_add_epi8(lo4, o);
          hi4 = _mm512_add_epi8(hi4, o);
        }
        _mm512_store_si512(tl.w[g][q / 4][q % 4][v], lo4);
        _mm512_store_si512(tl.w[g][q / 4][4 + q % 4][v], hi4);
      }
    }
  }
  return true;
}

// tokens t < TT of a token chunk over the tile's ng groups (group g0 + g of the prepared rows), into
// y[t * ldy + n] for the strip's rows n < rows (first: stored, else added)
template <int C, int TT>
void tile_tokens(const Tile& tl, int64_t g0, int64_t ng, const int8_t* const* xq, const float* const* xs,
                 const int32_t* const* xc, float* y, int64_t ldy, int64_t rows, bool first) {
  const __mmask16 m0 = mask16(rows), m1 = mask16(rows - 16);
  __m512 acc[2][TT];
  for (int t = 0; t < TT; ++t) {
    acc[0][t] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, y + t * ldy);
    acc[1][t] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, y + t * ldy + 16);
  }
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t gg = g0 + g;
    for (int j = 0; j < 4; ++j) {
      __m512i d[2][TT];
      for (int t = 0; t < TT; ++t) {
        const int32_t c = xc[t][16 * gg + 4 * j];
        d[0][t] = d[1][t] = _mm512_set1_epi32(C == MXFP4 ? c : -16 * c);
      }
      for (int k = 0; k < 8; ++k) {
        const __m512i w0 = _mm512_load_si512(tl.w[g][j][k][0]), w1 = _mm512_load_si512(tl.w[g][j][k][1]);
        const int64_t pos = GROUP * gg + (k < 4 ? 16 * j + 4 * k : 64 + 16 * j + 4 * (k - 4));
        for (int t = 0; t < TT; ++t) {
          int32_t xv;
          __builtin_memcpy(&xv, xq[t] + pos, 4);
          const __m512i xb = _mm512_set1_epi32(xv);
          d[0][t] = _mm512_dpbusd_epi32(d[0][t], w0, xb);
          d[1][t] = _mm512_dpbusd_epi32(d[1][t], w1, xb);
        }
      }
      const __m512 s0 = _mm512_load_ps(tl.ws[g][j][0]), s1 = _mm512_load_ps(tl.ws[g][j][1]);
      for (int t = 0; t < TT; ++t) {
        const __m512 sx = _mm512_set1_ps(xs[t][16 * gg + 4 * j]);
        acc[0][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[0][t]), _mm512_mul_ps(s0, sx), acc[0][t]);
        acc[1][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[1][t]), _mm512_mul_ps(s1, sx), acc[1][t]);
      }
    }
  }
  for (int t = 0; t < TT; ++t) {
    _mm512_mask_storeu_ps(y + t * ldy, m0, acc[0][t]);
    _mm512_mask_storeu_ps(y + t * ldy + 16, m1, acc[1][t]);
  }
}

// ---- the strips on AMX (TDPBSUD): a tile's block as B, 16 tokens' activations as A ----------------
// B = one block of a Tile row vector: 8 steps x 64 bytes, lane n = row n's 4 unsigned bytes, which is the
// layout TDPBSUD wants for its unsigned operand; A = 16 tokens x the block's 32 prepared int8 codes in the
// steps' order (the 16 even codes, then the 16 odd ones); C = 16 tokens x 16 rows of int32: the sums
// vpdpbusd makes. C converted plus the code-sum term (both below 2^18: exact in float32), times weight scale
// x activation scale, is what tile_tokens computes, so the outputs equal the VNNI strips' bit for bit.
struct AmxAct {  // T tokens' activations regrouped per block b (Kp / 32 of them), Tp = T rounded up to 16
  int8_t* a;     // [nb][Tp][32]; tokens past T: zeros
  float* sx;     // [nb][Tp] the block's activation scale
  float* cf;     // [nb][Tp] the block's code-sum term (MXFP4: xc; int4: -16 xc)
  int64_t Tp;
};

// false when the buffer cannot be had (the caller then runs the VNNI strips)
bool amx_prep(int code, int64_t K, const int8_t* const* xq, const float* const* xs, const int32_t* const* xc,
              int64_t T, AmxAct& A) {
  const int64_t nb = padded(K) / BLOCK, Tp = (T + 15) / 16 * 16;
  char* mem = static_cast<char*>(std::aligned_alloc(64, nb * Tp * (32 + 8)));
  if (!mem) return false;
  A = AmxAct{reinterpret_cast<int8_t*>(mem), reinterpret_cast<float*>(mem + nb * Tp * 32),
             reinterpret_cast<float*>(mem + nb * Tp * 36), Tp};
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t g = b / 4, j = b % 4;
    for (int64_t t = 0; t < Tp; ++t) {
      int8_t* r = A.a + (b * Tp + t) * 32;
      if (t < T) {
        _mm_store_si128(reinterpret_cast<__m128i*>(r), _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq[t] + GROUP * g + 16 * j)));
        _mm_store_si128(reinterpret_cast<__m128i*>(r + 16), _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq[t] + GROUP * g + 64 + 16 * j)));
        A.sx[b * Tp + t] = xs[t][16 * g + 4 * j];
        const int32_t c = xc[t][16 * g + 4 * j];
        A.cf[b * Tp + t] = float(code == MXFP4 ? c : -16 * c);
      } else {
        _mm256_store_si256(reinterpret_cast<__m256i*>(r), _mm256_setzero_si256());
        A.sx[b * Tp + t] = A.cf[b * Tp + t] = 0.f;
      }
    }
  }
  return true;
}

// tokens t0 .. t0 + tt - 1 (tt <= TT <= 16) over the tile's ng groups, as tile_tokens
template <int TT>
void amx_tokens(const Tile& tl, int64_t g0, int64_t ng, const AmxAct& A, int64_t t0, int64_t tt, float* y,
                int64_t ldy, int64_t rows, bool first) {
  alignas(64) int32_t cb[4][16][16];
  for (int v = 0; v < 2 && 16 * v < rows; ++v) {
    const __mmask16 m = mask16(rows - 16 * v);
    float* yv = y + t0 * ldy + 16 * v;
    __m512 acc[TT];
    for (int t = 0; t < TT; ++t) acc[t] = first || t >= tt ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, yv + t * ldy);
    for (int64_t g = 0; g < ng; ++g) {
      const int8_t* a = A.a + (4 * (g0 + g) * A.Tp + t0) * 32;  // block j's A: a + j * Tp * 32
      const int64_t ja = A.Tp * 32;
      const uint8_t* const b4[4] = {tl.w[g][0][0][v], tl.w[g][1][0][v], tl.w[g][2][0][v], tl.w[g][3][0][v]};
      amx::products4(a, ja, b4, cb);
      for (int j = 0; j < 4; ++j) {
        const int64_t b = 4 * (g0 + g) + j;
        const __m512 ws = _mm512_load_ps(tl.ws[g][j][v]);
        const float *sx = A.sx + b * A.Tp + t0, *cf = A.cf + b * A.Tp + t0;
        for (int t = 0; t < TT; ++t)
          acc[t] = _mm512_fmadd_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb[j][t])), _mm512_set1_ps(cf[t])),
                                   _mm512_mul_ps(ws, _mm512_set1_ps(sx[t])), acc[t]);
      }
    }
    for (int t = 0; t < TT && t < tt; ++t) _mm512_mask_storeu_ps(yv + t * ldy, m, acc[t]);
  }
}

#include "strip_chunks.h"  // the strips' token blocks
// tokens from which a pass goes to AMX (one thread, a weight in L2, bench/strip_bench.py: AMX over VNNI
// 0.93-0.99x at T = 8, 1.05-1.30x at T = 16 and 32, int4 and MXFP4 at the gpt-oss-20b and Qwen3-30B-A3B shapes)
constexpr int64_t AMX_TOKENS = 12;

// rows [a, a + SR) of W (fewer at the end) for every token; false when decode_tile refuses (the strip's
// outputs then hold partial sums: q8_block computes them again)
template <int C>
bool tile_strip(const Rows& W, int64_t N, int64_t K, int64_t a, const int8_t* const* xq, const float* const* xs,
                const int32_t* const* xc, int64_t T, float* y, int64_t ldy, Tile& tl, const AmxAct* amx_act) {
  const int64_t ng = (K + GROUP - 1) / GROUP, rows = lo(SR, N - a);
  for (int64_t g0 = 0; g0 < ng; g0 += KC) {
    const int64_t n = lo(KC, ng - g0);
    if (!decode_tile<C>(W, N, K, a, g0, n, tl)) return false;
    // passes of 16 tokens on AMX while at least AMX_TOKENS remain (a pass of 12 or fewer: 12 computed),
    // then the rest in register blocks on VNNI (strip_chunks.h), as even as can be (T = 8: 4 + 4, not 6 + 2)
    int64_t t0 = 0;
    for (; amx_act && T - t0 >= AMX_TOKENS; t0 += 16) {
      const int64_t tt = lo(16, T - t0);
      if (tt <= 12) amx_tokens<12>(tl, g0, n, *amx_act, t0, tt, y + a, ldy, rows, g0 == 0);
      else amx_tokens<16>(tl, g0, n, *amx_act, t0, tt, y + a, ldy, rows, g0 == 0);
    }
    strip_chunks::even(t0, T, [&](auto tc, int64_t t) __attribute__((always_inline)) {
      tile_tokens<C, decltype(tc)::value>(tl, g0, n, xq + t, xs + t, xc + t, y + t * ldy + a, ldy, rows, g0 == 0);
    });
  }
  return true;
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
  // int4 with G a multiple of GROUP: qz[t * ng + g] = sum over group g's 4 blocks of token t's code sum x
  // scale (q8_block's zero-point term), made before q8_block's first pass; on the stack (no std::
  // containers under this file's target pragma), so only for T x groups <= QZ (else the zero point per block)
  constexpr int64_t QZ = 4096;
  alignas(64) float qbuf[QZ];
  const int64_t ng = (K + GROUP - 1) / GROUP;
  const float* qz = nullptr;
  auto prepare_qz = [&] {
    if (code != INT4 || W.G % GROUP != 0 || T * ng > QZ || qz) return;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < ng; ++g) {
        const __m512 c = _mm512_cvtepi32_ps(_mm512_loadu_si512(xc[t] + 16 * g));
        qbuf[t * ng + g] = _mm512_reduce_add_ps(_mm512_mul_ps(c, _mm512_loadu_ps(xs[t] + 16 * g)));
      }
    qz = qbuf;
  };
  auto run = [&](auto rc, auto tc, const Rows& Wn, int64_t t0, float* yt, int64_t ahead) __attribute__((always_inline)) {
    constexpr int R = decltype(rc)::value, TT = decltype(tc)::value;
    if (code == MXFP4) q8_block<MXFP4, R, TT>(Wn, K, xq + t0, xs + t0, xc + t0, nullptr, yt, ldy, ahead);
    else q8_block<INT4, R, TT>(Wn, K, xq + t0, xs + t0, xc + t0, qz ? qz + t0 * ng : nullptr, yt, ldy, ahead);
  };
  const int64_t from = strip_tokens();
  if (from > 0 && T >= from) {
    Tile tl;
    AmxAct act{};
    const bool on_amx = T >= AMX_TOKENS && amx() && amx_prep(code, K, xq, xs, xc, T, act);
    if (on_amx) amx::config(32);  // amx_tiles.h
    for (int64_t a = 0; a < N; a += SR) {
      const AmxAct* A = on_amx ? &act : nullptr;
      const bool done = code == MXFP4 ? tile_strip<MXFP4>(W, N, K, a, xq, xs, xc, T, y, ldy, tl, A)
                                      : tile_strip<INT4>(W, N, K, a, xq, xs, xc, T, y, ldy, tl, A);
      if (!done) {
        prepare_qz();
        drive<1, 1>(offset(W, a), lo(SR, N - a), T, y + a, ldy, 0, run);
      }
    }
    if (on_amx) {
      amx::release();
      std::free(act.a);
    }
    return;
  }
  prepare_qz();
  // MXFP4: 4 rows share the activations at T = 1, 2 rows at T = 2, 3 (gpt-oss-20b expert shapes, one thread,
  // kernel alone: 17-19 -> 27-33 GB/s at T = 1, 13 -> 14-18 at T = 2, docs/real-scale.md); int4 with the zero
  // point out of the loop 2 rows a pass at T = 1, 2, 3 (one thread, weight in L2, bench/nibble_compute.cpp:
  // T = 1 26 -> 48 GB/s at K = 2048, 22 -> 32 at K = 768, T = 2 19 -> 33, T = 3 15 -> 19; 4 rows spill: 18);
  // other int4 one row at a time (2 or 4 rows measured slower)
  if (code == MXFP4) drive<4, 2>(W, N, T, y, ldy, pf, run);
  else if (qz) drive<2, 2>(W, N, T, y, ldy, pf, run);
  else drive<1, 1>(W, N, T, y, ldy, pf, run);
}

#pragma GCC pop_options

}  // namespace nib
