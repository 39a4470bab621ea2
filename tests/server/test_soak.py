"""A short run of bench/soak.py (the README's soak runs longer): concurrent clients with random
sampling, disconnects and invalid requests against a tiered-cache server on loopback; afterwards
no 5xx, no leaked KV block, sequence, pin or in-flight count, and greedy answers unchanged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


@pytest.mark.slow
def test_short_soak_leaves_the_server_idle_and_unchanged(qwen3_checkpoint):
    pytest.importorskip("uvicorn")
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    # a fixed number of requests (not a time window): what runs does not depend on the machine's speed;
    # the 600 s are only an upper bound
    res = soak.run(
        dict(
            model=str(qwen3_checkpoint), device="cpu", max_num_seqs=8, device_memory="50%", host_memory="75%"
        ),
        clients=6,
        seconds=600,
        seed=1,
        rss_growth_limit_mb=256,
        requests_per_client=8,
    )
    assert res["failures"] == [], res
    assert res["requests"] == 6 * 8 and res["disconnects"] > 0 and res["invalid"] > 0
    assert res["5xx"] == 0 and res["leaked_blocks"] == 0 and res["expert_check"] == "ok"
    assert res["greedy_after_equal"]
