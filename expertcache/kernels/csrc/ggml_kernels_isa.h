// The exact-math GGUF kernels' body, written once over a vector type V and compiled twice by
// ggml_kernels.cpp: inside namespace ggml::avx2 (V = 8 floats, AVX2 + FMA + F16C) and inside
// ggml::avx512 under its target pragma (V = 16 floats). No include guard: it is meant to be included
// twice, each time after its V. V gives: W (lanes), F / I (float / int32 vectors), zero, set1, load,
// fmadd, fmsub, mul, hsum, cvt (int32 -> float), u8 / s8 (W bytes -> int32, zero / sign extended),
// and_, or_, sub, srli, srlv, slli, iota (lanes 0..W-1), lut (16-entry float table by the low 4 bits).
//
// Dec<T>::block(p, fn) decodes the block at p into the float32 values the gguf package's dequantiser
// gives and calls fn(s, w) per sub-block s of 32 weights, w[0 .. NV) its NV = 32 / W vectors in order.

constexpr int NV = 32 / V::W;

template <int N>
struct Slot {
  static constexpr int value = N;
};

inline float h2f(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// 32 weights from 16 bytes, low nibbles first then high (q4_0, q5_0, iq4_nl, mxfp4, iq4_xs's sub-blocks):
// lo / hi receive the codes of the vector (int32) and return its floats
template <class Lo, class Hi>
__attribute__((always_inline)) inline void nib16(const uint8_t* q, typename V::F* w, Lo lo, Hi hi) {
  for (int i = 0; i < NV / 2; ++i) {
    const typename V::I c = V::u8(q + V::W * i);
    w[i] = lo(c, i);
    w[NV / 2 + i] = hi(V::srli(c, 4), i);
  }
}

// q4_k / q5_k: the 6-bit scale and min of sub-blocks 0..7 from the 12 scale bytes (get_scale_min_k4)
inline void scale_min_k4(const uint8_t* s, uint8_t sc[8], uint8_t m[8]) {
  const uint32_t w0 = u32(s), w1 = u32(s + 4), w2 = u32(s + 8);
  const uint32_t a = w0 & 0x3F3F3F3Fu, b = w1 & 0x3F3F3F3Fu;
  const uint32_t c = (w2 & 0x0F0F0F0Fu) | (((w0 >> 6) & 0x03030303u) << 4);
  const uint32_t d = ((w2 >> 4) & 0x0F0F0F0Fu) | (((w1 >> 6) & 0x03030303u) << 4);
  __builtin_memcpy(sc, &a, 4);
  __builtin_memcpy(sc + 4, &c, 4);
  __builtin_memcpy(m, &b, 4);
  __builtin_memcpy(m + 4, &d, 4);
}

// the same 8 scales and 8 mins as the bytes of two integers, for a vector made in registers (two 4-byte
// stores read back by one 8-byte load would stall the load)
inline void scale_min_k4_64(const uint8_t* s, uint64_t& sc, uint64_t& m) {
  const uint32_t w0 = u32(s), w1 = u32(s + 4), w2 = u32(s + 8);
  const uint32_t c = (w2 & 0x0F0F0F0Fu) | (((w0 >> 6) & 0x03030303u) << 4);
  const uint32_t d = ((w2 >> 4) & 0x0F0F0F0Fu) | (((w1 >> 6) & 0x03030303u) << 4);
  sc = uint64_t(w0 & 0x3F3F3F3Fu) | uint64_t(c) << 32;
  m = uint64_t(w1 & 0x3F3F3F3Fu) | uint64_t(d) << 32;
}

// q4_0, iq4_nl, mxfp4, iq4_xs: a 16-entry table by code, scaled by d once (each entry d x value, exact:
// an fp16 d times a value of at most 8 bits, or iq4_xs's d x ls of 17 bits times one of 7)
template <class Tab>
__attribute__((always_inline)) inline void table_block(const uint8_t* q, typename V::F d, const Tab& tab,
                                                       typename V::F* w) {
  const Tab t = V::tmul(tab, d);
  nib16(q, w, [&](typename V::I c, int) { return V::lut(c, t); }, [&](typename V::I c, int) { return V::lut(c, t); });
}

template <int T>
struct Dec;

template <>
struct Dec<Q8_0> {
  static constexpr int QK = 32, BYTES = 34;
  template <class Fn>
  __attribute__((always_inline)) static void block(const uint8_t* p, Fn fn) {
    const typename V::F d = V::set1(h2f(p));
    typename V::F w[NV];
    for (int i = 0; i < NV; ++i) w[i] = V::mul(V::cvt(V::s8(p + 2 + V::W * i)), d);
    fn(0, w);
  }
};

template <>
struct Dec<Q4_0> {
  static constexpr int QK = 32, BYTES = 18;
  template <class Fn>
  __attribute__((always_inline)) static void block(const uint8_t* p, Fn fn) {
    typename V::F w[NV];
    table_block(p + 2, V::set1(h2f(p)), V::q4_0(), w);
    fn(0, w);
  }
};

template <>
struct Dec<Q5_0> {
  static constexpr int QK = 32, BYTES = 22;
  template <class Fn>
  __attribute__((always_inline)) static void block(const uint8_t* p, Fn fn) {
    const typename V::F d = V::set1(h2f(p));
    const typename V::I qh = V::set1i(int32_t(u32(p + 2))), sixteen = V::set1i(16), nib = V::set1i(15),
                        one = V::set1i(1);
    // weight j's fifth bit: bit j of qh, moved to bit 4
    auto fifth = [&](int j0) { return V::slli(V::and_(V::srlv(qh, V::add(V::iota(), V::set1i(j0))), one), 4); };
    typename V::F w[NV];
    nib16(p + 6, w,
          [&](typename V::I c, int i) {
            return V::mul(V::cvt(V::sub(V::or_(V::and_(c, nib), fifth(V::W * i)), sixteen)), d);
          },
          [&](typename V::I c, int i) { return V::mul(V::cvt(V::sub(V::or_(c, fifth(16 + V::W * i)), sixteen)), d); });
    fn(0, w);
  }
};

template <>
struct Dec<IQ4_NL> {
  static constexpr int QK = 32, BYTES = 18;
  template <class Fn>
  __attribute__((always_inline)) static void block(const uint8_t* p, Fn fn) {
    typename V::F w[NV];
    table_block(p + 2, V::set1(h2f(p)), V::iq4nl(), w);
    fn(0, w);
  }
};

// e8m0 e as ggml's half scale 2^(e - 128) (ggml_e8m0_to_fp32_half: e < 2 as the subnormals)
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

template <>
struct Dec<MXFP4> {
  static constexpr int QK = 32, BYTES = 17;
  template <class Fn>
  __attribute__((always_inline)) static void block(const uint8_t* p, Fn fn) {
    typename V::F w[NV];
    table_block(p + 1, V::set1(e8m0_half(p[0])), V::e2m1x2(), w);
    fn(0, w);
  }
};

template <>
struct Dec<IQ4_XS> {
  static constexpr int QK = 256, BYTES = 136;
  template <class Fn>
  __attribute__((always_inline)) static void block(const uint8_t* p, Fn fn) {
    const float d = h2f(p);
    uint16_t sh;
    __builtin_memcpy(&sh, p + 2, 2);
    const auto tab = V::iq4nl();
    for (int s = 0; s < 8; ++s) {
      const int ls = (((p[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((sh >> (2 * s)) & 3) << 4)) - 32;
      typename V::F w[NV];
      table_block(p + 8 + 16 * s, V::set1(d * float(ls)), tab, w);
      fn(s, w);
    }
  }
};

// q4_k and q5_k (Q5: the fifth bits from qh)
template <bool Q5>
struct DecK {
  static constexpr int QK = 256, BYTES = Q5 ? 176 : 144;
  template <class Fn>
  __attribute__((always_inline)) static void block(const uint8_t* p, Fn fn) {
    const float d = h2f(p), dmin = h2f(p + 2);
    uint8_t sc[8], m[8];
    scale_min_k4(p + 4, sc, m);
    const uint8_t* qh = p + 16;
    const uint8_t* qs = p + (Q5 ? 48 : 16);
    const typename V::I nib = V::set1i(15), one = V::set1i(1);
    if constexpr (!Q5 && V::W == 16) {  // q4_k on AVX-512: each sub-block's 16 values d sc q - dmin m as a table
      uint64_t sc8, m8;
      scale_min_k4_64(p + 4, sc8, m8);
      const __m512 ds = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc8)))),
                                      _mm512_set1_ps(d));
      const __m512 ms = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(m8)))),
                                      _mm512_set1_ps(dmin));
      const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      auto table = [&](int j) __attribute__((always_inline)) {
        const __m512i jv = _mm512_set1_epi32(j);
        return _mm512_fmsub_ps(codes, _mm512_permutexvar_ps(jv, ds), _mm512_permutexvar_ps(jv, ms));
      };
      for (int c = 0; c < 4; ++c) {
        const __m512 t0 = table(2 * c), t1 = table(2 * c + 1);
        __m512 lo[NV], hi[NV];
        for (int i = 0; i < NV; ++i) {
          const __m512i q = V::u8(qs + 32 * c + V::W * i);
          lo[i] = _mm512_permutexvar_ps(q, t0);  // vpermps reads the low 4 bits
          hi[i] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), t1);
        }
        fn(2 * c, lo);
        fn(2 * c + 1, hi);
      }
      return;
    }
    for (int c = 0; c < 4; ++c) {
      typename V::F lo[NV], hi[NV];
      const typename V::F d0 = V::set1(d * float(sc[2 * c])), m0 = V::set1(dmin * float(m[2 * c]));
      const typename V::F d1 = V::set1(d * float(sc[2 * c + 1])), m1 = V::set1(dmin * float(m[2 * c + 1]));
      for (int i = 0; i < NV; ++i) {
        const typename V::I q = V::u8(qs + 32 * c + V::W * i);
        typename V::I a = V::and_(q, nib), b = V::srli(q, 4);
        if constexpr (Q5) {
          const typename V::I h = V::u8(qh + V::W * i);
          a = V::or_(a, V::slli(V::and_(V::srlv(h, V::set1i(2 * c)), one), 4));
          b = V::or_(b, V::slli(V::and_(V::srlv(h, V::set1i(2 * c + 1)), one), 4));
        }
        lo[i] = V::fmsub(V::cvt(a), d0, m0);
        hi[i] = V::fmsub(V::cvt(b), d1, m1);
      }
      fn(2 * c, lo);
      fn(2 * c + 1, hi);
    }
  }
};
template <>
struct Dec<Q4_K> : DecK<false> {};
template <>
struct Dec<Q5_K> : DecK<true> {};

