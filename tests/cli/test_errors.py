"""Broken checkpoints give a CheckpointError / ConfigError whose message names the problem."""

from __future__ import annotations

import re
from pathlib import Path

import checkpoints as C
import pytest
import torch

# Errors may surface while loading or on first use (lazily loaded experts): both count.
PROBE = [5, 17, 200, 3, 44]


@pytest.fixture(scope="module")
def errors(expertcache_api):
    from expertcache import errors

    assert issubclass(errors.CheckpointError, ValueError)
    assert issubclass(errors.ConfigError, ValueError)
    return errors


@pytest.fixture
def broken(qwen3_checkpoint, tmp_path) -> Path:
    """A private copy of the default tiny Qwen3-MoE checkpoint to damage."""
    return C.copy_checkpoint(qwen3_checkpoint, tmp_path / "model")


@pytest.fixture
def broken_sharded(checkpoint, tmp_path) -> Path:
    return C.copy_checkpoint(checkpoint("qwen3_moe", max_shard_size="100KB"), tmp_path / "sharded")


def load_and_run(api, path):
    llm = api.LLM(str(path), device="cpu")
    llm.logits(PROBE)
    llm.generate([PROBE], api.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return llm


def expect(api, path, exc_type, *needles):
    with pytest.raises(exc_type) as info:
        load_and_run(api, path)
    msg = str(info.value)
    for needle in needles:
        if isinstance(needle, re.Pattern):
            assert needle.search(msg), f"{needle.pattern!r} not in error message: {msg}"
        else:
            assert needle in msg, f"{needle!r} not in error message: {msg}"
    return msg


def shape_pattern(shape) -> str:
    """[32, 37], (32, 37), torch.Size([32, 37]), (16,) ..."""
    return r"[\[(]\s*" + r"\s*,\s*".join(str(d) for d in shape) + r"\s*,?\s*[\])]"


def edit_tensors(path, fn):
    C.rewrite_tensors(path, fn)


# ---------------------------------------------------------------------------
# tensors


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.experts.3.up_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.norm.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor(expertcache_api, errors, broken, name):
    edit_tensors(broken, lambda t: {k: v for k, v in t.items() if k != name})
    expect(expertcache_api, broken, errors.CheckpointError, name)


def test_missing_fused_expert_tensor(expertcache_api, errors, qwen3_checkpoint, tmp_path):
    fused = C.to_fused_layout(qwen3_checkpoint, tmp_path / "fused")
    name = "model.layers.1.mlp.experts.down_proj"
    edit_tensors(fused, lambda t: {k: v for k, v in t.items() if k != name})
    expect(expertcache_api, fused, errors.CheckpointError, "model.layers.1.mlp.experts")


@pytest.mark.parametrize(
    "name,bad_shape",
    [
        ("model.layers.0.self_attn.k_proj.weight", (32, 37)),  # expected (32, 64)
        ("model.layers.1.mlp.experts.5.gate_proj.weight", (31, 64)),  # expected (32, 64)
        ("model.embed_tokens.weight", (300, 64)),  # expected (320, 64)
        ("model.layers.0.self_attn.q_norm.weight", (15,)),  # expected (16,)
    ],
)
def test_wrong_shape(expertcache_api, errors, broken, name, bad_shape):
    expected = tuple(C.read_tensors(broken)[name].shape)

    def damage(t):
        t[name] = torch.zeros(bad_shape)
        return t

    edit_tensors(broken, damage)
    msg = expect(expertcache_api, broken, errors.CheckpointError, name)
    for shape in (expected, bad_shape):
        assert re.search(shape_pattern(shape), msg), f"shape {list(shape)} not named in: {msg}"


def test_wrong_fused_expert_shape(expertcache_api, errors, qwen3_checkpoint, tmp_path):
    fused = C.to_fused_layout(qwen3_checkpoint, tmp_path / "fused")
    name = "model.layers.0.mlp.experts.gate_up_proj"  # expected [8, 64, 64]

    def damage(t):
        t[name] = t[name][:, :60, :].clone()
        return t

    edit_tensors(fused, damage)
    expect(
        expertcache_api,
        fused,
        errors.CheckpointError,
        name,
        re.compile(shape_pattern((8, 60, 64))),
        re.compile(shape_pattern((8, 64, 64))),
    )


def test_truncated_safetensors(expertcache_api, errors, broken):
    f = broken / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    expect(expertcache_api, broken, errors.CheckpointError, "model.safetensors")


def test_truncated_shard(expertcache_api, errors, broken_sharded):
    shard = sorted(broken_sharded.glob("model-*.safetensors"))[2]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    expect(expertcache_api, broken_sharded, errors.CheckpointError, shard.name)


def test_garbage_safetensors_header(expertcache_api, errors, broken):
    f = broken / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff" * 32
    f.write_bytes(bytes(data))
    expect(expertcache_api, broken, errors.CheckpointError, "model.safetensors")


def test_missing_shard_file(expertcache_api, errors, broken_sharded):
    shard = sorted(broken_sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    expect(expertcache_api, broken_sharded, errors.CheckpointError, shard.name)


def test_no_weights_at_all(expertcache_api, errors, broken):
    (broken / "model.safetensors").unlink()
    expect(expertcache_api, broken, errors.CheckpointError, "safetensors")


# ---------------------------------------------------------------------------
# config.json


def test_config_bad_json(expertcache_api, errors, broken):
    (broken / "config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,')
    expect(expertcache_api, broken, (errors.ConfigError, errors.CheckpointError), "config.json")


def test_config_missing_file(expertcache_api, errors, broken):
    (broken / "config.json").unlink()
    expect(expertcache_api, broken, (errors.ConfigError, errors.CheckpointError), "config.json")


@pytest.mark.parametrize(
    "field",
    [
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "vocab_size",
        "moe_intermediate_size",
        "num_experts_per_tok",
    ],
)
def test_config_missing_required_field(expertcache_api, errors, broken, field):
    C.edit_config(broken, **{field: C.DELETE})
    expect(expertcache_api, broken, errors.ConfigError, field)


def test_config_missing_num_experts(expertcache_api, errors, broken):
    C.edit_config(broken, num_local_experts=C.DELETE, num_experts=C.DELETE)
    expect(expertcache_api, broken, errors.ConfigError, "num_experts")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "JambaForCausalLM"])
def test_unsupported_architecture(expertcache_api, errors, broken, arch):
    C.edit_config(broken, architectures=[arch], model_type=arch.lower())
    expect(expertcache_api, broken, errors.ConfigError, arch)


@pytest.mark.parametrize(
    "changes,needles",
    [
        ({"hidden_act": "gelu"}, ("hidden_act", "gelu")),
        (
            {"rope_parameters": {"rope_type": "longrope_x", "rope_theta": 10000.0, "factor": 2.0}},
            ("longrope_x",),
        ),
        (
            {
                "rope_parameters": C.DELETE,
                "rope_theta": 10000.0,
                "rope_scaling": {"type": "su_x", "factor": 2.0},
            },
            ("su_x",),
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                }
            },
            ("partial_rotary_factor",),
        ),
    ],
)
def test_unsupported_config_value(expertcache_api, errors, broken, changes, needles):
    C.edit_config(broken, **changes)
    expect(expertcache_api, broken, errors.ConfigError, *needles)


