// The attention half of a MoE decoder layer in one call: what runs between two MoE kernel calls.
//
//   attn_block(h, mlp, input_ln, post_ln, eps, qkv, o, router, math, <attention's arguments>, top_k, renorm)
//     s = h + mlp (h itself when mlp is None)     x = rms_norm(s, input_ln)
//     a = attention(x @ qkv^T) (+ bias; the fused q/k/v split by the kernel)     m = a @ o^T (+ bias)
//     h2 = s + m     x2 = rms_norm(h2, post_ln)     logits = x2 @ router^T (+ bias)
//     -> (s, h2, x2, logits, ids, weights, out): ids / weights the softmax top-k (renormalised when
//        renorm), both None when softmax_topk declines (a near-tie: the caller routes from the logits)
//   moe: None, or the MoE kernel's pool arguments (kernels/__init__.py `moe_args`) of a layer whose
//   slots are its expert ids (every expert resident): then, when the top-k answered, out = the layer's
//   expert FFN of x2 over those experts (the MoE call the caller would make next); else out is None.
//
// Each projection is a tuple (spec, bias or None, small_t, rows_per_unit) as kernels/__init__.py builds
// it. Every step is the function Python would call (ops.h) in the same order, so the results are the
// layer's Python path bit for bit; one call saves the ~7 Python round trips of the layer (each one on
// cold caches, after the weights streamed through them).

#include "ops.h"
#include "registry.h"

namespace {

at::Tensor project(const at::Tensor& x, const py::tuple& p, int64_t math) {
  at::Tensor y = ops::linear(x, p[0].cast<py::tuple>(), 0, p[2].cast<int64_t>(), p[3].cast<int64_t>(), math);
  if (!p[1].is_none()) y = y + p[1].cast<at::Tensor>().to(y.scalar_type());  // as layers/basic.py's linear
  return y;
}

template <class T>
T need(const std::optional<T>& t, const char* what) {
  TORCH_CHECK(t.has_value(), "attn_block: ", what, " needs float32 contiguous CPU tensors");
  return *t;
}

py::tuple attn_block(const at::Tensor& h, const c10::optional<at::Tensor>& mlp, const at::Tensor& input_ln,
                     const at::Tensor& post_ln, double eps, const py::tuple& qkv, const py::tuple& o,
                     const py::tuple& router, int64_t math, const c10::optional<at::Tensor>& q_norm,
                     const c10::optional<at::Tensor>& k_norm, const c10::optional<at::Tensor>& cos,
                     const c10::optional<at::Tensor>& sin, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_of_token,
                     const at::Tensor& positions, int64_t window, double scale, const c10::optional<at::Tensor>& sinks,
                     int64_t top_k, bool renorm, const py::object& moe) {
  at::Tensor s = h, x;
  if (mlp.has_value()) std::tie(s, x) = need(ops::add_rms_norm(h, *mlp, input_ln, eps), "add_rms_norm");
  else x = need(ops::rms_norm(h, input_ln, eps), "rms_norm");
  const at::Tensor a = ops::attention(project(x, qkv, math), c10::nullopt, c10::nullopt, q_norm, k_norm, eps, cos, sin,
                                      k_cache, v_cache, slot_mapping, block_tables, seq_of_token, positions, window,
                                      scale, sinks);
  const at::Tensor m = project(a, o, math);
  const auto [h2, x2] = need(ops::add_rms_norm(s, m, post_ln, eps), "add_rms_norm");
  const at::Tensor logits = project(x2, router, math);
  const auto routed = ops::softmax_topk(logits, top_k, renorm);
  if (!routed.has_value()) return py::make_tuple(s, h2, x2, logits, py::none(), py::none(), py::none());
  const auto& [ids, w] = *routed;
  if (moe.is_none()) return py::make_tuple(s, h2, x2, logits, ids, w, py::none());
  const py::tuple args = moe.cast<py::tuple>();  // (gate, up, down, act, alpha, limit, 3 biases, small_t, rows per unit)
  TORCH_CHECK(args.size() == 11, "attn_block: moe must be the MoE kernel's 11 pool arguments");
  at::Tensor out = at::zeros_like(x2);
  ops::moe(x2, ids, w, args[0].cast<py::tuple>(), args[1].cast<py::tuple>(), args[2].cast<py::tuple>(),
           args[3].cast<int64_t>(), args[4].cast<double>(), args[5].cast<double>(), args[6], args[7], args[8], out,
           args[9].cast<int64_t>(), args[10].cast<int64_t>(), math);
  return py::make_tuple(s, h2, x2, logits, ids, w, out);
}

}  // namespace

void register_decode_block(py::module_& m) {
  m.def("attn_block", &attn_block, "a MoE layer's attention half (norms, projections, attention, router top-k)",
        py::arg("h"), py::arg("mlp"), py::arg("input_ln"), py::arg("post_ln"), py::arg("eps"), py::arg("qkv"),
        py::arg("o"), py::arg("router"), py::arg("math"), py::arg("q_norm"), py::arg("k_norm"), py::arg("cos"),
        py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::arg("block_tables"),
        py::arg("seq_of_token"), py::arg("positions"), py::arg("window"), py::arg("scale"), py::arg("sinks"),
        py::arg("top_k"), py::arg("renorm"), py::arg("moe"));
}
