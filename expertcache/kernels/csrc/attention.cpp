// Attention of the new tokens over the paged KV cache on the CPU (AVX2 + FMA), one call per layer:
// the new tokens' per-head q/k RMSNorm and rotary, their k/v written into the cache, and softmax
// attention read through the block table (no gathered copy of the context).
//
// Shape legend:
//   T new tokens   h query heads   g kv heads (h % g == 0)   D head_dim   R rotary dims (even, <= D)
//   B sequences    nb blocks per table row   NB blocks in the cache   bs tokens per block
//   q [T, h, D], k / v [T, g, D] float32 (any token and head strides; each head's D values contiguous)
//   k_cache / v_cache [NB, bs, g, D] float32 or bfloat16, contiguous   block_tables [B, nb] int64
//   slot_mapping, seq_of_token, positions [T] int64   cos / sin [T, R] float32   norms [D]   sinks [h]
//   out [T, h, D] float32
//
// Visibility: key position kp of sequence b is visible to the query at position qp iff kp <= qp and
// (window == 0 or kp > qp - window); it is at cache slot block_tables[b, kp / bs] * bs + kp % bs.
// Sinks: softmax over [scores..., sink_h] with the sink's column dropped (a denominator term only).
//
// Step 1, per new token: RMSNorm per head (optional), rotary on the first R dims (half-split: x * cos
// + rotate_half(x) * sin), k and v written at slot_mapping in the cache's dtype (bf16 rounded to
// nearest even, as torch), the prepared q into `out`. Step 2, per (token, kv head) unit after every
// write (a prefill token sees the other new tokens): the h / g query heads of that kv head together,
// so each key and value row is read once; two passes over the visible keys: scores into a
// thread-local row, then exp(score - max) (vectorised) and the weighted sum of the value rows.

#include <torch/extension.h>
#include <immintrin.h>

