"""Synthetic knobs move the measured statistics; stats against hand counts and an LRU identity."""

import numpy as np
import pytest

from expertcache.trace.format import RoutingTrace
from expertcache.trace.replay import replay
from expertcache.trace.stats import reuse_distance_hist, reuse_fraction, top_share, use_counts
from expertcache.trace.synthetic import synth_trace


def test_use_counts_and_reuse_by_hand():
    ex = np.array([[[0, 1]], [[1, 2]], [[1, 2]], [[3, 0]]])
    t = RoutingTrace(experts=ex, num_experts=4, seq=[0, 0, 0, 1], token=[0, 1, 2, 0])
    assert use_counts(t).tolist() == [[2, 3, 2, 1]]
    # pairs (0,1): shares {1} -> 1/2; (1,2): shares both -> 1; row 3 starts a new sequence
    assert reuse_fraction(t) == (0.5 + 1.0) / 2


def test_reuse_distance_predicts_lru_hits():
    # top-1, one row per step: LRU with c slots hits exactly the uses with stack distance < c
    t = synth_trace(layers=2, experts=10, top_k=1, tokens=300, zipf=1.0, reuse=0.2, seed=5)
    h = reuse_distance_hist(t)
    assert sum(h.values()) == 600
    for c in (1, 2, 4, 7):
        assert replay(t, "lru", c, with_min=False).hits == sum(
            v for d, v in h.items() if d != "cold" and d < c
        )


def test_reuse_knob():
    lo = reuse_fraction(synth_trace(experts=32, top_k=4, tokens=400, zipf=0.0, reuse=0.0, seed=0))
    hi = reuse_fraction(synth_trace(experts=32, top_k=4, tokens=400, zipf=0.0, reuse=0.7, seed=0))
    assert abs(lo - 4 / 32) < 0.03  # chance only
    assert 0.7 <= hi <= 0.7 + 0.1  # kept with p=0.7, plus a little chance reuse


def test_zipf_knob_and_per_layer_permutation():
    flat = synth_trace(layers=2, experts=16, top_k=2, tokens=800, zipf=0.0, seed=1)
    skew = synth_trace(layers=2, experts=16, top_k=2, tokens=800, zipf=[0.0, 1.5], seed=1)
    assert top_share(flat).max() < 0.33  # uniform: top 4 of 16 take about 25%
    s = top_share(skew)
    assert s[0] < 0.33 < 0.6 < s[1]
    hot = [
        np.argsort(-use_counts(synth_trace(layers=1, experts=16, tokens=400, zipf=1.5, seed=k))[0])[0]
        for k in range(6)
    ]
    assert len(set(hot)) > 1  # the hot expert is a random id, not always 0


def test_topic_shift_moves_hot_set():
    t = synth_trace(layers=1, experts=32, top_k=2, tokens=600, zipf=2.0, shift_every=300, seed=2)
    a = use_counts(RoutingTrace(experts=t.experts[:300], num_experts=32))[0]
    b = use_counts(RoutingTrace(experts=t.experts[300:], num_experts=32))[0]
    assert set(np.argsort(-a)[:3]) != set(np.argsort(-b)[:3])
    still = synth_trace(layers=1, experts=32, top_k=2, tokens=600, zipf=2.0, seed=2)
    assert np.argmax(use_counts(RoutingTrace(experts=still.experts[:300], num_experts=32))[0]) == np.argmax(
        use_counts(RoutingTrace(experts=still.experts[300:], num_experts=32))[0]
    )


def test_seeded_and_sequences():
    a = synth_trace(seqs=3, tokens=20, seed=9)
    b = synth_trace(seqs=3, tokens=20, seed=9)
    np.testing.assert_array_equal(a.experts, b.experts)
    assert a.seq.tolist() == [0] * 20 + [1] * 20 + [2] * 20
    assert all(len(set(r)) == a.top_k for r in a.experts.reshape(-1, a.top_k).tolist())


def test_synthetic_lookahead_has_the_asked_recall_and_leaves_routing_alone():
    plain = synth_trace(layers=4, experts=32, top_k=4, tokens=600, zipf=1.1, reuse=0.4, seed=5)
    t = synth_trace(
        layers=4, experts=32, top_k=4, tokens=600, zipf=1.1, reuse=0.4, seed=5, lookahead_recall=0.8
    )
    assert np.array_equal(t.experts, plain.experts) and plain.lookahead is None
    assert (t.lookahead[:, 0] == -1).all()
    la, ex = t.lookahead[:, 1:], t.experts[:, 1:]
    assert all(len(set(r)) == 4 for r in la.reshape(-1, 4).tolist())  # distinct predictions
    hits = sum(len(set(a) & set(b)) for a, b in zip(la.reshape(-1, 4).tolist(), ex.reshape(-1, 4).tolist()))
    assert hits / ex.size == pytest.approx(0.8, abs=0.02)
    with pytest.raises(ValueError, match="lookahead_recall"):
        synth_trace(lookahead_recall=1.5)
