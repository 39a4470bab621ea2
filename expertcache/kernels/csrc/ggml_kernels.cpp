// GGUF quant blocks read in their own bytes (ggml_kernels.h): the exact-math kernels' body
// (ggml_kernels_isa.h) compiled for AVX2 and, under a target pragma, for AVX-512; the fast-math kernels
// (AVX-512 VNNI) below it.
//
// As in fast_kernels.cpp, the AVX-512 region uses no inline function of a torch or standard header (a copy
// compiled here could be the one the linker keeps for the whole module); it is reached only through the
// entry points at the bottom, called only where avx512_supported() / fast_supported() say so.
//
// Loop shapes: one row at a time (one sequential stream through memory, the row `pf` rows ahead asked
// for), up to TMAX tokens a pass over it (6 on AVX-512, 3 on AVX2: the accumulators of a 32-weight
// sub-block per token in registers), one token with two sets of accumulators; fast math up to 8 tokens
// a pass.

#include "ggml_kernels.h"
#include "ggml_kstrips.h"

#include <immintrin.h>

#include <cstdint>

namespace ggml {

int64_t block_elems(int type) { return type >= Q4_K ? 256 : 32; }

int64_t block_bytes(int type) {
  switch (type) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q5_0: return 22;
    case IQ4_NL: return 18;
    case MXFP4: return 17;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 136;  // IQ4_XS
  }
}

const char* type_name(int type) {
  static const char* names[] = {"q8_0", "q4_0", "q5_0", "iq4_nl", "mxfp4", "q4_k", "q5_k", "q6_k", "iq4_xs"};
  return is_type(type) ? names[type - FIRST] : "?";
}

bool avx512_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

bool fast_supported() { return avx512_supported() && __builtin_cpu_supports("avx512vnni"); }

bool has_strips(int type) { return type == MXFP4 || type == Q4_0 || type == IQ4_NL || type == Q4_K || type == Q5_K || type == Q6_K; }

int act_of(int type) {
  return type == Q8_0 ? A32 : (type == Q4_0 || type == Q5_0 || type == IQ4_NL || type == MXFP4) ? A32N : (type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS) ? A256 : -1;
}

const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};  // 2 x e2m1
const int8_t VALUES_Q4_0[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};  // code - 8

// ---- AVX2 -------------------------------------------------------------------------------------------
namespace avx2 {

struct V {
  static constexpr int W = 8;
  using F = __m256;
  using I = __m256i;
  struct Tab {
    __m256 lo, hi;
  };
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float a) { return _mm256_set1_ps(a); }
  static I set1i(int32_t a) { return _mm256_set1_epi32(a); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static float hsum(F v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
  }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static I u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I srli(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I slli(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I srlv(I a, I n) { return _mm256_srlv_epi32(a, n); }
  static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static Tab table(const int8_t* t) {
    return {_mm256_setr_ps(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]),
            _mm256_setr_ps(t[8], t[9], t[10], t[11], t[12], t[13], t[14], t[15])};
  }
  static Tab iq4nl() { return table(KVALUES_IQ4NL); }
  static Tab e2m1x2() { return table(KVALUES_MXFP4); }
  static Tab q4_0() { return table(VALUES_Q4_0); }
  static Tab tmul(const Tab& t, F d) { return {_mm256_mul_ps(t.lo, d), _mm256_mul_ps(t.hi, d)}; }
  // entry (c & 15): two 8-entry permutes, chosen by bit 3 moved to the sign
  static F lut(I c, const Tab& t) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, c), _mm256_permutevar8x32_ps(t.hi, c),
                            _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
  }
};

#include "ggml_kernels_isa.h"

}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

// ---- AVX-512 ----------------------------------------------------------------------------------------
namespace avx512 {

struct V {
  static constexpr int W = 16;
  using F = __m512;
  using I = __m512i;
  using Tab = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float a) { return _mm512_set1_ps(a); }
  static I set1i(int32_t a) { return _mm512_set1_epi32(a); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static I u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I srli(I a, int n) { return _mm512_srli_epi32(a, n); }
  static I slli(I a, int n) { return _mm512_slli_epi32(a, n); }
  static I srlv(I a, I n) { return _mm512_srlv_epi32(a, n); }
  static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static Tab table(const int8_t* t) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)))); }
  static Tab iq4nl() { return table(KVALUES_IQ4NL); }
  static Tab e2m1x2() { return table(KVALUES_MXFP4); }
  static Tab q4_0() { return table(VALUES_Q4_0); }
  static Tab tmul(const Tab& t, F d) { return _mm512_mul_ps(t, d); }
  static F lut(I c, const Tab& t) { return _mm512_permutexvar_ps(c, t); }  // vpermps reads c's low 4 bits
};

#include "ggml_kernels_isa.h"

// ---- fast math: int8 activations --------------------------------------------------------------------
inline __mmask16 mask16(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); }