template <>
struct Dec<Q6_K> {
  static constexpr int QK = 256, BYTES = 210;
  template <class Fn>
  __attribute__((always_inline)) static void block(const uint8_t* p, Fn fn) {
    const float d = h2f(p + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    if constexpr (V::W == 16) {  // the codes made 64 at a time as bytes (q - 32), then 16 at a time widened
      const __m512 dsc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)))),
                                       _mm512_set1_ps(d));
      const __m512i nib8 = _mm512_set1_epi8(0x0F), three8 = _mm512_set1_epi8(3), off8 = _mm512_set1_epi8(32);
      for (int h = 0; h < 2; ++h) {
        const __m512i ql = _mm512_loadu_si512(p + 64 * h);
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
        const __m512i qa = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
        const __m512i qb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(qh, 4)), _mm256_srli_epi16(qh, 6), 1);
        // q0: weights 128h + 0..63, q1: 128h + 64..127, as int8 q - 32
        const __m512i q0 = _mm512_sub_epi8(
            _mm512_or_si512(_mm512_and_si512(ql, nib8), _mm512_slli_epi16(_mm512_and_si512(qa, three8), 4)), off8);
        const __m512i q1 = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nib8),
                                                           _mm512_slli_epi16(_mm512_and_si512(qb, three8), 4)), off8);
        auto emit = [&](int s, __m512i q, auto l0) __attribute__((always_inline)) {
          constexpr int L = decltype(l0)::value;  // the 128-bit lanes L, L + 1 of q: sub-block s's 32 codes
          __m512 w[2];
          w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, L))),
                               _mm512_permutexvar_ps(_mm512_set1_epi32(2 * s), dsc));
          w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q, L + 1))),
                               _mm512_permutexvar_ps(_mm512_set1_epi32(2 * s + 1), dsc));
          fn(s, w);
        };
        emit(4 * h, q0, Slot<0>{});
        emit(4 * h + 1, q0, Slot<2>{});
        emit(4 * h + 2, q1, Slot<0>{});
        emit(4 * h + 3, q1, Slot<2>{});
      }
      return;
    }
    const typename V::I nib = V::set1i(15), three = V::set1i(3), off = V::set1i(32);
    for (int s = 0; s < 8; ++s) {
      const int h = s / 4, i4 = s % 4;
      const uint8_t* ql = p + 64 * h + 32 * (i4 % 2);
      const uint8_t* qh = p + 128 + 32 * h;
      typename V::F w[NV];
      for (int i = 0; i < NV; ++i) {
        const typename V::I l = V::u8(ql + V::W * i), hb = V::u8(qh + V::W * i);
        const typename V::I lq = i4 < 2 ? V::and_(l, nib) : V::srli(l, 4);
        const typename V::I q = V::sub(V::or_(lq, V::slli(V::and_(V::srlv(hb, V::set1i(2 * i4)), three), 4)), off);
        w[i] = V::mul(V::cvt(q), V::set1(d * float(sc[2 * s + (V::W * i) / 16])));
      }
      fn(s, w);
    }
  }
};

