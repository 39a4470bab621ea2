// The K-quants' prefill strips (ggml_kstrips.h): q4_k / q5_k / q6_k rows against many tokens' A256
// activations (int8 codes, a scale per 256, code sums per 16; ggml_kernels.h), as the 32-weight types'
// strips in ggml_kernels.cpp do for theirs.
//
// A strip is SR = 32 rows; per K chunk of KB superblocks it is decoded once into a Tile in L1: each
// superblock's 256 codes of 16 rows transposed so that lane n holds row n's 4 codes of a step (unsigned:
// q4_k 0..15, q5_k 0..31, q6_k 0..63, the -32 left to the activations' sums), in the activations' own order
// (sub-block j's step k: features 32 j + 4 k .. + 3), and the scales made float per row once: d x sc per
// sub-block (q6_k: per 16 weights), dmin, and q4_k / q5_k's mins as int16 pairs. Then per token: one
// vpdpbusd of the row codes against 4 activation bytes broadcast makes 64 MACs of 16 rows; a sub-block's
// (q6_k: 16 weights') int32 sum times d sc into float per row; q4_k / q5_k's dmin m term from the mins
// against the activations' sums per 32 (vpdpwssd, 2 sub-blocks a step), q6_k's -32 by starting each 16's
// sum at -32 x the activations' code sum; per superblock the float sum times the activations' scale.
//
// From AMX_CALL tokens, passes of 16 go to AMX where nib::amx() allows (q4_k and q5_k; amx_tokens, below:
// each superblock's sum as one integer from the scales split in two, see run() for q6_k).
//
// As ggml_kernels.cpp, the AVX-512 region uses no inline function of a standard header; the entry point at
// the bottom (outside it) prepares the activations' sums per token and is called only where fast_supported().

#include "ggml_kstrips.h"

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "amx_tiles.h"
#include "ggml_kernels.h"
#include "nibble_kernels.h"

namespace ggml {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")

#include "strip_chunks.h"  // the strips' token blocks (2 x 6 each of int32 sums, superblock sums, outputs: some spill)

namespace kstrip {

constexpr int64_t SR = 32;  // rows per strip: 2 vectors of 16
constexpr int64_t KB = 2;   // superblocks per K chunk (the Tile: 16 KiB of codes, 5.3 KiB of scales)

template <int T>
constexpr int64_t block_bytes() {
  return T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
}

struct Tile {
  alignas(64) uint8_t w[KB][8][8][2][64];  // [superblock][sub-block j][step k][row vector] lane n: codes 32 j + 4 k ..
  alignas(64) float ds[KB][16][2][16];     // d x scale per row: q4_k / q5_k sub-block j < 8, q6_k per 16 weights
  alignas(64) int32_t m[KB][4][2][16];     // q4_k / q5_k: mins of sub-blocks 2p (low int16) and 2p + 1 (high)
  alignas(64) float dmin[KB][2][16];
  alignas(64) int32_t sc[KB][8][2][16];    // q4_k / q5_k: the 6-bit scale of sub-block j per row (AMX's split)
  alignas(64) float d[KB][2][16];          // q4_k / q5_k: the superblock's d per row (AMX's split)
};

inline __mmask16 mask16(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); }

inline __m512i rep(uint32_t a) { return _mm512_set1_epi32(int(a)); }

inline uint32_t u32(const void* p) {
  uint32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// r[k] lane n = dword k of the 16 bytes at rp[n] + o: 128-bit lane q of y[i] is row 4q + i's bytes, then a
// 4 x 4 transpose of dwords within each lane
inline void transpose16(const uint8_t* const* rp, int64_t o, __m512i r[4]) {
  __m512i y[4];
  for (int i = 0; i < 4; ++i) {
    y[i] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[i] + o)));
    y[i] = _mm512_mask_broadcast_i32x4(y[i], 0x00F0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[4 + i] + o)));
    y[i] = _mm512_mask_broadcast_i32x4(y[i], 0x0F00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[8 + i] + o)));
    y[i] = _mm512_mask_broadcast_i32x4(y[i], 0xF000, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[12 + i] + o)));
  }
  const __m512i t0 = _mm512_unpacklo_epi32(y[0], y[1]), t1 = _mm512_unpackhi_epi32(y[0], y[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(y[2], y[3]), t3 = _mm512_unpackhi_epi32(y[2], y[3]);
  r[0] = _mm512_unpacklo_epi64(t0, t2);
  r[1] = _mm512_unpackhi_epi64(t0, t2);
  r[2] = _mm512_unpacklo_epi64(t1, t3);
  r[3] = _mm512_unpackhi_epi64(t1, t3);
}

// byte i of each lane as float: unsigned / signed
inline __m512 ubyte(__m512i v, int i) { return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * i), rep(0xFF))); }
inline __m512 sbyte(__m512i v, int i) { return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24)); }
// the fp16 in bits 16 h .. 16 h + 15 of each lane as float
inline __m512 half(__m512i v, int h) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16 * h))); }