// the int8 codes of n <= 16 * NVEC floats at x (zero past n) with their scale max|x| / 127 (nearest even;
// NaN when not all finite): codes c[v] (16 int32 lanes each), scale s
template <int NVEC>
inline float quantize(const float* x, int64_t n, __m512i* c) {
  __m512 v[NVEC];
  __m512 amax = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  for (int i = 0; i < NVEC; ++i) {
    v[i] = _mm512_maskz_loadu_ps(mask16(n - 16 * i), x + 16 * i);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
    finite &= _mm512_cmp_ps_mask(_mm512_sub_ps(v[i], v[i]), _mm512_setzero_ps(), _CMP_EQ_OQ);  // x - x: 0 or NaN
  }
  const float m = _mm512_reduce_max_ps(amax);
  const float s = finite == 0xFFFF ? m / 127.f : __builtin_nanf("");
  for (int i = 0; i < NVEC; ++i)
    c[i] = finite == 0xFFFF && m > 0.f ? _mm512_cvtps_epi32(_mm512_div_ps(v[i], _mm512_set1_ps(s))) : _mm512_setzero_si512();
  return s;
}

void prep_a32(const float* x, int64_t K, uint8_t* q, float* d) {
  for (int64_t g = 0; g * 64 < K; ++g)
    for (int j = 0; j < 2; ++j) {
      const int64_t k = 64 * g + 32 * j;
      __m512i c[2];
      const float s = quantize<2>(x + k, K - k, c);
      for (int i = 0; i < 2; ++i)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k + 16 * i),
                         _mm_xor_si128(_mm512_cvtsepi32_epi8(c[i]), _mm_set1_epi8(char(0x80))));
      _mm256_storeu_ps(d + 16 * g + 8 * j, _mm256_set1_ps(s));
    }
}

// A32N: signed codes (the 4-bit weights are the unsigned side, value + 128); per group 16 words (64 bytes,
// a line): 4 block scales, 16 int16 lane sums (lane L: minus the sum of the codes lane L of vpdpbusd reads,
// bytes 4L..4L+3 of both halves: the row kernels' first accumulator, 128 x it, so that each lane's sum is
// that of the weights' values, as small as the signed product's; one correction per block would make lanes
// 4j large, their float sum less exact), then 4 int32 block corrections (-128 x block j's code sum: the
// strips')
void prep_a32n(const float* x, int64_t K, int8_t* q, float* d) {
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t g = 0; g * 128 < K; ++g) {
    __m512i h[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // the group's two halves, in registers
    float* m = d + 16 * g;
    for (int j = 0; j < 4; ++j) {
      const int64_t k = 128 * g + 32 * j;
      __m512i c[2];
      m[j] = quantize<2>(x + k, K - k, c);
      for (int i = 0; i < 2; ++i)
        h[i] = _mm512_mask_broadcast_i32x4(h[i], __mmask16(0xF << (4 * j)), _mm512_cvtsepi32_epi8(c[i]));
    }
    _mm512_storeu_si512(q + 128 * g, h[0]);
    _mm512_storeu_si512(q + 128 * g + 64, h[1]);
    const __m512i sum = _mm512_sub_epi32(
        _mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, h[0]), ones, h[1]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(m + 4), _mm512_cvtepi32_epi16(sum));  // |sum| <= 8 x 128
    __m512i v = _mm512_add_epi32(sum, _mm512_shuffle_epi32(sum, _MM_PERM_CDAB));
    v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m + 12), _mm512_castsi512_si128(_mm512_slli_epi32(_mm512_permutexvar_epi32(first, v), 7)));
  }
}

void prep_a256(const float* x, int64_t K, int8_t* q, float* d, int16_t* bs) {
  for (int64_t b = 0; b * 256 < K; ++b) {
    __m512i c[16];
    d[b] = quantize<16>(x + 256 * b, K - 256 * b, c);
    for (int i = 0; i < 16; ++i) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 256 * b + 16 * i), _mm512_cvtsepi32_epi8(c[i]));
      bs[16 * b + i] = int16_t(_mm512_reduce_add_epi32(c[i]));
    }
  }
}