def test_generation_config_bad_json(expertcache_api, errors, broken):
    (broken / "generation_config.json").write_text("{eos_token_id: 2")
    expect(expertcache_api, broken, (errors.ConfigError, errors.CheckpointError), "generation_config.json")


# ---------------------------------------------------------------------------
# tokenizer


def test_missing_tokenizer(expertcache_api, errors, broken):
    """Without tokenizer.json the model still runs on token ids; text needs the tokenizer and
    raises CheckpointError naming it."""
    (broken / "tokenizer.json").unlink()
    api = expertcache_api
    llm = api.LLM(str(broken), device="cpu")
    params = api.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    out = llm.generate([PROBE], params)[0]
    assert len(out.token_ids) == 3
    with pytest.raises(errors.CheckpointError, match="tokenizer"):
        llm.generate("Hello world", params)
    with pytest.raises(errors.CheckpointError, match="tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], params)


def test_corrupt_tokenizer(expertcache_api, errors, broken):
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(errors.CheckpointError, match="tokenizer"):
        api = expertcache_api
        llm = api.LLM(str(broken), device="cpu")
        llm.generate("Hello world", api.SamplingParams(max_tokens=2))


def test_missing_model_dir(expertcache_api, errors, tmp_path):
    with pytest.raises(errors.CheckpointError) as info:
        expertcache_api.LLM(str(tmp_path / "nope"), device="cpu")
    assert "nope" in str(info.value)
