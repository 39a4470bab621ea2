"""The Triton fused MoE kernel under TRITON_INTERPRET=1 (CPU tensors) against a float64 reference written
from the formula (tests/kernel_refs.py, not experts/compute.py): every slot format (fp32/bf16/fp16 plain parts,
fp8 per-tensor, per-channel and block, int8 and int4 groups, mxfp4), the GPT-OSS expert variant
(interleaved and transposed gate_up, expert biases, clamped SwiGLU), ragged token counts, empty and
repeated slots, non-resident experts (slot -1, which must contribute nothing), 64-bit slot offsets, and an
alignment with no host read."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # with a GPU the kernels compile for it (never interpreted on CUDA tensors)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernel_refs import F32ACT, moe_reference  # noqa: E402  (tests/: the kernels' float64 MoE sum)

from expertcache.experts.compute import ExpertFFN  # noqa: E402
from expertcache.kernels import triton_moe, triton_moe_jit, triton_pool  # noqa: E402
from expertcache.kernels.triton_moe import (
    align_by_slot,
    alignment_to,
    fused_moe,
    host_alignment,  # noqa: E402
    num_blocks_bound,
)
from expertcache.quant.method import make_quant_method  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (triton_moe.interpreted() or torch.cuda.is_available()),
    reason="needs CUDA or TRITON_INTERPRET=1 before expertcache.kernels.triton_moe loads",
)
DEV = "cpu" if triton_moe.interpreted() else "cuda"
GPT_OSS = ExpertFFN(act="clamped_swiglu", interleaved=True, transposed=True, alpha=1.702, limit=1.5)


def reference(x, slots, weights, experts, ffn=ExpertFFN()):
    """float64 (tests/kernel_refs.py's MoE sum, activations as given): sum over pairs with a slot of
    w * (act(x gate^T + bg, x up^T + bu) down^T + bd)."""

    def stack(k):
        return torch.stack([e[k] for e in experts])

    params = {"limit": ffn.limit, "alpha": ffn.alpha} if ffn.act == "clamped_swiglu" else {}
    return moe_reference(
        x,
        slots,
        weights,
        stack("gate"),
        stack("up"),
        stack("down"),
        F32ACT,
        ffn.act,
        (stack("bg"), stack("bu"), stack("bd")),
        **params,
    )[0]


def canonical(S, H, I, seed, bias=False):
    """S experts as float64 gate [I, H], up [I, H], down [H, I] and biases (zero without `bias`)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).double()

    return [
        {
            "gate": r(I, H, scale=H**-0.5),
            "up": r(I, H, scale=H**-0.5),
            "down": r(H, I, scale=I**-0.5),
            "bg": r(I, scale=0.3 * bias),
            "bu": r(I, scale=0.3 * bias),
            "bd": r(H, scale=0.3 * bias),
        }
        for _ in range(S)
    ]


def fused_rows(e, interleaved):
    """gate_up [2I, H] of an expert: gate rows then up rows, or alternating (gate = even rows)."""
    if interleaved:
        return torch.stack([e["gate"], e["up"]], 1).flatten(0, 1), torch.stack(
            [e["bg"], e["bu"]], 1
        ).flatten()
    return torch.cat([e["gate"], e["up"]]), torch.cat([e["bg"], e["bu"]])


def float_pool(experts, dtype, ffn=ExpertFFN(), bias=False):
    """Plain parts as the slot pool holds them for `ffn` (orientation, row order, biases)."""
    gu, bgu = zip(*(fused_rows(e, ffn.interleaved) for e in experts))
    pool = {"gate_up": torch.stack(gu), "down": torch.stack([e["down"] for e in experts])}
    if ffn.transposed:
        pool = {n: t.transpose(1, 2).contiguous() for n, t in pool.items()}
    if bias:
        pool["gate_up_bias"], pool["down_bias"] = torch.stack(bgu), torch.stack([e["bd"] for e in experts])
    stored = [
        {**e, **{n: e[n].to(dtype).double() for n in ("gate", "up", "down", "bg", "bu", "bd")}}
        for e in experts
    ]
    return {n: t.to(dtype) for n, t in pool.items()}, stored