#include "registry.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  const uint32_t u = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store1(float* p, float x) { *p = x; }
inline void store1(uint16_t* p, float x) {  // round to nearest even; NaN -> 0x7FC0 (c10::BFloat16)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *p = 0x7FC0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = uint16_t(u >> 16);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (a score minus the row's max; Cephes polynomial, ~1 ulp); NaN stays NaN
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // NaN: max returns its second operand
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

struct Args {
  int64_t T, h, g, D, R, bs, nb, NB, window;
  float scale, eps;
  const float *q, *k, *v;
  int64_t q_t, q_h, k_t, k_h, v_t, v_h;  // strides in floats
  const float *q_norm, *k_norm, *cos, *sin, *sinks;
  const int64_t *slots, *tables, *seq_of, *pos;
  float* out;  // [T, h, D]
};

// y[D] = rotary(norm(x)) (either optional); y may not alias x
void prepare(const float* x, float* y, const float* w, const float* c, const float* s, const Args& a) {
  const int64_t D = a.D;
  if (w) {
    float ss = 0.f;
    for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
    const float inv = 1.0f / std::sqrt(ss / float(D) + a.eps);
    for (int64_t d = 0; d < D; ++d) y[d] = w[d] * (x[d] * inv);
  } else {
    std::memcpy(y, x, D * sizeof(float));
  }
  if (c) {
    const int64_t half = a.R / 2;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = y[i], x2 = y[i + half];
      y[i] = x1 * c[i] - x2 * s[i];
      y[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
  }
}

template <class KT>
void write_token(const Args& a, KT* kc, KT* vc, int64_t t) {
  const int64_t D = a.D;
  const float* c = a.cos ? a.cos + t * a.R : nullptr;
  const float* s = a.sin ? a.sin + t * a.R : nullptr;
  for (int64_t hd = 0; hd < a.h; ++hd)
    prepare(a.q + t * a.q_t + hd * a.q_h, a.out + (t * a.h + hd) * D, a.q_norm, c, s, a);
  float kbuf[1024];
  const int64_t slot = a.slots[t];
  for (int64_t j = 0; j < a.g; ++j) {
    prepare(a.k + t * a.k_t + j * a.k_h, kbuf, a.k_norm, c, s, a);
    KT* kd = kc + (slot * a.g + j) * D;
    KT* vd = vc + (slot * a.g + j) * D;
    const float* vs = a.v + t * a.v_t + j * a.v_h;
    for (int64_t d = 0; d < D; ++d) {
      store1(kd + d, kbuf[d]);
      store1(vd + d, vs[d]);
    }
  }
}

// s[r * ld + i] = scale * q_r . key(i) for the RC query rows q[r * D] and the keys at `keys[i]`
template <int RC, class KT>
inline void dot_rows(const float* q, int64_t D, const KT* key, float* s, int64_t ld, float scale) {
  const int64_t D8 = D & ~int64_t(7);
  __m256 acc[RC];
  for (int r = 0; r < RC; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D8; d += 8) {
    const __m256 kv = load8(key + d);
    for (int r = 0; r < RC; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * D + d), kv, acc[r]);
  }
  for (int r = 0; r < RC; ++r) {
    float sum = hsum(acc[r]);
    for (int64_t d = D8; d < D; ++d) sum += q[r * D + d] * load1(key + d);
    s[r * ld] = sum * scale;
  }
}

// o_r[D] += p[r * ld] * value for the RC output rows o[r * D]
template <int RC, class KT>
inline void add_rows(float* o, int64_t D, const KT* val, const float* p, int64_t ld) {
  const int64_t D8 = D & ~int64_t(7);
  __m256 pr[RC];
  for (int r = 0; r < RC; ++r) pr[r] = _mm256_set1_ps(p[r * ld]);
  for (int64_t d = 0; d < D8; d += 8) {
    const __m256 vv = load8(val + d);
    for (int r = 0; r < RC; ++r)
      _mm256_storeu_ps(o + r * D + d, _mm256_fmadd_ps(pr[r], vv, _mm256_loadu_ps(o + r * D + d)));
  }
  for (int64_t d = D8; d < D; ++d) {
    const float x = load1(val + d);
    for (int r = 0; r < RC; ++r) o[r * D + d] += p[r * ld] * x;
  }
}

// the RC query heads h0.. of token t over kv head j: q in qbuf [RC, D], result into out
template <int RC, class KT>
void attend(const Args& a, const KT* kc, const KT* vc, int64_t t, int64_t j, int64_t h0, const float* qbuf,
            std::vector<float>& sc) {
  const int64_t D = a.D, bs = a.bs, row = a.g * D;  // row: floats (elements) between tokens in the cache
  const int64_t qp = a.pos[t];
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, qp - a.window + 1) : 0;
  const int64_t n = qp - lo + 1;
  if (int64_t(sc.size()) < RC * n) sc.resize(RC * n);
  float* s = sc.data();
  const int64_t* table = a.tables + a.seq_of[t] * a.nb;

  // pass 1: scores, block by block
  for (int64_t kp = lo; kp <= qp;) {
    const int64_t blk = table[kp / bs], off = kp % bs, end = std::min(qp + 1, kp - off + bs);
    const KT* key = kc + (blk * bs + off) * row + j * D;
    for (; kp < end; ++kp, key += row) dot_rows<RC>(qbuf, D, key, s + (kp - lo), n, a.scale);
  }
  // softmax per row (sink in the denominator)
  float inv[RC];
  for (int r = 0; r < RC; ++r) {
    float* sr = s + r * n;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sr + i));
    float buf[8];
    _mm256_storeu_ps(buf, mv);
    float m = buf[0];
    for (int l = 1; l < 8; ++l) m = std::max(m, buf[l]);
    for (; i < n; ++i) m = std::max(m, sr[i]);
    const float sink = a.sinks ? a.sinks[h0 + r] : 0.f;
    if (a.sinks) m = std::max(m, sink);
    const __m256 mm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + i), mm));
      _mm256_storeu_ps(sr + i, e);
      acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum(acc);
    for (; i < n; ++i) {
      sr[i] = std::exp(sr[i] - m);
      sum += sr[i];
    }
    if (a.sinks) sum += std::exp(sink - m);
    inv[r] = 1.0f / sum;
  }
  // pass 2: weighted values
  float* o = a.out + (t * a.h + h0) * D;
  std::memset(o, 0, RC * D * sizeof(float));
  for (int64_t kp = lo; kp <= qp;) {
    const int64_t blk = table[kp / bs], off = kp % bs, end = std::min(qp + 1, kp - off + bs);
    const KT* val = vc + (blk * bs + off) * row + j * D;
    for (; kp < end; ++kp, val += row) add_rows<RC>(o, D, val, s + (kp - lo), n);
  }
  for (int r = 0; r < RC; ++r)
    for (int64_t d = 0; d < D; ++d) o[r * D + d] *= inv[r];
}

