// Attention of the new tokens over the paged KV cache on the CPU (AVX2 + FMA), one call per layer:
// the new tokens' per-head q/k RMSNorm and rotary, their k/v written into the cache, and softmax
// attention read through the block table (no gathered copy of the context).
//
// Shape legend:
//   T new tokens   h query heads   g kv heads (h % g == 0)   D head_dim   R rotary dims (even, <= D)
//   B sequences    nb blocks per table row   NB blocks in the cache   bs tokens per block
//   q [T, h, D], k / v [T, g, D] float32 (any token and head strides; each head's D values contiguous),
//   or [T, h * D] / [T, g * D] (rows of contiguous heads: views into one qkv projection), or k = v =
//   None and q the fused qkv [T, (h + 2 g) * D] itself (each row: the q heads, then k's, then v's)
//   k_cache / v_cache [NB, bs, g, D] float32 or bfloat16, contiguous   block_tables [B, nb] int64
//   slot_mapping, seq_of_token, positions [T] int64   cos / sin [T, R] float32   norms [D]   sinks [h]
//   out [T, h * D] float32 (the heads in order, as the output projection reads them)
//
// Visibility: key position kp of sequence b is visible to the query at position qp iff kp <= qp and
// (window == 0 or kp > qp - window); it is at cache slot block_tables[b, kp / bs] * bs + kp % bs.
// Sinks: softmax over [scores..., sink_h] with the sink's column dropped (a denominator term only).
//
// Step 1, per new token: RMSNorm per head (optional), rotary on the first R dims (half-split: x * cos
// + rotate_half(x) * sin), k and v written at slot_mapping in the cache's dtype (bf16 rounded to
// nearest even, as torch), the prepared q into `out`. Step 2, after every write (a prefill token sees
// the other new tokens), per unit = (chunk of up to TQ new tokens of one sequence, kv head): rows =
// the chunk's tokens x the kv head's h / g query heads, keys = the union of their visible ranges
// (read in place through the block table); scores [rows, keys] by a register-tiled micro-kernel
// (2 rows x 4 keys), each row's softmax (masked keys -inf, the sink in the denominator; exp
// vectorised), then the weighted values [rows, D] (4 rows x 16 dims in registers). Two passes over
// the keys, the scores in a thread-local scratch.

#include <torch/extension.h>
#include <immintrin.h>

#include "ops.h"
#include "registry.h"
#include "simd_math.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
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

// Step 2. A unit: a chunk of up to TQ new tokens of one sequence x one kv head. Its rows are the
// chunk's tokens x the G = h / g query heads of that kv head (row i: token i / G, head i % G) and its
// keys the union of the tokens' visible ranges; a key outside a row's own range scores -inf.
constexpr int64_t TQ = 8;

struct Chunk {
  int64_t b, first, count;  // tokens order[first .. first + count), all of sequence b
};

// s[r * ld + i] = q_r . key_i for RT rows of q (row stride D) and NK keys (NK 4: one transposing
// reduction of the 4 accumulators; 1: a horizontal sum)
template <int RT, int NK, class KT>
inline void dots(const float* q, int64_t D, const KT* const* key, float* s, int64_t ld) {
  const int64_t D8 = D & ~int64_t(7);
  __m256 acc[RT][NK];
  for (int r = 0; r < RT; ++r)
    for (int i = 0; i < NK; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D8; d += 8) {
    __m256 kv[NK];
    for (int i = 0; i < NK; ++i) kv[i] = load8(key[i] + d);
    for (int r = 0; r < RT; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * D + d);
      for (int i = 0; i < NK; ++i) acc[r][i] = _mm256_fmadd_ps(qv, kv[i], acc[r][i]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    float sum[NK];
    if constexpr (NK == 4) {
      const __m256 hh = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
      _mm_storeu_ps(sum, _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)));
    } else {
      for (int i = 0; i < NK; ++i) sum[i] = hsum(acc[r][i]);
    }
    for (int64_t d = D8; d < D; ++d)
      for (int i = 0; i < NK; ++i) sum[i] += q[r * D + d] * load1(key[i] + d);
    for (int i = 0; i < NK; ++i) s[r * ld + i] = sum[i];
  }
}

