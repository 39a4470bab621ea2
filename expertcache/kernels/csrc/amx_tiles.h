// The AMX tile configuration the strips' products use (nibble_kernels.cpp: k = 32, ggml_kstrips.cpp: k = 64)
// and the 4-bit strips' four-product step; their instructions run only where nib::amx() says the CPU has AMX
// and Linux granted the tile state.
//
// tiles 0..3: C, 16 tokens x 16 rows of int32; 4, 5: A, 16 tokens x k int8 activation codes; 6, 7: B,
// k / 4 steps x 64 bytes (lane n = row n's 4 unsigned codes of a step: TDPBSUD's unsigned operand). Two A and
// two B tiles, so one product's loads need not wait for the previous product (ggml_kstrips.cpp uses 5..7 as B).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace amx {

// k: the features of one product (32: a block of the 4-bit formats or a K-quant sub-block; 16: a q6_k scale group)
__attribute__((target("amx-tile"))) inline void config(int k) {
  struct alignas(64) {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } c{};
  c.palette = 1;
  for (int i = 0; i < 4; ++i) c.rows[i] = 16, c.colsb[i] = 64;
  for (int i = 4; i < 6; ++i) c.rows[i] = 16, c.colsb[i] = uint16_t(k);
  for (int i = 6; i < 8; ++i) c.rows[i] = uint8_t(k / 4), c.colsb[i] = 64;
  _tile_loadconfig(&c);
}

__attribute__((target("amx-tile"))) inline void release() { _tile_release(); }

// Four products of config(32): cb[p] (int32, 16 tokens x 16 rows) = A_p . B_p for p < 4, where A_p is 16 tokens
// x 32 signed codes at a + p * ja (a token's 32 bytes apart) and B_p is 8 steps x 64 unsigned bytes at b[p]
// (steps 128 bytes apart: a strip Tile's two row vectors interleave)
__attribute__((target("amx-tile,amx-int8"))) inline void products4(const int8_t* a, int64_t ja, const uint8_t* const b[4],
                                                                    int32_t cb[4][16][16]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 32);
  _tile_loadd(6, b[0], 2 * 64);
  _tile_loadd(5, a + ja, 32);
  _tile_loadd(7, b[1], 2 * 64);
  _tile_dpbsud(0, 4, 6);
  _tile_dpbsud(1, 5, 7);
  _tile_loadd(4, a + 2 * ja, 32);
  _tile_loadd(6, b[2], 2 * 64);
  _tile_loadd(5, a + 3 * ja, 32);
  _tile_loadd(7, b[3], 2 * 64);
  _tile_dpbsud(2, 4, 6);
  _tile_dpbsud(3, 5, 7);
  _tile_stored(0, cb[0], 64);
  _tile_stored(1, cb[1], 64);
  _tile_stored(2, cb[2], 64);
  _tile_stored(3, cb[3], 64);
}

}  // namespace amx
