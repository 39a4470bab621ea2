"""The Triton fused MoE kernel under TRITON_INTERPRET=1 (CPU tensors) against a per-pair reference:
every slot format (fp32, bf16, fp8 per-channel, mxfp4), ragged token counts, empty and repeated
slots, and non-resident experts (slot -1, which must contribute nothing)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from expertcache.experts.compute import expert_ffn  # noqa: E402
from expertcache.kernels.triton_moe import align_by_slot, fused_moe  # noqa: E402
from expertcache.quant.method import make_quant_method  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs CUDA or TRITON_INTERPRET=1")


def reference(x, ids, weights, slot_of, experts, method=None):
    """float64 sum over resident pairs of w * FFN(x) with the expert's dequantized weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if int(slot_of[e]) < 0:
                continue
            y = expert_ffn(x[t:t + 1].double(), {n: v.double() for n, v in experts[e].items()})
            out[t] += float(weights[t, k]) * y[0]
    return out


def make_case(T, K, E, S, H, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    resident = torch.randperm(E, generator=g)[:S]
    slot_of = torch.full((E,), -1, dtype=torch.int64)
    slot_of[resident] = torch.randperm(S, generator=g)
    experts = [{"gate_up": torch.randn(2 * I, H, generator=g) / H ** 0.5,
                "down": torch.randn(H, I, generator=g) / I ** 0.5} for _ in range(E)]
    return x, ids, weights, slot_of, experts


def float_pool(experts, slot_of, S, dtype):
    pool = {n: torch.zeros((S, *experts[0][n].shape), dtype=dtype) for n in ("gate_up", "down")}
    for e, s in enumerate(slot_of.tolist()):
        if s >= 0:
            for n in pool:
                pool[n][s] = experts[e][n].to(dtype)
    return pool


def quant_pool(experts, slot_of, S, method):
    """Pack every resident expert with the project's QuantMethod; -> (pool, dequantized experts)."""
    I = experts[0]["down"].shape[1]
    packed, deq = {}, []
    for e, w in enumerate(experts):
        parts = method.pack({"gate.weight": w["gate_up"][:I], "up.weight": w["gate_up"][I:],
                             "down.weight": w["down"]})
        deq.append({"gate_up": torch.cat([method.dequantize(parts, "gate"), method.dequantize(parts, "up")]),
                    "down": method.dequantize(parts, "down")})
        s = int(slot_of[e])
        if s >= 0:
            for n, t in parts.items():
                packed.setdefault(n, torch.zeros((S, *t.shape), dtype=t.dtype))[s] = t
    return packed, deq


@pytest.mark.parametrize("T,K", [(1, 2), (7, 2), (16, 4), (37, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_slots(T, K, dtype):
    x, ids, w, slot_of, experts = make_case(T, K, E=12, S=7, H=48, I=40)  # dims not multiples of the blocks
    pool = float_pool(experts, slot_of, 7, dtype)
    stored = [{n: v.to(dtype).float() for n, v in ex.items()} for ex in experts]
    got = fused_moe(x, ids, w, slot_of, pool)
    torch.testing.assert_close(got.double(), reference(x, ids, w, slot_of, stored), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("fmt", ["fp8-channel", "mxfp4"])
def test_quantized_slots(fmt):
    x, ids, w, slot_of, experts = make_case(9, 2, E=10, S=6, H=64, I=32, seed=1)
    method = make_quant_method(fmt)
    pool, deq = quant_pool(experts, slot_of, 6, method)
    got = fused_moe(x, ids, w, slot_of, pool)
    torch.testing.assert_close(got.double(), reference(x, ids, w, slot_of, deq), atol=2e-4, rtol=2e-4)


def test_empty_repeated_and_missing_slots():
    x, ids, w, slot_of, experts = make_case(20, 2, E=8, S=5, H=32, I=32, seed=2)
    ids[:, 0] = int((slot_of >= 0).nonzero()[0])  # one slot repeated by every token
    ids[:3, 1] = int((slot_of < 0).nonzero()[0])  # and some pairs whose expert is not resident
    pool = float_pool(experts, slot_of, 5, torch.float32)
    got = fused_moe(x, ids, w, slot_of, pool)
    torch.testing.assert_close(got.double(), reference(x, ids, w, slot_of, experts), atol=2e-4, rtol=2e-4)
    none = torch.full_like(slot_of, -1)
    assert fused_moe(x, ids, w, none, pool).abs().max() == 0


def test_align_by_slot_is_a_padded_permutation():
    slots = torch.tensor([3, 0, 3, -1, 3, 1, 0, -1, 3])
    sorted_ids, bslot = align_by_slot(slots, num_slots=5, block_m=2)
    P = slots.numel()
    blocks = sorted_ids.view(-1, 2)
    seen = []
    for b, s in enumerate(bslot.tolist()):
        rows = [r for r in blocks[b].tolist() if r < P]
        if s < 0:
            assert rows == []
        else:
            assert rows and all(int(slots[r]) == s for r in rows)
            seen += rows
    assert sorted(seen) == [i for i in range(P) if slots[i] >= 0]


def test_grouped_mm_is_gated_on_compute_capability(monkeypatch):
    """A pre-Ampere GPU (T4 = 7.5, V100 = 7.0) must not reach torch's grouped_mm; CPU always may."""
    from expertcache.experts import compute

    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    cuda = torch.device("cuda", 0)
    for cap, dtype, ok in (((7, 5), torch.float16, False), ((7, 0), torch.float32, False),
                           ((8, 0), torch.bfloat16, True), ((9, 0), torch.float16, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cap=cap: cap)
        assert compute.grouped_mm_ok(cuda, dtype) is ok, (cap, dtype)
    assert compute.grouped_mm_ok(torch.device("cpu"), torch.float32)