// q4_k / q5_k superblock at offset o of 16 rows into the tile's superblock i, row vector v (ints: also the
// integer scales and d that the AMX passes' split reads)
template <bool Q5>
void decode_k45(const uint8_t* const* rp, int64_t o, Tile& tl, int64_t i, int v, bool ints) {
  __m512i r[4];
  transpose16(rp, o, r);  // d | dmin, then the 12 scale bytes: w0, w1, w2 (get_scale_min_k4)
  const __m512 d = half(r[0], 0);
  _mm512_store_ps(tl.dmin[i][v], half(r[0], 1));
  const __m512i m6 = rep(0x3F3F3F3F), m4 = rep(0x0F0F0F0F), m2 = rep(0x03030303);
  const __m512i sc[2] = {_mm512_and_si512(r[1], m6),
                         _mm512_or_si512(_mm512_and_si512(r[3], m4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(r[1], 6), m2), 4))};
  const __m512i mn[2] = {_mm512_and_si512(r[2], m6),
                         _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(r[3], 4), m4),
                                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(r[2], 6), m2), 4))};
  for (int j = 0; j < 8; ++j) _mm512_store_ps(tl.ds[i][j][v], _mm512_mul_ps(ubyte(sc[j / 4], j % 4), d));
  if (ints) {
    for (int j = 0; j < 8; ++j)
      _mm512_store_si512(tl.sc[i][j][v], _mm512_and_si512(_mm512_srli_epi32(sc[j / 4], 8 * (j % 4)), rep(0xFF)));
    _mm512_store_ps(tl.d[i][v], d);
  }
  for (int p = 0; p < 4; ++p) {  // mins 2p, 2p + 1: bytes 2 (p % 2), + 1 of mn[p / 2] -> int16 lanes
    const __m512i x = _mm512_srli_epi32(mn[p / 2], 16 * (p % 2));
    _mm512_store_si512(tl.m[i][p][v], _mm512_or_si512(_mm512_and_si512(x, rep(0xFF)), _mm512_slli_epi32(_mm512_and_si512(x, rep(0xFF00)), 8)));
  }
  __m512i h[8];  // q5_k: qh dword k (weights 4k .. 4k + 3 of every sub-block, bit s: sub-block s)
  if constexpr (Q5) {
    transpose16(rp, o + 16, h);
    transpose16(rp, o + 32, h + 4);
  }
  constexpr int64_t QS = Q5 ? 48 : 16;
  for (int c2 = 0; c2 < 8; ++c2) {  // 16 code bytes: steps 4 (c2 % 2) .. + 3 of sub-blocks 2c (low), 2c + 1 (high)
    const int c = c2 / 2;
    transpose16(rp, o + QS + 16 * c2, r);
    for (int kk = 0; kk < 4; ++kk) {
      const int k = 4 * (c2 % 2) + kk;
      __m512i lo = _mm512_and_si512(r[kk], m4), hi = _mm512_and_si512(_mm512_srli_epi32(r[kk], 4), m4);
      if constexpr (Q5) {
        const __m512i one = rep(0x01010101);
        lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[k], 2 * c), one), 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[k], 2 * c + 1), one), 4));
      }
      _mm512_store_si512(tl.w[i][2 * c][k][v], lo);
      _mm512_store_si512(tl.w[i][2 * c + 1][k][v], hi);
    }
  }
}

