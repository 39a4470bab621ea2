"""EngineConfig: the one list of engine options. LLM's keywords fill it by field name (an unknown one
refused by name before anything is read), the CLI's engine flags are its fields, and an expert-parallel
rank is started from the whole of it as plain data."""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import json

import pytest
import torch

from expertcache import LLM
from expertcache.cli_common import FLAG_KEYWORDS, PARALLEL_FLAGS, add_engine_args, engine_flags, engine_kwargs
from expertcache.config import EngineConfig
from expertcache.errors import ConfigError
from expertcache.parallel.config import ParallelConfig

# keywords the CLI gives no flag for, each with the reason (a new option must be added here or get a flag)
API_ONLY = {
    "progress": "the CLI always shows its progress bar",
    "verbose": "the CLI prints the plan itself",
    "expert_parallel": "made from the --expert-parallel group of flags (PARALLEL_FLAGS)",
    "block_size": "the KV block size stays the engine's default",
    "max_num_batched_tokens": "a serve flag (server/cli.py)",
    "prefix_caching": "a serve flag (--no-prefix-caching)",
    "revision": "resolved with the model argument before the engine starts (resolve_model_arg)",
    "prefill_admit_tokens": "a tuning knob of the cache",
    "cost_profile": "a tuning knob of the cache",
    "overlap_io": "an ablation switch",
    "prefetch_gate": "an ablation switch",
    "exclusive": "an ablation switch",
    "o_direct": "an ablation switch",
    "verify": "an ablation switch (tests)",
}


def test_unknown_keyword_is_refused_by_name_before_anything_is_read(monkeypatch):
    opened = []
    real = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(str(f)) or real(f, *a, **k))
    with pytest.raises(ConfigError, match=r"^unknown option 'max_num_seq'; engine options: .*max_num_seqs"):
        LLM("/nonexistent/model", max_num_seq=4)
    assert not [f for f in opened if "nonexistent" in f]


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"max_num_seqs": 0}, "max_num_seqs: an integer >= 1, got 0"),
        ({"max_num_batched_tokens": True}, "max_num_batched_tokens: an integer >= 1"),
        ({"block_size": "16"}, "block_size: an integer >= 1"),
        ({"device": "tpu"}, "device: expected cpu or cuda"),
        ({"dtype": "int8"}, "dtype: a torch floating dtype"),
        ({"kv_cache_memory": "50%"}, "kv_cache_memory: a size or 'auto'"),
        ({"check_finite": "yes"}, "check_finite: must be True or False"),
        ({"prefix_caching": 1}, "prefix_caching: must be True or False"),
        ({"lm_head": "int3"}, "lm_head: unknown format 'int3'"),
        ({"cpu_math": "turbo"}, "cpu_math: one of exact, fast"),
        ({"expert_parallel": "two"}, "expert_parallel='two'"),
    ],
)
def test_each_field_is_validated_naming_it(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        EngineConfig.from_kwargs(**kw)


def test_keywords_go_to_their_groups():
    c = EngineConfig.from_kwargs(
        model="m",
        device="cpu",
        dtype=torch.bfloat16,
        max_num_seqs=3,
        block_size=8,
        dense="int8",
        device_memory="25%",
        cache_policy="lru",
        overlap_io=False,
        low_memory=True,
        expert_parallel=2,
        record_routing="t.npz",
    )
    assert (c.load.model, c.load.dtype, c.load.torch_dtype) == ("m", "bfloat16", torch.bfloat16)
    assert (c.scheduler.max_num_seqs, c.scheduler.block_size, c.kernels.dense) == (3, 8, "int8")
    assert (c.cache.device_memory, c.cache.policy, c.cache.ablation.overlap_io, c.cache.low_memory) == (
        "25%",
        "lru",
        False,
        True,
    )
    assert c.parallel == ParallelConfig(2) and c.record_routing == "t.npz"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.scheduler.max_num_seqs = 4


def test_plain_data_round_trip():
    """What an expert-parallel rank is started from: JSON-able, and the same config back."""
    c = EngineConfig.from_kwargs(
        model="m",
        device_memory="20%",
        host_memory="30%",
        verify=True,
        progress=print,
        expert_parallel=ParallelConfig(2, eplb=True, eplb_window_size=10, peer_tier="off"),
    )
    d = json.loads(json.dumps(c.to_dict()))
    assert EngineConfig.from_dict(d) == dataclasses.replace(c, progress=False)
    plain = EngineConfig.from_kwargs(expert_parallel=3)
    assert EngineConfig.from_dict(json.loads(json.dumps(plain.to_dict()))) == plain


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_cli_flags_are_the_config_fields():
    """Every engine flag is an EngineConfig keyword (by its dest, or FLAG_KEYWORDS), and every keyword
    has a flag or a reason in API_ONLY."""
    keywords = set(EngineConfig.keywords())
    flags = {FLAG_KEYWORDS.get(d, d) for d in engine_flags()}
    assert flags <= keywords, f"flags that are no EngineConfig keyword: {sorted(flags - keywords)}"
    missing = keywords - flags - set(API_ONLY)
    assert not missing, f"EngineConfig keywords without a flag or a reason: {sorted(missing)}"
    assert not set(API_ONLY) & flags, sorted(set(API_ONLY) & flags)
    assert "expert_parallel" in PARALLEL_FLAGS


def test_cli_flags_make_the_config_llm_makes():
    args = _parser().parse_args(
        [
            "some/model",
            "--max-num-seqs",
            "3",
            "--device-memory",
            "25%",
            "--cache-policy",
            "lfu",
            "--no-prefetch",
            "--dense",
            "int8",
            "--no-check-finite",
            "--expert-parallel",
            "2",
            "--peer-tier",
            "off",
        ]
    )
    c = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert c == EngineConfig.from_kwargs(
        model="some/model",
        max_num_seqs=3,
        device_memory="25%",
        cache_policy="lfu",
        prefetch="off",
        dense="int8",
        check_finite=False,
        progress=True,
        expert_parallel=ParallelConfig(2, peer_tier="off", exit_on_failure=True),
    )
    defaults = EngineConfig.from_kwargs(**engine_kwargs(_parser().parse_args([])))
    assert (
        dataclasses.replace(defaults, progress=False) == EngineConfig()
    )  # the flags' defaults are the config's


def test_a_tokenizer_directory_replaces_the_models_own(tmp_path):
    from fixture_paths import QWEN3_TOKENIZER_DIR

    from expertcache import LLM
    from expertcache.errors import CheckpointError

    llm = LLM(tokenizer=str(QWEN3_TOKENIZER_DIR))
    try:
        assert llm.tokenizer.encode("Hello world") == [
            9707,
            1879,
        ]  # the Qwen3 tokenizer's ids, not the demo's
    finally:
        llm.close()
    with pytest.raises(CheckpointError, match=r"--tokenizer .*: no tokenizer.json in that directory"):
        LLM(tokenizer=str(tmp_path))
