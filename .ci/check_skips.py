"""Fail CI when a test that must run here was skipped.

    python .ci/check_skips.py JUNIT_XML

Reads the junit report `make test` writes and prints every skip with its reason. A skip is allowed
only for a reason in ALLOWED: the `gpu` marker (no CUDA device in CI) and CPU features this machine
may lack. Anything else (a missing dependency, a missing data file, a data-dependent skip) fails.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

ALLOWED = (
    "needs a CUDA device",  # tests/conftest.py: the gpu marker
    "the fast CPU math needs the C++ kernels and AVX-512 BF16/VNNI",  # test_fast_math: CPU without them
    "needs the C++ kernels on a CPU without AVX-512 BF16/VNNI",  # test_fast_math: CPU with them
    "no transparent huge pages on this machine",  # test_hostmem: kernel without THP
    "needs a CPU with AMX-TILE/INT8 whose OS grants the tile state",  # test_kernels_nibble_strips: CPU without AMX
    "llama.cpp's converter absent (bench/peers: EXPERTCACHE_LLAMA_CPP)",  # test_gguf_converter: an optional peer
    "llama.cpp's llama-quantize absent (bench/peers: EXPERTCACHE_LLAMA_QUANTIZE)",  # test_gguf_converter: likewise
)


def main(path: str) -> int:
    bad, allowed = [], 0
    for case in ET.parse(path).getroot().iter("testcase"):
        skip = case.find("skipped")
        if skip is None:
            continue
        reason = skip.get("message", "").removeprefix("Skipped: ").strip()
        name = f"{case.get('classname')}::{case.get('name')}"
        if reason == "collection skipped":  # a whole module: (path, line, reason) in the text
            name, reason = "module", (skip.text or "").strip()
        if reason in ALLOWED:
            allowed += 1
        else:
            bad.append(f"{name}: {reason}")
    print(f"skips: {allowed} allowed (gpu marker, CPU features), {len(bad)} not allowed")
    for line in bad:
        print(f"  not allowed: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
