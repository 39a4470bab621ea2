"""`python -m expertcache.kernels`: build the C++ kernels now (`make setup` runs it) and say which backend runs."""

from __future__ import annotations

import sys

from . import backend, why
from .build import cache_dir

if __name__ == "__main__":
    b = backend()
    print(f"expertcache kernels: {b}" + (f" (built in {cache_dir()})" if b == "cpp" else f" ({why()})"))
    sys.exit(0)