// ---- kernels ---------------------------------------------------------------------------------------
inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), e = a + bytes;
  for (uintptr_t l = a & ~uintptr_t(63); l < e; l += 64) _mm_prefetch(reinterpret_cast<const char*>(l), _MM_HINT_T0);
}

// y[t * ldy] = row . x[t] for t < TT; ahead: bytes past each block to prefetch (0: none). One token: two
// sets of accumulators alternating by sub-block (2 NV chains).
template <int T, int TT>
void row_dot(const uint8_t* row, int64_t nb, const float* const* x, float* y, int64_t ldy, int64_t ahead) {
  using D = Dec<T>;
  constexpr int C = TT == 1 ? 2 : 1;
  typename V::F acc[C][TT][NV];
  for (int c = 0; c < C; ++c)
    for (int t = 0; t < TT; ++t)
      for (int i = 0; i < NV; ++i) acc[c][t][i] = V::zero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * D::BYTES;
    if (ahead) prefetch_block(p + ahead, D::BYTES);
    D::block(p, [&](int s, const typename V::F* w) __attribute__((always_inline)) {
      const int64_t k = b * D::QK + 32 * s;
      for (int t = 0; t < TT; ++t)
        for (int i = 0; i < NV; ++i) acc[s % C][t][i] = V::fmadd(w[i], V::load(x[t] + k + V::W * i), acc[s % C][t][i]);
    });
  }
  for (int t = 0; t < TT; ++t) {
    typename V::F s = acc[0][t][0];
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < NV; ++i)
        if (c || i) s = V::add(s, acc[c][t][i]);
    y[t * ldy] = V::hsum(s);
  }
}