// Blocks32<Q8_0>: the 64 int8 weights of the blocks at p and p + BYTES (the second: zero when !two), and
// a block's scale; Nibbles32: the 4-bit types' block (q4_0: code - 8, iq4_nl: kvalues, mxfp4: 2 x e2m1 with
// the half scale 2^(e - 128))
template <int T>
struct Blocks32;
template <>
struct Blocks32<Q8_0> {
  static constexpr int64_t BYTES = 34;
  static __m512i weights(const uint8_t* p, bool two) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
    const __m256i w1 = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 36)) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
  }
  static float scale(const uint8_t* p) { return h2f(p); }
};
template <int T>
struct Nibbles32 {
  static constexpr int64_t BYTES = T == MXFP4 ? 17 : T == Q5_0 ? 22 : 18;
  static constexpr int64_t Q = T == MXFP4 ? 1 : T == Q5_0 ? 6 : 2;  // the codes' offset
  static float scale(const uint8_t* p) { return T == MXFP4 ? e8m0_half(p[0]) : h2f(p); }
  // the scales of the 4 blocks from p in lanes 4j..4j+3 (block j's), from one 64-byte load where they lie
  // in it: mxfp4's e8m0 byte 17 j is byte j of 128-bit lane j (vpshufb), q4_0 / iq4_nl's fp16 at 18 j
  // word 9 j (vpermw); q5_0's fourth lies past it (4 scalar loads, assembled in registers: 4 stores read
  // back as a vector would stall)
  static __m512 scale16(const uint8_t* p) {
    if constexpr (T == MXFP4) {
      const __m512i idx = _mm512_setr_epi32(-0x7F7F8000, -0x7F7F8000, -0x7F7F8000, -0x7F7F8000, -0x7F7F7FFF,
                                            -0x7F7F7FFF, -0x7F7F7FFF, -0x7F7F7FFF, -0x7F7F7FFE, -0x7F7F7FFE,
                                            -0x7F7F7FFE, -0x7F7F7FFE, -0x7F7F7FFD, -0x7F7F7FFD, -0x7F7F7FFD,
                                            -0x7F7F7FFD);  // 0x808080jj: byte j, zeros
      const __m512i e = _mm512_shuffle_epi8(_mm512_loadu_si512(p), idx);
      const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);  // e >= 2: (e - 1) << 23
      // e < 2: 0x00200000 << e
      return _mm512_castsi512_ps(
          _mm512_mask_sllv_epi32(big, _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), _mm512_set1_epi32(0x00200000), e));
    } else if constexpr (T != Q5_0) {
      const __m512i idx = _mm512_setr_epi32(0, 0, 0x00090009, 0x00090009, 0x00120012, 0x00120012, 0x001B001B, 0x001B001B,
                                            0, 0, 0, 0, 0, 0, 0, 0);
      return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(p))));
    } else {
      uint16_t h[4];
      for (int j = 0; j < 4; ++j) __builtin_memcpy(&h[j], p + j * BYTES, 2);
      const uint64_t v = uint64_t(h[0]) | uint64_t(h[1]) << 16 | uint64_t(h[2]) << 32 | uint64_t(h[3]) << 48;
      const __m512i rep4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
      return _mm512_permutexvar_ps(rep4, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi64_si128(int64_t(v)))));
    }
  }
};

// the 4-bit types' 16-entry table as unsigned bytes, value + 128 (the weights' side of vpdpbusd), in each
// 128-bit lane
template <int T>
inline __m512i table128() {
  const int8_t* tv = T == MXFP4 ? KVALUES_MXFP4 : T == IQ4_NL ? KVALUES_IQ4NL : VALUES_Q4_0;
  return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tv))),
                          _mm512_set1_epi8(char(0x80)));
}

// the n <= 4 blocks at p (a group; missing blocks zero) as A32N weights: wl / wh the low / high nibbles'
// values + 128 (128-bit lane j: block j's 16 bytes; q5_0: the fifth bits from qh as a byte mask, code +
// 112; the others through the table), dw block j's scale in lanes 4j..4j+3
template <int T>
__attribute__((always_inline)) inline void group4(const uint8_t* p, int64_t n, __m512i tab, __m512i& wl, __m512i& wh,
                                                  __m512& dw) {
  using B = Nibbles32<T>;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512i v;
  if (n == 4) {  // block j's codes into 128-bit lane j (broadcasts under a mask: loads, no shuffle)
    v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + B::Q)));
    v = _mm512_mask_broadcast_i32x4(v, 0x00F0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + B::BYTES + B::Q)));
    v = _mm512_mask_broadcast_i32x4(v, 0x0F00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * B::BYTES + B::Q)));
    v = _mm512_mask_broadcast_i32x4(v, 0xF000, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * B::BYTES + B::Q)));
    dw = B::scale16(p);
  } else {  // the row's last blocks: the missing ones zero (weight scale 0)
    alignas(64) uint8_t codes[64] = {};
    alignas(64) float ds[16];
    for (int64_t j = 0; j < 4; ++j) {
      for (int i = 0; i < 4; ++i) ds[4 * j + i] = j < n ? B::scale(p + j * B::BYTES) : 0.f;
      for (int i = 0; j < n && i < 16; ++i) codes[16 * j + i] = p[j * B::BYTES + B::Q + i];
    }
    v = _mm512_load_si512(codes);
    dw = _mm512_load_ps(ds);
  }
  wl = _mm512_and_si512(v, nib);
  wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
  if constexpr (T == Q5_0) {  // byte 16 j + i of the low / high codes: bit i / 16 + i of block j's qh
    uint64_t ml = 0, mh = 0;
    for (int64_t j = 0; j < n; ++j) {
      uint32_t qh;
      __builtin_memcpy(&qh, p + j * B::BYTES + 2, 4);
      ml |= uint64_t(qh & 0xFFFFu) << (16 * j);
      mh |= uint64_t(qh >> 16) << (16 * j);
    }
    const __m512i sixteen = _mm512_set1_epi8(16), off = _mm512_set1_epi8(112);  // (code - 16) + 128
    wl = _mm512_add_epi8(wl, off);
    wh = _mm512_add_epi8(wh, off);
    wl = _mm512_mask_add_epi8(wl, ml, wl, sixteen);
    wh = _mm512_mask_add_epi8(wh, mh, wh, sixteen);
  } else {
    wl = _mm512_shuffle_epi8(tab, wl);
    wh = _mm512_shuffle_epi8(tab, wh);
  }
}