// the cache lines of one key or value row into L2: in a decode step the context's rows were evicted
// by the layers' expert weights streaming through. The pointer loop fetches the first PREFETCH rows,
// pass 1 the rest PREFETCH ahead. Measured (decode, 16 q / 4 kv heads, D 64, 2 threads, after a
// 64 MiB stream; busy machine): 500 keys 137-197 us without, 114-150 us with; 40 keys ~40 us either
// way (7 us warm).
constexpr int64_t PREFETCH = 256;

template <class KT>
inline void prefetch_row(const KT* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < D * int64_t(sizeof(KT)); b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}

template <int RT, class KT>
void score_rows(const float* q, int64_t D, const KT* const* key, const KT* const* val, int64_t n, float* s,
                int64_t ld, bool prefetch) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    if (prefetch)
      for (int64_t f = i + PREFETCH; f < std::min(n, i + PREFETCH + 4); ++f) {
        prefetch_row(key[f], D);
        prefetch_row(val[f], D);
      }
    dots<RT, 4>(q, D, key + i, s + i, ld);
  }
  for (; i < n; ++i) dots<RT, 1>(q, D, key + i, s + i, ld);
}

// o_r[d0 .. d0 + 8 CV) = sum_i p[r * ld + i] * val_i[d0 ..] for RT rows
template <int RT, int CV, class KT>
inline void weighted(const float* p, int64_t ld, const KT* const* val, int64_t n, int64_t d0, float* const* o) {
  __m256 acc[RT][CV];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CV; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m256 vv[CV];
    for (int c = 0; c < CV; ++c) vv[c] = load8(val[i] + d0 + 8 * c);
    for (int r = 0; r < RT; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * ld + i);
      for (int c = 0; c < CV; ++c) acc[r][c] = _mm256_fmadd_ps(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < CV; ++c) _mm256_storeu_ps(o[r] + d0 + 8 * c, acc[r][c]);
}

template <int RT, class KT>
void value_rows(const float* p, int64_t ld, const KT* const* val, int64_t n, int64_t D, float* const* o) {
  const int64_t D8 = D & ~int64_t(7);
  int64_t d0 = 0;
  for (; d0 + 16 <= D8; d0 += 16) weighted<RT, 2>(p, ld, val, n, d0, o);
  if (d0 < D8) weighted<RT, 1>(p, ld, val, n, d0, o);
  for (int64_t d = D8; d < D; ++d)
    for (int r = 0; r < RT; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) sum += p[r * ld + i] * load1(val[i] + d);
      o[r][d] = sum;
    }
}

// softmax of one row s[n] in place (entries outside [vlo, vhi) masked out; the sink, when given, in
// the denominator), normalised: the row becomes the weights of the values
inline void softmax_row(float* s, int64_t n, int64_t vlo, int64_t vhi, const float* sink) {
  for (int64_t i = 0; i < vlo; ++i) s[i] = -INFINITY;
  for (int64_t i = vhi; i < n; ++i) s[i] = -INFINITY;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + i));
  float buf[8];
  _mm256_storeu_ps(buf, mv);
  float m = buf[0];
  for (int l = 1; l < 8; ++l) m = std::max(m, buf[l]);
  for (; i < n; ++i) m = std::max(m, s[i]);
  if (sink) m = std::max(m, *sink);
  const __m256 mm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + i), mm);
    const __m256 e = _mm256_and_ps(simd::exp8(x), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ));  // -inf: 0
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  if (sink) sum += std::exp(*sink - m);
  const __m256 inv = _mm256_set1_ps(1.0f / sum);
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(_mm256_loadu_ps(s + i), inv));
  for (; i < n; ++i) s[i] *= 1.0f / sum;
}