// q6_k superblock at offset o of 16 rows: weight 128 h + 32 i + l is nibble i / 2 of ql[64 h + 32 (i % 2) + l]
// with bits 2i .. 2i + 1 of qh[32 h + l] above it (sub-block 4 h + i); scales int8 per 16, fp16 d at 208
void decode_q6(const uint8_t* const* rp, int64_t o, Tile& tl, int64_t i, int v) {
  __m512i s[4], r[4];
  transpose16(rp, o + 192, s);
  transpose16(rp, o + 196, r);  // r[3]: bytes 208 .. 211 (d)
  const __m512 d = half(r[3], 0);
  for (int g = 0; g < 16; ++g) _mm512_store_ps(tl.ds[i][g][v], _mm512_mul_ps(sbyte(s[g / 4], g % 4), d));
  const __m512i m4 = rep(0x0F0F0F0F), m2 = rep(0x03030303);
  for (int h = 0; h < 2; ++h)
    for (int kq = 0; kq < 2; ++kq) {  // steps 4 kq .. 4 kq + 3
      __m512i ql[2][4], qh[4];
      transpose16(rp, o + 64 * h + 16 * kq, ql[0]);
      transpose16(rp, o + 64 * h + 32 + 16 * kq, ql[1]);
      transpose16(rp, o + 128 + 32 * h + 16 * kq, qh);
      for (int q = 0; q < 4; ++q)
        for (int kk = 0; kk < 4; ++kk) {
          const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(ql[q % 2][kk], 4 * (q / 2)), m4);
          const __m512i hi = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(qh[kk], 2 * q), m2), 4);
          _mm512_store_si512(tl.w[i][4 * h + q][4 * kq + kk][v], _mm512_or_si512(lo, hi));
        }
    }
}

// superblocks b0 .. b0 + n - 1 of rows a .. a + SR - 1 into the tile (rows past N: row N - 1's, never stored;
// ints: for the AMX passes, decode_k45's)
template <int T>
void strip_decode(const uint8_t* w, int64_t w_row, int64_t N, int64_t nb, int64_t a, int64_t b0, int64_t n, Tile& tl,
                  bool ints) {
  constexpr int64_t BYTES = block_bytes<T>();
  for (int v = 0; v < 2; ++v) {
    const uint8_t* rp[16];
    for (int r = 0; r < 16; ++r) {
      const int64_t row = a + 16 * v + r;
      rp[r] = w + (row < N ? row : N - 1) * w_row;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t o = (b0 + i) * BYTES;
      if (b0 + i + KB < nb)  // the superblock the next chunk reads
        for (int r = 0; r < 16; ++r)
          for (int64_t l = 0; l < BYTES + 63; l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(rp[r] + o + KB * BYTES + (l < BYTES ? l : BYTES - 1)), _MM_HINT_T0);
      if constexpr (T == Q6_K) decode_q6(rp, o, tl, i, v);
      else decode_k45<T == Q5_K>(rp, o, tl, i, v, ints);
    }
  }
}

