"""The kernels' thread pool's per-site timing (csrc/thread_pool.h, read by bench/decode_breakdown.py
--moe-gap): off unless EXPERTCACHE_POOL_STATS=1, and when on it counts every job and unit a known
sequence of calls makes. Each case runs in its own process (the switch is read at the first job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, {bench!r})
from decode_breakdown import pool_stats
import ctypes
from expertcache import kernels as K
torch.set_num_threads(2)
ext = K.extension()
lib = ctypes.CDLL(ext.__file__)
S, H, I, k, calls = 4, 64, 512, 2, 5
pool = {{"gate_up": (torch.randn(S, 2 * I, H) * 0.05).bfloat16(), "down": (torch.randn(S, H, I) * 0.05).bfloat16()}}
x, w = torch.randn(1, H), torch.full((1, k), 0.5)
with K.cpu_threads("cpu"):
    pool_stats(lib)
    for _ in range(calls):
        assert K.moe(x, torch.tensor([[0, 2]]), w, pool, None, torch.zeros(1, H))
    got = pool_stats(lib)
    after = pool_stats(lib)
print(json.dumps({{"sites": list(got.values()), "after_reset": len(after), "calls": calls}}))
"""


def run(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "EXPERTCACHE_POOL_STATS"}
    if env_value is not None:
        env["EXPERTCACHE_POOL_STATS"] = env_value
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(bench=str(ROOT / "bench"))],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_stats_count_the_jobs_and_units_of_known_calls():
    pytest.importorskip("expertcache.kernels")
    r = run("1")
    assert r["after_reset"] == 0  # read with reset: the sums start again from zero
    moe = [s for s in r["sites"] if s[0] == r["calls"]]  # the MoE job: one per call
    assert moe, r["sites"]
    jobs, units, helper_units, ns, work, wait, _start, cpu = moe[0]
    assert units % jobs == 0 and units >= jobs  # the same units every call
    assert 0 <= helper_units <= units
    assert (
        ns >= work >= 0 and ns >= wait >= 0 and work + wait <= ns + jobs
    )  # work and wait split the job's time
    assert cpu > 0


def test_stats_stay_off_by_default():
    pytest.importorskip("expertcache.kernels")
    assert run(None)["sites"] == []
