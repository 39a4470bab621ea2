"""Prefill on the CPU's matrix units: under `--cpu-math fast`, a weight multiplied by many tokens at once
goes to torch's bf16 matmul (oneDNN: AVX-512 BF16, AMX on Sapphire Rapids and later) instead of the C++
kernels, from a token count measured per shape class on this machine (the crossover).

Shape legend:
    T tokens of one weight (a dense projection's rows, or the tokens routed to one expert)
    N x K a weight [out, in]; an expert: I intermediate, H hidden

A shape class is (what, format, N, K): "dense" (one bf16 weight [N, K]) or "expert" (one expert's whole
FFN, gate_up [2I, H] + down [H, I], its weights converted to bf16 once per use where stored otherwise).
Its crossover is the smallest T of PROBE_T at which the matmul measured faster than the kernel, measured
at T = PROBE_T[-1] first (not faster there: NEVER) and then downwards until it is not (the kernel's time
grows with T no slower than the matmul's). It is measured at the first use of the class, on at most
PROBE_ROWS rows of the weight, with the thread count a forward gives both (the kernels' threads), and
kept in memory and in `<cache_root>/prefill_gemm.json` under a hardware key (CPU model, threads, torch
version, the C++ kernels' build): a machine measures each class once per build of the kernels. A damaged
file is measured again.

Within a forward on several threads the matmul runs on the kernels' own threads, W's row blocks each a
single-threaded oneDNN matmul (csrc/pool_gemm.cpp): torch's OpenMP team ends each call at a barrier that
waits for every thread, and on a shared machine a descheduled one stalled the whole product (2 threads,
1024 x 2880 at 128 tokens beside a niced test run: 1.5 ms at best, 17-26 ms median). The price on a quiet
machine (`python bench/pool_matmul.py`, 5120 x 2880, 2 threads, medians): 25.9 against OpenMP's 19.6 ms at
512 tokens, level at 32-128 (6.8 / 6.3 ms at 128). Its products equal torch's bitwise.

The matmul returns bf16 (torch's CPU bf16 matmul has no float32 output), so its outputs are rounded to
bf16 on top of what fast math already rounds (activations to bf16): allowed only under fast math.
EXPERTCACHE_PREFILL_GEMM=0 (or `enable(False)`) keeps every weight on the C++ kernels.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from functools import lru_cache

import torch
import torch.nn.functional as F

from ..cost.measure import cpu_name
from ..paths import cache_root
from .build import cache_dir, extension

ENV = "EXPERTCACHE_PREFILL_GEMM"
PROBE_T = (16, 32, 64, 128, 256, 512)  # token counts measured; below the first the kernels always compute
MIN_T = PROBE_T[0]
NEVER = 1 << 30  # the crossover of a class where the matmul never measured faster
PROBE_ROWS = 1024  # rows of a weight (its out dim) the measurement uses at most: time per row is ~constant
PROBE_REPS = 3  # best of, per method and T

_on = [os.environ.get(ENV, "1") != "0"]
_threads = [0]  # the kernels' thread count within a forward (kernels.cpu_threads), 0 outside one
_fixed: list[int | None] = [None]  # a crossover every class takes (tests, benchmarks), None: measured
_table: dict[str, int] = {}  # class key -> crossover, for this hardware key
_loaded = [""]  # the hardware key _table was read for
CALLS = {"dense": 0, "expert": 0}  # calls that took the matmul (benchmarks and tests read them)


def enable(on: bool) -> None:
    """Turn the path on (the default unless EXPERTCACHE_PREFILL_GEMM=0) or off for this process."""
    _on[0] = bool(on)


def enabled() -> bool:
    return _on[0]


@contextmanager
def fixed_crossover(t: int | None):
    """Within: every shape class's crossover is `t` (no measurement); None: measured as usual."""
    saved = _fixed[0]
    _fixed[0] = t
    try:
        yield
    finally:
        _fixed[0] = saved


def set_forward_threads(n: int) -> None:
    """The kernels' thread count within a forward (kernels.cpu_threads sets it; 0 outside one)."""
    _threads[0] = n