// tokens t < TT over the tile's n superblocks (superblock b0 + i of the activations), into y[t * ldy + r]
// for the strip's rows r < rows (first: stored, else added). aux[t]: q4_k / q5_k the activations' code sums
// per 32 as int16 pairs (sub-blocks 2p, 2p + 1), q6_k -32 x their code sums per 16
template <int T, int TT>
void strip_tokens(const Tile& tl, int64_t b0, int64_t n, const int8_t* const* xq, const float* const* xd,
                  const int32_t* const* aux, float* y, int64_t ldy, int64_t rows, bool first) {
  constexpr bool K45 = T != Q6_K;
  constexpr int GROUPS = K45 ? 1 : 2, STEPS = K45 ? 8 : 4;  // scale groups per sub-block, steps per group
  const __mmask16 m0 = mask16(rows), m1 = mask16(rows - 16);
  __m512 acc[2][TT];
  for (int t = 0; t < TT; ++t) {
    acc[0][t] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, y + t * ldy);
    acc[1][t] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, y + t * ldy + 16);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = b0 + i;
    __m512 f[2][TT];
    for (int j = 0; j < 8; ++j)
      for (int gq = 0; gq < GROUPS; ++gq) {
        const int g = K45 ? j : 2 * j + gq;
        __m512i s[2][TT];
        for (int t = 0; t < TT; ++t)
          s[0][t] = s[1][t] = K45 ? _mm512_setzero_si512() : _mm512_set1_epi32(aux[t][16 * b + g]);
        for (int kk = 0; kk < STEPS; ++kk) {
          const int k = STEPS * gq + kk;
          const __m512i w0 = _mm512_load_si512(tl.w[i][j][k][0]), w1 = _mm512_load_si512(tl.w[i][j][k][1]);
          for (int t = 0; t < TT; ++t) {
            const __m512i xb = _mm512_set1_epi32(int(u32(xq[t] + 256 * b + 32 * j + 4 * k)));
            s[0][t] = _mm512_dpbusd_epi32(s[0][t], w0, xb);
            s[1][t] = _mm512_dpbusd_epi32(s[1][t], w1, xb);
          }
        }
        const __m512 d0 = _mm512_load_ps(tl.ds[i][g][0]), d1 = _mm512_load_ps(tl.ds[i][g][1]);
        for (int t = 0; t < TT; ++t) {
          const bool start = j == 0 && gq == 0;
          f[0][t] = start ? _mm512_mul_ps(_mm512_cvtepi32_ps(s[0][t]), d0) : _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0][t]), d0, f[0][t]);
          f[1][t] = start ? _mm512_mul_ps(_mm512_cvtepi32_ps(s[1][t]), d1) : _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[1][t]), d1, f[1][t]);
        }
      }
    if constexpr (K45) {  // - dmin sum_j m_j (code sum of sub-block j)
      const __m512 dm0 = _mm512_load_ps(tl.dmin[i][0]), dm1 = _mm512_load_ps(tl.dmin[i][1]);
      for (int t = 0; t < TT; ++t) {
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) {
          const __m512i xb = _mm512_set1_epi32(aux[t][4 * b + p]);
          s0 = _mm512_dpwssd_epi32(s0, _mm512_load_si512(tl.m[i][p][0]), xb);
          s1 = _mm512_dpwssd_epi32(s1, _mm512_load_si512(tl.m[i][p][1]), xb);
        }
        f[0][t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(s0), dm0, f[0][t]);
        f[1][t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(s1), dm1, f[1][t]);
      }
    }
    for (int t = 0; t < TT; ++t) {
      const __m512 sx = _mm512_set1_ps(xd[t][b]);
      acc[0][t] = _mm512_fmadd_ps(f[0][t], sx, acc[0][t]);
      acc[1][t] = _mm512_fmadd_ps(f[1][t], sx, acc[1][t]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    _mm512_mask_storeu_ps(y + t * ldy, m0, acc[0][t]);
    _mm512_mask_storeu_ps(y + t * ldy + 16, m1, acc[1][t]);
  }
}

// ---- the products on AMX (q4_k, q5_k) ---------------------------------------------------------------------
// A superblock's sum for a row, d sum_j sc_j S_j (S_j: sub-block j's code . activation sum), is d times one
// integer: with sc_j = 8 h_j + l_j (h, l < 8), sum_j sc_j S_j = 8 H + L where H = sum_i (h_j(i) q_i) x_i and L
// likewise, and h q, l q < 256 (q4_k codes < 16, q5_k < 32) are unsigned bytes. So two "weights" per superblock
// (Split: the codes times h, times l, decoded once per strip) make two int32 products over its 256 features, 4
// TDPBSUD of 64 features each, accumulated in the tile; after them one convert and one multiply by d per row
// and token instead of one per sub-block. The mins term and the activations' scale follow as strip_tokens'.
// Float rounding differs from the VNNI strips' order (d sc_j S_j summed in float there): both within the fast
// math's tolerance of the dequantised product.

// A call of AMX_CALL tokens or more goes to AMX, in passes of 16 while AMX_TOKENS remain (a pass of 12 to 16
// tokens), the rest on VNNI. Below AMX_CALL the split per strip costs more than the passes save: one thread,
// q4_k / q5_k 768 x 2048 and 2048 x 768, AMX against VNNI: 0.70-0.82x at 16 tokens, 0.96-1.04x at 32,
// 1.32-1.45x at 128.
constexpr int64_t AMX_CALL = 48;
constexpr int64_t AMX_TOKENS = 12;
constexpr int64_t AG = 64;  // features per TDPBSUD (amx::config(64))

struct AmxA {  // T tokens' int8 codes regrouped per 64 features: [K / 64][Tp][64]; tokens past T zero
  int8_t* a;
  int64_t Tp;
};

// false when the buffer cannot be had (the caller then runs the VNNI path alone)
inline bool amx_prep(int64_t K, const int8_t* const* xq, int64_t T, AmxA& A) {
  const int64_t ng = K / AG, Tp = (T + 15) / 16 * 16;
  A = AmxA{static_cast<int8_t*>(std::aligned_alloc(64, ng * Tp * AG)), Tp};
  if (!A.a) return false;
  for (int64_t g = 0; g < ng; ++g)
    for (int64_t t = 0; t < Tp; ++t)
      _mm512_store_si512(A.a + (g * Tp + t) * AG,
                         t < T ? _mm512_loadu_si512(xq[t] + g * AG) : _mm512_setzero_si512());
  return true;
}

