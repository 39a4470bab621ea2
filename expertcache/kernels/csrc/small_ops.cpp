// Fused small ops of a decode step on the CPU: each replaces a handful of torch ops whose per-op
// overhead (dispatch, allocation, a pass over the data each) is most of their cost at batch 1.
//
//   rms_norm(x [..., H], w [H], eps) -> y [..., H]               y = w * (x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(h, d, w, eps) -> (s, y)                          s = h + d, y = rms_norm(s)
//   row_stats(logits [R, V]) -> (max [R], argmax [R], lse [R], finite [R])
//   softmax_topk(logits [T, E], k, renorm) -> (ids [T, K], w [T, K]) or None (not exact)
//
// All float32 contiguous CPU tensors. rms_norm, add_rms_norm and softmax_topk check that in C++ and
// return None for anything else (the caller then computes with torch): a decode step makes ~50 of
// these calls, and the same checks in Python cost several times the op.
//
// The norm computes as layers/basic.py's torch path does (mean of squares, then the same float
// multiplies in the same order; the mean is accumulated in double, so it can differ from torch's
// float reduction in its last bit). row_stats follows torch.max / argmax (first maximum; a NaN wins,
// the first NaN) / logsumexp / isfinite().all() on every row, finite or not. softmax_topk picks on
// the logits (softmax is monotone) and returns None when a row has a non-finite logit or two of its
// k+1 best logits so close that torch's rounded probabilities could tie or swap: the caller then
// computes with torch, so the chosen experts and their order are always torch's.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "ops.h"
#include "registry.h"
#include "simd_math.h"
#include "thread_pool.h"

namespace {

void check_2d(const at::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous(), fn, ": ",
              name, " must be a contiguous float32 [rows, cols] CPU tensor");
}

// ---- rms_norm ----------------------------------------------------------------------------------------

inline double sumsq(const float* x, int64_t n) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    a0 = _mm256_fmadd_pd(lo, lo, a0);
    a1 = _mm256_fmadd_pd(hi, hi, a1);
  }
  double buf[4];
  _mm256_storeu_pd(buf, _mm256_add_pd(a0, a1));
  double s = (buf[0] + buf[1]) + (buf[2] + buf[3]);
  for (; i < n; ++i) s += double(x[i]) * double(x[i]);
  return s;
}

// y = w * (x * r), r = 1 / sqrt(float(mean(x^2)) + eps): torch's float ops in torch's order
inline void norm_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  const float mean = float(sumsq(x, H) / double(H));
  const float r = 1.f / std::sqrt(mean + eps);
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= H; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
  for (; i < H; ++i) y[i] = w[i] * (x[i] * r);
}

// rows of [T, H] per unit of work: ~64 KiB of x each
inline int64_t rows_per_unit(int64_t H) { return std::max<int64_t>(1, (16384 + H - 1) / H); }

template <class Fn>
void over_rows(int64_t T, int64_t H, const Fn& fn) {
  const int64_t per = rows_per_unit(H), units = (T + per - 1) / per;
  if (units <= 1) {
    for (int64_t t = 0; t < T; ++t) fn(t);
    return;
  }
  pybind11::gil_scoped_release nogil;
  pool::run_units(units, [&](int64_t u) {
    for (int64_t t = u * per, end = std::min(T, t + per); t < end; ++t) fn(t);
  });
}

// x [..., H] and w [H] the float32 contiguous CPU tensors the norms read
bool norm_args(const at::Tensor& x, const at::Tensor& w) {
  return x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() > 0 && x.is_contiguous() &&
         w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 1 && w.is_contiguous() &&
         x.size(-1) == w.size(0);
}

std::optional<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  if (!norm_args(x, w)) return std::nullopt;
  const int64_t H = x.size(-1), T = H ? x.numel() / H : 0;
  at::Tensor y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_rows(T, H, [&](int64_t t) { norm_row(xp + t * H, wp, yp + t * H, H, float(eps)); });
  return y;
}

