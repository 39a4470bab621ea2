"""Real routing from the trained tinymoe-py16 checkpoint (skipped when absent)."""

import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import TINYMOE_DIR

from expertcache.trace.format import RoutingTrace
from expertcache.trace.replay import sweep
from expertcache.trace.stats import reuse_fraction

MODEL = TINYMOE_DIR
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="tinymoe-py16 not available")
def test_tinymoe_trace_is_skewed_and_local(tmp_path):
    out = tmp_path / "t.npz"
    subprocess.run([sys.executable, str(ROOT / "bench/trace_tinymoe.py"), str(out), "--model", str(MODEL),
                    "--seqs", "2", "--tokens", "128"], check=True, capture_output=True)
    t = RoutingTrace.load(out)
    assert t.experts.shape == (256, 6, 2) and t.num_experts == 16
    assert (t.lookahead[:, 0] == -1).all() and (t.lookahead[:, 1:] >= 0).all()
    assert reuse_fraction(t) > 0.3  # trained router: far above chance (2/16)
    res = {r.policy: r for r in sweep(t, ["lru", "lfru-admit"], [4])}
    assert res["lfru-admit"].hit_rate > res["lru"].hit_rate
    assert res["lru"].hit_rate < res["lru"].min_hit_rate
