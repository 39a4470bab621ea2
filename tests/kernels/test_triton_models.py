"""Whole tiny models through `moe_kernel="triton"` (the fused Triton MoE, under TRITON_INTERPRET=1 on the
CPU) against the default path: Qwen3-MoE (bf16 experts), GPT-OSS (bf16 and MXFP4 as shipped: interleaved
transposed gate_up, biases, clamped SwiGLU) and DeepSeek-V3 (block fp8, shared expert, grouped router).
Greedy tokens identical, logits within the format's tolerance (float32 activations, so the only difference
is the order of float32 sums), and every MoE layer of every step counted through the kernel; plus the
option's validation: `auto` on the CPU, a refused `triton` without the interpreter, bad names, the CLI flag."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

if not torch.cuda.is_available():  # with a GPU the kernels compile for it (never interpreted on CUDA tensors)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import checkpoints  # noqa: E402
import gpt_oss_checkpoints as gpt_oss  # noqa: E402
from test_quant_checkpoints import ship_fp8_block  # noqa: E402

from expertcache import LLM, SamplingParams  # noqa: E402
from expertcache.errors import ConfigError  # noqa: E402
from expertcache.experts.compute import ExpertFFN, with_moe_kernel  # noqa: E402
from expertcache.kernels import triton_moe  # noqa: E402

pytestmark = pytest.mark.skipif(
    not triton_moe.interpreted(),
    reason="needs TRITON_INTERPRET=1 before expertcache.kernels.triton_moe loads",
)
PROMPT = [5, 17, 42, 99, 7, 3, 11]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SMALL = dict(max_model_len=64, max_num_seqs=2, kv_cache_memory="4MiB")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return checkpoints.make_checkpoint(tmp_path_factory.mktemp("q"), "qwen3_moe", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def gpt_oss_bf16(tmp_path_factory):
    return gpt_oss.make_gpt_oss(tmp_path_factory.mktemp("g"), dtype=torch.bfloat16, num_hidden_layers=2)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss_bf16, tmp_path_factory):
    return gpt_oss.to_shipped_mxfp4(gpt_oss_bf16, tmp_path_factory.mktemp("m") / "mx")


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory):
    src = checkpoints.make_checkpoint(tmp_path_factory.mktemp("d"), "deepseek_v3")
    return ship_fp8_block(src, tmp_path_factory.mktemp("d8") / "fp8")


def counted(monkeypatch) -> list:
    """Every fused_moe call (compute.moe_ffn looks it up at call time), so a test can tell the kernel ran."""
    calls, real = [], triton_moe.fused_moe

    def spy(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)

    monkeypatch.setattr(triton_moe, "fused_moe", spy)
    return calls


def compare(path, monkeypatch, atol, expect: dict, **options):
    """`expect`: what the checkpoint must exercise (expert format, ExpertFFN fields), so a builder change
    cannot quietly turn a case into another one."""
    ref = LLM(path, **SMALL, **options)
    method = ref.source.method.name if ref.source.method is not None else str(ref.source.dtype)
    assert {"format": method, **{k: getattr(ref.source.ffn, k) for k in expect if k != "format"}} == expect
    want_tokens = ref.generate([PROMPT], GREEDY)[0].token_ids
    want_logits = ref.logits(PROMPT)
    moe_layers = len(ref.source.layers)
    ref.close()
    calls = counted(monkeypatch)
    llm = LLM(path, **SMALL, moe_kernel="triton", **options)
    assert llm.source.ffn.kernel == "triton"
    got_tokens = llm.generate([PROMPT], GREEDY)[0].token_ids
    n = len(calls)
    got_logits = llm.logits(PROMPT)
    stats = llm.expert_stats()
    llm.close()
    if options:  # the tiered cache really ran: hits and misses
        assert stats["hits"] > 0 and stats["misses"] > 0, stats
    assert got_tokens == want_tokens
    torch.testing.assert_close(got_logits, want_logits, atol=atol, rtol=0)
    # the prompt's step and each decoded token's step (the last token is sampled, not fed back) per MoE
    # layer, and once per layer for logits(): nothing took another path
    assert n == moe_layers * GREEDY.max_tokens and len(calls) == n + moe_layers


def test_qwen3_moe_bf16(qwen3, monkeypatch):
    compare(qwen3, monkeypatch, 1e-4, {"format": "torch.bfloat16", "act": "silu", "interleaved": False})


def test_qwen3_moe_bf16_through_the_expert_cache(qwen3, monkeypatch):
    """A budget: the tiered cache computes hits and fills through the kernel, the pairs' slot alignment made
    on the host from its slot table (the device alignment never runs)."""

    def no_device_alignment(*a, **k):
        raise AssertionError("the tiered step aligned its pairs on the device")

    monkeypatch.setattr(triton_moe, "align_by_slot", no_device_alignment)
    compare(
        qwen3,
        monkeypatch,
        1e-4,
        {"format": "torch.bfloat16"},
        device_memory="40%",
        host_memory="100%",
        cache_policy="lru",
    )


def test_gpt_oss_bf16(gpt_oss_bf16, monkeypatch):
    compare(
        gpt_oss_bf16,
        monkeypatch,
        1e-4,
        {"format": "torch.bfloat16", "act": "clamped_swiglu", "interleaved": True, "transposed": True},
    )


def test_gpt_oss_mxfp4(gpt_oss_mxfp4, monkeypatch):
    compare(
        gpt_oss_mxfp4,
        monkeypatch,
        1e-4,
        {"format": "mxfp4", "act": "clamped_swiglu", "interleaved": True, "fused_quant": True},
    )


def test_deepseek_v3_block_fp8(deepseek_fp8, monkeypatch):
    compare(deepseek_fp8, monkeypatch, 1e-4, {"format": "fp8"})


def test_auto_is_the_torch_path_on_cpu():
    assert with_moe_kernel(ExpertFFN(), "auto", "cpu").kernel == "torch"
    assert with_moe_kernel(ExpertFFN(), "triton", "cpu").kernel == "triton"  # the interpreter is on here


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(triton_moe, "interpreted", lambda: False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        with_moe_kernel(ExpertFFN(), "triton", "cpu")
    assert with_moe_kernel(ExpertFFN(), "auto", "cpu").kernel == "torch"


def test_unsupported_format_is_refused_for_triton_and_left_to_torch_by_auto(monkeypatch):
    class NF4:
        name = "nf4"

    with pytest.raises(ConfigError, match="nf4"):
        with_moe_kernel(ExpertFFN(), "triton", "cpu", NF4())
    monkeypatch.setattr(triton_moe, "unavailable_reason", lambda device: None)  # as if on a CUDA machine
    assert with_moe_kernel(ExpertFFN(), "auto", "cuda", NF4()).kernel == "torch"
    assert with_moe_kernel(ExpertFFN(), "auto", "cuda").kernel == "triton"


def test_bad_name_is_refused_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="moe_kernel: must be one of auto, triton, torch, got 'cuda'"):
        LLM(tmp_path / "not-read", moe_kernel="cuda")


def test_cli_flag_reaches_the_keyword():
    from expertcache.cli_common import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--moe-kernel", "triton"])
    args.model = "m"
    assert engine_kwargs(args)["moe_kernel"] == "triton"
    assert "moe_kernel" not in engine_kwargs(p.parse_args([]))
    with pytest.raises(SystemExit):
        p.parse_args(["--moe-kernel", "fast"])


def test_moe_kernel_is_not_a_cache_only_option():
    """It chooses what computes resident experts too: accepted without a budget, kept as given."""
    from expertcache.experts.config import CacheConfig

    cfg = CacheConfig.from_options(moe_kernel="triton")
    assert not cfg.tiered and cfg.moe_kernel == "triton" and cfg.cache_only_options() == []


def test_auto_chosen_triton_falls_back_to_torch_on_failure(monkeypatch, capsys):
    """An auto-chosen Triton kernel that fails (say, a compile error on a GPU it was never built for)
    hands that configuration's layers to the next backend with one note, and is not tried again for it;
    another configuration still tries it (no process-wide failure flag); an explicit choice raises."""
    import dataclasses

    from expertcache.experts import compute
    from expertcache.kernels import triton_moe

    torch.manual_seed(0)
    E, H, I, T, K = 4, 16, 8, 5, 2
    pool = {"gate_up": torch.randn(E, 2 * I, H), "down": torch.randn(E, H, I)}
    x, slots = torch.randn(T, H), torch.randint(0, E, (T, K))
    w = torch.rand(T, K)
    expected = compute.moe_ffn(x, slots, w, pool, ffn=compute.SWIGLU)
    tries = []

    def broken(*a, **k):
        tries.append(a[0].shape)
        raise RuntimeError("PTX assembly failed\ndetails")

    monkeypatch.setattr(triton_moe, "fused_moe", broken)
    explicit = dataclasses.replace(compute.SWIGLU, kernel="triton")
    with pytest.raises(RuntimeError, match="PTX"):
        compute.moe_ffn(x, slots, w, pool, ffn=explicit)
    auto = dataclasses.replace(explicit, kernel_fallback=True)
    got = compute.moe_ffn(x, slots, w, pool, ffn=auto)
    assert torch.equal(got, expected) and len(tries) == 2
    err = capsys.readouterr().err
    assert err.count("fused Triton MoE kernel failed (RuntimeError: PTX assembly failed)") == 1, err
    layer2 = {n: t.clone() for n, t in pool.items()}  # another layer of the same configuration
    assert torch.equal(
        compute.moe_ffn(x, slots, w, pool, ffn=auto), expected
    )  # no second try, no second note
    assert torch.equal(compute.moe_ffn(x, slots, w, layer2, ffn=auto), expected)
    assert len(tries) == 2 and "failed" not in capsys.readouterr().err
    wide = {"gate_up": torch.randn(E, 4 * I, H), "down": torch.randn(E, H, 2 * I)}  # another configuration
    assert torch.equal(compute.moe_ffn(x, slots, w, wide, ffn=auto), compute.moe_ffn(x, slots, w, wide))
    assert len(tries) == 3 and capsys.readouterr().err.count("fused Triton MoE kernel failed") == 1