struct Split {  // one superblock of a strip: [h or l][step of 4 features, 64][row vector][64 bytes], TDPBSUD's B
  alignas(64) uint8_t w[2][64][2][64];
};

// the tile's superblock i: codes times h_j and times l_j (16-bit multiplies: each byte's product stays < 256)
inline void split(const Tile& tl, int64_t i, Split& sp) {
  for (int j = 0; j < 8; ++j)
    for (int v = 0; v < 2; ++v) {
      const __m512i sc = _mm512_load_si512(tl.sc[i][j][v]);
      const __m512i h = _mm512_srli_epi32(sc, 3), l = _mm512_and_si512(sc, rep(7));
      const __m512i h2 = _mm512_or_si512(h, _mm512_slli_epi32(h, 16)), l2 = _mm512_or_si512(l, _mm512_slli_epi32(l, 16));
      for (int k = 0; k < 8; ++k) {
        const __m512i c = _mm512_load_si512(tl.w[i][j][k][v]);
        _mm512_store_si512(sp.w[0][8 * j + k][v], _mm512_mullo_epi16(c, h2));
        _mm512_store_si512(sp.w[1][8 * j + k][v], _mm512_mullo_epi16(c, l2));
      }
    }
}

// tokens t0 .. t0 + tt - 1 (tt <= TT <= 16) over the tile's superblock i (activations' superblock b) and its
// Split, added into y (first: stored), as strip_tokens
template <int TT>
void amx_tokens(const Tile& tl, const Split& sp, int64_t i, int64_t b, const AmxA& A, int64_t t0, int64_t tt,
                const float* const* xd, const int32_t* const* aux, float* y, int64_t ldy, int64_t rows, bool first) {
  alignas(64) int32_t cb[4][16][16];  // [h v0, l v0, h v1, l v1][token][row]
  __m512 acc[2][TT];
  for (int v = 0; v < 2; ++v)
    for (int t = 0; t < TT; ++t)
      acc[v][t] = first || t >= tt ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask16(rows - 16 * v), y + (t0 + t) * ldy + 16 * v);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < 256 / AG; ++c) {  // 64 features: 16 steps
    _tile_loadd(4, A.a + ((4 * b + c) * A.Tp + t0) * AG, AG);
    _tile_loadd(5, sp.w[0][16 * c][0], 2 * 64);
    _tile_loadd(6, sp.w[1][16 * c][0], 2 * 64);
    _tile_loadd(7, sp.w[0][16 * c][1], 2 * 64);
    _tile_dpbsud(0, 4, 5);
    _tile_dpbsud(1, 4, 6);
    _tile_dpbsud(2, 4, 7);
    _tile_loadd(5, sp.w[1][16 * c][1], 2 * 64);
    _tile_dpbsud(3, 4, 5);
  }
  _tile_stored(0, cb[0], 64);
  _tile_stored(1, cb[1], 64);
  _tile_stored(2, cb[2], 64);
  _tile_stored(3, cb[3], 64);
  for (int v = 0; v < 2; ++v) {
    const __m512 d = _mm512_load_ps(tl.d[i][v]), dm = _mm512_load_ps(tl.dmin[i][v]);
    for (int t = 0; t < TT && t < tt; ++t) {
      const __m512i hl = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(cb[2 * v][t]), 3), _mm512_load_si512(cb[2 * v + 1][t]));
      __m512i s = _mm512_setzero_si512();  // sum_j m_j (code sum of sub-block j), as strip_tokens
      for (int p = 0; p < 4; ++p) s = _mm512_dpwssd_epi32(s, _mm512_load_si512(tl.m[i][p][v]), _mm512_set1_epi32(aux[t][4 * b + p]));
      const __m512 f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(s), dm, _mm512_mul_ps(_mm512_cvtepi32_ps(hl), d));
      acc[v][t] = _mm512_fmadd_ps(f, _mm512_set1_ps(xd[t][b]), acc[v][t]);
    }
  }
  for (int v = 0; v < 2 && 16 * v < rows; ++v)
    for (int t = 0; t < TT && t < tt; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy + 16 * v, mask16(rows - 16 * v), acc[v][t]);
}