// q4_0 / q5_0 / iq4_nl / mxfp4 x A32N, R rows (row r at row + r * w_row) and tokens t < TT: 4 blocks a step
// (group4), the low nibbles against the prepared codes 0..63, the high against 64..127, from the
// activations' -128 x code sums per lane (the weights' + 128 taken off); int32 lanes 4j..4j+3 block j's,
// times the 4 scales. R rows share each load of the activations.
template <int T, int R, int TT>
void n32_rows(const uint8_t* row, int64_t w_row, int64_t nb, const int8_t* const* xq, const float* const* xd,
              float* y, int64_t ldy, int64_t ahead) {
  constexpr int64_t GB = 4 * Nibbles32<T>::BYTES;  // bytes of a group
  const __m512i tab = table128<T>();
  const __m512i rep4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  auto group = [&](int64_t g, int64_t n) __attribute__((always_inline)) {
    __m512i wl[R], wh[R];
    __m512 dw[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = row + r * w_row + GB * g;
      if (ahead) {  // a group's first byte and its 65th: every line of the row, the groups being over 64 bytes
        _mm_prefetch(reinterpret_cast<const char*>(p + ahead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p + ahead + 64), _MM_HINT_T0);
      }
      group4<T>(p, n, tab, wl[r], wh[r], dw[r]);
    }
    for (int t = 0; t < TT; ++t) {
      const int8_t* x = xq[t] + 128 * g;
      const __m512i xl = _mm512_loadu_si512(x), xh = _mm512_loadu_si512(x + 64);
      const float* m = xd[t] + 16 * g;  // prep_a32n's 4 scales and 16 lane sums, to 16 lanes
      const __m512 sx = _mm512_permutexvar_ps(rep4, _mm512_castps128_ps512(_mm_loadu_ps(m)));
      const __m512i c = _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 4))), 7);
      for (int r = 0; r < R; ++r) {
        const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, wl[r], xl), wh[r], xh);
        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw[r], sx), acc[r][t]);
      }
    }
  };
  const int64_t full = nb / 4;
  for (int64_t g = 0; g < full; ++g) group(g, 4);
  if (nb % 4) group(full, nb % 4);
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// q8_0 x A32, tokens t < TT: per pair of blocks (64 weights, lanes 0..7 the first block's,
// 8..15 the second's) dpbusd(x + 128, w) - 128 sum(w), times the two scales
template <int T, int TT>
void b32_row(const uint8_t* row, int64_t nb, const uint8_t* const* xq, const float* const* xd, float* y, int64_t ldy,
             int64_t ahead) {
  using B = Blocks32<T>;
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t g = 0; 2 * g < nb; ++g) {
    const uint8_t* p = row + 2 * B::BYTES * g;
    const bool two = 2 * g + 1 < nb;
    if (ahead) prefetch_block(p + ahead, two ? 2 * B::BYTES : B::BYTES);
    const __m512i w = B::weights(p, two);
    const __m512 dw = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(B::scale(p)),
                                           _mm512_set1_ps(two ? B::scale(p + B::BYTES) : 0.f));
    const __m512i ws = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w), 7);
    for (int t = 0; t < TT; ++t) {
      const __m512i s = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(xq[t] + 64 * g), w), ws);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_loadu_ps(xd[t] + 16 * g)), acc[t]);
    }
  }
  for (int t = 0; t < TT; ++t) y[t * ldy] = _mm512_reduce_add_ps(acc[t]);
}