std::optional<std::tuple<at::Tensor, at::Tensor>> add_rms_norm(const at::Tensor& h, const at::Tensor& d,
                                                               const at::Tensor& w, double eps) {
  if (!norm_args(h, w) || !norm_args(d, w) || h.sizes() != d.sizes()) return std::nullopt;
  const int64_t H = h.size(-1), T = H ? h.numel() / H : 0;
  at::Tensor s = at::empty_like(h), y = at::empty_like(h);
  const float *hp = h.data_ptr<float>(), *dp = d.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = s.data_ptr<float>(), *yp = y.data_ptr<float>();
  over_rows(T, H, [&](int64_t t) {
    const float *a = hp + t * H, *b = dp + t * H;
    float* o = sp + t * H;
    int64_t i = 0;
    for (; i + 8 <= H; i += 8) _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    for (; i < H; ++i) o[i] = a[i] + b[i];
    norm_row(o, wp, yp + t * H, H, float(eps));
  });
  return std::make_tuple(s, y);
}

// ---- row_stats ---------------------------------------------------------------------------------------

// exp(x) for x <= 0 (simd::exp8; below -87.3 it returns ~0, -inf included, and so does NaN here: the
// rows' finiteness is tracked apart)
inline __m256 exp_neg(__m256 x) { return simd::exp8(_mm256_max_ps(x, _mm256_set1_ps(-87.3f))); }

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline double hsum_pd(__m256d v) {
  double b[4];
  _mm256_storeu_pd(b, v);
  return (b[0] + b[1]) + (b[2] + b[3]);
}

constexpr int64_t CHUNK = 1024;       // floats scanned twice while in L1: max, then sum of exp
constexpr int64_t PART = 32 * CHUNK;  // floats of a row per unit of work

struct Part {
  float max = -std::numeric_limits<float>::infinity();
  double sum = 0.0;     // sum of exp(x - max)
  int64_t chunk = -1;   // first chunk holding max
  bool finite = true;
};

// one part of a finite-so-far row, chunk by chunk: the chunk's max (any non-finite value ends it), then
// the running sum rescaled to a new max; exp's argument x - max is rounded to float as torch's is
void scan_part(const float* x, int64_t n, Part& p) {
  const __m256i expo = _mm256_set1_epi32(0x7f800000);
  for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
    const int64_t c1 = std::min(n, c0 + CHUNK);
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256i bad = _mm256_setzero_si256();
    int64_t i = c0;
    for (; i + 8 <= c1; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      mv = _mm256_max_ps(mv, v);
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(v), expo), expo));
    }
    float cm = hmax(mv);
    bool nonfinite = !_mm256_testz_si256(bad, bad);
    for (; i < c1; ++i) {
      nonfinite |= !std::isfinite(x[i]);
      cm = std::max(cm, x[i]);
    }
    if (nonfinite) {
      p.finite = false;
      return;
    }
    if (cm > p.max) {
      p.sum *= std::exp(double(p.max) - double(cm));  // 0 * exp(-inf) = 0 for the first chunk
      p.max = cm;
      p.chunk = c0 / CHUNK;
    }
    const __m256 m = _mm256_set1_ps(p.max);
    // float lanes within a chunk (64 terms each, all <= 1), double across chunks
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (i = c0; i + 16 <= c1; i += 16) {
      s0 = _mm256_add_ps(s0, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
      s1 = _mm256_add_ps(s1, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), m)));
    }
    for (; i + 8 <= c1; i += 8) s0 = _mm256_add_ps(s0, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
    const __m256 sv = _mm256_add_ps(s0, s1);
    double s = hsum_pd(_mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(sv)), _mm256_cvtps_pd(_mm256_extractf128_ps(sv, 1))));
    for (; i < c1; ++i) s += std::exp(double(x[i] - p.max));
    p.sum += s;
  }
}

struct Stats {
  float max, lse;
  int64_t argmax;
  bool finite;
};

