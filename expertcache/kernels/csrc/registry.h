// The extension is one module built from every csrc/*.cpp: each source defines its entry points in a
// register_<file>(m) function, and module.cpp calls them all. A new source adds its function here and
// one line in module.cpp.
#pragma once

#include <torch/extension.h>

void register_expert_kernels(py::module_& m);  // expert_kernels.cpp: y = x W^T from stored bytes, grouped MoE
void register_attention(py::module_& m);       // attention.cpp: attention over the paged KV cache
void register_small_ops(py::module_& m);       // small_ops.cpp: fused norms and per-token helpers
void register_decode_block(py::module_& m);    // decode_block.cpp: a MoE layer's attention half in one call
void register_pool_gemm(py::module_& m);       // pool_gemm.cpp: prefill's bf16 matmul on the kernels' threads
void register_planner_core(py::module_& m);    // planner_core.cpp: the step planner's policies (experts/policy.py)
