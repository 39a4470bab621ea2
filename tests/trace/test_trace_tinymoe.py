"""Real routing: the trained tinymoe-py16 checkpoint's recorded trace (tests/fixtures, see its README).

The trained router is skewed and local (far above the 2/16 reuse of chance), so the admission policy
beats LRU on it and LRU stays below Belady's optimum.
"""

from fixture_paths import TINYMOE_ROUTING

from expertcache.trace.format import RoutingTrace
from expertcache.trace.replay import sweep
from expertcache.trace.stats import reuse_fraction


def test_tinymoe_trace_is_skewed_and_local():
    t = RoutingTrace.load(TINYMOE_ROUTING)
    assert t.experts.shape == (256, 6, 2) and t.num_experts == 16
    assert (t.lookahead[:, 0] == -1).all() and (t.lookahead[:, 1:] >= 0).all()
    assert reuse_fraction(t) > 0.3  # trained router: far above chance (2/16)
    res = {r.policy: r for r in sweep(t, ["lru", "lfru-admit"], [4])}
    assert res["lfru-admit"].hit_rate > res["lru"].hit_rate
    assert res["lru"].hit_rate < res["lru"].min_hit_rate
