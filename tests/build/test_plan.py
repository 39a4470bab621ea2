"""`expertcache plan`: headers only, the engine's own slot counts, exit codes, JSON keys, traces."""

from __future__ import annotations

import builtins
import io
import json
import os
import struct
from pathlib import Path

import pytest
import torch

from expertcache import LLM, SamplingParams
from expertcache.cli import main
from expertcache.plan.speed import check_trace, decode_replay
from expertcache.trace.synthetic import synth_trace


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    # 16 experts, top-2, 3 layers, bf16 storage, sharded: several safetensors headers to read
    return checkpoint(
        "qwen3_moe",
        dtype=torch.bfloat16,
        num_experts=16,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        max_shard_size="200KB",
    )


def plan_json(capsys, *args) -> tuple[int, dict]:
    rc = main(["plan", *map(str, args), "--json"])
    return rc, json.loads(capsys.readouterr().out)


# -- reads no weight bytes ---------------------------------------------------------------------------


class _Counting:
    """A file object proxy that counts the bytes read from it."""

    def __init__(self, f, counter: list[int]):
        self._f, self._n = f, counter

    def read(self, *a):
        data = self._f.read(*a)
        self._n[0] += len(data)
        return data

    def readinto(self, b):
        n = self._f.readinto(b)
        self._n[0] += n or 0
        return n

    def __getattr__(self, name):
        if name in ("readline", "readlines", "readall", "read1", "readinto1", "__iter__", "fileno"):
            raise AssertionError(f"plan used {name} on a safetensors file")
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _header_bytes(model_dir: Path) -> int:
    total = 0
    for p in model_dir.glob("*.safetensors"):
        with open(p, "rb") as f:
            total += 8 + struct.unpack("<Q", f.read(8))[0]
    return total


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_reads_headers_only(ckpt, which, monkeypatch, capsys):
    if which == "demo":
        from expertcache.demo import demo_model_dir

        model_dir = demo_model_dir(progress=False)
    else:
        model_dir = ckpt
    budget = _header_bytes(model_dir)
    counted = [0]
    real_open = io.open

    def counting_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        return _Counting(f, counted) if str(file).endswith(".safetensors") else f

    def forbidden(*a, **k):
        raise AssertionError("plan used a raw fd read")

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    for name in ("pread", "preadv", "read", "readv"):
        monkeypatch.setattr(os, name, forbidden)
    rc, r = plan_json(capsys, model_dir, "--device-memory", "25%")
    monkeypatch.undo()
    assert rc == 0 and r["plan"]["fits"]
    assert 0 < counted[0] <= budget, (counted[0], budget)
    assert r["bytes"]["experts_stored"] > 10 * budget  # the weights are far larger than what was read


# -- the engine's own plan ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device_memory,host_memory", [("25%", "auto"), ("13%", "13%"), ("300KiB", "40%"), ("100%", None)]
)
def test_slots_equal_the_engines(ckpt, capsys, monkeypatch, device_memory, host_memory):
    import expertcache.ramlimit as ramlimit

    # free RAM moves between the two calls on a shared machine
    monkeypatch.setattr(ramlimit, "available", lambda: (8 << 30, "MemAvailable"))
    args = [ckpt, "--device-memory", device_memory] + (["--host-memory", host_memory] if host_memory else [])
    rc, r = plan_json(capsys, *args)
    assert rc == 0
    kw = {"device_memory": device_memory} | ({"host_memory": host_memory} if host_memory else {})
    llm = LLM(str(ckpt), **kw)
    try:
        p = r["plan"]
        if p["resident"]:
            assert not hasattr(llm.experts, "device_slots")
        else:
            assert p["device_slots"] == llm.experts.device_slots
            assert p["host_slots"] == llm.experts.host_slots
        # the same lines; the engine then adds its prefetch/policy line (tiered) and its KV cache line
        assert llm.plan_lines[: len(p["lines"])] == p["lines"]
        assert len(llm.plan_lines) - len(p["lines"]) == (1 if p["resident"] else 2)
        c = llm.cfg
        assert (
            r["kv"]["bytes_per_token"] == 2 * c.num_layers * c.num_kv_heads * c.head_dim * llm.dtype.itemsize
        )
    finally:
        llm.close()


