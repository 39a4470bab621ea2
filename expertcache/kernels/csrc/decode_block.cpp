// The attention half of a MoE decoder layer in one call: what runs between two MoE kernel calls.
//
//   attn_block(h, mlp, input_ln, post_ln, eps, qkv, o, router, math, <attention's arguments>, top_k, renorm)
//     s = h + mlp (h itself when mlp is None)     x = rms_norm(s, input_ln)
//     a = attention(x @ qkv^T) (+ bias; the fused q/k/v split by the kernel)     m = a @ o^T (+ bias)
//     (qkv one projection, or a list of them, q's, k's and v's, their outputs side by side: a file's q/k/v
//     in different types)
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
//
//   attn_stack(h, mlp, layers, kv, step, eps, math, start, with_moe): consecutive layers' blocks in
//   one call, each layer's MoE inside its block, until a layer needs Python for its MoE (see below):
//   saves the Python between two layers' blocks (~45 us a layer on the yardstick, on cold caches).

#include "ops.h"
#include "registry.h"

namespace {

at::Tensor project(const at::Tensor& x, const py::tuple& p, int64_t math) {
  at::Tensor y = ops::linear(x, p[0].cast<py::tuple>(), 0, p[2].cast<int64_t>(), p[3].cast<int64_t>(), math);
  if (!p[1].is_none()) y = y + p[1].cast<at::Tensor>().to(y.scalar_type());  // as layers/basic.py's linear
  return y;
}

// x @ qkv^T: one projection, or a list of projections whose outputs are joined by column
at::Tensor project_qkv(const at::Tensor& x, const py::object& qkv, int64_t math) {
  if (!py::isinstance<py::list>(qkv)) return project(x, qkv.cast<py::tuple>(), math);
  std::vector<at::Tensor> parts;
  for (const auto& p : qkv.cast<py::list>()) parts.push_back(project(x, p.cast<py::tuple>(), math));
  return at::cat(parts, 1);
}

template <class T>
T need(const std::optional<T>& t, const char* what) {
  TORCH_CHECK(t.has_value(), "attn_block: ", what, " needs float32 contiguous CPU tensors");
  return *t;
}

c10::optional<at::Tensor> opt(const py::handle& o) {
  return o.is_none() ? c10::nullopt : c10::optional<at::Tensor>(o.cast<at::Tensor>());
}

py::object or_none(const c10::optional<at::Tensor>& t) { return t.has_value() ? py::cast(*t) : py::none(); }

struct Block {  // one layer's results; ids / w / out as attn_block returns them
  at::Tensor s, h2, x2, logits;
  c10::optional<at::Tensor> ids, w, out;
};

Block block(const at::Tensor& h, const c10::optional<at::Tensor>& mlp, const at::Tensor& input_ln,
            const at::Tensor& post_ln, double eps, const py::object& qkv, const py::tuple& o, const py::tuple& router,
            int64_t math, const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
            const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin, at::Tensor k_cache,
            at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
            const at::Tensor& seq_of_token, const at::Tensor& positions, int64_t window, double scale,
            const c10::optional<at::Tensor>& sinks, int64_t top_k, bool renorm, const py::object& moe) {
  Block r;
  at::Tensor x;
  r.s = h;
  if (mlp.has_value()) std::tie(r.s, x) = need(ops::add_rms_norm(h, *mlp, input_ln, eps), "add_rms_norm");
  else x = need(ops::rms_norm(h, input_ln, eps), "rms_norm");
  const at::Tensor a = ops::attention(project_qkv(x, qkv, math), c10::nullopt, c10::nullopt, q_norm, k_norm, eps, cos, sin,
                                      k_cache, v_cache, slot_mapping, block_tables, seq_of_token, positions, window,
                                      scale, sinks);
  const at::Tensor m = project(a, o, math);
  std::tie(r.h2, r.x2) = need(ops::add_rms_norm(r.s, m, post_ln, eps), "add_rms_norm");
  r.logits = project(r.x2, router, math);
  const auto routed = ops::softmax_topk(r.logits, top_k, renorm);
  if (!routed.has_value()) return r;
  r.ids = std::get<0>(*routed);
  r.w = std::get<1>(*routed);
  if (moe.is_none()) return r;
  const py::tuple args = moe.cast<py::tuple>();  // (gate, up, down, act, alpha, limit, 3 biases, small_t, rows per unit)
  TORCH_CHECK(args.size() == 11, "attn_block: moe must be the MoE kernel's 11 pool arguments");
  at::Tensor out = at::zeros_like(r.x2);
  ops::moe(r.x2, *r.ids, *r.w, args[0].cast<py::tuple>(), args[1].cast<py::tuple>(), args[2].cast<py::tuple>(),
           args[3].cast<int64_t>(), args[4].cast<double>(), args[5].cast<double>(), args[6], args[7], args[8], out,
           args[9].cast<int64_t>(), args[10].cast<int64_t>(), math);
  r.out = out;
  return r;
}

py::tuple attn_block(const at::Tensor& h, const c10::optional<at::Tensor>& mlp, const at::Tensor& input_ln,
                     const at::Tensor& post_ln, double eps, const py::object& qkv, const py::tuple& o,
                     const py::tuple& router, int64_t math, const c10::optional<at::Tensor>& q_norm,
                     const c10::optional<at::Tensor>& k_norm, const c10::optional<at::Tensor>& cos,
                     const c10::optional<at::Tensor>& sin, at::Tensor k_cache, at::Tensor v_cache,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_of_token,
                     const at::Tensor& positions, int64_t window, double scale, const c10::optional<at::Tensor>& sinks,
                     int64_t top_k, bool renorm, const py::object& moe) {
  const Block r = block(h, mlp, input_ln, post_ln, eps, qkv, o, router, math, q_norm, k_norm, cos, sin, k_cache,
                        v_cache, slot_mapping, block_tables, seq_of_token, positions, window, scale, sinks, top_k,
                        renorm, moe);
  return py::make_tuple(r.s, r.h2, r.x2, r.logits, or_none(r.ids), or_none(r.w), or_none(r.out));
}

// Consecutive layers' blocks in one call, from layer `start` on, each layer's MoE inside its block:
// layer i + 1 starts from h2 and out of layer i. It returns after the first layer whose MoE did not
// run inside (no moe arguments, with_moe false, or a declined top-k), or after the last layer:
//   -> (stop, sums, s, h2, x2, logits, ids, w, out) of layer `stop`; sums: s of every layer run that
//      had an mlp to add (layer start's only when mlp was given), in layer order.
// layers[i] = (input_ln, post_ln, qkv, o, router, q_norm, k_norm, window, scale, sinks, top_k, renorm,
// moe), kv[i] = (k_cache, v_cache), step = (cos, sin, slot_mapping, block_tables, seq_of_token, positions).
py::tuple attn_stack(const at::Tensor& h_in, const c10::optional<at::Tensor>& mlp_in, const py::list& layers,
                     const py::list& kv, const py::tuple& step, double eps, int64_t math, int64_t start,
                     bool with_moe) {
  const int64_t n = layers.size();
  TORCH_CHECK(0 <= start && start < n && int64_t(kv.size()) == n && step.size() == 6,
              "attn_stack: start must index the layers, one kv pair per layer, a step of 6 tensors");
  const c10::optional<at::Tensor> cos = opt(step[0]), sin = opt(step[1]);
  const at::Tensor slot_mapping = step[2].cast<at::Tensor>(), block_tables = step[3].cast<at::Tensor>(),
                   seq_of_token = step[4].cast<at::Tensor>(), positions = step[5].cast<at::Tensor>();
  at::Tensor h = h_in;
  c10::optional<at::Tensor> mlp = mlp_in;
  py::list sums;
  for (int64_t i = start;; ++i) {
    const py::tuple L = layers[i].cast<py::tuple>();
    const py::tuple c = kv[i].cast<py::tuple>();
    TORCH_CHECK(L.size() == 13 && c.size() == 2, "attn_stack: layer ", i, " needs 13 arguments and a kv pair");
    const Block r = block(h, mlp, L[0].cast<at::Tensor>(), L[1].cast<at::Tensor>(), eps, L[2].cast<py::object>(),
                          L[3].cast<py::tuple>(), L[4].cast<py::tuple>(), math, opt(L[5]), opt(L[6]), cos, sin,
                          c[0].cast<at::Tensor>(), c[1].cast<at::Tensor>(), slot_mapping, block_tables, seq_of_token,
                          positions, L[7].cast<int64_t>(), L[8].cast<double>(), opt(L[9]), L[10].cast<int64_t>(),
                          L[11].cast<bool>(), with_moe ? py::object(L[12]) : py::object(py::none()));
    if (mlp.has_value()) sums.append(r.s);
    if (!r.out.has_value() || i + 1 == n)
      return py::make_tuple(i, sums, r.s, r.h2, r.x2, r.logits, or_none(r.ids), or_none(r.w), or_none(r.out));
    h = r.h2;
    mlp = r.out;
  }
}

}  // namespace

void register_decode_block(py::module_& m) {
  m.def("attn_block", &attn_block, "a MoE layer's attention half (norms, projections, attention, router top-k)",
        py::arg("h"), py::arg("mlp"), py::arg("input_ln"), py::arg("post_ln"), py::arg("eps"), py::arg("qkv"),
        py::arg("o"), py::arg("router"), py::arg("math"), py::arg("q_norm"), py::arg("k_norm"), py::arg("cos"),
        py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), py::arg("block_tables"),
        py::arg("seq_of_token"), py::arg("positions"), py::arg("window"), py::arg("scale"), py::arg("sinks"),
        py::arg("top_k"), py::arg("renorm"), py::arg("moe"));
  m.def("attn_stack", &attn_stack, "consecutive layers' blocks, each MoE inside, until one needs Python",
        py::arg("h"), py::arg("mlp"), py::arg("layers"), py::arg("kv"), py::arg("step"), py::arg("eps"),
        py::arg("math"), py::arg("start"), py::arg("with_moe"));
}
