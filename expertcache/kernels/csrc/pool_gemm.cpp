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
// Shape legend: x [T, K] bf16, w [N, K] bf16 (contiguous rows) -> y [T, N] bf16 (a transposed view of
// the [N, T] result).
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

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
  at::Tensor yt = at::empty({N, T}, x.options());
  if (N == 0 || T == 0) return yt.t();
  pool::run_units((N + ROWS - 1) / ROWS, [&](int64_t u) {
    c10::InferenceMode guard;  // thread-local: the pool's threads start without the caller's mode
    const int64_t n0 = u * ROWS, n = std::min(ROWS, N - n0);
    at::Tensor out = yt.narrow(0, n0, n);
    at::mm_out(out, wc.narrow(0, n0, n), xt);
  });
  return yt.t();
}

}  // namespace

void register_pool_gemm(py::module_& m) {
  m.def("linear_bf16", &linear_bf16, "y [T, N] = x [T, K] @ w [N, K]^T in bf16, w's row blocks on the kernels' threads",
        py::arg("x"), py::arg("w"));
}
