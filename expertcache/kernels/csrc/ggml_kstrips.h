// The fast math's prefill strips of GGUF's K-quants (q4_k, q5_k, q6_k): many tokens of one weight against
// strips of 32 rows decoded once, rows in the lanes (ggml_kstrips.cpp). Reached from ggml::rows_q8 where
// has_strips(type) and the tokens reach strips_from (ggml_kernels.h); only where fast_supported().
#pragma once

#include <cstdint>

namespace ggml {

// y[t * ldy + n] = row n . token t for rows n < N, tokens t < T; q / d / bs: the tokens' A256 rows
// (int8 codes [K], scale per 256, int16 code sums per 16), K a multiple of 256
void kstrips(int type, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const int8_t* const* q,
             const float* const* d, const int16_t* const* bs, int64_t T, float* y, int64_t ldy);

}  // namespace ggml