// q4_k / q5_k / q6_k x A256, tokens t < TT: a block's 4 vectors of 64 weights (unsigned codes) by vpmaddubsw
// against the int8 activations, then vpdpwssd by the sub-block scales (int16 lanes), in int32 for the
// block, times d x the activations' scale; q4_k / q5_k's dmin m and q6_k's -32 through the code sums
template <int T, int TT>
void k_row(const uint8_t* row, int64_t nb, const int8_t* const* xq, const float* const* xd, const int16_t* const* xb,
           float* y, int64_t ldy, int64_t ahead) {
  constexpr bool K45 = T == Q4_K || T == Q5_K;  // d, dmin, 6-bit scales and mins (else q6_k)
  constexpr int64_t BYTES = T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
  __m512 acc[TT];
  __m256 accm[TT];
  for (int t = 0; t < TT; ++t) {
    acc[t] = _mm512_setzero_ps();
    accm[t] = _mm256_setzero_ps();
  }
  // int16 lane k of weight vector v's scale: q4_k / q5_k sub-block 2v + k / 16; q6_k group 4v + k / 8
  __m512i sidx[4];
  for (int v = 0; v < 4; ++v) {
    alignas(64) int16_t ix[32];
    for (int k = 0; k < 32; ++k) ix[k] = int16_t(K45 ? 2 * v + k / 16 : 4 * v + k / 8);
    sidx[v] = _mm512_load_si512(ix);
  }
  const __m256i mdup = _mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i nib = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10), bits45 = _mm512_set1_epi8(0x30);
  constexpr __mmask32 UPPER = 0xFFFF0000u;  // the int16 lanes of a vector's upper 256 bits
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * BYTES;
    if (ahead) prefetch_block(p + ahead, BYTES);
    __m512i wv[4], sv[4];
    float dd, dm = 0.f;
    __m256i m16 = _mm256_setzero_si256(), sc16 = _mm256_setzero_si256();
    if constexpr (K45) {
      dd = h2f(p);
      dm = h2f(p + 2);
      uint64_t sc8, m8;
      scale_min_k4_64(p + 4, sc8, m8);
      const __m512i scz = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc8))));
      m16 = _mm256_permutexvar_epi16(mdup, _mm256_castsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(m8)))));
      // a vector of 64 weights from 32 code bytes broadcast to both halves: the low nibbles (sub-block 2v) in
      // the lower half, the high ones (2v + 1) shifted down in the upper: no cross-lane shuffle
      const uint8_t* q = p + (T == Q5_K ? 48 : 16);
      const __m512i qh5 = T == Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)))
                                    : _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        const __m512i c = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * v)));
        wv[v] = _mm512_and_si512(_mm512_mask_srli_epi16(c, UPPER, c, 4), nib);
        if constexpr (T == Q5_K) {  // sub-block s's fifth bits: bit s of qh[l], to bit 4
          const __m512i h = _mm512_srl_epi16(qh5, _mm_cvtsi32_si128(2 * v));
          wv[v] = _mm512_ternarylogic_epi32(wv[v], _mm512_slli_epi16(_mm512_mask_srli_epi16(h, UPPER, h, 1), 4), bit4, 0xF8);
        }
        sv[v] = _mm512_permutexvar_epi16(sidx[v], scz);
      }
    } else {
      dd = h2f(p + 208);
      sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
      const __m512i scz = _mm512_castsi256_si512(sc16);
      for (int h = 0; h < 2; ++h) {  // the two high bits of 32 weights a 2-bit field of qh: broadcast, shifted
        const __m512i ql = _mm512_loadu_si512(p + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h)));
        const __m512i qb = _mm512_mask_srli_epi16(qh, UPPER, qh, 2);  // fields 2 | 3 at bit 4 (lower | upper half)
        const __m512i qa = _mm512_slli_epi16(qb, 4);                   // fields 0 | 1 at bit 4
        wv[2 * h] = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, nib), qa, bits45, 0xF8);
        wv[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nib), qb, bits45, 0xF8);
      }
      for (int v = 0; v < 4; ++v) sv[v] = _mm512_permutexvar_epi16(sidx[v], scz);
    }
    for (int t = 0; t < TT; ++t) {
      const int8_t* x = xq[t] + 256 * b;
      __m512i a0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(wv[0], _mm512_loadu_si512(x)), sv[0]);
      __m512i a1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(wv[1], _mm512_loadu_si512(x + 64)), sv[1]);
      a0 = _mm512_dpwssd_epi32(a0, _mm512_maddubs_epi16(wv[2], _mm512_loadu_si512(x + 128)), sv[2]);
      a1 = _mm512_dpwssd_epi32(a1, _mm512_maddubs_epi16(wv[3], _mm512_loadu_si512(x + 192)), sv[3]);
      __m512i a = _mm512_add_epi32(a0, a1);
      const __m256i bsv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[t] + 16 * b));
      const float dx = xd[t][b];
      if constexpr (T == Q6_K)  // sum sc (q - 32) x = sum sc q x - 32 sum sc (code sum per 16)
        a = _mm512_sub_epi32(a, _mm512_slli_epi32(_mm512_zextsi256_si512(_mm256_madd_epi16(sc16, bsv)), 5));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(dd * dx), acc[t]);
      if constexpr (K45)
        accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(m16, bsv)), _mm256_set1_ps(dm * dx), accm[t]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    float v = _mm512_reduce_add_ps(acc[t]);
    if constexpr (K45) v -= _mm512_reduce_add_ps(_mm512_zextps256_ps512(accm[t]));
    y[t * ldy] = v;
  }
}

// iq4_xs x A256, tokens t < TT: per 64 weights (sub-blocks 2v, 2v + 1) the kvalues + 128 (unsigned, by
// vpshufb) by vpdpbusd against the int8 activations, times the sub-blocks' scales ls (int32 lanes 0..7 /
// 8..15), less 128 ls x the code sums; in int32 for the block, times d x the activations' scale
template <int TT>
void xs_row(const uint8_t* row, int64_t nb, const int8_t* const* xq, const float* const* xd, const int16_t* const* xb,
            float* y, int64_t ldy, int64_t ahead) {
  constexpr int64_t BYTES = 136;
  alignas(16) int8_t kv[16];
  for (int i = 0; i < 16; ++i) kv[i] = int8_t(KVALUES_IQ4NL[i] + 128);  // as unsigned bytes 1..241
  const __m512i tab = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kv)));
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m256i mdup = _mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m256i sl_shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), sh_shift = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  __m512i lidx[4];
  for (int v = 0; v < 4; ++v)
    lidx[v] = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(2 * v), _mm512_set1_epi32(2 * v + 1));
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * BYTES;
    if (ahead) prefetch_block(p + ahead, BYTES);
    const float dd = h2f(p);
    uint16_t sh;
    __builtin_memcpy(&sh, p + 2, 2);
    // ls_j = (low 4 bits: nibble j of scales_l) | (2 bits j of scales_h) << 4, - 32; int32 lane j
    const __m256i ls = _mm256_sub_epi32(
        _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(u32(p + 4))), sl_shift), _mm256_set1_epi32(15)),
                        _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(sh), sh_shift), _mm256_set1_epi32(3)), 4)),
        _mm256_set1_epi32(32));
    const __m256i ls16 = _mm256_permutexvar_epi16(mdup, _mm256_castsi128_si256(_mm256_cvtepi32_epi16(ls)));
    __m512i wv[4], lv[4];
    for (int v = 0; v < 4; ++v) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8 + 32 * v));
      const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
      // 128-bit lanes [q0, q1, q0 >> 4, q1 >> 4] -> [q0, q0 >> 4, q1, q1 >> 4]: sub-block 2v's, then 2v + 1's
      wv[v] = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_shuffle_i64x2(z, z, 0xD8), nib));
      lv[v] = _mm512_permutexvar_epi32(lidx[v], _mm512_castsi256_si512(ls));
    }
    for (int t = 0; t < TT; ++t) {
      const int8_t* x = xq[t] + 256 * b;
      __m512i a = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v)
        a = _mm512_add_epi32(a, _mm512_mullo_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[v], _mm512_loadu_si512(x + 64 * v)), lv[v]));
      const __m256i bsv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb[t] + 16 * b));
      a = _mm512_sub_epi32(a, _mm512_slli_epi32(_mm512_zextsi256_si512(_mm256_madd_epi16(ls16, bsv)), 7));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(dd * xd[t][b]), acc[t]);
    }
  }
  for (int t = 0; t < TT; ++t) y[t * ldy] = _mm512_reduce_add_ps(acc[t]);
}

