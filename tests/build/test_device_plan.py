"""The device-memory plan: every term from headers alone for real model shapes, the engine's own numbers,
a one-line refusal with the smallest budget, and allocated bytes == plan with nothing read on a refusal.

Real shapes (Qwen3-30B-A3B, gpt-oss-20b) live in sparse safetensors files: the headers are real, the
data is holes. Allocation is checked on tiny real checkpoints with the CPU standing in for the device
(devmem.simulate), every persistent tensor counted by devmem.Ledger from its storage.
"""

from __future__ import annotations

import builtins
import json
import os
import re

import pytest
import torch
from test_gpt_oss_layout import EXPERT_BYTES as GPT_OSS_EXPERT
from test_gpt_oss_layout import write_hub_layout, write_sparse_safetensors

from expertcache import LLM
from expertcache.build import ledger as devmem
from expertcache.build import plan as dp_module
from expertcache.build.plan import GpuSpec
from expertcache.cli import main
from expertcache.config import EngineConfig
from expertcache.cost.profiles import get_profile
from expertcache.errors import BudgetError
from expertcache.experts.layout import ExpertSource
from expertcache.loader.disk import DiskReader
from expertcache.loader.safetensors_index import TensorIndex
from expertcache.parallel.config import ParallelConfig
from expertcache.plan.model import budget_for_slots, device_plan, read_model
from expertcache.units import fmt_bytes

GiB = 1 << 30
CUDA = torch.device("cuda")


def cuda_config(device_memory, **kw) -> EngineConfig:
    """A bf16 CUDA engine at max_model_len 4096 with this device_memory (host_memory auto)."""
    return EngineConfig.from_kwargs(
        device="cuda", max_model_len=4096, device_memory=device_memory, host_memory="auto", **kw
    )


def cpu_config(device_memory, **kw) -> EngineConfig:
    return EngineConfig.from_kwargs(device="cpu", device_memory=device_memory, host_memory="auto", **kw)


# Qwen/Qwen3-30B-A3B as published (config.json fields that size it)
Q = dict(H=2048, I=6144, MOE_I=768, L=48, E=128, K=8, HEADS=32, KV_HEADS=4, D=128, V=151936)


def qwen3_30b_config() -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": Q["H"],
        "intermediate_size": Q["I"],
        "moe_intermediate_size": Q["MOE_I"],
        "num_hidden_layers": Q["L"],
        "num_attention_heads": Q["HEADS"],
        "num_key_value_heads": Q["KV_HEADS"],
        "head_dim": Q["D"],
        "num_experts": Q["E"],
        "num_experts_per_tok": Q["K"],
        "vocab_size": Q["V"],
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "attention_bias": False,
    }


def qwen3_30b_tensors() -> dict[str, list[int]]:
    H, D, q, kv = Q["H"], Q["D"], Q["HEADS"] * Q["D"], Q["KV_HEADS"] * Q["D"]
    t = {"model.embed_tokens.weight": [Q["V"], H], "model.norm.weight": [H], "lm_head.weight": [Q["V"], H]}
    for i in range(Q["L"]):
        p = f"model.layers.{i}"
        t |= {
            f"{p}.input_layernorm.weight": [H],
            f"{p}.post_attention_layernorm.weight": [H],
            f"{p}.self_attn.q_proj.weight": [q, H],
            f"{p}.self_attn.k_proj.weight": [kv, H],
            f"{p}.self_attn.v_proj.weight": [kv, H],
            f"{p}.self_attn.o_proj.weight": [H, q],
            f"{p}.self_attn.q_norm.weight": [D],
            f"{p}.self_attn.k_norm.weight": [D],
            f"{p}.mlp.gate.weight": [Q["E"], H],
        }
        for j in range(Q["E"]):
            e = f"{p}.mlp.experts.{j}"
            t |= {
                f"{e}.gate_proj.weight": [Q["MOE_I"], H],
                f"{e}.up_proj.weight": [Q["MOE_I"], H],
                f"{e}.down_proj.weight": [H, Q["MOE_I"]],
            }
    return t


