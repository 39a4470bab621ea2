"""RoutingTrace: npz and JSONL round trips, and malformed input naming line/field."""

import json

import numpy as np
import pytest

from expertcache.trace.format import RoutingTrace


def small_trace():
    rng = np.random.default_rng(0)
    ex = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(3)]) for _ in range(10)])
    la = ex.copy()
    la[:, 0] = -1
    return RoutingTrace(
        experts=ex,
        num_experts=8,
        weights=rng.random(ex.shape).astype(np.float32),
        seq=[0] * 5 + [1] * 5,
        token=list(range(5)) * 2,
        phase=[0, 0, 1, 1, 1] * 2,
        step=[0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
        lookahead=la,
        model="m",
        layer_ids=[1, 3, 5],
        expert_bytes=1234,
    )


def assert_same(a, b, lookahead=True):
    for k in ("experts", "seq", "token", "phase", "step"):
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=k)
    np.testing.assert_allclose(a.weights, b.weights, rtol=1e-6)
    if lookahead:
        np.testing.assert_array_equal(a.lookahead, b.lookahead)
    assert (a.num_experts, a.layer_ids, a.model, a.expert_bytes) == (
        b.num_experts,
        b.layer_ids,
        b.model,
        b.expert_bytes,
    )


def test_npz_round_trip(tmp_path):
    t = small_trace()
    t.save(tmp_path / "t.npz")
    assert_same(t, RoutingTrace.load(tmp_path / "t.npz"))


def test_jsonl_round_trip(tmp_path):
    t = small_trace()
    t.to_jsonl(tmp_path / "t.jsonl")
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert len(lines) == 10 * 3
    assert json.loads(lines[0])["phase"] == "prefill" and json.loads(lines[0])["layer"] == 1
    back = RoutingTrace.from_jsonl(tmp_path / "t.jsonl", num_experts=8, model="m", expert_bytes=1234)
    assert_same(t, back, lookahead=False)


def test_jsonl_minimal_fields(tmp_path):
    p = tmp_path / "m.jsonl"
    recs = [
        {"seq": s, "layer": l, "token": i, "experts": [i % 4, 4 + l]}
        for s in (0, 1)
        for i in range(3)
        for l in (0, 1)
    ]
    p.write_text("\n".join(json.dumps(r) for r in recs))
    t = RoutingTrace.from_jsonl(p, num_experts=8)
    assert t.experts.shape == (6, 2, 2) and t.weights is None
    assert t.step.tolist() == list(range(6)) and (t.phase == 1).all()
    assert t.experts[4, 1].tolist() == [1, 5]


@pytest.mark.parametrize(
    "lines, match",
    [
        (['{"seq":0,"layer":0,"experts":[1,2]}'], "line 1: missing field 'token'"),
        (
            ['{"seq":0,"layer":0,"token":0,"experts":[1,2]}', '{"seq":0,"layer":0,"token":1,"experts":[1]}'],
            "line 2: field 'experts' has 1 ids",
        ),
        (['{"seq":0,"layer":0,"token":0,"experts":[1,9]}'], "line 1: field 'experts' id 9 out of range"),
        (['{"seq":0,"layer":0,"token":0,"experts":[1,2],"phase":"train"}'], "line 1: field 'phase'"),
        (["not json"], "line 1: invalid JSON"),
        (
            [
                '{"seq":0,"layer":0,"token":0,"experts":[1,2]}',
                '{"seq":0,"layer":1,"token":0,"experts":[1,2]}',
                '{"seq":0,"layer":0,"token":1,"experts":[1,2]}',
            ],
            "lacks layer 1",
        ),
    ],
)
def test_jsonl_malformed(tmp_path, lines, match):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=match):
        RoutingTrace.from_jsonl(p, num_experts=8)


def test_layer_count_mismatch(tmp_path):
    p = tmp_path / "t.jsonl"
    small_trace().to_jsonl(p)
    with pytest.raises(ValueError, match="layer: trace has 3 layers, model has 4"):
        RoutingTrace.from_jsonl(p, num_experts=8, num_layers=4)
    with pytest.raises(ValueError, match="experts: trace has 3 layers"):
        small_trace().validate(num_layers=2)


def test_array_validation():
    with pytest.raises(ValueError, match="experts: ids must lie in"):
        RoutingTrace(experts=np.full((2, 1, 2), 8), num_experts=8)
    with pytest.raises(ValueError, match="step: must be non-decreasing"):
        RoutingTrace(experts=np.zeros((2, 1, 1)), num_experts=8, step=[1, 0])
    with pytest.raises(ValueError, match="lookahead: expected shape"):
        RoutingTrace(experts=np.zeros((2, 1, 1)), num_experts=8, lookahead=np.zeros((2, 1, 2)))
