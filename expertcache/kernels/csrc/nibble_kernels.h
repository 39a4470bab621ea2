// 4-bit weights at memory speed: MXFP4 (e2m1 codes, one e8m0 scale per block of 32) and int4 (codes
// 0..15 with a float scale and an integer zero point per group of G, G a multiple of 32), codes two
// per byte, low nibble first along K. AVX-512 kernels that decode the codes through a 16-entry table
// held in a register, in both CPU maths:
//   exact: float32 activations. 16 codes -> 16 float32 values by one vpermps (the table is 16 floats:
//          e2m1 values, or 0..15) of a 64-byte load shifted by 4j (nibble j of every dword), against
//          the activations reordered to match; MXFP4 sums scaled per block, int4 weights
//          code * s - zero * s (or, for a single row, s * sum - zero * s * the activations' lane sums).
//   fast:  activations quantized per block of 32 to int8 (scale = max|x| / 127, nearest even; as
//          llama.cpp pairs its 4-bit formats with q8), products summed exactly in int32 by vpdpbusd
//          with the weights as the unsigned side: MXFP4 2 x e2m1 + 12 (0..24) by vpshufb, the +12 taken
//          off by a per-block term of the activations; int4 the codes, the zero point times the
//          block's code sum taken off in float32. From strip_tokens() tokens (prefill) the rows go in
//          the lanes instead: 32 rows x 512 features decoded once (code dwords transposed 16 x 16) into
//          a tile in L1, one vpdpbusd = 16 rows x 4 features of a token against 4 activation bytes
//          broadcast, the per-block float work shared by 16 rows; int4 there as code - zero + 16 (a
//          zero point above 16: the pairs of rows), the +16 taken off through the code sum.
// Compiled for AVX-512 F/BW/VL/VNNI inside nibble_kernels.cpp only, called only where supported().
//
// Shape legend (K features, even; Kp = K rounded up to GROUP):
//   W row        codes uint8 [K / 2]; MXFP4: e8m0 uint8 [ceil(K / 32)] at z; int4: scales float32 at s
//                and zero points uint8 at z, [ceil(K / G)]
//   prepared f32 row    float [Kp]    per GROUP of 128 features: 8 vectors of 16, lane L of vector j
//                                     = feature 8L + j of the group; zero past K
//                       float [Kp/8]  (int4) per GROUP, lane L: the sum of the group's features 8L..8L+7
//   prepared q8 row     int8  [Kp]    per GROUP of 4 blocks: 64 even codes (block j's at 16 j), then
//                                     64 odd codes; zero past K
//                       float [Kp/8]  per GROUP, 16 lanes: block j's scale in lanes 4j..4j+3 (MXFP4:
//                                     halved; NaN when the block is not finite)
//                       int32 [Kp/8]  per GROUP, 16 lanes, lane 4j: block j's code sum (MXFP4: times
//                                     -12), the other lanes 0
//   y            y[t * ldy + i] for tokens t < T and rows i < N
#pragma once

#include <cstdint>

namespace nib {

constexpr int64_t BLOCK = 32;   // features per e8m0 scale and per int8 activation block
constexpr int64_t GROUP = 128;  // features per 64-byte load of codes

enum Code { MXFP4 = 0, INT4 = 1 };

inline int64_t padded(int64_t K) { return (K + GROUP - 1) / GROUP * GROUP; }

// N rows of a 4-bit weight; row i at w + i * w_row, z + i * z_row (bytes), s + i * s_row (floats)
struct Rows {
  const uint8_t* w;
  int64_t w_row;
  const uint8_t* z;  // MXFP4: e8m0 scales; int4: zero points
  int64_t z_row;
  const float* s;  // int4: scales
  int64_t s_row;
  int64_t G;  // int4: features per scale group (a multiple of BLOCK)
};

bool supported();  // the CPU has AVX-512 F, BW, VL and VNNI

void prep_f32(const float* x, int64_t K, float* out, float* lane_sums);  // lane_sums: nullptr for MXFP4
void prep_q8(int code, const float* x, int64_t K, int8_t* q, float* scales, int32_t* corr);

// pf: with fewer than 4 tokens, each row of a pass of R rows asks for the codes R + pf rows ahead (0: none)
void rows_f32(int code, const Rows& W, int64_t N, int64_t K, const float* const* xf, const float* const* xsum,
              int64_t T, float* y, int64_t ldy, int64_t pf);
// rows_q8 computes T >= strip_tokens() tokens by strips (32 rows decoded once per 512 features, rows in the
// lanes), fewer by pairs of rows; set_strip_tokens(0): never by strips (default 4)
void set_strip_tokens(int64_t tokens);
int64_t strip_tokens();
// the strips' products on AMX (TDPBSUD, 16 tokens x 16 rows x 32 features an instruction) where the CPU has
// AMX-TILE/INT8 and Linux grants the tile state: the same outputs bit for bit; set_amx(false): VNNI always
bool amx_supported();
void set_amx(bool on);
bool amx();  // allowed and supported
void rows_q8(int code, const Rows& W, int64_t N, int64_t K, const int8_t* const* xq, const float* const* xs,
             const int32_t* const* xc, int64_t T, float* y, int64_t ldy, int64_t pf);

}  // namespace nib