// ---- fast math, many tokens: strips of rows decoded once, rows in the lanes --------------------------
// q4_0 / iq4_nl / mxfp4 from `strips_from` tokens (nibble_kernels.h's strips, taught GGUF's blocks): SR = 32
// rows x KC groups of 4 blocks decoded once into a Tile in L1, each block's 16 code bytes of 16 rows
// transposed so that lane n holds row n's dword; the codes through the type's table
// in the A32N order (low nibbles: the block's features 0..15, high: 16..31), so one vpdpbusd of a step
// (unsigned, value + 128, as n32_rows) against 4 prepared activation bytes broadcast (signed) makes 64 MACs
// of 16 rows; the +128 taken off by the token's -128 x the block's code sum (prep_a32n's block
// correction), the sums' first value; the block's int32 sum times (weight scale x activation
// scale) into float32 per row, the float work shared by 16 rows.
constexpr int64_t SR = 32;  // rows per strip: 2 vectors of 16
constexpr int64_t KC = 4;   // groups of 4 blocks per K chunk (the Tile: 16 KiB of codes, 2 KiB of scales)

struct Tile {
  // [group][block][step k][row vector] lane n = row n's 4 weights at A32N positions 16 j + 4 k (k < 4),
  // 64 + 16 j + 4 (k - 4) (k >= 4)
  alignas(64) uint8_t w[KC][4][8][2][64];
  alignas(64) float ws[KC][4][2][16];   // the block's scale, per row (mxfp4: the half scale)
};

// groups g0 .. g0 + ng - 1 of rows a .. a + SR - 1 (rows past N: row N - 1's, never stored; blocks past nb:
// zero weights and scale)
template <int T>
void strip_decode(const uint8_t* w, int64_t w_row, int64_t N, int64_t nb, int64_t a, int64_t g0, int64_t ng,
                  Tile& tl) {
  using B = Nibbles32<T>;
  const __m512i tab = table128<T>();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const int64_t ng_all = (nb + 3) / 4;
  for (int v = 0; v < 2; ++v) {
    const uint8_t* rp[16];
    for (int n = 0; n < 16; ++n) {
      const int64_t r = a + 16 * v + n;
      rp[n] = w + (r < N ? r : N - 1) * w_row;
    }
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t gg = g0 + g;
      if (gg + KC < ng_all)  // the group the next chunk reads
        for (int n = 0; n < 16; ++n) {
          const uint8_t* q = rp[n] + 4 * B::BYTES * (gg + KC);
          _mm_prefetch(reinterpret_cast<const char*>(q), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(q + 4 * B::BYTES - 1), _MM_HINT_T0);
        }
      for (int j = 0; j < 4; ++j) {
        const int64_t b = 4 * gg + j;
        if (b >= nb) {
          for (int k = 0; k < 8; ++k) _mm512_store_si512(tl.w[g][j][k][v], _mm512_setzero_si512());
          _mm512_store_ps(tl.ws[g][j][v], _mm512_setzero_ps());
          continue;
        }
        const int64_t o = b * B::BYTES;
        alignas(64) float sc[16];
        for (int n = 0; n < 16; ++n) sc[n] = B::scale(rp[n] + o);
        _mm512_store_ps(tl.ws[g][j][v], _mm512_load_ps(sc));
        // 128-bit lane q of y[i]: row 4q + i's 16 code bytes, then a 4 x 4 transpose of dwords in each lane:
        // r[k] lane 4q + i = dword k of row 4q + i
        __m512i y[4];
        for (int i = 0; i < 4; ++i) {
          y[i] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[i] + o + B::Q)));
          y[i] = _mm512_mask_broadcast_i32x4(y[i], 0x00F0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[4 + i] + o + B::Q)));
          y[i] = _mm512_mask_broadcast_i32x4(y[i], 0x0F00, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[8 + i] + o + B::Q)));
          y[i] = _mm512_mask_broadcast_i32x4(y[i], 0xF000, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[12 + i] + o + B::Q)));
        }
        const __m512i t0 = _mm512_unpacklo_epi32(y[0], y[1]), t1 = _mm512_unpackhi_epi32(y[0], y[1]);
        const __m512i t2 = _mm512_unpacklo_epi32(y[2], y[3]), t3 = _mm512_unpackhi_epi32(y[2], y[3]);
        const __m512i r[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3),
                              _mm512_unpackhi_epi64(t1, t3)};
        for (int k = 0; k < 4; ++k) {
          const __m512i lo4 = _mm512_shuffle_epi8(tab, _mm512_and_si512(r[k], nib));
          const __m512i hi4 = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(r[k], 4), nib));
          _mm512_store_si512(tl.w[g][j][k][v], lo4);
          _mm512_store_si512(tl.w[g][j][4 + k][v], hi4);
        }
      }
    }
  }
}