// torch's answers for a row with a NaN or an infinity in it (rare: scalar, in double)
Stats slow_row(const float* x, int64_t V) {
  Stats r{-std::numeric_limits<float>::infinity(), 0.f, 0, false};
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(x[i])) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      return {nan, nan, i, false};
    }
    if (x[i] > r.max) r.max = x[i], r.argmax = i;
  }
  if (std::isinf(r.max)) {  // +inf present: logsumexp is +inf; all -inf: -inf
    r.lse = r.max;
    return r;
  }
  double s = 0.0;
  for (int64_t i = 0; i < V; ++i) s += std::exp(double(x[i] - r.max));
  r.lse = float(double(r.max) + std::log(s));
  return r;
}

// first index of the row's max, inside the chunk that first held it
int64_t first_max(const float* x, int64_t V, int64_t chunk, float m) {
  for (int64_t i = chunk * CHUNK, end = std::min(V, i + CHUNK); i < end; ++i)
    if (x[i] == m) return i;
  return chunk * CHUNK;  // unreachable: the chunk holds m
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_stats(const at::Tensor& logits) {
  check_2d(logits, "row_stats", "logits");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "row_stats: logits need at least one column");
  const int64_t parts = (V + PART - 1) / PART;
  std::vector<Part> ps(R * parts);
  const float* xp = logits.data_ptr<float>();
  {
    pybind11::gil_scoped_release nogil;
    pool::run_units(R * parts, [&](int64_t u) {
      const int64_t r = u / parts, p = u % parts, start = p * PART;
      scan_part(xp + r * V + start, std::min(PART, V - start), ps[u]);
    });
  }
  at::Tensor mx = at::empty({R}, logits.options()), lse = at::empty({R}, logits.options());
  at::Tensor am = at::empty({R}, logits.options().dtype(at::kLong)), fin = at::empty({R}, logits.options().dtype(at::kBool));
  for (int64_t r = 0; r < R; ++r) {
    const float* x = xp + r * V;
    const Part* row = ps.data() + r * parts;
    Stats s;
    if (std::all_of(row, row + parts, [](const Part& p) { return p.finite; })) {
      float m = row[0].max;
      for (int64_t p = 1; p < parts; ++p) m = std::max(m, row[p].max);
      double sum = 0.0;
      int64_t first = -1;
      for (int64_t p = 0; p < parts; ++p) {
        sum += row[p].sum * std::exp(double(row[p].max) - double(m));
        if (first < 0 && row[p].max == m) first = p * (PART / CHUNK) + row[p].chunk;
      }
      s = {m, float(double(m) + std::log(sum)), first_max(x, V, first, m), true};
    } else {
      s = slow_row(x, V);
    }
    mx.data_ptr<float>()[r] = s.max;
    lse.data_ptr<float>()[r] = s.lse;
    am.data_ptr<int64_t>()[r] = s.argmax;
    fin.data_ptr<bool>()[r] = s.finite;
  }
  return {mx, am, lse, fin};
}

// ---- softmax_topk --------------------------------------------------------------------------------------

// Relative gap below which two logits count as a possible tie of torch's rounded softmax values:
// exp's argument x - max carries a rounding error of |x - max| * 2^-24 and exp/divide a few ulps more.
constexpr float TIE_GAP = 1e-5f;

// top[0 .. keep) = the row's keep best logits, largest first, the lower index first among equals (the order
// std::partial_sort with that comparison gives), by insertion: keep is top_k + 1, a few of E
inline void best(const float* x, int64_t E, int64_t keep, int64_t* top) {
  int64_t n = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (n == keep && !(x[e] > x[top[keep - 1]])) continue;  // an equal later index stays behind
    int64_t j = n < keep ? n++ : keep - 1;
    for (; j > 0 && x[e] > x[top[j - 1]]; --j) top[j] = top[j - 1];
    top[j] = e;
  }
}

