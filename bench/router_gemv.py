"""A decode step's router GEMVs through the kernels: float32 weights of Qwen3-30B-A3B's router shape
(128 x 2048, as every GGUF file stores `ffn_gate_inp`), 96 of them (96 MB, past the caches), one token,
at each --rows rows per unit of work (kernels/__init__.py UNIT_ROWS for code 0), alternated round by round.

    python bench/router_gemv.py [--rows 128 32] [--rounds 7] [--threads 2]

One line per rows setting: GB/s of the weights' bytes (median of rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import hardware_line

import expertcache.kernels as K
from expertcache.kernels.formats import plain_spec

N, H, WEIGHTS = 128, 2048, 96


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 32])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(N, H, generator=g) for _ in range(WEIGHTS)]
    specs = [plain_spec(w.unsqueeze(0)) for w in ws]
    x = torch.randn(1, H, generator=g)
    ext = K.extension()
    print(hardware_line())
    res = {r: [] for r in a.rows}
    for r in range(a.rounds + 1):  # round 0: warm-up
        for rows in a.rows if r % 2 else a.rows[::-1]:
            with K.cpu_threads("cpu"):
                t0 = time.perf_counter()
                for s in specs:
                    ext.linear(x, s, 0, 1 << 30, rows, 0)
                dt = time.perf_counter() - t0
            if r:
                res[rows].append(WEIGHTS * N * H * 4 / dt / 1e9)
    for rows, v in res.items():
        print(
            f"router: shape={N}x{H} dtype=float32 tokens=1 threads={a.threads} rows_per_unit={rows} "
            f"GBps={statistics.median(v):.1f} rounds={a.rounds}"
        )


if __name__ == "__main__":
    main()