@pytest.fixture(scope="module")
def qwen3_30b(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3-30b-a3b")
    (d / "config.json").write_text(json.dumps(qwen3_30b_config()))
    write_sparse_safetensors(
        d / "model.safetensors", {n: ("BF16", s) for n, s in qwen3_30b_tensors().items()}
    )
    return d


@pytest.fixture(scope="module")
def gpt_oss_20b(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt-oss-20b")
    write_hub_layout(d, "openai/gpt-oss-20b")
    return d


def plan_json(capsys, *args):
    rc = main(["plan", *map(str, args), "--device", "cuda", "--json"])
    return rc, json.loads(capsys.readouterr().out)


def qwen3_dense_bytes() -> int:
    """Qwen3-30B-A3B's dense weights in bf16, from the published shapes (+ float32 rotary frequencies)."""
    H, D, q, kv = Q["H"], Q["D"], Q["HEADS"] * Q["D"], Q["KV_HEADS"] * Q["D"]
    per_layer = 2 * H + q * H + 2 * kv * H + H * q + 2 * D + Q["E"] * H
    return 2 * (2 * Q["V"] * H + H + Q["L"] * per_layer) + (D // 2) * 4


# -- plan numbers from headers: an independent count of the published shapes ----------------------


def card(name: str) -> GpuSpec:
    return GpuSpec.from_profile(get_profile(name))


@pytest.fixture(scope="module")
def qwen3_info(qwen3_30b):
    return read_model(qwen3_30b)


def test_qwen3_30b_terms(qwen3_info):
    """(Through plan/model.py's device_plan, the function `plan` calls: the command's speed band replays
    48 x 128 experts for a minute, so the command itself is run on gpt-oss-20b below.)"""
    p = device_plan(qwen3_info, cuda_config("12GiB", max_num_batched_tokens=512), card("rtx3060-12gb"))
    t = p.terms
    expert = 3 * Q["MOE_I"] * Q["H"] * 2
    assert t["dense"] == qwen3_dense_bytes()
    kv_block = Q["L"] * 16 * 2 * Q["KV_HEADS"] * Q["D"] * 2
    assert t["kv_cache"] == (GiB // kv_block) * kv_block  # auto: 1 GiB of whole blocks (> 4096 tokens)
    assert t["staging"] == expert and t["cuda_context"] == 400 << 20 and t["linear_state"] == 0
    assert t["expert_slots"] == p.experts.device.slots * Q["L"] * expert
    assert p.total == sum(t.values()) <= 12 * GiB == p.budget
    assert p.total + Q["L"] * expert > 12 * GiB  # the most slots that fit: one more per layer would not
    assert p.lines[-1].startswith("device memory (rtx3060-12gb, 12.00 GiB): dense weights")


def test_gpt_oss_20b_at_8gib(gpt_oss_20b, capsys):
    """The issue's case: 8 GiB of an 8 GB card. It fits at the default 2048 batched tokens, because a
    step's logits are bounded (the scheduler computes at most F prompt tokens' logits a step: F x V x
    (2 + 4) bytes within 256 MiB, plus one row per sequence); the slots are what is left. 6 GiB does not
    fit, and the one-line refusal names every term."""
    rc, r = plan_json(capsys, gpt_oss_20b, "--gpu", "rtx4060-8gb", "--device-memory", "8GiB")
    assert rc == 0
    t = r["device_plan"]["terms"]
    V = 201088
    F = (256 << 20) // (V * 6)
    assert t["logits"] == min(2048, 16 + F) * V * 6  # not 2048 x V x 6 = 2.30 GiB
    assert t["expert_slots"] == r["plan"]["device_slots"] * 24 * GPT_OSS_EXPERT
    assert r["plan"]["device_slots"] >= 4
    assert (
        sum(t.values())
        == r["device_plan"]["total"]
        <= 8 * GiB
        < r["device_plan"]["total"] + 24 * GPT_OSS_EXPERT
    )
    rc, r = plan_json(capsys, gpt_oss_20b, "--gpu", "rtx4060-8gb", "--device-memory", "6GiB")
    err = r["plan"]["error"]
    assert rc == 1 and "\n" not in err
    for term in (
        "dense weights",
        "KV cache",
        "activations",
        "logits",
        "CUDA context",
        "allocator slack",
        "top_k=4 expert slots per layer (4 x 24 layers x 12.62 MiB)",
        "staging",
        "give at least",
    ):
        assert term in err, term


@pytest.mark.parametrize("which", ["qwen3_30b", "gpt_oss_20b"])
def test_smallest_budget_is_exact(which, request):
    """The refusal's smallest budget holds top_k slots per layer; one byte less is refused."""
    info = read_model(request.getfixturevalue(which))
    K, L = (Q["K"], Q["L"]) if which == "qwen3_30b" else (4, 24)
    gpu = card("a100-80gb")
    p = device_plan(info, cuda_config("25%"), gpu)
    expert = p.terms["staging"]
    need = (
        sum(v for k, v in p.terms.items() if k not in ("expert_slots", "staging")) + K * L * expert + expert
    )
    p = device_plan(info, cuda_config(need), gpu)
    assert p.experts.device.slots == K and p.total == need
    with pytest.raises(BudgetError, match=f"top_k={K} .*; give at least {re.escape(fmt_bytes(need))}"):
        device_plan(info, cuda_config(need - 1), gpu)


@pytest.mark.parametrize("which", ["qwen3_30b", "gpt_oss_20b"])
def test_plan_equals_the_engines(which, request, capsys, monkeypatch):
    """LLM(device='cuda') plans the numbers and lines `plan` prints (a card stands in for the GPU;
    construction stops right after the plan)."""
    from expertcache import build, ramlimit

    d = request.getfixturevalue(which)
    monkeypatch.setattr(
        ramlimit, "available", lambda: (32 * GiB, "MemAvailable")
    )  # free RAM moves on a shared machine
    if which == "gpt_oss_20b":  # the command itself, --json
        rc, r = plan_json(capsys, d, "--gpu", "rtx4090-24gb", "--device-memory", "16GiB")
        assert rc == 0
        terms, lines = r["device_plan"]["terms"], r["plan"]["lines"]
    else:
        p = device_plan(read_model(d), cuda_config("16GiB"), card("rtx4090-24gb"))
        terms, lines = p.terms, p.lines
    seen = []

    class Stop(Exception):
        pass

    def record(*a, **k):
        seen.append(dp_module.plan_device(*a, **k))
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(GpuSpec, "from_device", classmethod(lambda cls, dev: card("rtx4090-24gb")))
    monkeypatch.setattr(build, "plan_device", record)
    with pytest.raises(Stop):
        LLM(str(d), device="cuda", device_memory="16GiB")
    assert seen[0].terms == terms and seen[0].lines == lines


def test_auto_is_free_memory_less_the_margin(gpt_oss_20b):
    """`auto` on a GPU: its free memory plus what this process's context took, less AUTO_MARGIN; a size
    beyond what is free is refused naming the free bytes."""
    info = read_model(gpt_oss_20b)
    gpu = GpuSpec("test-gpu", total=24 * GiB, free=20 * GiB, context=300 << 20, capability=(8, 9))
    p = device_plan(info, cuda_config("auto"), gpu)
    assert p.budget == 20 * GiB + (300 << 20) - dp_module.AUTO_MARGIN
    assert p.total <= p.budget < p.total + 24 * GPT_OSS_EXPERT or p.experts.resident
    assert p.lines[1].startswith(
        "auto device budget = free 20.00 GiB + CUDA context 300.00 MiB - margin 512.00 MiB"
    )
    small = GpuSpec("test-gpu", total=16 * GiB, free=12 * GiB, context=300 << 20, capability=(8, 9))
    for value in ("100%", "14GiB"):  # every expert; a budget beyond what is free
        with pytest.raises(BudgetError, match="but test-gpu has 12.00 GiB free"):
            device_plan(info, cuda_config(value), small)


# -- allocated == plan, on real tiny models (the CPU as the device) --------------------------------


CASES = {
    "resident": ("qwen3_moe", {}, {}),
    "tiered": ("qwen3_moe", {}, {"device_memory": "50%", "host_memory": "100%"}),
    "low-memory": ("qwen3_moe", {}, {"device_memory": "50%", "host_memory": 0, "low_memory": True}),
    "hybrid": ("qwen3_next", {"num_hidden_layers": 4}, {"device_memory": "50%"}),
    "mla": ("deepseek_v3", {}, {}),
    "int8-dense": ("qwen2_moe", {}, {"dense": "int8", "lm_head": "int8", "device_memory": "50%"}),
    "int4-dense": ("qwen3_moe", {}, {"dense": "int4", "lm_head": "int4", "device_memory": "50%"}),
    # rank 0 of 2 (the cap is this process's): its own half of every layer's experts, all resident
    "expert-parallel": (
        "qwen3_moe",
        {"num_experts": 16, "num_experts_per_tok": 2},
        {"expert_parallel": ParallelConfig(2, peer_tier="off")},
    ),
    # rank 0 of 2 with its own tiers and the peer tier forced on: its receive buffers are a term
    "expert-parallel-peer": (
        "qwen3_moe",
        {"num_experts": 16, "num_experts_per_tok": 2},
        {"expert_parallel": ParallelConfig(2, peer_tier="on"), "device_memory": "50%", "host_memory": "50%"},
    ),
}


@pytest.fixture(scope="module")
def int8_checkpoint(checkpoint, tmp_path_factory):
    from expertcache.quantize.rewrite import quantize_checkpoint

    q = tmp_path_factory.mktemp("int8") / "model"
    quantize_checkpoint(checkpoint("qwen3_moe", dtype=torch.bfloat16), q, "int8")
    return q


def _build(path, opts, cap):
    with devmem.simulate(cap):
        return LLM(str(path), **opts)


@pytest.mark.parametrize("case", [*CASES, "int8-experts"])
def test_allocated_equals_plan(case, checkpoint, request):
    if case == "int8-experts":
        path, opts = request.getfixturevalue("int8_checkpoint"), {"device_memory": "50%"}
    else:
        family, overrides, opts = CASES[case]
        path = checkpoint(family, **overrides)
    llm = _build(path, opts, 1 << 40)
    try:
        plan, ledger = llm.device_plan, llm.ledger
        counted = {k: ledger.terms.get(k, 0) for k in plan.allocated}
        assert counted == plan.allocated  # term by term
        assert set(ledger.terms) <= set(plan.allocated)  # nothing counted outside the plan's terms
        assert (
            plan.allocated["dense"] > 0
            and plan.allocated["kv_cache"] > 0
            and plan.allocated["expert_slots"] > 0
        )
        assert (plan.allocated["linear_state"] > 0) == (case == "hybrid")
        assert ledger.cap == (1 << 40) - plan.terms["activations"] - plan.terms["logits"]
        if case == "expert-parallel":  # this rank's pools: its share of the experts, counted by the ledger
            owned = sum(
                p["gate_up"].shape[0] if "gate_up" in p else next(iter(p.values())).shape[0]
                for p in llm.experts.local.pools.values()
            )
            assert owned == len(llm.source.layers) * 16 // 2
            assert ledger.terms["expert_slots"] == owned * llm.source.expert_nbytes
            assert (
                sum(
                    t.numel() * t.element_size() for p in llm.experts.local.pools.values() for t in p.values()
                )
                == ledger.terms["expert_slots"]
            )
        # the peer tier's receive buffers: top_k experts in the stored format, planned and counted only
        # where the peer tier runs
        peer = getattr(llm.experts, "peer", None)
        assert (peer is not None) == (case == "expert-parallel-peer")
        if peer is not None:
            made = sum(t.numel() * t.element_size() for b in peer.buffers for t in b.values())
            assert made == ledger.terms["peer_buffers"] == 2 * llm.source.expert_nbytes
        assert plan.allocated["peer_buffers"] == (0 if peer is None else made)
    finally:
        llm.close()


class _Reads:
    """Records every safetensors data read: os.open/os.pread(v) (the disk tier), unbuffered opens (the
    buffered expert and dense reads; headers are read through buffered files) and TensorIndex.load."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        real_open, real_preadv, real_pread = os.open, os.preadv, os.pread
        real_load, real_builtin_open = TensorIndex.load, builtins.open
        real_expert, real_parts = ExpertSource.read, DiskReader.read_parts

        def expert(source, layer, e):
            self.calls.append(f"expert {layer}.{e}")
            return real_expert(source, layer, e)

        def parts(reader, ranges, dst, *a, **k):
            self.calls.append("expert (disk tier)")
            return real_parts(reader, ranges, dst, *a, **k)

        def builtin_open(file, mode="r", buffering=-1, *a, **k):
            if str(file).endswith(".safetensors") and buffering == 0:
                self.calls.append(f"read {file}")
            return real_builtin_open(file, mode, buffering, *a, **k)

        def os_open(path, *a, **k):
            if str(path).endswith(".safetensors"):
                self.calls.append(f"os.open {path}")
            return real_open(path, *a, **k)

        def preadv(fd, bufs, off, *a):
            self.calls.append(f"preadv {off}")
            return real_preadv(fd, bufs, off, *a)

        def pread(fd, n, off):
            self.calls.append(f"pread {off}")
            return real_pread(fd, n, off)

        def load(index, name, *a, **k):
            self.calls.append(f"load {name}")
            return real_load(index, name, *a, **k)

        monkeypatch.setattr(builtins, "open", builtin_open)
        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(os, "pread", pread)
        monkeypatch.setattr(TensorIndex, "load", load)
        monkeypatch.setattr(ExpertSource, "read", expert)
        monkeypatch.setattr(DiskReader, "read_parts", parts)


@pytest.mark.parametrize(
    "case",
    [
        "resident",
        "tiered",
        "low-memory",
        "hybrid",
        "mla",
        "int8-dense",
        "expert-parallel",
        "expert-parallel-peer",
    ],
)
def test_too_small_cap_reads_nothing(case, checkpoint, monkeypatch):
    family, overrides, opts = CASES[case]
    path = checkpoint(family, **overrides)
    reads = _Reads(monkeypatch)
    llm = _build(path, opts, 1 << 40)  # the recorder sees a real load's expert reads
    llm.close()
    assert any(c.startswith(("preadv", "pread", "read ")) for c in reads.calls) and any(
        c.startswith("load ") for c in reads.calls
    )
    # plan -> allocate -> fill: every dense weight is read before the first expert, every device tensor
    # is counted in order (KV cache and state first)
    first_expert = next((i for i, c in enumerate(reads.calls) if c.startswith("expert")), len(reads.calls))
    assert max(i for i, c in enumerate(reads.calls) if c.startswith("load ")) < first_expert
    order = list(llm.ledger.terms)
    assert order[: 2 if case == "hybrid" else 1] == (
        ["kv_cache", "linear_state"] if case == "hybrid" else ["kv_cache"]
    )
    need = llm.device_plan.total
    reads.calls.clear()
    with pytest.raises(BudgetError) as e:
        _build(path, opts, need - 1)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"the device cap {fmt_bytes(need - 1)} does not fit")
    for term in ("dense weights", "KV cache", "activations", "logits"):
        assert term in msg, term
    if case == "expert-parallel-peer":
        assert "peer receive buffers" in msg
    assert reads.calls == []  # refused before a weight byte (dense or expert) was read
    llm = _build(path, opts, need)  # the plan's own total is enough
    llm.close()


def test_ledger_cap_names_the_term():
    ledger = devmem.Ledger(torch.device("cpu"), cap=1000)
    # held: a freed block's address could be reused by `a` below
    kv = ledger.alloc((100,), torch.float32, "kv_cache")
    a = torch.zeros(100)
    assert ledger.charge("dense", [a, a[10:], {"x": a}]) == 400  # one storage, counted once
    with pytest.raises(
        BudgetError, match=r"cap 1000 B exceeded by expert_slots \(400 B\) after kv_cache 400 B"
    ):
        ledger.alloc((100,), torch.float32, "expert_slots")
    assert ledger.terms == {"kv_cache": 400, "dense": 400}
    del kv


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{}, {"device_memory": "50%"}], ids=["resident", "tiered"])
def test_cuda_allocations_match_the_plan(opts, checkpoint):
    """On a GPU: the counted tensors are the plan's, torch's allocator holds them, and what it reserved
    after the load (and a step) stays within the plan's total less the context."""
    path = checkpoint("qwen3_moe", dtype=torch.bfloat16)
    torch.cuda.empty_cache()
    base_alloc, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    llm = LLM(str(path), device="cuda", max_num_batched_tokens=64, **opts)
    try:
        plan, ledger = llm.device_plan, llm.ledger
        assert {k: ledger.terms.get(k, 0) for k in plan.allocated} == plan.allocated
        assert torch.cuda.memory_allocated() - base_alloc >= ledger.total
        from expertcache import SamplingParams

        llm.generate([[5, 17, 42, 99]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        reserved = torch.cuda.memory_reserved() - base_reserved
        assert ledger.total <= reserved <= plan.total - plan.terms["cuda_context"], (reserved, plan.terms)
    finally:
        llm.close()


@pytest.mark.parametrize("slots", [4, 5, 11])
def test_budget_for_slots_gives_exactly_that_many(gpt_oss_20b, slots):
    """The whole-engine budget for N slots per layer (used by the GPU tests and the device check)."""
    info = read_model(gpt_oss_20b)
    gpu = card("a100-80gb")
    b = budget_for_slots(info, cuda_config("auto"), slots, gpu)
    p = device_plan(info, cuda_config(b), gpu)
    assert p.experts.device.slots == slots and p.total <= b
    # on the CPU the budget is the expert tier alone: the slots and the half-slot margin, nothing else
    b = budget_for_slots(info, cpu_config("auto"), slots)
    assert device_plan(info, cpu_config(b)).experts.device.slots == slots
    assert b < (slots + 1) * 24 * device_plan(info, cpu_config(b)).experts.device.expert_bytes