// one row: false where it has a non-finite logit or a near tie among its keep best (the caller's torch path)
inline bool topk_row(const float* x, int64_t E, int64_t k, int64_t keep, bool renorm, int64_t* top, int64_t* ip, float* wp) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t e = 0; e < E; ++e) {
    if (!std::isfinite(x[e])) return false;
    m = std::max(m, x[e]);
  }
  best(x, E, keep, top);
  for (int64_t j = 0; j + 1 < keep; ++j) {
    const float a = x[top[j]], b = x[top[j + 1]];
    if (a - b <= TIE_GAP * (1.f + std::fabs(a - m))) return false;
  }
  double z = 0.0;
  for (int64_t e = 0; e < E; ++e) z += std::exp(double(x[e] - m));
  float total = 0.f;
  for (int64_t j = 0; j < k; ++j) {
    ip[j] = top[j];
    wp[j] = float(std::exp(double(x[top[j]] - m)) / z);
    total += wp[j];
  }
  if (renorm)
    for (int64_t j = 0; j < k; ++j) wp[j] /= total;
  return true;
}

constexpr int64_t TOPK_ROWS = 32;  // rows per unit of the thread pool (a prompt's rows; a decode step's stay on the caller)

std::optional<std::tuple<at::Tensor, at::Tensor>> softmax_topk(const at::Tensor& logits, int64_t k, bool renorm) {
  if (!logits.device().is_cpu() || logits.scalar_type() != at::kFloat || logits.dim() != 2 || !logits.is_contiguous())
    return std::nullopt;
  const int64_t T = logits.size(0), E = logits.size(1);
  if (k < 1 || k > E) return std::nullopt;
  at::Tensor ids = at::empty({T, k}, logits.options().dtype(at::kLong)), w = at::empty({T, k}, logits.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = w.data_ptr<float>();
  const int64_t keep = std::min(k + 1, E);  // the k best and the first one left out
  std::atomic<bool> ok{true};
  auto rows = [&](int64_t u) {
    std::vector<int64_t> top(keep);
    for (int64_t t = u * TOPK_ROWS; t < std::min(T, (u + 1) * TOPK_ROWS) && ok.load(std::memory_order_relaxed); ++t)
      if (!topk_row(lp + t * E, E, k, keep, renorm, top.data(), ip + t * k, wp + t * k)) ok.store(false);
  };
  const int64_t units = (T + TOPK_ROWS - 1) / TOPK_ROWS;
  if (units == 1) rows(0);
  else pool::run_units(units, rows);
  if (!ok.load()) return std::nullopt;
  return std::make_tuple(ids, w);
}

}  // namespace

std::optional<at::Tensor> ops::rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return ::rms_norm(x, w, eps);
}
std::optional<std::tuple<at::Tensor, at::Tensor>> ops::add_rms_norm(const at::Tensor& h, const at::Tensor& d,
                                                                    const at::Tensor& w, double eps) {
  return ::add_rms_norm(h, d, w, eps);
}
std::optional<std::tuple<at::Tensor, at::Tensor>> ops::softmax_topk(const at::Tensor& logits, int64_t k, bool renorm) {
  return ::softmax_topk(logits, k, renorm);
}

void register_small_ops(py::module_& m) {
  m.def("rms_norm", &rms_norm, "y = w * (x * rsqrt(mean(x^2) + eps)) over the rows of x [..., H], or None", py::arg("x"),
        py::arg("w"), py::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "(s, rms_norm(s)) with s = h + d, or None", py::arg("h"), py::arg("d"), py::arg("w"),
        py::arg("eps"));
  m.def("row_stats", &row_stats, "(max, argmax, logsumexp, all finite) of each row of logits [R, V]",
        py::arg("logits"));
  m.def("softmax_topk", &softmax_topk, "(ids, weights): top-k of softmax(logits [T, E]), renormalised; None: not exact",
        py::arg("logits"), py::arg("k"), py::arg("renorm"));
}
