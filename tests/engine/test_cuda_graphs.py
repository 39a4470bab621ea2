"""Decode's dense segments as CUDA graphs (engine/cuda_graphs.py), checked on the CPU.

No GPU here, so two things stand in for a capture:
- each segment runs under `CaptureRules`, a dispatch mode that refuses what makes a CUDA graph capture
  fail or go stale: data-dependent ops (nonzero, masked_select, unique, bincount, boolean-mask indexing,
  `.item()` / _local_scalar_dense, every op tagged dynamic_output_shape or data_dependent_output), copies
  between devices (a device -> host read; a host -> device copy of pageable memory) and tensors made from
  host data inside the segment (lift_fresh: torch.tensor(...));
- the "replay" calls the same segment functions on the bucket's static buffers, rewritten in place each
  step, and its logits are compared, step after step, with the eager forward's (the engine's torch path,
  C++ kernels off: what CUDA runs) at three sequences of different lengths padded to a bucket of four.
"""

from __future__ import annotations

import gpt_oss_checkpoints as G
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from expertcache import LLM, SamplingParams
from expertcache.config import EngineConfig
from expertcache.engine.cuda_graphs import DecodeGraphs, bucket, why_not
from expertcache.errors import ConfigError
from expertcache.experts.manager import TieredExperts
from expertcache.kernels import build as kernel_build

aten = torch.ops.aten
BOOL_INDEX = (
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
)
FROM_HOST = (aten.lift_fresh.default, aten.lift_fresh_copy.default)


class CaptureRules(TorchDispatchMode):
    """Refuses every op that would make a CUDA graph capture fail or replay stale values; records the rest."""

    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in BOOL_INDEX:
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in idx):
                raise AssertionError(f"{func}: a boolean mask index (its output shape depends on the data)")
        elif torch.Tag.dynamic_output_shape in func.tags or torch.Tag.data_dependent_output in func.tags:
            raise AssertionError(f"{func}: its output depends on tensor values (a host read)")
        if func in FROM_HOST:
            raise AssertionError(f"{func}: a tensor made from host data inside the segment")
        if func in (aten._to_copy.default, aten.copy_.default):
            devices = {t.device for t in tensors} | ({kwargs["device"]} if kwargs.get("device") else set())
            if len(devices) > 1:
                raise AssertionError(f"{func}: a copy between devices {sorted(map(str, devices))}")
        self.ops.append(func)
        return func(*args, **kwargs)


def test_capture_rules_refuse_what_a_capture_cannot_hold():
    x, ids = torch.randn(6, 4), torch.tensor([0, 2])
    for bad in (
        lambda: x.nonzero(),
        lambda: x[x > 0],
        lambda: x.sum().item(),
        lambda: torch.unique(ids),
        lambda: torch.bincount(ids),
        lambda: torch.tensor([1, 2]),
        lambda: x.masked_select(x > 0),
        lambda: x.to("meta"),
    ):
        with pytest.raises(AssertionError), CaptureRules():
            bad()
    with CaptureRules() as rules:  # what the segments do is allowed
        (
            x.index_select(0, ids),
            x[ids],
            x.masked_fill(x > 0, 0.0),
            x.view(-1).index_copy_(0, ids, x[0, :2].clone()),
        )
    assert len(rules.ops) >= 4


def test_cuda_graphs_refused_on_the_cpu():
    with pytest.raises(ConfigError, match="cuda_graphs: .*device='cpu'"):
        EngineConfig.from_kwargs(device="cpu", cuda_graphs=True)
    assert EngineConfig.from_kwargs(device="cuda", cuda_graphs=True).kernels.cuda_graphs
    assert not EngineConfig.from_kwargs(device="cuda").kernels.cuda_graphs  # off by default
    with pytest.raises(ConfigError, match="cuda_graphs: must be True or False"):
        EngineConfig.from_kwargs(device="cuda", cuda_graphs="yes")