// tokens t < TT over the tile's ng groups (group g0 + g of the prepared A32N rows, its block corrections
// prep_a32n's), into y[t * ldy + n] for the strip's rows n < rows (first: stored, else added)
template <int TT>
void strip_tokens(const Tile& tl, int64_t g0, int64_t ng, const int8_t* const* xq, const float* const* xd,
                  float* y, int64_t ldy, int64_t rows, bool first) {
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
        d[0][t] = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(xd[t])[16 * gg + 12 + j]);
        d[1][t] = d[0][t];
      }
      for (int k = 0; k < 8; ++k) {
        const __m512i w0 = _mm512_load_si512(tl.w[g][j][k][0]), w1 = _mm512_load_si512(tl.w[g][j][k][1]);
        const int64_t pos = 128 * gg + (k < 4 ? 16 * j + 4 * k : 64 + 16 * j + 4 * (k - 4));
        for (int t = 0; t < TT; ++t) {
          const __m512i xb = _mm512_set1_epi32(int(u32(reinterpret_cast<const uint8_t*>(xq[t]) + pos)));
          d[0][t] = _mm512_dpbusd_epi32(d[0][t], w0, xb);
          d[1][t] = _mm512_dpbusd_epi32(d[1][t], w1, xb);
        }
      }
      const __m512 s0 = _mm512_load_ps(tl.ws[g][j][0]), s1 = _mm512_load_ps(tl.ws[g][j][1]);
      for (int t = 0; t < TT; ++t) {
        const __m512 sx = _mm512_set1_ps(xd[t][16 * gg + j]);
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

#include "strip_chunks.h"  // the strips' token blocks (2 x 6 accumulators, 2 x 6 sums at 6)

template <int T>
void strips(const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const int8_t* const* xq, const float* const* xd,
            int64_t TN, float* y, int64_t ldy) {
  Tile tl;
  const int64_t nb = K / 32, ng = (nb + 3) / 4;
  for (int64_t a = 0; a < N; a += SR) {
    const int64_t rows = N - a < SR ? N - a : SR;
    for (int64_t g0 = 0; g0 < ng; g0 += KC) {
      const int64_t n = ng - g0 < KC ? ng - g0 : KC;
      strip_decode<T>(w, w_row, N, nb, a, g0, n, tl);
      strip_chunks::even(0, TN, [&](auto tc, int64_t t0) __attribute__((always_inline)) {
        strip_tokens<decltype(tc)::value>(tl, g0, n, xq + t0, xd + t0, y + t0 * ldy + a, ldy, rows, g0 == 0);
      });
    }
  }
}
constexpr int TQ = 8;  // tokens per pass over a row in fast math

// chunks of up to TQ tokens (t0, Slot<tt>) for TN tokens
template <class Fn>
__attribute__((always_inline)) inline void token_chunks(int64_t TN, Fn fn) {
  for (int64_t t0 = 0; t0 < TN; t0 += TQ) {
    switch (TN - t0 < TQ ? TN - t0 : TQ) {
      case 1: fn(t0, Slot<1>{}); break;
      case 2: fn(t0, Slot<2>{}); break;
      case 3: fn(t0, Slot<3>{}); break;
      case 4: fn(t0, Slot<4>{}); break;
      case 5: fn(t0, Slot<5>{}); break;
      case 6: fn(t0, Slot<6>{}); break;
      case 7: fn(t0, Slot<7>{}); break;
      default: fn(t0, Slot<TQ>{}); break;
    }
  }
}

// q4_0 / q5_0 / iq4_nl / mxfp4 rows [0, N) for TN tokens by n32_rows: fewer than 4 tokens R rows a pass
// (R1 at one token, R23 at 2 or 3), so that one load of the activations serves R rows and R row streams are
// in flight; more tokens RN rows a pass in chunks of up to TQ tokens; the rest a row at a time
constexpr int R1 = 4, R23 = 2, RN = 2;

template <int T>
void n32(const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const int8_t* const* xq, const float* const* xd,
         int64_t TN, float* y, int64_t ldy, int64_t pf) {
  const int64_t nb = K / 32;
  int64_t n = 0;
  auto pass = [&](auto rc, auto tc) __attribute__((always_inline)) {
    constexpr int R = decltype(rc)::value;
    for (; n + R <= N; n += R)
      n32_rows<T, R, decltype(tc)::value>(w + n * w_row, w_row, nb, xq, xd, y + n, ldy,
                                          pf && n + R + pf <= N ? pf * w_row : 0);
  };
  if (TN == 1) pass(Slot<R1>{}, Slot<1>{});
  else if (TN == 2) pass(Slot<R23>{}, Slot<2>{});
  else if (TN == 3) pass(Slot<R23>{}, Slot<3>{});
  auto chunked = [&](auto rc) __attribute__((always_inline)) {
    constexpr int R = decltype(rc)::value;
    for (; n + R <= N; n += R) {
      const int64_t ahead = pf && n + R + pf <= N ? pf * w_row : 0;
      token_chunks(TN, [&](int64_t t0, auto tc) __attribute__((always_inline)) {
        n32_rows<T, R, decltype(tc)::value>(w + n * w_row, w_row, nb, xq + t0, xd + t0, y + t0 * ldy + n, ldy,
                                            t0 == 0 ? ahead : 0);
      });
    }
  };
  if (TN > 3) chunked(Slot<RN>{});
  chunked(Slot<1>{});
}

void rows_q8(int type, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const uint8_t* const* q,
             const float* const* d, const int16_t* const* bs, int64_t T, float* y, int64_t ldy, int64_t pf,
             int64_t strips_from) {
  if (act_of(type) == A32N) {
    const int8_t* const* xq = reinterpret_cast<const int8_t* const*>(q);
    if (strips_from > 0 && T >= strips_from && has_strips(type)) {
      if (type == MXFP4) strips<MXFP4>(w, w_row, N, K, xq, d, T, y, ldy);
      else if (type == Q4_0) strips<Q4_0>(w, w_row, N, K, xq, d, T, y, ldy);
      else strips<IQ4_NL>(w, w_row, N, K, xq, d, T, y, ldy);
    } else if (type == MXFP4) n32<MXFP4>(w, w_row, N, K, xq, d, T, y, ldy, pf);
    else if (type == Q4_0) n32<Q4_0>(w, w_row, N, K, xq, d, T, y, ldy, pf);
    else if (type == IQ4_NL) n32<IQ4_NL>(w, w_row, N, K, xq, d, T, y, ldy, pf);
    else n32<Q5_0>(w, w_row, N, K, xq, d, T, y, ldy, pf);
    return;
  }
  if (strips_from > 0 && T >= strips_from && has_strips(type)) {  // q4_k, q5_k, q6_k: ggml_kstrips.h
    kstrips(type, w, w_row, N, K, reinterpret_cast<const int8_t* const*>(q), d, bs, T, y, ldy);
    return;
  }
  const int64_t nb = K / block_elems(type);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t ahead = pf && n + pf < N ? pf * w_row : 0;
    const uint8_t* r = w + n * w_row;
    for (int64_t t0 = 0; t0 < T; t0 += TQ) {
      const int64_t tt = T - t0 < TQ ? T - t0 : TQ;
      float* yt = y + t0 * ldy + n;
      const int64_t a = t0 == 0 ? ahead : 0;
      auto go = [&](auto tc) __attribute__((always_inline)) {
        constexpr int TT = decltype(tc)::value;
        const int8_t* const* xq = reinterpret_cast<const int8_t* const*>(q + t0);
        if (type == Q8_0) b32_row<Q8_0, TT>(r, nb, q + t0, d + t0, yt, ldy, a);
        else if (type == Q4_K) k_row<Q4_K, TT>(r, nb, xq, d + t0, bs + t0, yt, ldy, a);
        else if (type == Q5_K) k_row<Q5_K, TT>(r, nb, xq, d + t0, bs + t0, yt, ldy, a);
        else if (type == IQ4_XS) xs_row<TT>(r, nb, xq, d + t0, bs + t0, yt, ldy, a);
        else k_row<Q6_K, TT>(r, nb, xq, d + t0, bs + t0, yt, ldy, a);
      };
      switch (tt) {
        case 1: go(Slot<1>{}); break;
        case 2: go(Slot<2>{}); break;
        case 3: go(Slot<3>{}); break;
        case 4: go(Slot<4>{}); break;
        case 5: go(Slot<5>{}); break;
        case 6: go(Slot<6>{}); break;
        case 7: go(Slot<7>{}); break;
        default: go(Slot<TQ>{}); break;
      }
    }
  }
}

}  // namespace avx512