def quant_pool(experts, method, ffn=ExpertFFN(), bias=False):
    """Every expert packed with the project's QuantMethod (per projection, or gate_up fused as
    ffn.fused_quant says); -> (pool, the experts as the stored bytes decode)."""
    pool, deq = {}, []
    I = experts[0]["gate"].shape[0]
    for e in experts:
        if ffn.fused_quant:
            gu, bgu = fused_rows(e, ffn.interleaved)
            parts = method.pack({"gate_up.weight": gu.float(), "down.weight": e["down"].float()})
            d = method.dequantize(parts, "gate_up").double()
            gate, up = (d[0::2], d[1::2]) if ffn.interleaved else (d[:I], d[I:])
            if bias:
                parts["gate_up_bias"], parts["down_bias"] = bgu.float(), e["bd"].float()
        else:
            parts = method.pack({f"{p}.weight": e[p].float() for p in ("gate", "up", "down")})
            gate, up = method.dequantize(parts, "gate").double(), method.dequantize(parts, "up").double()
        deq.append({**e, "gate": gate, "up": up, "down": method.dequantize(parts, "down").double()})
        for n, t in parts.items():
            pool.setdefault(n, []).append(t)
    return {n: torch.stack(ts) for n, ts in pool.items()}, deq


def routing(T, K, S, seed, missing=0.2):
    g = torch.Generator().manual_seed(seed)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    slots[torch.rand(T, K, generator=g) < missing] = -1  # pairs whose expert is not in this pool
    return slots, torch.rand(T, K, generator=g)


def run(x, slots, w, pool, method=None, ffn=None, **blocks):
    on = {n: t.to(DEV) for n, t in pool.items()}
    return fused_moe(x.to(DEV), slots.to(DEV), w.to(DEV), on, method, ffn, **blocks).cpu()


def case(T, K, S, H, seed):
    g = torch.Generator().manual_seed(seed + 100)
    slots, w = routing(T, K, S, seed)
    return torch.randn(T, H, generator=g), slots, w


