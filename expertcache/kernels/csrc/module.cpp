// The Python module: every source's entry points (registry.h).
#include "registry.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "expertcache CPU kernels: y = x W^T from stored bf16/fp16/fp8/int8/int4/mxfp4 bytes, attention, small ops";
  register_expert_kernels(m);
  register_attention(m);
  register_small_ops(m);
  register_decode_block(m);
  register_pool_gemm(m);
  register_planner_core(m);
}