template <class KT>
void unit(const Args& a, const KT* kc, const KT* vc, int64_t u) {
  thread_local std::vector<float> sc, qbuf;
  const int64_t t = u / a.g, j = u % a.g, G = a.h / a.g, D = a.D;
  for (int64_t r0 = 0; r0 < G; r0 += 4) {
    const int64_t rc = std::min<int64_t>(4, G - r0), h0 = j * G + r0;
    if (int64_t(qbuf.size()) < rc * D) qbuf.resize(rc * D);
    std::memcpy(qbuf.data(), a.out + (t * a.h + h0) * D, rc * D * sizeof(float));  // step 1's q
    switch (rc) {
      case 4: attend<4>(a, kc, vc, t, j, h0, qbuf.data(), sc); break;
      case 3: attend<3>(a, kc, vc, t, j, h0, qbuf.data(), sc); break;
      case 2: attend<2>(a, kc, vc, t, j, h0, qbuf.data(), sc); break;
      default: attend<1>(a, kc, vc, t, j, h0, qbuf.data(), sc); break;
    }
  }
}

constexpr int64_t WRITE_TOKENS = 8;  // tokens per step-1 unit (and the T from which step 1 is threaded)

template <class KT>
void run(const Args& a, KT* kc, KT* vc) {
  if (a.T <= WRITE_TOKENS) {
    for (int64_t t = 0; t < a.T; ++t) write_token(a, kc, vc, t);
  } else {
    pool::run_units((a.T + WRITE_TOKENS - 1) / WRITE_TOKENS, [&](int64_t u) {
      for (int64_t t = u * WRITE_TOKENS; t < std::min(a.T, (u + 1) * WRITE_TOKENS); ++t) write_token(a, kc, vc, t);
    });
  }
  pool::run_units(a.T * a.g, [&](int64_t u) { unit(a, kc, vc, u); });
}

void check_heads(const at::Tensor& x, int64_t T, int64_t n, int64_t D, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3, "attention: ", what,
              " must be a float32 CPU tensor [T, heads, D]");
  TORCH_CHECK(x.size(0) == T && x.size(1) == n && x.size(2) == D, "attention: ", what, " has shape ", x.sizes(),
              ", expected [", T, ", ", n, ", ", D, "]");
  TORCH_CHECK(x.stride(2) == 1, "attention: ", what, ": each head's values must be contiguous");
}

const float* vec(const c10::optional<at::Tensor>& x, int64_t n, const char* what) {
  if (!x.has_value()) return nullptr;
  TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kFloat && x->is_contiguous() && x->numel() == n,
              "attention: ", what, " must be a contiguous float32 CPU tensor of ", n, " values");
  return x->data_ptr<float>();
}

