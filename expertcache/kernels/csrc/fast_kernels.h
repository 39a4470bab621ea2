// The "fast" CPU math (`--cpu-math fast`): llama.cpp-style kernels that round the activations once
// per call and multiply them against the stored weights with AVX-512 dot-product instructions.
//   bf16 weights: x rounded to bf16 (nearest even), products summed in float32 by vdpbf16ps
//   int8 weights: x quantized per block of 64 to int8 (scale = max|x| / 127, nearest even),
//                 products summed exactly in int32 by vpdpbusd, then scaled in float32
// Compiled for AVX-512 F/BW/VL/BF16/VNNI inside fast_kernels.cpp only (its own target region, no torch
// or standard-library templates there), called only where supported() says the CPU has them.
//
// Shape legend (K features, Kp = K rounded up to 64):
//   prepared bf16 row  uint16 [Kp]          the row rounded to bf16, zero past K
//   prepared q8 row    uint8  [Kp]          int8 code + 128 per feature (128 past K)
//                      float  [Kp / 64]     the block's scale (NaN when the block is not finite)
//   W rows             the stored row n at w + n * w_row bytes: bf16 [K] or int8 [K];
//                      int8 scales float32 at s + n * s_row, one per group of G features
//   y                  y[t * ldy + n] for tokens t < T and rows n < N
#pragma once

#include <cstdint>

namespace fastk {

constexpr int64_t BLOCK = 64;  // features per int8 activation block; int8 weights need G % 64 == 0 or G >= K

inline int64_t padded(int64_t K) { return (K + BLOCK - 1) / BLOCK * BLOCK; }

bool supported();  // the CPU has AVX-512 F, BW, VL, BF16 and VNNI

void prep_bf16(const float* x, int64_t K, uint16_t* out);
void prep_q8(const float* x, int64_t K, uint8_t* q, float* scales);

// pf: with fewer than 4 tokens, each row asks for the row pf rows ahead (0: none)
void rows_bf16(const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const uint16_t* const* xb, int64_t T, float* y,
               int64_t ldy, int64_t pf);
void rows_q8(const uint8_t* w, int64_t w_row, const float* s, int64_t s_row, int64_t G, int64_t N, int64_t K,
             const uint8_t* const* xq, const float* const* xs, int64_t T, float* y, int64_t ldy, int64_t pf);

}  // namespace fastk
