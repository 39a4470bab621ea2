// MXFP4 (e2m1 codes, low nibble first, one e8m0 scale per block of 32) at memory speed: AVX-512
// kernels that decode a weight's codes through a 16-entry table held in a register, in both CPU maths.
//   exact: float32 activations. 16 codes -> 16 float32 weights by one vpermps (the table is 16 floats)
//          of a 64-byte load shifted by 4j (nibble j of every dword), against the activations
//          reordered to match; sums scaled per block by its power of two.
//   fast:  activations quantized per block of 32 to int8 (scale = max|x| / 127, nearest even; as
//          llama.cpp pairs MXFP4 with q8_0), 2 x e2m1 + 12 (0..24) looked up by vpshufb, products
//          summed exactly in int32 by vpdpbusd; the +12 is taken off by a per-block term of the
//          activations, prepared once per token.
// Compiled for AVX-512 F/BW/VL/VNNI inside mxfp4_kernels.cpp only, called only where supported().
//
// Shape legend (K features, Kp = K rounded up to GROUP):
//   W row        codes uint8 [K / 2] (K even), e8m0 scales uint8 [ceil(K / 32)]
//   prepared f32 row    float [Kp]    per GROUP of 128 features: 8 vectors of 16, lane L of vector j
//                                     = feature 8L + j of the group; zero past K
//   prepared q8 row     int8  [Kp]    per GROUP of 4 blocks: 64 even codes (block j's at 16 j), then
//                                     64 odd codes; zero past K
//                       float [Kp/8]  per GROUP, 16 lanes: block j's scale / 2 in lanes 4j..4j+3
//                                     (NaN when the block is not finite)
//                       int32 [Kp/8]  per GROUP, 16 lanes: -12 x (block j's code sum) in lane 4j, else 0
//   y            y[t * ldy + i] for tokens t < T and rows i < N
#pragma once

#include <cstdint>

namespace mxk {

constexpr int64_t BLOCK = 32;   // features per e8m0 scale and per int8 activation block
constexpr int64_t GROUP = 128;  // features per 64-byte load of codes

inline int64_t padded(int64_t K) { return (K + GROUP - 1) / GROUP * GROUP; }

bool supported();  // the CPU has AVX-512 F, BW, VL and VNNI

void prep_f32(const float* x, int64_t K, float* out);
void prep_q8(const float* x, int64_t K, int8_t* q, float* scales, int32_t* corr);

// N rows of W: row i's codes at w + i * w_row, its scales at z + i * z_row (bytes)
void rows_f32(const uint8_t* w, int64_t w_row, const uint8_t* z, int64_t z_row, int64_t N, int64_t K,
              const float* const* xf, int64_t T, float* y, int64_t ldy);
void rows_q8(const uint8_t* w, int64_t w_row, const uint8_t* z, int64_t z_row, int64_t N, int64_t K,
             const int8_t* const* xq, const float* const* xs, const int32_t* const* xc, int64_t T, float* y,
             int64_t ldy);

}  // namespace mxk
