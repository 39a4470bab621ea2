// GGUF (ggml) quant blocks read in their own bytes: y = x W^T where each row of W is its blocks exactly as
// a GGUF file stores them (QK weights a block, BYTES bytes, rows of K / QK blocks, no padding).
//
//   type     code  QK   BYTES  block (ggml-common.h), value of weight j
//   q8_0      7    32    34    fp16 d, int8 q[32]                          d * q[j]
//   q4_0      8    32    18    fp16 d, q[16] (j < 16 low nibble of q[j], else high of q[j - 16])   d * (q - 8)
//   q5_0      9    32    22    fp16 d, uint32 qh (bit j: the fifth bit), q[16] as q4_0             d * (q - 16)
//   iq4_nl   10    32    18    fp16 d, q[16] as q4_0                      d * kvalues_iq4nl[q]
//   mxfp4    11    32    17    e8m0 e, q[16] as q4_0                      2^(e - 128) * (2 x e2m1)[q]
//   q4_k     12   256   144    fp16 d, fp16 dmin, 12 bytes of 6-bit scale / min per 32, q[128]:
//                              bytes 32c..32c+31: low nibbles sub-block 2c, high 2c + 1     d sc q - dmin m
//   q5_k     13   256   176    as q4_k, then qh[32] (bit s of qh[l]: sub-block s, weight l) before q[128]
//   q6_k     14   256   210    ql[128], qh[64], int8 scales[16] (one per 16), fp16 d at the end:
//                              weight 128h + 32i + l: nibble (i / 2) of ql[64h + 32 (i % 2) + l], bits
//                              2i..2i+1 of qh[32h + l] above it, minus 32                    d * sc * q
//   iq4_xs   15   256   136    fp16 d, uint16 scales_h, scales_l[4] (6-bit scale - 32 per 32), q[128]
//                              (bytes 16s..16s+15 as iq4_nl for sub-block s)       d * ls * kvalues[q]
//
// Exact math: float32 activations against every weight decoded in registers to the float32 value the gguf
// package's dequantiser gives (the products d * sc * q are exact in float32; q4_k / q5_k's d sc q - dmin m
// rounds once, as float32 numpy does), AVX-512 (F/BW/VL) or AVX2 + FMA + F16C. Fast math (AVX-512 VNNI):
// activations quantised as llama.cpp pairs them, then integer dot products:
//   q8_0           x per block of 32 to int8 (scale max|x| / 127, nearest even), stored + 128 (unsigned)
//                  for vpdpbusd against the signed weights, 128 x the weights' sum taken off
//   q4_0, q5_0,    x per block of 32 to int8 as q8_0's, signed, with -128 x its code sums per 8; the
//   iq4_nl, mxfp4  4-bit codes of 4 blocks a 64-byte vector through a 16-entry table by vpshufb to their
//                  value + 128 (code - 8, kvalues, 2 x e2m1; q5_0: its fifth bits by a byte mask, code +
//                  112), the unsigned side of vpdpbusd against activations in that order (A32N), the
//                  +128 taken off by the code sums (the sums' first value: no work per row)
//   q4_k, q5_k,    x per block of 256 (Q8_K: scale max|x| / 127, nearest even) with the code sums per 16;
//   q6_k           vpmaddubsw (weights unsigned) then vpdpwssd by the sub-block scales, in int32 for a
//                  block; q4_k / q5_k's mins and q6_k's -32 through the code sums
//   iq4_xs         x as Q8_K; kvalues + 128 by vpshufb, vpdpbusd, times the sub-block scales (vpmulld), less
//                  128 ls x the code sums
//
// Shape legend (K features, a multiple of QK):
//   W row        uint8 [K / QK * BYTES] at w + n * w_row
//   x            float32 rows [K] (exact), y[t * ldy + n] for tokens t < T and rows n < N
//   prepared q8 (kind A32)         uint8 [Kp]  code + 128, Kp = K rounded up to 64 (128 past K)
//                                  float [Kp / 4] per 64 features 16 lanes: block 2g's scale in lanes 0..7,
//                                  2g + 1's in 8..15 (NaN when the block is not finite)
//   prepared q8 (kind A32N, q4_0, q5_0, iq4_nl, mxfp4)  int8 [Kp] codes (signed), per 128 features (4 blocks):
//                                  the blocks' first 16 codes at 16 j, their last 16 at 64 + 16 j (Kp = K
//                                  rounded up to 128); float [Kp / 8], per 128 features 16 words (a line):
//                                  4 block scales, 16 int16 lane sums (lane L: minus the sum of codes
//                                  4L..4L+3 and 64 + 4L..64 + 4L+3, block L / 4's), 4 int32 block
//                                  corrections (-128 x block j's code sum): one pointer a token
//   prepared q8 (kind A256, q4_k, q5_k, q6_k, iq4_xs)  int8 [K] codes, float [K / 256] scales, int16 [K / 16] code sums
#pragma once

#include <cstdint>

namespace ggml {

enum Type { Q8_0 = 7, Q4_0 = 8, Q5_0 = 9, IQ4_NL = 10, MXFP4 = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_XS = 15 };
constexpr int FIRST = Q8_0, LAST = IQ4_XS;

inline bool is_type(int code) { return code >= FIRST && code <= LAST; }
int64_t block_elems(int type);  // QK
int64_t block_bytes(int type);  // BYTES
const char* type_name(int type);

bool avx512_supported();  // F, BW, VL (exact); fast also needs VNNI (fast_supported)
bool fast_supported();

// exact math; avx512: the AVX-512 kernels (only where avx512_supported()), else AVX2
// pf: rows ahead each row asks for (0: none)
void rows_f32(int type, bool avx512, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const float* const* x,
              int64_t T, float* y, int64_t ldy, int64_t pf);
// rows [0, N) decoded to float32: out[n * ld + k]
void dequant(int type, bool avx512, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, float* out, int64_t ld);

// ---- fast math (only where fast_supported()) ----
enum Act { A32 = 0, A256 = 1, A32N = 2 };
int act_of(int type);  // the activations' kind a fast kernel of `type` reads; -1: no fast kernel
inline int64_t act_unit(int act) { return act == A32 ? 64 : act == A32N ? 128 : 256; }  // features per piece of a prepared row
inline int64_t act_scale_div(int act) { return act == A256 ? 256 : act == A32N ? 8 : 4; }  // features per float (A32N: 16 words a group)
inline int64_t act_padded(int act, int64_t K) { return (K + act_unit(act) - 1) / act_unit(act) * act_unit(act); }

// features [0, K) of x (K a multiple of act_unit or the row's end) -> q [Kp], d, bsum (A256 only)
void prep_q8(int act, const float* x, int64_t K, uint8_t* q, float* d, int16_t* bsum);
// q[t], d[t], bs[t]: token t's prepared row (its start); from strips_from tokens (0: never) the types
// with strips (has_strips) go by strips of 32 rows decoded once, rows in the lanes (nibble_kernels.h)
bool has_strips(int type);  // q4_0, iq4_nl, mxfp4; q4_k, q5_k, q6_k (ggml_kstrips.h)
void rows_q8(int type, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const uint8_t* const* q,
             const float* const* d, const int16_t* const* bs, int64_t T, float* y, int64_t ldy, int64_t pf,
             int64_t strips_from);

}  // namespace ggml
