// Fused small ops of a decode step on the CPU (not yet written: the torch path computes them).
#include "registry.h"

void register_small_ops(py::module_& m) {}