FORMATS = {  # name -> (QuantMethod or None with the plain dtype, atol)
    "fp32": (None, torch.float32, 2e-4),
    "bf16": (None, torch.bfloat16, 2e-4),
    "fp16": (None, torch.float16, 2e-4),
    "fp8": (make_quant_method("fp8", block_size=[16, 32]), None, 2e-4),
    "fp8-channel": (make_quant_method("fp8-channel"), None, 2e-4),
    "fp8-tensor": (make_quant_method("fp8-tensor"), None, 2e-4),
    "int8": (make_quant_method("int8", group_size=32), None, 2e-4),
    "int4": (make_quant_method("int4", group_size=32), None, 2e-4),
    "mxfp4": (make_quant_method("mxfp4"), None, 2e-4),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("T", [1, 2, 7, 16, 64])
def test_every_format_against_float64(fmt, T):
    """H, I are not multiples of the 64-wide tiles; activations float32, so the dot is IEEE float32."""
    method, dtype, atol = FORMATS[fmt]
    S, H, I, K = 5, 96, 64, 2
    experts = canonical(S, H, I, seed=T)
    pool, stored = float_pool(experts, dtype) if method is None else quant_pool(experts, method)
    x, slots, w = case(T, K, S, H, seed=T)
    got = run(x, slots, w, pool, method)
    torch.testing.assert_close(got.double(), reference(x, slots, w, stored), atol=atol, rtol=2e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpt_oss_plain_experts(dtype):
    """Transposed interleaved gate_up with biases and the clamped SwiGLU (alpha, limit small enough to bite)."""
    S, H, I = 4, 64, 32
    experts = canonical(S, H, I, seed=3, bias=True)
    pool, stored = float_pool(experts, dtype, GPT_OSS, bias=True)
    x, slots, w = case(9, 2, S, H, seed=3)
    got = run(x, slots, w, pool, None, GPT_OSS)
    torch.testing.assert_close(got.double(), reference(x, slots, w, stored, GPT_OSS), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("interleaved", [True, False])
def test_fused_mxfp4_with_biases(interleaved):
    """GPT-OSS as shipped: gate_up.weight_blocks [S, 2I, H/32, 16] (rows interleaved), biases, clamped SwiGLU."""
    ffn = ExpertFFN(act="clamped_swiglu", interleaved=interleaved, fused_quant=True, alpha=1.702, limit=1.5)
    S, H, I = 4, 64, 64
    experts = canonical(S, H, I, seed=4, bias=True)
    pool, deq = quant_pool(experts, make_quant_method("mxfp4"), ffn, bias=True)
    x, slots, w = case(7, 3, S, H, seed=4)
    got = run(x, slots, w, pool, make_quant_method("mxfp4"), ffn)
    torch.testing.assert_close(got.double(), reference(x, slots, w, deq, ffn), atol=2e-4, rtol=2e-4)


def test_bf16_activations_dot_in_bf16():
    """x bf16: on CUDA x and the dequantised tile go to tl.dot in bf16 (float32 accumulate) and the
    intermediate is stored in bf16 (the interpreter multiplies in float32: its bf16 dot is broken); the
    result is bf16 and within bf16 rounding of the float64 value."""
    S, H, I = 4, 64, 32
    experts = canonical(S, H, I, seed=5)
    pool, stored = float_pool(experts, torch.bfloat16)
    x, slots, w = case(16, 2, S, H, seed=5)
    x = x.bfloat16()
    got = run(x, slots, w, pool)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), reference(x.double(), slots, w, stored), atol=3e-2, rtol=2e-2)


def test_empty_repeated_and_missing_slots():
    S, H, I = 6, 32, 32
    experts = canonical(S, H, I, seed=2)
    pool, stored = float_pool(experts, torch.float32)
    x, slots, w = case(20, 2, S, H, seed=2)
    slots[:, 0] = 3  # one slot repeated by every token; slots 0 and 5 used by no pair
    slots[:, 1] = torch.where(torch.arange(20) % 3 == 0, -1, 1 + torch.arange(20) % 2)
    got = run(x, slots, w, pool)
    torch.testing.assert_close(got.double(), reference(x, slots, w, stored), atol=2e-4, rtol=2e-4)
    assert run(x, torch.full_like(slots, -1), w, pool).abs().max() == 0  # nothing resident: nothing added


def test_adds_into_the_given_output():
    S, H, I = 3, 32, 32
    pool, stored = float_pool(canonical(S, H, I, seed=6), torch.float32)
    x, slots, w = case(5, 2, S, H, seed=6)
    base = torch.randn(5, H)
    got = fused_moe(x, slots, w, pool, out=base.clone()) if DEV == "cpu" else run(x, slots, w, pool) + base
    torch.testing.assert_close(
        got.double(), base.double() + reference(x, slots, w, stored), atol=2e-4, rtol=2e-4
    )


def check_alignment(al, slots, S, block_m, exact):
    """Brute force: every block is one slot's rows (padding = num_rows), each row's pair has that slot,
    rows are the pairs with a slot, each once, in slot order (stable); row_of_pair inverts pair_of_row."""
    sl = [int(v) for v in slots]
    P = len(sl)
    want = sorted((s, i) for i, s in enumerate(sl) if s >= 0)  # (slot, pair): the stable order
    sorted_rows, bslot = [int(v) for v in al.sorted_rows], [int(v) for v in al.block_slot]
    pair_of_row, row_of_pair = [int(v) for v in al.pair_of_row], [int(v) for v in al.row_of_pair]
    assert len(sorted_rows) == len(bslot) * block_m and al.block_m == block_m
    blocks_needed = sum(-(-sl.count(s) // block_m) for s in range(S))
    if exact:
        assert len(bslot) == blocks_needed and al.num_rows == len(want)
    else:
        assert len(bslot) == num_blocks_bound(P, S, block_m) and al.num_rows == P
    seen = []
    for b, s in enumerate(bslot):
        rows = [r for r in sorted_rows[b * block_m : (b + 1) * block_m] if r < al.num_rows]
        assert all(r == al.num_rows for r in sorted_rows[b * block_m : (b + 1) * block_m] if r >= al.num_rows)
        if s < 0:
            assert rows == []
        else:
            assert rows and all(sl[pair_of_row[r]] == s for r in rows)
            seen += rows
    assert len([s for s in bslot if s >= 0]) == blocks_needed
    assert seen == list(range(len(want)))  # rows 0..R-1, each once, in order
    assert [pair_of_row[r] for r in seen] == [i for _, i in want]
    assert [row_of_pair[i] for i in range(P)] == [
        seen[[p for _, p in want].index(i)] if sl[i] >= 0 else -1 for i in range(P)
    ]


@pytest.mark.parametrize("block_m", [16, 32])
def test_both_alignments_are_padded_permutations(block_m):
    slots = torch.tensor([3, 0, 3, -1, 3, 1, 0, -1, 3] * 5)
    S = 5
    check_alignment(align_by_slot(slots, num_slots=S, block_m=block_m), slots, S, block_m, exact=False)
    check_alignment(host_alignment(slots.numpy(), S, block_m), slots, S, block_m, exact=True)
    empty = host_alignment(torch.full((4, 2), -1), S, block_m)  # no pair for this pool: no block
    assert empty.block_slot.size == 0 and empty.num_rows == 0 and (empty.row_of_pair == -1).all()
    with pytest.raises(ValueError, match="host_alignment slots"):
        host_alignment(np.array([0, 5]), S, block_m)


@pytest.mark.parametrize("T,S,missing", [(1, 8, 0.0), (3, 8, 0.5), (40, 6, 0.3), (2, 4, 1.0)])
def test_a_host_alignment_gives_the_device_alignments_output(T, S, missing):
    """fused_moe with the alignment made on the host (numpy, sent in one copy, `slots` not passed) equals
    the call that aligns on the device, byte for byte: the same rows in the same order, the same sums."""
    H, I, K = 32, 32, 2
    pool, _ = float_pool(canonical(S, H, I, seed=11, bias=True), torch.float32, bias=True)
    g = torch.Generator().manual_seed(12)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    slots[torch.rand(T, K, generator=g) < missing] = -1
    x, w = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    on = {n: t.to(DEV) for n, t in pool.items()}
    base = torch.randn(T, H, generator=g).to(DEV)
    dev = fused_moe(x.to(DEV), slots.to(DEV), w.to(DEV), on, out=base.clone())
    al = alignment_to(host_alignment(slots, S), DEV)
    host = fused_moe(x.to(DEV), None, w.to(DEV), on, out=base.clone(), alignment=al)
    assert torch.equal(dev.cpu(), host.cpu())


def test_workspace_bytes_counts_the_calls_buffers(monkeypatch):
    """The temporaries a call allocates (inter, out_rows, the weights) are within workspace_bytes."""
    S, H, I, T, K = 4, 32, 64, 9, 2
    pool, _ = float_pool(canonical(S, H, I, seed=13), torch.float32)
    x, slots, w = case(T, K, S, H, seed=13)
    made, real_empty = [], torch.empty

    def empty(*a, **k):
        t = real_empty(*a, **k)
        made.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(torch, "empty", empty)
    al = alignment_to(host_alignment(slots, S), DEV)
    fused_moe(x.to(DEV), None, w.to(DEV), {n: t.to(DEV) for n, t in pool.items()}, alignment=al)
    monkeypatch.undo()
    rows = int((slots >= 0).sum())
    assert sum(made) >= rows * (I + H) * 4  # inter and out_rows for the call's own rows, no more
    assert sum(made) <= triton_moe.workspace_bytes(rows, H, I, torch.float32, S)
    assert triton_moe.workspace_bytes(T * K, H, I, torch.bfloat16, S) < triton_moe.workspace_bytes(
        T * K, H, I, torch.float32, S
    )


def test_warm_up_runs_each_config_once():
    S, H, I = 4, 32, 32
    pool, _ = float_pool(canonical(S, H, I, seed=14), torch.float32)
    on = {n: t.to(DEV) for n, t in pool.items()}
    assert triton_moe.warm_up(on, dtype=torch.float32, top_k=2, configs=("decode", "prefill")) == 2


def test_no_host_read(monkeypatch):
    """Every value the alignment and the launches need stays on the device: reading one (item, tolist,
    cpu, numpy, bool, int, float of a tensor) raises during fused_moe. On CUDA the sync debug mode also
    turns a sync hidden inside an op (as torch.bincount has) into an error."""
    S, H, I = 8, 32, 32
    pool, stored = float_pool(canonical(S, H, I, seed=9), torch.float32)
    x, slots, w = case(37, 2, S, H, seed=9)
    args = (x.to(DEV), slots.to(DEV), w.to(DEV), {n: t.to(DEV) for n, t in pool.items()})

    def refuse(*a, **k):
        raise AssertionError("host read during fused_moe")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    if DEV == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = fused_moe(*args)
    finally:
        if DEV == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        monkeypatch.undo()
    torch.testing.assert_close(got.cpu().double(), reference(x, slots, w, stored), atol=2e-4, rtol=2e-4)


def test_slot_offsets_are_64_bit():
    """The kernels' slot base (`triton_moe_jit.slot_base`) of slot 3 with a 2^30-element stride is 3 * 2^30, past int32
    (in int32 arithmetic it wraps to a negative offset): checked through the same jit function the
    kernels call, without allocating a pool that large."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(slot_ptr, out_ptr, stride):
        tl.store(out_ptr, triton_moe_jit.slot_base(tl.load(slot_ptr), stride))

    out = torch.zeros(1, dtype=torch.int64, device=DEV)
    probe[(1,)](torch.tensor([3], dtype=torch.int32, device=DEV), out, 2**30)
    assert int(out) == 3 * 2**30


def test_strided_pool_view_is_addressed_through_its_strides():
    """A pool that is a view into a larger buffer (slot stride bigger than one expert) reads the right bytes."""
    S, H, I = 3, 32, 32
    pool, stored = float_pool(canonical(S, H, I, seed=7), torch.float32)
    wide = {n: torch.zeros((S, 2, *t.shape[1:]), dtype=t.dtype) for n, t in pool.items()}
    for n, t in pool.items():
        wide[n][:, 1] = t
    x, slots, w = case(6, 2, S, H, seed=7)
    views = {n: t.to(DEV)[:, 1] for n, t in wide.items()}
    got = fused_moe(x.to(DEV), slots.to(DEV), w.to(DEV), views).cpu()
    torch.testing.assert_close(got.double(), reference(x, slots, w, stored), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("bad", [8, 24, 0, True, 16.0])
def test_block_sizes_are_checked(bad):
    pool, _ = float_pool(canonical(2, 32, 32, seed=8), torch.float32)
    x, slots, w = case(2, 1, 2, 32, seed=8)
    with pytest.raises(ValueError, match="block_n"):
        run(x, slots, w, pool, block_n=bad)


def test_config_table_by_shape():
    assert triton_moe.pick_config(8, 128) is triton_moe.CONFIGS["decode"]
    assert triton_moe.pick_config(8 * 4096, 128) is triton_moe.CONFIGS["prefill"]


def test_unknown_format_is_refused_by_name():
    class Other:
        name = "nf4"

    with pytest.raises(ValueError, match="nf4"):
        triton_pool.projections({"gate.weight": torch.zeros(1, 2, 2)}, Other(), None)


def test_grouped_mm_is_gated_on_compute_capability(monkeypatch):
    """A pre-Ampere GPU (T4 = 7.5, V100 = 7.0) must not reach torch's grouped_mm; CPU always may."""
    from expertcache.experts import compute

    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    cuda = torch.device("cuda", 0)
    for cap, dtype, ok in (
        ((7, 5), torch.float16, False),
        ((7, 0), torch.float32, False),
        ((8, 0), torch.bfloat16, True),
        ((9, 0), torch.float16, False),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cap=cap: cap)
        assert compute.grouped_mm_ok(cuda, dtype) is ok, (cap, dtype)
    assert compute.grouped_mm_ok(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("T,K,S", [(1, 8, 32), (3, 2, 5), (40, 4, 6), (300, 8, 64)])
def test_host_alignment_python_and_numpy_paths_agree(T, K, S, monkeypatch):
    """Few pairs (decode) are aligned in plain Python, many with numpy: the same arrays either way."""
    g = torch.Generator().manual_seed(T)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    slots[torch.rand(T, K, generator=g) < 0.25] = -1
    got = {}
    for name, limit in (("python", 10**9), ("numpy", 0)):
        monkeypatch.setattr(triton_moe, "SMALL_ALIGN", limit)
        got[name] = host_alignment(slots, S)
        check_alignment(got[name], slots.reshape(-1), S, got[name].block_m, exact=True)
    for a, b in zip(got["python"], got["numpy"]):
        assert (a == b) if isinstance(a, int) else (a.dtype == b.dtype == np.int64 and np.array_equal(a, b))