template <class KT>
void unit(const Args& a, const KT* kc, const KT* vc, const Chunk& ch, const int64_t* order, int64_t j) {
  thread_local std::vector<float> sc, qbuf;
  thread_local std::vector<const void*> ptrs;
  const int64_t G = a.h / a.g, D = a.D, rows = ch.count * G;
  // the keys: union of the chunk's visible ranges
  int64_t klo = INT64_MAX, khi = -1;
  for (int64_t c = 0; c < ch.count; ++c) {
    const int64_t qp = a.pos[order[ch.first + c]];
    klo = std::min(klo, a.window > 0 ? std::max<int64_t>(0, qp - a.window + 1) : int64_t(0));
    khi = std::max(khi, qp);
  }
  const int64_t n = khi - klo + 1, ld = n;
  if (int64_t(qbuf.size()) < rows * D) qbuf.resize(rows * D);
  if (int64_t(sc.size()) < rows * n) sc.resize(rows * n);
  if (int64_t(ptrs.size()) < 2 * n) ptrs.resize(2 * n);
  float* o[64 * TQ];
  const float* sinks[64 * TQ];
  for (int64_t c = 0; c < ch.count; ++c) {
    const int64_t t = order[ch.first + c];
    for (int64_t r = 0; r < G; ++r) {
      const int64_t hd = j * G + r;
      o[c * G + r] = a.out + (t * a.h + hd) * D;
      sinks[c * G + r] = a.sinks ? a.sinks + hd : nullptr;
      const float* src = o[c * G + r];  // step 1's q
      float* dst = qbuf.data() + (c * G + r) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
    }
  }
  const KT** key = reinterpret_cast<const KT**>(ptrs.data());
  const KT** val = key + n;
  const int64_t* table = a.tables + ch.b * a.nb;
  const int64_t row = a.g * D;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t kp = klo + i, at = (table[kp / a.bs] * a.bs + kp % a.bs) * row + j * D;
    key[i] = kc + at;
    val[i] = vc + at;
    if (i < PREFETCH) {
      prefetch_row(key[i], D);
      prefetch_row(val[i], D);
    }
  }
  float* s = sc.data();
  const float* q = qbuf.data();
  int64_t r0 = 0;
  for (; r0 + 2 <= rows; r0 += 2) score_rows<2>(q + r0 * D, D, key, val, n, s + r0 * ld, ld, r0 == 0);
  if (r0 < rows) score_rows<1>(q + r0 * D, D, key, val, n, s + r0 * ld, ld, r0 == 0);
  for (int64_t c = 0; c < ch.count; ++c) {
    const int64_t qp = a.pos[order[ch.first + c]];
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, qp - a.window + 1) : int64_t(0);
    for (int64_t r = 0; r < G; ++r) softmax_row(s + (c * G + r) * ld, n, lo - klo, qp - klo + 1, sinks[c * G + r]);
  }
  for (r0 = 0; r0 < rows; r0 += 4) {
    float* const* orow = o + r0;
    const float* p = s + r0 * ld;
    switch (std::min<int64_t>(4, rows - r0)) {
      case 4: value_rows<4>(p, ld, val, n, D, orow); break;
      case 3: value_rows<3>(p, ld, val, n, D, orow); break;
      case 2: value_rows<2>(p, ld, val, n, D, orow); break;
      default: value_rows<1>(p, ld, val, n, D, orow); break;
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
  // the tokens grouped by sequence (stable), cut into chunks of up to TQ
  thread_local std::vector<int64_t> order;
  thread_local std::vector<Chunk> chunks;
  order.resize(a.T);
  for (int64_t t = 0; t < a.T; ++t) order[t] = t;
  bool sorted = true;
  for (int64_t t = 1; t < a.T; ++t) sorted = sorted && a.seq_of[t - 1] <= a.seq_of[t];
  if (!sorted)
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return a.seq_of[x] < a.seq_of[y]; });
  chunks.clear();
  for (int64_t i = 0; i < a.T;) {
    const int64_t b = a.seq_of[order[i]];
    int64_t e = i;
    while (e < a.T && e - i < TQ && a.seq_of[order[e]] == b) ++e;
    chunks.push_back({b, i, e - i});
    i = e;
  }
  const Chunk* ch = chunks.data();
  const int64_t* ord = order.data();
  pool::run_units(int64_t(chunks.size()) * a.g, [&](int64_t u) { unit(a, kc, vc, ch[u / a.g], ord, u % a.g); });
}

// x [T, n, D] (any strides but the last) or [T, n * D] (rows with heads of D contiguous) -> its
// token and head strides in floats
std::pair<int64_t, int64_t> check_heads(const at::Tensor& x, int64_t T, int64_t n, int64_t D, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && (x.dim() == 3 || x.dim() == 2), "attention: ",
              what, " must be a float32 CPU tensor [T, heads, D] or [T, heads * D]");
  if (x.dim() == 2) {
    TORCH_CHECK(x.size(0) == T && x.size(1) == n * D && x.stride(1) == 1, "attention: ", what, " has shape ",
                x.sizes(), " (strides ", x.strides(), "), expected [", T, ", ", n * D, "] with contiguous rows");
    return {x.stride(0), D};
  }
  TORCH_CHECK(x.size(0) == T && x.size(1) == n && x.size(2) == D, "attention: ", what, " has shape ", x.sizes(),
              ", expected [", T, ", ", n, ", ", D, "]");
  TORCH_CHECK(x.stride(2) == 1, "attention: ", what, ": each head's values must be contiguous");
  return {x.stride(0), x.stride(1)};
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

