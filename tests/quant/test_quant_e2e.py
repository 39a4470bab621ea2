"""Quantized experts end to end: `quantize_checkpoint` -> LLM -> generate, for every format.

What is checked, per format (fp8 block, fp8-channel, int8, int4, mxfp4):
- under a tight cache (device and host tiers ~top_k slots per layer, verify=True so every slot
  fill is compared with the checkpoint bytes, scales included) greedy tokens and logits equal
  the same quantized model fully resident. With 2 slots and 16 experts, slot ids and expert ids
  differ almost always, so a part (scale, zero point) indexed by expert id instead of slot
  shows up as wrong logits or an index error;
- the byte budget counts the stored bytes (weights + scales + zero points): a fixed budget
  holds proportionally more int4 / mxfp4 experts than bf16 ones;
- a quantized model equals a plain fp32 model whose expert weights are the method's
  dequantized weights (engine vs engine, and transformers on that dense checkpoint as an
  independent oracle).

The tiny model: Qwen3-MoE, hidden 64, moe_intermediate 64, 16 experts, top-2, 2 layers, bf16.
`dequantized_dense_checkpoint` is reused by test_quant_checkpoints.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import checkpoints
import pytest
import torch
from safetensors.torch import save_file
from safetensors_reference import independent_slot_checks

from expertcache import LLM, SamplingParams
from expertcache.quant.checkpoint import method_from_config
from expertcache.quantize.rewrite import quantize_checkpoint


@pytest.fixture(autouse=True)
def _slot_checks_read_safetensors(monkeypatch):
    """verify=True and check(contents=True) compare slots with the checkpoint read by safetensors."""
    independent_slot_checks(monkeypatch)


H, I, E, L, K = 64, 64, 16, 2, 2
TINY = dict(
    dtype=torch.bfloat16,
    hidden_size=H,
    moe_intermediate_size=I,
    num_experts=E,
    num_hidden_layers=L,
    num_experts_per_tok=K,
)

# (format, quantize_checkpoint kwargs). fp8 block 48 and int8 group 24 leave ragged edge blocks/groups.
FORMATS = {
    "fp8": dict(block_size=48),
    "fp8-channel": {},
    "int8": dict(group_size=24),
    "int4": dict(group_size=16),
    "mxfp4": {},
}

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [60, 61, 62], list(range(100, 140))]
SEQ = [(i * 37 + 11) % 300 + 3 for i in range(48)]  # a fixed 48-token sequence for logits
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
TIGHT = dict(device_memory="13%", host_memory="13%", cache_policy="lru", verify=True)


# ---------------------------------------------------------------------------
# helpers


def expected_expert_bytes(fmt: str, params: dict) -> int:
    """Stored bytes of one expert (gate [I, H], up [I, H], down [H, I]) from the layout legend, by hand."""
    c = lambda a, b: -(-a // b)  # noqa: E731

    def one(out: int, inp: int) -> int:
        if fmt == "bf16":
            return out * inp * 2
        if fmt == "fp8":
            b = params["block_size"]
            return out * inp + c(out, b) * c(inp, b) * 4
        if fmt == "fp8-channel":
            return out * inp + out * 4
        if fmt == "int8":
            return out * inp + out * c(inp, params["group_size"]) * 4
        if fmt == "int4":
            return out * inp // 2 + out * c(inp, params["group_size"]) * (4 + 1)
        if fmt == "mxfp4":
            return out * inp // 2 + out * inp // 32
        raise AssertionError(fmt)

    return 2 * one(I, H) + one(H, I)


def dequantized_dense_checkpoint(qdir: Path, dst: Path) -> Path:
    """A plain fp32 checkpoint from a quantized one: every quantized weight replaced by
    `method.dequantize(...)` of its stored tensors (scales etc. dropped), every other float tensor
    converted to float32 (exact for bf16), quantization_config removed."""
    qdir, dst = Path(qdir), Path(dst)
    hf = json.loads((qdir / "config.json").read_text())
    method = method_from_config(hf)
    assert method is not None, f"{qdir} is not quantized"
    tensors = checkpoints.read_tensors(qdir)
    primary = method.primary
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name, t in tensors.items():
        if name.endswith(f".{primary}") and t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            base = name[: -len(primary) - 1]
            out[f"{base}.weight"] = method.dequantize(tensors, base).contiguous()
            done.add(base)
    for name, t in tensors.items():
        base, _, suffix = name.rpartition(".")
        if base in done or (suffix == "input_scale"):
            if suffix == "bias":
                out[name] = t.float()
            continue
        assert t.is_floating_point() and t.dtype != torch.float8_e4m3fn, f"{name}: {t.dtype} left over"
        out[name] = t.float().contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    hf.pop("quantization_config")
    hf["dtype"] = "float32"
    hf.pop("torch_dtype", None)
    (dst / "config.json").write_text(json.dumps(hf, indent=2))
    for f in qdir.iterdir():
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name not in ("config.json", "model.safetensors.index.json")
        ):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def greedy(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


# ---------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def base(checkpoint) -> Path:
    return checkpoint("qwen3_moe", **TINY)


@pytest.fixture(scope="module")
def quantized(base, tmp_path_factory):
    """fmt -> quantized checkpoint directory (built on first use)."""
    root = tmp_path_factory.mktemp("quant-e2e")
    cache: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in cache:
            cache[fmt] = quantize_checkpoint(base, root / fmt, fmt, **FORMATS[fmt])
        return cache[fmt]

    return get


@pytest.fixture(scope="module")
def resident(quantized):
    """fmt -> (LLM fully resident, its logits on SEQ, its greedy tokens)."""
    cache: dict[str, tuple] = {}

    def get(fmt: str):
        if fmt not in cache:
            llm = LLM(str(quantized(fmt)))
            cache[fmt] = (llm, llm.logits(SEQ), greedy(llm))
        return cache[fmt]

    return get


# ---------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_checkpoint_layout_and_bytes(fmt, quantized):
    q = quantized(fmt)
    hf = json.loads((q / "config.json").read_text())
    assert hf["quantization_config"] == {"quant_method": "expertcache", "experts": fmt, **FORMATS[fmt]}
    method = method_from_config(hf)
    llm_bytes = expected_expert_bytes(fmt, FORMATS[fmt])
    tensors = checkpoints.read_tensors(q)
    for layer in range(L):
        for j in (0, E - 1):
            names = [n for n in tensors if n.startswith(f"model.layers.{layer}.mlp.experts.{j}.")]
            want = {
                f"model.layers.{layer}.mlp.experts.{j}.{k}"
                for p, s in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))
                for k in method.layout(p, s)
            }
            assert set(names) == want
            assert sum(tensors[n].nbytes for n in names) == llm_bytes
    # dense tensors are untouched bf16
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["lru", "no-prefetch-cpu"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tight_cache_equals_resident(fmt, mode, quantized, resident):
    full, full_logits, full_tokens = resident(fmt)
    extra = {} if mode == "lru" else dict(prefetch=False, cpu_compute="always")
    llm = LLM(str(quantized(fmt)), **TIGHT, **extra)
    try:
        cache = llm.experts
        assert cache.device_slots == K and cache.host_slots == K, llm.plan_lines
        # every tier holds the stored parts, in their stored dtypes (no dequantized copies)
        method = llm.quant
        want = {
            f"{c}.{s}": spec.dtype
            for c, shp in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))
            for s, spec in ((k.split(".", 1)[1], v) for k, v in method.layout(c, shp).items())
        }
        assert {n: t.dtype for n, t in cache.dev.buf.items()} == want
        assert {n: t.dtype for n, t in cache.host.buf.items()} == want
        assert llm.source.expert_nbytes == expected_expert_bytes(fmt, FORMATS[fmt])

        torch.testing.assert_close(llm.logits(SEQ), full_logits, atol=1e-5, rtol=0)
        assert greedy(llm) == full_tokens
        cache.check(contents=True)
        s = llm.expert_stats()
        assert s["misses"] > 2 * E, s["misses"]  # experts really cycled through 2 slots
        if mode == "lru":
            assert s["hits"] > 0
        else:
            assert s["cpu_computed_share"] == 1.0
    finally:
        llm.close()


def test_generation_is_not_degenerate(resident, base):
    """Guard the guard: the formats must not all collapse to the same tokens (else equality is vacuous)."""
    toks = {fmt: resident(fmt)[2] for fmt in ("fp8", "mxfp4")}
    dense = LLM(str(base))
    ref = greedy(dense)
    dense.close()
    assert all(len(set(t)) > 3 for t in ref)
    # fp8 keeps 3+ significant bits: its first generated token agrees with bf16 on every prompt
    assert [t[0] for t in toks["fp8"]] == [t[0] for t in ref]


def test_budget_counts_stored_bytes(quantized, base):
    """A fixed byte budget (25% of the bf16 experts) holds budget // (layers x stored bytes) experts
    per layer in each format: int4 and mxfp4 fit proportionally more than bf16."""
    bf16_bytes = expected_expert_bytes("bf16", {})
    budget = bf16_bytes * L * E // 4
    slots = {}
    for fmt in ["bf16", *FORMATS]:
        path = base if fmt == "bf16" else quantized(fmt)
        nbytes = bf16_bytes if fmt == "bf16" else expected_expert_bytes(fmt, FORMATS[fmt])
        # dtype=bfloat16: the device tier then holds bf16 experts as bf16 (on CPU the default compute
        # dtype is float32, which would hold the bf16 model's experts in 4 bytes/weight)
        llm = LLM(str(path), dtype="bfloat16", device_memory=f"{budget}", host_memory=f"{budget}")
        try:
            assert llm.source.expert_nbytes == nbytes
            slots[fmt] = llm.experts.device_slots
            assert slots[fmt] == min(E, budget // (L * nbytes)), (fmt, llm.plan_lines)
            assert llm.experts.host_slots == slots[fmt]
            for tier in ("device", "host"):
                line = next(x for x in llm.plan_lines if x.startswith(f"{tier}:"))
                assert re.match(rf"{tier}: {slots[fmt]} slots/layer x {L} layers", line), line
        finally:
            llm.close()
    assert slots["bf16"] == 4
    assert slots["fp8"] >= 7 and slots["int8"] >= 6  # 1 byte + fp32 scales per block/group
    assert slots["int4"] >= 2 * slots["bf16"] and slots["mxfp4"] >= 3 * slots["bf16"], slots
    # proportional to bytes: slots x bytes stays within one expert of the budget
    for fmt, n in slots.items():
        nbytes = bf16_bytes if fmt == "bf16" else expected_expert_bytes(fmt, FORMATS[fmt])
        assert budget - L * nbytes < n * L * nbytes <= budget or n == E


def test_quantize_fused_layout_input_gives_same_bytes(base, quantized, tmp_path):
    fused = checkpoints.to_fused_layout(base, tmp_path / "fused")
    q = quantize_checkpoint(fused, tmp_path / "q", "int4", **FORMATS["int4"])
    a, b = checkpoints.read_tensors(q), checkpoints.read_tensors(quantized("int4"))
    experts = {n for n in b if ".experts." in n}
    assert experts and experts <= set(a)
    for n in experts:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_equals_dense_dequantized(fmt, quantized, resident, tmp_path):
    """Quantized model == fp32 model built from method.dequantize(stored) (engine vs engine, fp32 logits),
    and == transformers on that dense checkpoint (independent oracle)."""
    _, q_logits, q_tokens = resident(fmt)
    dense = dequantized_dense_checkpoint(quantized(fmt), tmp_path / "dense")
    tensors = checkpoints.read_tensors(dense)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert not any("scale" in n or "blocks" in n or "zero" in n for n in tensors)
    llm = LLM(str(dense))
    try:
        assert llm.quant is None
        # the experts' rounding differs (stored format vs fp32): a few float32 ulps of the largest logit
        torch.testing.assert_close(llm.logits(SEQ), q_logits, atol=2e-6 * q_logits.abs().max().item(), rtol=0)
        assert greedy(llm) == q_tokens
    finally:
        llm.close()
    ref = checkpoints.load_reference(dense)
    torch.testing.assert_close(checkpoints.reference_logits(ref, SEQ), q_logits, atol=1e-4, rtol=1e-4)
    assert checkpoints.reference_greedy(ref, PROMPTS[0], GREEDY.max_tokens) == q_tokens[0]


def test_dequantized_weights_differ_from_bf16(quantized, base):
    """The dense-dequantized oracle is not trivially the bf16 model: every format changes the experts,
    by a relative error in the range its bits allow."""
    src = checkpoints.read_tensors(base)
    name = "model.layers.1.mlp.experts.5.down_proj"
    w = src[f"{name}.weight"].float()
    bound = {"fp8": 0.07, "fp8-channel": 0.07, "int8": 0.01, "int4": 0.12, "mxfp4": 0.25}
    for fmt in FORMATS:
        q = checkpoints.read_tensors(quantized(fmt))
        method = method_from_config(json.loads((quantized(fmt) / "config.json").read_text()))
        d = method.dequantize(q, name)
        rel = ((d - w).norm() / w.norm()).item()
        assert 0 < rel < bound[fmt], (fmt, rel)
        assert math.isfinite(rel)