#pragma GCC pop_options

// ---- entry points ------------------------------------------------------------------------------------
void rows_f32(int type, bool avx512, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const float* const* x,
              int64_t T, float* y, int64_t ldy, int64_t pf) {
  if (avx512) avx512::rows_f32(type, w, w_row, N, K, x, T, y, ldy, pf);
  else avx2::rows_f32(type, w, w_row, N, K, x, T, y, ldy, pf);
}

void dequant(int type, bool avx512, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, float* out, int64_t ld) {
  if (avx512) avx512::dequant(type, w, w_row, N, K, out, ld);
  else avx2::dequant(type, w, w_row, N, K, out, ld);
}

void prep_q8(int act, const float* x, int64_t K, uint8_t* q, float* d, int16_t* bsum) {
  if (act == A32) avx512::prep_a32(x, K, q, d);
  else if (act == A32N) avx512::prep_a32n(x, K, reinterpret_cast<int8_t*>(q), d);
  else avx512::prep_a256(x, K, reinterpret_cast<int8_t*>(q), d, bsum);
}

void rows_q8(int type, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const uint8_t* const* q,
             const float* const* d, const int16_t* const* bs, int64_t T, float* y, int64_t ldy, int64_t pf,
             int64_t strips_from) {
  avx512::rows_q8(type, w, w_row, N, K, q, d, bs, T, y, ldy, pf, strips_from);
}

}  // namespace ggml
