// The entry points one source calls from another (decode_block.cpp composes them into one call per
// layer). Each is the function Python calls under the same name (registry.h), with its contract.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

namespace ops {

// expert_kernels.cpp: y [..., N] = x [..., K] @ W[slot]^T for a kernel spec (kernels/formats.py)
at::Tensor linear(const at::Tensor& x, const py::tuple& spec, int64_t slot, int64_t small_t, int64_t rows_per_unit,
                  int64_t math);

// expert_kernels.cpp: out [T, H] += the grouped expert FFN of one MoE layer (kernels/__init__.py `moe`)
void moe(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& weights, const py::tuple& gate_spec,
         const py::tuple& up_spec, const py::tuple& down_spec, int64_t act, double alpha, double limit,
         const py::object& gate_bias, const py::object& up_bias, const py::object& down_bias, at::Tensor& out,
         int64_t small_t, int64_t rows_per_unit, int64_t math);

// attention.cpp: the new tokens' attention over the paged cache (k = v = None: q is the fused qkv)
at::Tensor attention(const at::Tensor& q, const c10::optional<at::Tensor>& k, const c10::optional<at::Tensor>& v,
                     const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps,
                     const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin, at::Tensor k_cache,
                     at::Tensor v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& seq_of_token, const at::Tensor& positions, int64_t window, double scale,
                     const c10::optional<at::Tensor>& sinks);

// small_ops.cpp: None where the op does not apply (not float32 contiguous CPU tensors; softmax_topk: a
// near-tie or a non-finite logit)
std::optional<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::optional<std::tuple<at::Tensor, at::Tensor>> add_rms_norm(const at::Tensor& h, const at::Tensor& d,
                                                               const at::Tensor& w, double eps);
std::optional<std::tuple<at::Tensor, at::Tensor>> softmax_topk(const at::Tensor& logits, int64_t k, bool renorm);

}  // namespace ops
