"""The Triton fused MoE reading GGUF blocks in the slot's bytes (kernels/triton_moe_jit.py `_gguf_tile`)
under TRITON_INTERPRET=1, against a float64 MoE sum of the weights quant/ggml.py's `decode` gives: every
GGUF type with a QuantMethod, gate_up and down in different types (gguf-mixed: Q4_K_M's q4_k / q6_k;
gguf-layers: parts keyed by type, a dequantized f32 down), a fused gate_up part, and the refusals.
Pools are tiny (3 slots, H = I = 256: one 256-weight superblock per 256 columns) of valid random blocks."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # with a GPU the kernels compile for it (never interpreted on CUDA tensors)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from gguf_files import random_blocks  # noqa: E402  (tests/: valid random blocks, finite scales)
from kernel_refs import moe_reference  # noqa: E402

from expertcache.errors import ConfigError  # noqa: E402
from expertcache.experts.backends import MoEOptions, choose_backend  # noqa: E402
from expertcache.experts.compute import ExpertFFN  # noqa: E402
from expertcache.kernels import triton_moe, triton_pool  # noqa: E402
from expertcache.kernels.triton_moe_jit import Q4_K, Q6_K  # noqa: E402
from expertcache.quant.ggml import decode, mixed_method  # noqa: E402
from expertcache.quant.ggml_blocks import BY_NAME, METHODS  # noqa: E402
from expertcache.quant.method import make_quant_method  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (triton_moe.interpreted() or torch.cuda.is_available()),
    reason="needs CUDA or TRITON_INTERPRET=1 before expertcache.kernels.triton_moe loads",
)
DEV = "cpu" if triton_moe.interpreted() else "cuda"
S, H, I = 3, 256, 256
SHAPES = {"gate": (I, H), "up": (I, H), "down": (H, I)}


def blocks(type_name: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """S slots of `type_name` weights [rows, cols] -> (uint8 [S, rows, row bytes], their decoded values
    float64 [S, rows, cols])."""
    b = torch.from_numpy(random_blocks(type_name, S * rows, cols, seed=seed)).reshape(S, rows, -1)
    deq = decode(type_name, b.reshape(-1, BY_NAME[type_name].block_bytes)).reshape(S, rows, cols)
    return b, deq.double()


def gguf_pool(types: dict[str, str], keyed: bool = False) -> tuple[dict, dict]:
    """Parts "P.weight" (or "P.<type>": gguf-layers) of {P: type} ("F32": a dequantized float32 part)
    -> (pool, {P: float64 [S, out, in]})."""
    pool, deq = {}, {}
    for seed, (p, t) in enumerate(types.items()):
        if t == "F32":
            deq[p] = torch.randn(S, *SHAPES[p], generator=torch.Generator().manual_seed(seed)).double()
            pool[f"{p}.f32"] = deq[p].float()
            continue
        pool[f"{p}.{t.lower() if keyed else 'weight'}"], deq[p] = blocks(t, *SHAPES[p], seed)
    return pool, deq


def check(pool, deq, method, ffn=None, T=5):
    """fused_moe on x scaled so gate x is about unit size, against the float64 sum over the decoded
    weights; compared relative to the output's largest value (random K-quant scales run large)."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g) / (deq["gate"].pow(2).mean().sqrt() * H**0.5).float()
    slots = torch.stack([torch.randperm(S, generator=g)[:2] for _ in range(T)])
    slots[1, 1] = -1  # a pair not in this pool: nothing added for it
    w = torch.rand(T, 2, generator=g)
    on = {n: t.to(DEV) for n, t in pool.items()}
    got = triton_moe.fused_moe(x.to(DEV), slots.to(DEV), w.to(DEV), on, method, ffn).cpu().double()
    ref = moe_reference(x, slots, w, deq["gate"], deq["up"], deq["down"])[0]
    scale = ref.abs().max()
    torch.testing.assert_close(got / scale, ref / scale, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("type_name", METHODS)
def test_every_gguf_type_against_its_decoder(type_name):
    pool, deq = gguf_pool(dict.fromkeys(SHAPES, type_name))
    check(pool, deq, make_quant_method(f"gguf-{type_name.lower()}"))


@pytest.mark.parametrize("how", ["gguf-mixed", "gguf-layers"])
def test_q4_k_gate_up_with_q6_k_down(how):
    """Q4_K_M's routed experts: gate_up launched with the Q4_K decoder, down with Q6_K's."""
    types = {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}
    pool, deq = gguf_pool(types, keyed=how == "gguf-layers")
    method = make_quant_method(mixed_method(types) if how == "gguf-mixed" else how)
    _, g, u, d = triton_pool.projections(pool, method, None)
    assert (g.fmt, u.fmt, d.fmt) == (Q4_K, Q4_K, Q6_K)
    check(pool, deq, method)


def test_per_layer_types_with_a_dequantized_down():
    """gguf-layers where a type no kernel reads was dequantized at load: down "P.f32" float32, gate and
    up Q5_0."""
    pool, deq = gguf_pool({"gate": "Q5_0", "up": "Q5_0", "down": "F32"}, keyed=True)
    check(pool, deq, make_quant_method("gguf-layers"))


def test_fused_gate_up_part():
    """blk.N.ffn_gate_up_exps: one "gate_up.weight" part [S, 2I, row bytes], gate rows first."""
    gu, gu_deq = blocks("Q8_0", 2 * I, H, seed=7)
    down, down_deq = blocks("Q8_0", H, I, seed=8)
    deq = {"gate": gu_deq[:, :I], "up": gu_deq[:, I:], "down": down_deq}
    check(
        {"gate_up.weight": gu, "down.weight": down},
        deq,
        make_quant_method("gguf-q8_0"),
        ExpertFFN(fused_quant=True),
    )


def test_refusals_name_the_format():
    every = triton_pool.supported
    for t in METHODS:
        assert every(make_quant_method(f"gguf-{t.lower()}")) is None
    mixed = make_quant_method(mixed_method({"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K"}))
    assert "gguf-mixed:q4_k,q5_k,q6_k" in every(mixed) and "gate" in every(mixed)
    layers = make_quant_method("gguf-layers")
    assert every(layers) is None  # without a layer's pool: its tiers hold only types read here
    pool, _ = gguf_pool({"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K"}, keyed=True)
    assert "gguf-layers" in every(layers, pool)
    with pytest.raises(ValueError, match="gguf-layers"):
        triton_pool.projections(pool, layers, None)
    with pytest.raises(ConfigError, match="gguf-layers: gate"):  # the backend checks each layer's pool
        choose_backend(pool, DEV, MoEOptions(method=layers, backend="triton"))
    pool = {"gate.q4_k": pool["gate.q4_k"], "up.q4_k": pool["gate.q4_k"], "down.q2_k": pool["down.q6_k"]}
    assert "'gguf-layers' part down.q2_k" in every(layers, pool)
    bad = dict.fromkeys(("gate.weight", "up.weight", "down.weight"), torch.zeros(S, I, 34, dtype=torch.int8))
    with pytest.raises(ValueError, match="gguf-q8_0 blocks must be uint8"):
        triton_pool.projections(bad, make_quant_method("gguf-q8_0"), None)