// tokens per pass over a row: as many as the accumulators allow (NV x TT of them, with NV weight vectors)
constexpr int TMAX = V::W == 16 ? 6 : 3;

template <int T>
void rows(const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const float* const* x, int64_t nt, float* y,
          int64_t ldy, int64_t pf) {
  const int64_t nb = K / Dec<T>::QK;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t ahead = pf && n + pf < N ? pf * w_row : 0;
    for (int64_t t0 = 0; t0 < nt; t0 += TMAX) {
      const int64_t tt = nt - t0 < TMAX ? nt - t0 : TMAX;
      const uint8_t* r = w + n * w_row;
      float* yt = y + t0 * ldy + n;
      const int64_t a = t0 == 0 ? ahead : 0;
      auto go = [&](auto tc) __attribute__((always_inline)) {
        row_dot<T, decltype(tc)::value>(r, nb, x + t0, yt, ldy, a);
      };
      switch (tt) {  // tt <= TMAX
        case 1: go(Slot<1>{}); break;
        case 2: go(Slot<2>{}); break;
        case 3: go(Slot<3>{}); break;
        case 4: if constexpr (TMAX >= 4) go(Slot<4>{}); break;
        case 5: if constexpr (TMAX >= 5) go(Slot<5>{}); break;
        default: go(Slot<TMAX>{}); break;
      }
    }
  }
}

template <int T>
void dequant_rows(const uint8_t* w, int64_t w_row, int64_t N, int64_t K, float* out, int64_t ld) {
  using D = Dec<T>;
  const int64_t nb = K / D::QK;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      float* o = out + n * ld + b * D::QK;
      D::block(w + n * w_row + b * D::BYTES, [&](int s, const typename V::F* v) __attribute__((always_inline)) {
        for (int i = 0; i < NV; ++i) V::store(o + 32 * s + V::W * i, v[i]);
      });
    }
}

template <class Fn>
void by_type(int type, Fn fn) {
  switch (type) {
    case Q8_0: fn(Slot<Q8_0>{}); break;
    case Q4_0: fn(Slot<Q4_0>{}); break;
    case Q5_0: fn(Slot<Q5_0>{}); break;
    case IQ4_NL: fn(Slot<IQ4_NL>{}); break;
    case MXFP4: fn(Slot<MXFP4>{}); break;
    case Q4_K: fn(Slot<Q4_K>{}); break;
    case Q5_K: fn(Slot<Q5_K>{}); break;
    case Q6_K: fn(Slot<Q6_K>{}); break;
    default: fn(Slot<IQ4_XS>{}); break;
  }
}

void rows_f32(int type, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, const float* const* x, int64_t T,
              float* y, int64_t ldy, int64_t pf) {
  by_type(type, [&](auto tc) { rows<decltype(tc)::value>(w, w_row, N, K, x, T, y, ldy, pf); });
}

void dequant(int type, const uint8_t* w, int64_t w_row, int64_t N, int64_t K, float* out, int64_t ld) {
  by_type(type, [&](auto tc) { dequant_rows<decltype(tc)::value>(w, w_row, N, K, out, ld); });
}