@pytest.mark.parametrize("flags", [[], ["--dense", "int8", "--lm-head", "int4"], ["--low-memory"]])
def test_plan_prints_the_dense_term_the_engine_allocates(ckpt, capsys, flags):
    """One dense figure: what `plan` prints as the dense bytes is the device plan's dense term, the one a
    refusal names, and what the engine's ledger counted when it loaded the dense weights."""
    from expertcache.build import ledger

    rc, r = plan_json(capsys, ckpt, "--device-memory", "50%", "--host-memory", "100%", *flags)
    assert rc == 0 and r["bytes"]["dense_compute"] == r["device_plan"]["terms"]["dense"]
    assert main(["plan", str(ckpt), "--device-memory", "50%", "--host-memory", "100%", *flags]) == 0
    from expertcache.units import fmt_bytes

    assert (
        f"dense {fmt_bytes(r['bytes']['dense_stored'])} stored, {fmt_bytes(r['bytes']['dense_compute'])} as"
        in capsys.readouterr().out
    )
    kw = (
        {f.lstrip("-").replace("-", "_"): v for f, v in zip(flags[::2], flags[1::2])}
        if "--dense" in flags
        else {}
    )
    with ledger.simulate(1 << 40):
        llm = LLM(
            str(ckpt), device_memory="50%", host_memory="100%", low_memory="--low-memory" in flags, **kw
        )
    try:
        assert llm.ledger.terms["dense"] == llm.device_plan.terms["dense"] == r["bytes"]["dense_compute"]
    finally:
        llm.close()