@contextmanager
def gemm_threads():
    """Around a matmul within a forward: torch on the kernels' thread count (kernels.cpu_threads puts
    torch's own ops on one thread), restored afterwards."""
    n, saved = _threads[0], torch.get_num_threads()
    if n <= 1 or n == saved:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@lru_cache(maxsize=1)
def _cpu_name() -> str:
    return cpu_name()


@lru_cache(maxsize=1)
def _kernels_build() -> str:
    return cache_dir().name  # named by the hash of the kernels' sources and flags


def hardware_key() -> str:
    """What a crossover depends on beside the shape: the CPU model, the thread count, torch's version and
    the C++ kernels' build (a faster kernel moves the crossover)."""
    threads = _threads[0] or torch.get_num_threads()
    return f"{_cpu_name()}|threads={threads}|torch={torch.__version__}|kernels={_kernels_build()}"


def cache_file():
    return cache_root() / "prefill_gemm.json"


def _read_file() -> dict:
    try:
        saved = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def _entries(key: str) -> dict[str, int]:
    if _loaded[0] != key:
        entry = _read_file().get(key)
        _table.clear()
        if isinstance(entry, dict):
            _table.update({k: v for k, v in entry.items() if isinstance(v, int) and v > 0})
        _loaded[0] = key
    return _table


def _save(key: str) -> None:
    saved = _read_file()
    saved[key] = dict(_table)
    try:
        path = cache_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(saved, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: measured again by the next process


def table() -> dict[str, int]:
    """The crossovers known for this machine (class key -> T; NEVER: the kernels at every T)."""
    return dict(_entries(hardware_key()))


def class_key(what: str, fmt: str, n: int, k: int) -> str:
    return f"{what}|{fmt}|{n}x{k}"


def _best(fn, t: int) -> float:
    fn(t)  # warm-up
    best = float("inf")
    for _ in range(PROBE_REPS):
        t0 = time.perf_counter()
        fn(t)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(kernel_fn, gemm_fn) -> tuple[int, dict]:
    """The crossover of kernel_fn(T) vs gemm_fn(T) (each computing T tokens) -> (T or NEVER, {T: (kernel s,
    gemm s)} of the token counts measured)."""
    times, cross = {}, NEVER
    for t in reversed(PROBE_T):
        times[t] = (_best(kernel_fn, t), _best(gemm_fn, t))
        if times[t][1] >= times[t][0]:
            break
        cross = t
    return cross, times


def crossover(what: str, fmt: str, n: int, k: int, probe) -> int:
    """The crossover of a shape class; at its first use on this machine probe() -> (kernel_fn, gemm_fn)
    is measured (measure()) and the figure cached."""
    if _fixed[0] is not None:
        return _fixed[0]
    hw = hardware_key()
    table = _entries(hw)
    name = class_key(what, fmt, n, k)
    if name not in table:
        with torch.no_grad():
            table[name] = measure(*probe())[0]
        _save(hw)
    return table[name]


def takes(t: int, what: str, fmt: str, n: int, k: int, probe) -> bool:
    """Whether T tokens of a weight of shape class (what, fmt, n, k) go to the bf16 matmul (the caller
    checks fast math)."""
    return _on[0] and t >= MIN_T and t >= crossover(what, fmt, n, k, probe)


def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 @ w [N, K] bf16 ^T -> float32 [..., N]: x rounded to bf16, products summed in
    float32 by oneDNN, the output rounded to bf16. Within a forward on several threads, w's row blocks
    run as single-threaded matmuls on the kernels' own threads (csrc/pool_gemm.cpp: no OpenMP barrier
    waiting on a descheduled thread); elsewhere torch's matmul on its threads."""
    xb = x.to(torch.bfloat16)
    ext = extension()
    if _threads[0] > 1 and ext is not None and w.is_contiguous():
        return ext.linear_bf16(xb.reshape(-1, w.shape[1]), w).view(*x.shape[:-1], w.shape[0])
    with gemm_threads():
        return F.linear(xb, w).float()


__all__ = [
    "CALLS",
    "ENV",
    "MIN_T",
    "NEVER",
    "PROBE_T",
    "bf16_linear",
    "crossover",
    "enable",
    "enabled",
    "fixed_crossover",
    "gemm_threads",
    "set_forward_threads",
    "measure",
    "table",
    "takes",
]