const int64_t* ids(const at::Tensor& x, int64_t n, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kLong && x.dim() == 1 && x.size(0) == n &&
                  x.is_contiguous(),
              "attention: ", what, " must be a contiguous int64 CPU tensor [", n, "]");
  return x.data_ptr<int64_t>();
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps,
                     const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin, at::Tensor k_cache,
                     at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& seq_of_token, const at::Tensor& positions, int64_t window, double scale,
                     const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "attention: q and k must be [T, heads, D]");
  Args a;
  a.T = q.size(0), a.h = q.size(1), a.D = q.size(2), a.g = k.size(1);
  TORCH_CHECK(a.g >= 1 && a.h % a.g == 0, "attention: ", a.h, " query heads are not a multiple of ", a.g, " kv heads");
  TORCH_CHECK(a.D >= 1 && a.D <= 1024, "attention: head_dim ", a.D, " outside [1, 1024]");
  check_heads(q, a.T, a.h, a.D, "q");
  check_heads(k, a.T, a.g, a.D, "k");
  check_heads(v, a.T, a.g, a.D, "v");
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "attention: k_cache and v_cache must be contiguous CPU tensors of one shape and dtype [NB, bs, g, D]");
  TORCH_CHECK(k_cache.size(2) == a.g && k_cache.size(3) == a.D, "attention: k_cache is ", k_cache.sizes(),
              ", expected [NB, bs, ", a.g, ", ", a.D, "]");
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || k_cache.scalar_type() == at::kFloat, "attention: k_cache dtype ", k_cache.scalar_type(),
              " unsupported (float32 or bfloat16)");
  a.NB = k_cache.size(0), a.bs = k_cache.size(1);
  TORCH_CHECK(window >= 0, "attention: window must be >= 0 (0: none), got ", window);
  a.window = window, a.scale = float(scale), a.eps = float(eps);
  a.q = q.data_ptr<float>(), a.k = k.data_ptr<float>(), a.v = v.data_ptr<float>();
  a.q_t = q.stride(0), a.q_h = q.stride(1), a.k_t = k.stride(0), a.k_h = k.stride(1);
  a.v_t = v.stride(0), a.v_h = v.stride(1);
  a.q_norm = vec(q_norm, a.D, "q_norm");
  a.k_norm = vec(k_norm, a.D, "k_norm");
  TORCH_CHECK(cos.has_value() == sin.has_value(), "attention: cos and sin come together");
  a.R = 0;
  if (cos.has_value()) {
    a.R = a.T > 0 ? cos->numel() / a.T : 0;
    TORCH_CHECK(a.T == 0 || (a.R * a.T == cos->numel() && a.R % 2 == 0 && a.R <= a.D && cos->size(0) == a.T),
                "attention: cos must be [T, R] with R even and <= head_dim, got ", cos->sizes());
  }
  a.cos = vec(cos, a.T * a.R, "cos");
  a.sin = vec(sin, a.T * a.R, "sin");
  a.sinks = vec(sinks, a.h, "sinks");
  a.slots = ids(slot_mapping, a.T, "slot_mapping");
  a.seq_of = ids(seq_of_token, a.T, "seq_of_token");
  a.pos = ids(positions, a.T, "positions");
  TORCH_CHECK(block_tables.device().is_cpu() && block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.is_contiguous(),
              "attention: block_tables must be a contiguous int64 CPU tensor [B, nb]");
  const int64_t B = block_tables.size(0);
  a.nb = block_tables.size(1);
  a.tables = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * a.nb; ++i)
    TORCH_CHECK(a.tables[i] >= 0 && a.tables[i] < a.NB, "attention: block_tables holds block ", a.tables[i],
                " outside [0, ", a.NB, ")");
  for (int64_t t = 0; t < a.T; ++t) {
    TORCH_CHECK(a.slots[t] >= 0 && a.slots[t] < a.NB * a.bs, "attention: slot_mapping[", t, "] = ", a.slots[t],
                " outside [0, ", a.NB * a.bs, ")");
    TORCH_CHECK(a.seq_of[t] >= 0 && a.seq_of[t] < B, "attention: seq_of_token[", t, "] = ", a.seq_of[t],
                " outside [0, ", B, ")");
    TORCH_CHECK(a.pos[t] >= 0 && a.pos[t] < a.nb * a.bs, "attention: positions[", t, "] = ", a.pos[t],
                " outside the block table's ", a.nb * a.bs, " tokens");
  }
  at::Tensor out = at::empty({a.T, a.h, a.D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  a.out = out.data_ptr<float>();
  if (a.T == 0) return out;
  if (bf16) {
    run(a, reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>()));
  } else {
    run(a, k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
  return out;
}

}  // namespace

void register_attention(py::module_& m) {
  m.def("attention", &attention,
        "out [T, h, D]: the new tokens' q/k norm + rotary, k/v written into the paged cache, softmax attention "
        "over it through the block table",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("cos"),
        py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::arg("block_tables"),
        py::arg("seq_of_token"), py::arg("positions"), py::arg("window"), py::arg("scale"), py::arg("sinks"));
}