at::Tensor attention(const at::Tensor& q, const c10::optional<at::Tensor>& k, const c10::optional<at::Tensor>& v,
                     const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps,
                     const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin, at::Tensor k_cache,
                     at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& seq_of_token, const at::Tensor& positions, int64_t window, double scale,
                     const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(k_cache.dim() == 4, "attention: k_cache must be [NB, bs, g, D], got ", k_cache.sizes());
  TORCH_CHECK(q.dim() == 2 || q.dim() == 3, "attention: q must be [T, h, D] or [T, h * D]");
  Args a;
  a.T = q.size(0), a.g = k_cache.size(2), a.D = k_cache.size(3);
  TORCH_CHECK(a.g >= 1 && a.D >= 1 && a.D <= 1024, "attention: k_cache ", k_cache.sizes(),
              ": kv heads >= 1 and head_dim in [1, 1024]");
  TORCH_CHECK(k.has_value() == v.has_value(), "attention: k and v come together (or neither: q is the fused qkv)");
  const bool fused = !k.has_value();  // q = [T, (h + 2g) * D]: each row its q heads, then k, then v
  TORCH_CHECK(!fused || q.dim() == 2, "attention: a fused qkv must be [T, (h + 2 g) * D]");
  a.h = q.dim() == 3 ? q.size(1) : q.size(1) / a.D - (fused ? 2 * a.g : 0);
  TORCH_CHECK(a.h >= 1 && a.h % a.g == 0, "attention: ", a.h, " query heads are not a multiple of ", a.g, " kv heads");
  TORCH_CHECK(a.h / a.g <= 64, "attention: ", a.h / a.g, " query heads per kv head (at most 64)");
  if (fused) {
    check_heads(q, a.T, a.h + 2 * a.g, a.D, "qkv");
    a.q_t = a.k_t = a.v_t = q.stride(0);
    a.q_h = a.k_h = a.v_h = a.D;
  } else {
    std::tie(a.q_t, a.q_h) = check_heads(q, a.T, a.h, a.D, "q");
    std::tie(a.k_t, a.k_h) = check_heads(*k, a.T, a.g, a.D, "k");
    std::tie(a.v_t, a.v_h) = check_heads(*v, a.T, a.g, a.D, "v");
  }
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "attention: k_cache and v_cache must be contiguous CPU tensors of one shape and dtype [NB, bs, g, D]");
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || k_cache.scalar_type() == at::kFloat, "attention: k_cache dtype ", k_cache.scalar_type(),
              " unsupported (float32 or bfloat16)");
  a.NB = k_cache.size(0), a.bs = k_cache.size(1);
  TORCH_CHECK(window >= 0, "attention: window must be >= 0 (0: none), got ", window);
  a.window = window, a.scale = float(scale), a.eps = float(eps);
  a.q = q.data_ptr<float>();
  a.k = fused ? a.q + a.h * a.D : k->data_ptr<float>();
  a.v = fused ? a.q + (a.h + a.g) * a.D : v->data_ptr<float>();
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
  at::Tensor out = at::empty({a.T, a.h * a.D}, q.options().memory_format(at::MemoryFormat::Contiguous));
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

at::Tensor ops::attention(const at::Tensor& q, const c10::optional<at::Tensor>& k, const c10::optional<at::Tensor>& v,
                          const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps,
                          const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                          at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& seq_of_token, const at::Tensor& positions,
                          int64_t window, double scale, const c10::optional<at::Tensor>& sinks) {
  return ::attention(q, k, v, q_norm, k_norm, eps, cos, sin, k_cache, v_cache, slot_mapping, block_tables,
                     seq_of_token, positions, window, scale, sinks);
}

void register_attention(py::module_& m) {
  m.def("attention", &attention,
        "out [T, h * D]: the new tokens' q/k norm + rotary, k/v written into the paged cache, softmax attention "
        "over it through the block table",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_norm"), py::arg("k_norm"), py::arg("eps"), py::arg("cos"),
        py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::arg("block_tables"),
        py::arg("seq_of_token"), py::arg("positions"), py::arg("window"), py::arg("scale"), py::arg("sinks"));
}