def test_cuda_plan_needs_no_gpu(ckpt, capsys):
    # a share of the experts: the slots are that share; the other terms are added on top
    rc, r = plan_json(capsys, ckpt, "--device", "cuda", "--device-memory", "25%")
    assert rc == 0 and r["dtype"] == "bfloat16" and r["speed"]["profile"] == "rtx4090-pcie4"
    b, p, d = r["bytes"], r["plan"], r["device_plan"]
    assert b["expert_fast"] == b["expert_stored"]  # bf16 checkpoint, bf16 compute
    assert p["staging"] == b["expert_fast"] == d["terms"]["staging"]
    L = r["model"]["moe_layers"]
    assert p["device_slots"] == (b["experts_stored"] // 4 - p["staging"]) // (b["expert_fast"] * L)
    assert d["terms"]["expert_slots"] == p["device_slots"] * L * b["expert_fast"]
    assert (
        d["card"] == "rtx4090-24gb"
        and d["card_bytes"] == 24 << 30
        and d["terms"]["cuda_context"] == 500 << 20
    )
    assert d["total"] == sum(d["terms"].values())
    # a size is the GPU total: 200 KiB cannot hold the CUDA context, refused naming it
    rc, r = plan_json(capsys, ckpt, "--device", "cuda", "--device-memory", "200KiB", "--gpu", "rtx4060-8gb")
    assert (
        rc == 1 and "CUDA context 400.00 MiB" in r["plan"]["error"] and "give at least" in r["plan"]["error"]
    )
    rc = main(["plan", str(ckpt), "--device", "cuda", "--profile", "cpu-only", "--device-memory", "25%"])
    assert rc == 2 and "no GPU figures" in capsys.readouterr().err
    assert main(["plan", str(ckpt), "--device", "cuda", "--gpu", "cpu-only"]) == 2
    assert "no card fields" in capsys.readouterr().err


def test_budget_too_small_exits_1_naming_top_k(ckpt, capsys):
    assert main(["plan", str(ckpt), "--device-memory", "1KiB"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "top_k=2" in out
    rc, r = plan_json(capsys, ckpt, "--device-memory", "25%", "--host-memory", "10KiB")
    assert rc == 1 and not r["plan"]["fits"] and "host_memory" in r["plan"]["error"] and r["speed"] is None


def test_unsupported_architecture_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert main(["plan", str(tmp_path)]) == 2
    assert "unsupported architecture" in capsys.readouterr().err


def test_json_keys_are_stable(ckpt, capsys):
    rc, r = plan_json(capsys, ckpt, "--device-memory", "25%")
    assert rc == 0
    assert list(r) == ["model", "device", "dtype", "bytes", "plan", "device_plan", "kv", "speed"]
    assert list(r["device_plan"]) == ["card", "card_bytes", "max_model_len", "budget", "terms", "total"]
    assert list(r["device_plan"]["terms"]) == [
        "dense",
        "kv_cache",
        "linear_state",
        "activations",
        "logits",
        "expert_slots",
        "staging",
        "peer_buffers",
        "cuda_context",
        "allocator_slack",
    ]
    assert list(r["model"]) == [
        "dir",
        "dir_bytes",
        "architecture",
        "layers",
        "moe_layers",
        "num_experts",
        "top_k",
    ]
    assert list(r["bytes"]) == [
        "dense_stored",
        "dense_compute",
        "experts_stored",
        "expert_stored",
        "expert_fast",
        "stored_format",
        "fast_format",
    ]
    assert list(r["plan"]) == [
        "fits",
        "error",
        "resident",
        "device_slots",
        "host_slots",
        "device_budget",
        "host_budget",
        "device_used",
        "host_used",
        "staging",
        "lines",
    ]
    assert list(r["kv"]) == [
        "bytes_per_token",
        "device_free",
        "tokens_in_device_free",
        "state_bytes_per_sequence",
        "auto_max_model_len",
        "auto_max_num_seqs",
        "auto_tokens",
        "auto_bytes",
    ]
    assert list(r["speed"]) == [
        "profile",
        "profile_source",
        "step_overhead_ms",
        "layer_overhead_ms",
        "source",
        "synthetic",
        "from_disk",
        "low",
        "high",
        "band_tok_s",
        "schedule",
    ]
    if r["device"] == "cuda" and not r["plan"]["resident"]:  # the schedule model's four combinations
        assert sorted((e["cpu_compute"], e["prefetch"]) for e in r["speed"]["schedule"]) == [
            (False, False),
            (False, True),
            (True, False),
            (True, True),
        ]
    else:
        assert r["speed"]["schedule"] is None
    assert list(r["speed"]["low"]) == ["policy", "prefetch", "hit_rate", "tok_s"]
    lo, hi = r["speed"]["band_tok_s"]
    assert 0 < lo <= hi


# -- traces ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(ckpt, tmp_path_factory):
    from expertcache.trace.recorder import RoutingRecorder

    llm = LLM(str(ckpt), device_memory="25%")
    try:
        llm.engine.recorder = RoutingRecorder(llm)
        llm.generate([[5, 17, 42, 99, 7, 3]], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        path = tmp_path_factory.mktemp("trace") / "run.npz"
        llm.engine.recorder.save(path)
    finally:
        llm.close()
    return path


def test_trace_band(ckpt, recorded, capsys):
    rc, r = plan_json(
        capsys,
        ckpt,
        "--device-memory",
        "25%",
        "--trace",
        recorded,
        "--profile",
        "rtx4090-pcie4",
        "--device",
        "cuda",
    )
    assert rc == 0
    s = r["speed"]
    assert "15 decode rows" in s["source"] and s["synthetic"] is None
    assert s["low"]["policy"] == "lru" and not s["low"]["prefetch"]
    assert s["band_tok_s"][0] <= s["band_tok_s"][1]


def test_decode_replay_counts_only_decode_rows(recorded):
    from expertcache.trace.format import RoutingTrace

    t = RoutingTrace.load(recorded)
    r = decode_replay(t, "lru", 4, prefetch=False)
    assert r.rows == int((t.phase == 1).sum()) == 15
    decode = t.experts[t.phase == 1]  # [rows, layers, top_k]; one sequence: one row a step
    assert r.hits + r.misses == sum(len(set(layer.tolist())) for row in decode for layer in row)


def test_trace_of_another_model_is_rejected(ckpt, tmp_path, capsys):
    wrong_layers = synth_trace(layers=5, experts=16, top_k=2, tokens=8)
    with pytest.raises(ValueError, match="5 layers, model has 3"):
        check_trace(wrong_layers, [0, 1, 2], 16, 2)
    too_many = synth_trace(layers=3, experts=64, top_k=2, tokens=8, seed=1)
    with pytest.raises(ValueError, match="64 experts"):
        check_trace(too_many, [0, 1, 2], 16, 2)
    path = tmp_path / "wrong.npz"
    wrong_layers.save(path)
    assert main(["plan", str(ckpt), "--device-memory", "25%", "--trace", str(path)]) == 2
    assert "5 layers, model has 3" in capsys.readouterr().err


def test_quantized_experts_stay_quantized_in_the_fastest_tier(ckpt, tmp_path, capsys, monkeypatch):
    import expertcache.ramlimit as ramlimit
    from expertcache.quantize.rewrite import quantize_checkpoint

    monkeypatch.setattr(ramlimit, "available", lambda: (8 << 30, "MemAvailable"))
    q = tmp_path / "int8"
    quantize_checkpoint(ckpt, q, "int8")
    rc, r = plan_json(capsys, q, "--device-memory", "25%")
    assert rc == 0
    b = r["bytes"]
    assert b["expert_fast"] == b["expert_stored"] and "as stored" in b["fast_format"]
    llm = LLM(str(q), device_memory="25%")
    try:
        assert r["plan"]["device_slots"] == llm.experts.device_slots
        assert llm.plan_lines[: len(r["plan"]["lines"])] == r["plan"]["lines"]
    finally:
        llm.close()
