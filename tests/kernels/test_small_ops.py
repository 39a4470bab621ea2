"""The fused small ops of a step (kernels/small_ops.py, csrc/small_ops.cpp) against float64 / torch
references, and the torch fallbacks they leave to:

- rms_norm and add_rms_norm vs float64 and the torch path (rows not a multiple of 8 wide, many rows
  split over the kernel threads, 3-D input), the residual sum bit-exact;
- row_stats vs torch.max / argmax / isfinite().all() and a float64 logsumexp, on rows with NaN,
  +inf, -inf, all -inf, repeated maxima, extreme finite values, several parts per row;
- softmax_topk: torch's ids exactly and its weights to float rounding whenever it answers; it
  declines exact ties, near-ties and non-finite logits (torch decides those);
- each declines what it does not handle (other dtypes, strided views, wrong shapes, no extension);
- the whole model with the small ops equals the model with them declined (1e-4 relative).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertcache import LLM, kernels
from expertcache.kernels import build, small_ops
from expertcache.layers import basic
from expertcache.layers.moe import route
from expertcache.spec.model_config import RouterSpec

needs_cpp = pytest.mark.skipif(kernels.backend() != "cpp", reason="the C++ kernels are not built here")


def _norm64(x, w, eps):
    x64 = x.double()
    return w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


def _torch_norm(x, w, eps):  # layers/basic.py's torch path
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


@needs_cpp
@pytest.mark.parametrize("shape", [(1, 1024), (7, 1000), (300, 64), (2, 3, 13), (1, 5)])
def test_rms_norm_against_float64_and_torch(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    y = small_ops.rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == torch.float32
    ref = _norm64(x, w, 1e-6)
    assert (y.double() - ref).abs().max() <= 4e-7 * ref.abs().max()
    assert (y - _torch_norm(x, w, 1e-6)).abs().max() <= 4e-7 * ref.abs().max()
    assert torch.equal(basic.rms_norm(x, w, 1e-6), y)  # the layer uses it


@needs_cpp
@pytest.mark.parametrize("shape", [(1, 1024), (9, 100), (600, 64)])
def test_add_rms_norm_sum_exact_norm_against_float64(shape):
    g = torch.Generator().manual_seed(1)
    h, d = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    w = torch.rand(shape[-1], generator=g) + 0.5
    s, y = small_ops.add_rms_norm(h, d, w, 1e-5)
    assert torch.equal(s, h + d)
    ref = _norm64(h + d, w, 1e-5)
    assert (y.double() - ref).abs().max() <= 4e-7 * ref.abs().max()
    s2, y2 = basic.add_rms_norm(h, d, w, 1e-5)
    assert torch.equal(s2, s) and torch.equal(y2, y)


def test_norms_decline_what_they_do_not_handle(monkeypatch):
    x, w = torch.randn(4, 16), torch.randn(16)
    assert small_ops.rms_norm(x.bfloat16(), w, 1e-6) is None
    assert small_ops.rms_norm(x, w.double(), 1e-6) is None
    assert small_ops.rms_norm(torch.randn(16, 4).T, w, 1e-6) is None  # strided
    assert small_ops.rms_norm(x, torch.randn(15), 1e-6) is None
    assert small_ops.add_rms_norm(x, torch.randn(3, 16), w, 1e-6) is None
    # the torch fallback then computes: the same values
    xb = x.bfloat16()
    assert torch.equal(
        basic.rms_norm(xb, w, 1e-6),
        w * (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16),
    )
    monkeypatch.setattr(build, "_state", {"mod": None, "why": "disabled by the test"})
    assert small_ops.rms_norm(x, w, 1e-6) is None and small_ops.row_stats(x) is None
    assert small_ops.softmax_topk(x, 2, True) is None and small_ops.add_rms_norm(x, x, w, 1e-6) is None
    s, y = basic.add_rms_norm(x, x, w, 1e-6)
    assert torch.equal(s, x + x) and torch.equal(y, _torch_norm(x + x, w, 1e-6))


def _logit_rows(V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    L = torch.randn(10, V, generator=g) * 4
    nan, inf = float("nan"), float("inf")
    L[1, V // 2] = nan
    L[1, V // 3] = inf  # NaN and +inf: max NaN, argmax the NaN
    L[2, 7] = inf
    L[2, V - 1] = inf  # two +inf: the first
    L[3] = -inf  # all -inf
    L[4, 9] = -inf  # one -inf, otherwise finite
    L[5, [3, V // 2, V - 2]] = 50.0  # repeated maximum: the first
    L[6] = 0.0  # flat
    L[7, 0] = 3e38  # extreme finite values (their sum overflows)
    L[7, 1:] = -3e38
    L[8, V - 1] = nan  # NaN in the last position (the scalar tail)
    L[9, :] = 3e38  # every value huge and equal
    return L


@needs_cpp
@pytest.mark.parametrize("V", [1, 13, 1029, 151936])
def test_row_stats_against_torch_and_float64(V):
    if V < 13:
        L = torch.tensor([[float("nan")], [float("-inf")], [2.5], [float("inf")]])
    else:
        L = _logit_rows(V)
    mx, am, lse, fin = small_ops.row_stats(L)
    assert torch.equal(fin, torch.isfinite(L).all(-1))
    ref_max = L.max(-1).values
    assert torch.equal(mx.isnan(), ref_max.isnan()) and torch.equal(
        mx[~mx.isnan()], ref_max[~ref_max.isnan()]
    )
    assert torch.equal(am, L.argmax(-1))
    ref = torch.logsumexp(L.double(), -1)
    assert torch.equal(lse.isnan(), ref.isnan())
    ok = ~ref.isnan()
    assert torch.equal(lse[ok].isinf(), ref[ok].isinf()) and torch.equal(
        lse[ok & ref.isinf()], ref[ok & ref.isinf()].float()
    )
    close = ok & ~ref.isinf()
    assert ((lse[close].double() - ref[close]).abs() <= 2e-6 * ref[close].abs().clamp(min=1)).all()


def test_row_stats_torch_fallback_agrees(monkeypatch):
    """The sampler's row_stats on the torch path (no extension) gives the same answers: the finite
    check from the row sums, rechecked element by element where a sum is not finite."""
    from expertcache.engine.sampler import row_stats

    L = _logit_rows(1000)
    monkeypatch.setattr(build, "_state", {"mod": None, "why": "disabled by the test"})
    fin, lse, am, top = row_stats(L)
    assert torch.equal(top[fin], L[fin].amax(-1))
    assert fin.tolist() == [True, False, False, False, False, True, True, True, False, True]
    assert torch.equal(fin, torch.isfinite(L).all(-1))
    assert torch.equal(am, L.argmax(-1))
    ref = torch.logsumexp(L.double(), -1)
    close = fin
    assert ((lse[close].double() - ref[close]).abs() <= 2e-6 * ref[close].abs().clamp(min=1)).all()


def _torch_router(logits, k, renorm):
    w, ids = torch.topk(F.softmax(logits, dim=-1), k, dim=-1)
    return ids, (w / (w.sum(dim=-1, keepdim=True) + 0.0) if renorm else w)


@needs_cpp
@pytest.mark.parametrize("E,k", [(64, 8), (8, 2), (5, 5), (60, 1)])
@pytest.mark.parametrize("renorm", [True, False])
def test_softmax_topk_is_torchs_choice(E, k, renorm):
    g = torch.Generator().manual_seed(E * 10 + k)
    answered = 0
    for i in range(200):
        logits = torch.randn(3, E, generator=g) * (0.5 + i % 5)
        got = small_ops.softmax_topk(logits, k, renorm)
        if got is None:
            continue
        answered += 1
        ids, w = _torch_router(logits, k, renorm)
        assert torch.equal(got[0], ids)
        assert (got[1] - w).abs().max() <= 1e-6 * w.abs().max()
    assert answered >= 190  # near-ties are rare: the kernel answers nearly every call


@needs_cpp
def test_softmax_topk_of_a_prompt_is_torchs_choice_in_every_unit():
    """A prompt's rows go to the thread pool in units of 32: every row torch's, and a non-finite logit in a
    late unit still declines the whole call."""
    g = torch.Generator().manual_seed(5)
    for T in (33, 300, 512):
        logits = torch.argsort(torch.rand(T, 128, generator=g), dim=1).float() * 0.05  # no near ties
        got = small_ops.softmax_topk(logits, 8, True)
        assert got is not None, T
        ids, w = _torch_router(logits, 8, True)
        assert torch.equal(got[0], ids), T
        assert (got[1] - w).abs().max() <= 1e-6 * w.abs().max()
        logits[T - 1, 7] = float("nan")
        assert small_ops.softmax_topk(logits, 8, True) is None, T


@needs_cpp
def test_softmax_topk_declines_ties_near_ties_and_nonfinite():
    base = torch.linspace(-2, 2, 16)[None].repeat(2, 1)
    assert small_ops.softmax_topk(base, 4, True) is not None
    for tweak in (
        [(1, 15, 2.0), (1, 14, 2.0)],  # exact tie inside the top-k
        [(0, 11, base[0, 12].item())],  # tie at the k-th / (k+1)-th boundary
        [(0, 14, 2.0 - 1e-7)],  # near-tie
        [(1, 3, float("nan"))],
        [(0, 0, float("-inf"))],
        [(0, 0, float("inf"))],
    ):
        x = base.clone()
        for r, c, v in tweak:
            x[r, c] = v
        assert small_ops.softmax_topk(x, 4, True) is None, tweak
    tie_outside = base.clone()
    tie_outside[0, 0] = tie_outside[0, 1]  # a tie far below the top k + 1: answered
    assert small_ops.softmax_topk(tie_outside, 4, True) is not None
    assert small_ops.softmax_topk(base, 17, True) is None and small_ops.softmax_topk(base, 0, True) is None


@needs_cpp
def test_route_with_and_without_the_kernel(monkeypatch):
    """layers/moe.py's softmax router: the fused path equals the torch path (ids exact, weights to
    rounding), with scaling; ties (torch decides) give torch's answer on both."""
    g = torch.Generator().manual_seed(5)
    x, rw = torch.randn(6, 32, generator=g), torch.randn(16, 32, generator=g)
    spec = RouterSpec(scaling=2.5)
    x[3] = 0.0  # every logit 0: all tied, the kernel declines
    fast = route(x, rw, 4, True, spec)
    with monkeypatch.context() as mp:
        mp.setattr(small_ops, "softmax_topk", lambda *a: None)
        slow = route(x, rw, 4, True, spec)
    assert torch.equal(fast[0], slow[0])
    assert (fast[1] - slow[1]).abs().max() <= 1e-6 * slow[1].abs().max()


SEQ = [(i * 37 + 11) % 300 + 3 for i in range(40)]


@needs_cpp
def test_whole_model_small_ops_equal_torch_path(checkpoint, monkeypatch):
    """The tiny model's logits (every position) with the fused norms, residual adds and router
    against the same model with every small op declined (the torch code computes)."""
    path = checkpoint(
        "qwen3_moe",
        dtype=torch.bfloat16,
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_hidden_layers=2,
        num_experts_per_tok=2,
    )
    llm = LLM(str(path))
    llm.model.fused_blocks = False  # the layers' Python path (the C++ block equals it: test_attn_block.py)
    calls = {"n": 0}
    real = small_ops.add_rms_norm

    def counted(*a):
        calls["n"] += 1
        return real(*a)

    with monkeypatch.context() as mp:
        mp.setattr(small_ops, "add_rms_norm", counted)
        got = llm.logits(SEQ)
    assert calls["n"] == 3  # 2 layers: post-attention x 2, then the next layer's input norm
    with monkeypatch.context() as mp:
        for name in ("rms_norm", "add_rms_norm", "softmax_topk", "row_stats"):
            mp.setattr(small_ops, name, lambda *a: None)
        want = llm.logits(SEQ)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
