// The bf16 matmul of prefill (kernels/prefill_gemm.py) on the kernels' own threads.
//
// y = x W^T for x [T, K] and W [N, K], both bf16: W's rows are split into blocks of ROWS, and each block
// is one at::mm (oneDNN's bf16 matmul) into its rows of y^T [N, T], taken as a unit of the kernels' pool
// (thread_pool.h) by whichever thread is running. Inside a forward torch runs on one thread
// (kernels.cpu_threads), so each at::mm is single-threaded: torch's OpenMP team is not used. That team
// ends every call at a barrier that waits for all its threads; on a shared machine one descheduled
// thread stalls the whole matmul (2 threads, 1024 x 2880 at 128 tokens, a niced test run on the other
// core: 1.5 ms at best, 17-26 ms median), where the pool's units are simply taken by the threads that run.
//
// The experts of a MoE layer at prefill (experts/prefill.py) likewise: each expert one unit, its two
// matmuls single-threaded on the thread that takes it, so the layer's experts run side by side with no
// OpenMP barrier and no Python between them.
//
// Shape legend: x [T, K] bf16, w [N, K] bf16 (contiguous rows) -> y [T, N] float32 (the bf16 products,
// each unit's [n, T] block transposed into its columns). Experts: x [T, H] float32, slots [T, Kr] int64
// (-1: none), weights [T, Kr] float32, gate_up [S, 2I, H] and down [S, H, I] bf16, take [S] bool,
// out [T, H] float32.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <vector>

#include "registry.h"
#include "thread_pool.h"

namespace {

constexpr int64_t ROWS = 256;  // rows of W per unit: several units per thread, each a few hundred us at T >= 16

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_bf16: x [T, K] and w [N, K], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && x.is_cpu() && w.is_cpu(),
              "linear_bf16: bf16 CPU tensors");
  const at::Tensor wc = w.contiguous(), xt = x.t();  // xt [K, T]: a view, as F.linear passes it
  const int64_t N = wc.size(0), T = x.size(0);
  at::Tensor y = at::empty({T, N}, x.options().dtype(at::kFloat));
  if (N == 0 || T == 0) return y;
  pool::run_units((N + ROWS - 1) / ROWS, [&](int64_t u) {
    c10::InferenceMode guard;  // thread-local: the pool's threads start without the caller's mode
    const int64_t n0 = u * ROWS, n = std::min(ROWS, N - n0);
    // the block's [n, T] products, then its columns of y in float32 (transposed here, on this thread,
    // while the block is in cache: a transposing copy of all of y afterwards took as long as the matmul)
    y.narrow(1, n0, n).copy_(at::mm(wc.narrow(0, n0, n), xt).t());
  });
  return y;
}

