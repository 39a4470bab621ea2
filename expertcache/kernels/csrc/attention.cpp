// Attention over the paged KV cache on the CPU (not yet written: the torch path computes it).
#include "registry.h"

void register_attention(py::module_& m) {}