def test_the_flag_on_the_cpu_is_one_line_exit_2(capsys, qwen3_checkpoint):
    from expertcache.cli import main

    rc = main(["generate", str(qwen3_checkpoint), "--cuda-graphs", "--prompt", "x", "--max-tokens", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "cuda_graphs" in err and "--cuda-graphs" in err


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


@pytest.fixture
def torch_path(monkeypatch):
    """The engine's torch code (what CUDA runs): no C++ kernels anywhere (the small ops too)."""
    monkeypatch.setitem(kernel_build._state, "mod", None)
    monkeypatch.setitem(kernel_build._state, "why", "EXPERTCACHE_KERNELS=torch")


def _model_dir(family, tmp_path_factory, checkpoint):
    if family == "gpt_oss":  # sliding window 4 on layers 0 and 2, sinks, router bias, clamped SwiGLU
        return G.make_gpt_oss(tmp_path_factory.mktemp("gpt-oss-graphs"))
    return checkpoint(family)


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss"]


def _compare(llm, capture_rules: bool) -> list[float]:
    """Greedy generation of three prompts (5, 9 and 13 tokens, 6 new tokens) where every decode step is
    also run through DecodeGraphs (segments called, capture=False) right after the eager forward, which
    wrote the same KV slots -> the largest |graph - eager| logit per decode step."""
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv, max_num_seqs=4, capture=False)
    seen, eager_rows = [], runner.run_rows
    if capture_rules:
        plain = graphs.segment

        def ruled(k, st, prev):
            with CaptureRules() as rules:
                out = plain(k, st, prev)
            assert any(op is aten.index_copy_.default for op in rules.ops) or "logits" in out
            return out

        graphs.segment = ruled

    def both(work, full):
        logits, spans = eager_rows(work, full)
        if graphs.takes(work) and not any(full):
            got = graphs.run(work)
            assert got.shape == (len(work), logits.shape[1]) and got.dtype == torch.float32
            seen.append((len(work), float((got - logits).abs().max()), float(logits.abs().max())))
        return logits, spans

    runner.run_rows = both
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 13)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(seen) >= 5 and {n for n, _, _ in seen} == {3}  # every decode step of the three
    assert {key for key in graphs.buckets} >= {(4, 4), (4, 8)}  # B=4 (one padding row); tables 4 and 8 wide
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_segments_run_as_captured(family, tmp_path_factory, checkpoint, torch_path):
    llm = LLM(
        str(_model_dir(family, tmp_path_factory, checkpoint)), device="cpu", block_size=4, max_num_seqs=4
    )
    try:
        _compare(llm, capture_rules=True)
    finally:
        llm.close()


@pytest.mark.parametrize(
    "family, cache",
    [("qwen3_moe", {}), ("gpt_oss", {}), ("qwen2_moe", {}), ("qwen3_moe", {"device_memory": "50%"})],
    ids=["qwen3_moe", "gpt_oss", "qwen2_moe", "qwen3_moe-tiered"],
)
def test_static_buffer_replay_equals_the_eager_step(family, cache, tmp_path_factory, checkpoint, torch_path):
    """(tiered: the cache's step, planner and all, runs between the segments as the eager MoE op)"""
    path = _model_dir(family, tmp_path_factory, checkpoint)
    llm = LLM(str(path), device="cpu", block_size=4, max_num_seqs=4, **cache)
    try:
        assert isinstance(llm.engine.runner.model.experts, TieredExperts) == bool(cache)
        for _, diff, scale in _compare(llm, capture_rules=False):
            assert diff <= 1e-4 * max(1.0, scale), (family, diff, scale)
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])
def test_models_without_a_graph_path_are_refused(family, checkpoint, torch_path):
    llm = LLM(str(checkpoint(family)), device="cpu")
    try:
        model = llm.engine.runner.model
        assert why_not(model) is not None
        with pytest.raises(ConfigError, match="cuda_graphs: layer"):
            DecodeGraphs(model, llm.engine.runner.kv, 4)
    finally:
        llm.close()
