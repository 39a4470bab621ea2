// The strips' tokens in register blocks, one loop for the three strip kernels (ggml_kernels.cpp,
// ggml_kstrips.cpp, nibble_kernels.cpp). Included inside each file's AVX-512 target region, so the blocks
// inline into its kernels; no standard header here.
#pragma once

namespace strip_chunks {

constexpr int BLOCK = 6;  // tokens of the full register block (ggml_kstrips.cpp, one thread, 768 x 2048, T = 16:
                          // q4_k 6% and q6_k 10% faster than 4 tokens; the 4-bit strips measured 4 the same)

template <int N>
struct Tokens {
  static constexpr int value = N;
};

// go(Tokens<tt>{}, t0) over tokens [t0, T) in chunks of at most BLOCK, as even as can be (T = 8: 4 + 4, not
// 6 + 2): 1 to 5 tokens their own block, BLOCK the full one
template <class Go>
__attribute__((always_inline)) inline void even(long t0, long T, const Go& go) {
  const long chunks = (T - t0 + BLOCK - 1) / BLOCK;
  for (long c = 0; c < chunks; ++c) {
    const long tt = (T - t0) / (chunks - c) + ((T - t0) % (chunks - c) != 0);
    switch (tt) {
      case 1: go(Tokens<1>{}, t0); break;
      case 2: go(Tokens<2>{}, t0); break;
      case 3: go(Tokens<3>{}, t0); break;
      case 4: go(Tokens<4>{}, t0); break;
      case 5: go(Tokens<5>{}, t0); break;
      default: go(Tokens<BLOCK>{}, t0); break;
    }
    t0 += tt;
  }
}

}  // namespace strip_chunks