// out[t] += sum over k (in order) of weights[t, k] * expert_{slots[t, k]}(x[t]) for the pairs whose slot is
// taken: x rounded to bf16, gate_up's output rounded to bf16 (oneDNN, float32 sums), SiLU(gate) * up in
// float32 (interleaved: gate the even rows), rounded to bf16, down's output rounded to bf16, times the
// pair's weight in float32; the numerics of experts/prefill.py's bf16_expert. Each expert is a unit
// writing its pairs' rows of a [pairs, H] buffer; the rows are then added per token in k order, so the
// result does not depend on which thread took which expert.
void experts_bf16(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& weights, const at::Tensor& gate_up,
                  const at::Tensor& down, const at::Tensor& take, bool interleaved, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "experts_bf16: x [T, H] float32");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == T && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "experts_bf16: slots [T, top_k] int64");
  const int64_t Kr = slots.size(1);
  TORCH_CHECK(weights.sizes() == slots.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "experts_bf16: weights [T, top_k] float32");
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous() &&
                  gate_up.size(2) == H && gate_up.size(1) % 2 == 0,
              "experts_bf16: gate_up [S, 2I, H] bf16, got ", gate_up.sizes());
  const int64_t S = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(down.dim() == 3 && down.scalar_type() == at::kBFloat16 && down.is_contiguous() && down.size(0) == S &&
                  down.size(1) == H && down.size(2) == I,
              "experts_bf16: down [S, H, I] bf16, got ", down.sizes());
  TORCH_CHECK(take.dim() == 1 && take.size(0) == S && take.scalar_type() == at::kBool, "experts_bf16: take [S] bool");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "experts_bf16: out [T, H] float32");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const bool* tk = take.data_ptr<bool>();
  std::vector<std::vector<int64_t>> pairs(S);  // per slot: t * Kr + k of its taken pairs, in order
  std::vector<int64_t> row(T * Kr, -1);        // pair -> its row of y
  int64_t rows = 0;
  for (int64_t p = 0; p < T * Kr; ++p)
    if (sl[p] >= 0 && sl[p] < S && tk[sl[p]]) pairs[sl[p]].push_back(p), row[p] = rows++;
  std::vector<int64_t> experts;
  for (int64_t s = 0; s < S; ++s)
    if (!pairs[s].empty()) experts.push_back(s);
  if (experts.empty()) return;
  at::Tensor y = at::empty({rows, H}, x.options());
  const float* wt = weights.data_ptr<float>();
  pool::run_units(static_cast<int64_t>(experts.size()), [&](int64_t u) {
    c10::InferenceMode guard;
    const int64_t s = experts[u];
    const std::vector<int64_t>& ps = pairs[s];
    const int64_t n = static_cast<int64_t>(ps.size());
    at::Tensor tok = at::empty({n}, slots.options());
    int64_t* tp = tok.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) tp[i] = ps[i] / Kr;
    const at::Tensor xb = x.index_select(0, tok).to(at::kBFloat16);
    const at::Tensor gu = at::mm(xb, gate_up[s].t());  // [n, 2I] bf16
    const at::Tensor g = interleaved ? gu.slice(1, 0, 2 * I, 2) : gu.narrow(1, 0, I);
    const at::Tensor up = interleaved ? gu.slice(1, 1, 2 * I, 2) : gu.narrow(1, I, I);
    const at::Tensor h = (at::silu(g.to(at::kFloat)) * up.to(at::kFloat)).to(at::kBFloat16);
    const at::Tensor yd = at::mm(h, down[s].t()).to(at::kFloat).contiguous();  // [n, H]
    const float* src = yd.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      float* dst = y.data_ptr<float>() + row[ps[i]] * H;
      const float w = wt[ps[i]];
      for (int64_t c = 0; c < H; ++c) dst[c] = src[i * H + c] * w;
    }
  });
  constexpr int64_t TOKENS = 16;  // tokens per unit of the sum
  pool::run_units((T + TOKENS - 1) / TOKENS, [&](int64_t u) {
    for (int64_t t = u * TOKENS; t < std::min(T, (u + 1) * TOKENS); ++t) {
      float* o = out.data_ptr<float>() + t * H;
      for (int64_t k = 0; k < Kr; ++k) {
        const int64_t r = row[t * Kr + k];
        if (r < 0) continue;
        const float* src = y.data_ptr<float>() + r * H;
        for (int64_t c = 0; c < H; ++c) o[c] += src[c];
      }
    }
  });
}

}  // namespace

void register_pool_gemm(py::module_& m) {
  m.def("experts_bf16", &experts_bf16, "out [T, H] += the taken slots' experts (bf16 matmuls, SiLU) on the kernels' threads",
        py::arg("x"), py::arg("slots"), py::arg("weights"), py::arg("gate_up"), py::arg("down"), py::arg("take"),
        py::arg("interleaved"), py::arg("out"));
  m.def("linear_bf16", &linear_bf16, "y [T, N] float32 = x [T, K] @ w [N, K]^T in bf16 (outputs rounded to bf16), w's row blocks on the kernels' threads",
        py::arg("x"), py::arg("w"));
}