template <int T>
void strips(const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const int8_t* const* xq, const float* const* xd,
            const int32_t* const* aux, int64_t TN, float* y, int64_t ldy, const AmxA* A) {
  Tile tl;
  Split sp;  // the AMX passes' weights, one superblock at a time (16 KiB: the Tile and it stay in L1)
  const int64_t nb = K / 256;
  for (int64_t a = 0; a < N; a += SR) {
    const int64_t rows = N - a < SR ? N - a : SR;
    for (int64_t b0 = 0; b0 < nb; b0 += KB) {
      const int64_t n = nb - b0 < KB ? nb - b0 : KB;
      strip_decode<T>(w, w_row, N, nb, a, b0, n, tl, A != nullptr);
      // passes of 16 tokens on AMX while at least AMX_TOKENS remain (a pass of 12 or fewer: 12 computed),
      // then the rest in register blocks on VNNI (strip_chunks.h), as even as can be (T = 8: 4 + 4, not 6 + 2)
      int64_t t0 = 0;
      if constexpr (T != Q6_K)
        if (A && TN >= AMX_TOKENS) {
          const int64_t passes = (TN - AMX_TOKENS) / 16 + 1;  // while at least AMX_TOKENS remain
          for (int64_t i = 0; i < n; ++i) {
            split(tl, i, sp);
            for (int64_t p = 0; p < passes; ++p) {
              const int64_t tp = 16 * p, tt = TN - tp < 16 ? TN - tp : 16;
              const bool first = b0 == 0 && i == 0;
              if (tt <= 12) amx_tokens<12>(tl, sp, i, b0 + i, *A, tp, tt, xd + tp, aux + tp, y + a, ldy, rows, first);
              else amx_tokens<16>(tl, sp, i, b0 + i, *A, tp, tt, xd + tp, aux + tp, y + a, ldy, rows, first);
            }
          }
          t0 = 16 * passes;
        }
      strip_chunks::even(t0, TN, [&](auto tc, int64_t t) __attribute__((always_inline)) {
        strip_tokens<T, decltype(tc)::value>(tl, b0, n, xq + t, xd + t, aux + t, y + t * ldy + a, ldy, rows, b0 == 0);
      });
    }
  }
}

void run(int type, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const int8_t* const* xq, const float* const* xd,
         const int32_t* const* aux, int64_t T, float* y, int64_t ldy) {
  AmxA act{};
  // q6_k stays on VNNI (its int8 scale per 16 weights does not split into two factors below 8)
  const bool on_amx = T >= AMX_CALL && type != Q6_K && nib::amx() && amx_prep(K, xq, T, act);
  if (on_amx) amx::config(int(AG));
  const AmxA* A = on_amx ? &act : nullptr;
  if (type == Q4_K) strips<Q4_K>(w, w_row, N, K, xq, xd, aux, T, y, ldy, A);
  else if (type == Q5_K) strips<Q5_K>(w, w_row, N, K, xq, xd, aux, T, y, ldy, A);
  else strips<Q6_K>(w, w_row, N, K, xq, xd, aux, T, y, ldy, A);
  if (on_amx) {
    amx::release();
    std::free(act.a);
  }
}

}  // namespace kstrip

#pragma GCC pop_options

void kstrips(int type, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const int8_t* const* q,
             const float* const* d, const int16_t* const* bs, int64_t T, float* y, int64_t ldy) {
  // per token: q4_k / q5_k the code sums per 32 as int16 pairs (sub-blocks 2p, 2p + 1 of each superblock),
  // q6_k -32 x the code sums per 16
  const bool q6 = type == Q6_K;
  const int64_t per = q6 ? K / 16 : K / 64;
  std::vector<int32_t> sums(T * per);
  std::vector<const int32_t*> aux(T);
  for (int64_t t = 0; t < T; ++t) {
    int32_t* o = sums.data() + t * per;
    const int16_t* s = bs[t];
    for (int64_t g = 0; g < per; ++g)
      o[g] = q6 ? -32 * int32_t(s[g])
                : int32_t(uint32_t(uint16_t(s[4 * g] + s[4 * g + 1])) | uint32_t(uint16_t(s[4 * g + 2] + s[4 * g + 3])) << 16);
    aux[t] = o;
  }
  kstrip::run(type, w, w_row, N, K, q, d, aux.data(), T, y, ldy);
}

}  // namespace ggml
