"""openai/gpt-oss-20b and openai/gpt-oss-120b as published: config.json and every tensor's name,
dtype and shape, in sparse safetensors files (the headers are real, the data is holes), read by
`expertcache plan` and the expert layout without loading anything.
"""

from __future__ import annotations

import json
import os
import struct

import pytest

from expertcache.cli import main
from expertcache.experts.layout import ExpertSource
from expertcache.loader.safetensors_index import TensorIndex
from expertcache.models.registry import read_config
from expertcache.quant.checkpoint import method_from_config

H, I, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2880, 2880, 64, 8, 64, 201088
HUB = {"openai/gpt-oss-20b": dict(layers=24, experts=32), "openai/gpt-oss-120b": dict(layers=36, experts=128)}


def shipped_config(layers: int, experts: int) -> dict:
    """config.json as the hub repos have it (transformers 4.55 spelling: rope_scaling + rope_theta)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": H,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": I,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": HEADS,
        "num_experts_per_tok": 4,
        "num_hidden_layers": layers,
        "num_key_value_heads": KV_HEADS,
        "num_local_experts": experts,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def shipped_tensors(layers: int, experts: int) -> dict[str, tuple[str, list[int]]]:
    t = {
        "model.embed_tokens.weight": ("BF16", [VOCAB, H]),
        "model.norm.weight": ("BF16", [H]),
        "lm_head.weight": ("BF16", [VOCAB, H]),
    }
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = ("BF16", [H])
        t[f"{p}.post_attention_layernorm.weight"] = ("BF16", [H])
        for name, out, inp in (("q", q, H), ("k", kv, H), ("v", kv, H), ("o", H, q)):
            t[f"{p}.self_attn.{name}_proj.weight"] = ("BF16", [out, inp])
            t[f"{p}.self_attn.{name}_proj.bias"] = ("BF16", [out])
        t[f"{p}.self_attn.sinks"] = ("BF16", [HEADS])
        t[f"{p}.mlp.router.weight"] = ("BF16", [experts, H])
        t[f"{p}.mlp.router.bias"] = ("BF16", [experts])
        t[f"{p}.mlp.experts.gate_up_proj_blocks"] = ("U8", [experts, 2 * I, H // 32, 16])
        t[f"{p}.mlp.experts.gate_up_proj_scales"] = ("U8", [experts, 2 * I, H // 32])
        t[f"{p}.mlp.experts.gate_up_proj_bias"] = ("BF16", [experts, 2 * I])
        t[f"{p}.mlp.experts.down_proj_blocks"] = ("U8", [experts, H, I // 32, 16])
        t[f"{p}.mlp.experts.down_proj_scales"] = ("U8", [experts, H, I // 32])
        t[f"{p}.mlp.experts.down_proj_bias"] = ("BF16", [experts, H])
    return t


def write_sparse_safetensors(path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A safetensors file with these tensors whose data section is a hole; returns the data bytes."""
    size = {"BF16": 2, "U8": 1}
    header, off = {}, 0
    for name, (dtype, shape) in sorted(tensors.items()):
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)
    if os.stat(path).st_blocks * 512 > 64 << 20:
        pytest.skip("this filesystem has no sparse files")
    return off


def write_hub_layout(d, name: str) -> int:
    """config.json, generation_config.json and a sparse model.safetensors of hub repo `name` in d."""
    spec = HUB[name]
    (d / "config.json").write_text(json.dumps(shipped_config(spec["layers"], spec["experts"])))
    (d / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 199998,
                "do_sample": True,
                "eos_token_id": [200002, 199999, 200012],
                "pad_token_id": 199999,
            }
        )
    )
    return write_sparse_safetensors(d / "model.safetensors", shipped_tensors(spec["layers"], spec["experts"]))


@pytest.fixture(scope="module", params=list(HUB))
def hub(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param.split("/")[1])
    return request.param, HUB[request.param], d, write_hub_layout(d, request.param)


# bytes of one expert as shipped: blocks + e8m0 scales of gate_up [2I, H] and down [H, I], bf16 biases
EXPERT_BYTES = (2 * I * H // 2 + 2 * I * H // 32) + (H * I // 2 + H * I // 32) + 2 * (2 * I + H)


def test_config_and_expert_layout(hub):
    name, spec, d, _ = hub
    family, cfg, hf = read_config(d)
    assert (
        family.name == "gpt_oss" and cfg.num_layers == spec["layers"] and cfg.num_experts == spec["experts"]
    )
    assert cfg.sliding_window[:2] == (128, None) and cfg.eos_token_ids == (200002, 199999, 200012)
    assert (
        cfg.rope["rope_type"] == "yarn" and cfg.rope["rope_theta"] == 150000 and cfg.rope["truncate"] is False
    )
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)  # alpha: GptOssConfig's default
    index = TensorIndex(d)
    src = ExpertSource(index, cfg, family.names, method_from_config(hf))
    assert src.expert_nbytes == EXPERT_BYTES == 13_236_480
    assert src.ffn.fused_quant and src.ffn.interleaved and src.ffn.act == "clamped_swiglu"
    last, E = spec["layers"] - 1, spec["experts"]
    blocks = index.info(f"model.layers.{last}.mlp.experts.gate_up_proj_blocks")
    ((f, off, n),) = src.ranges(last, E - 1)["gate_up.weight_blocks"]
    assert (f, off, n) == (blocks.file, blocks.offset + (E - 1) * n, 2 * I * H // 2)
    bias = index.info(f"model.layers.{last}.mlp.experts.down_proj_bias")
    assert src.ranges(last, 1)["down_bias"] == [(bias.file, bias.offset + 2 * H, 2 * H)]


def test_plan_sizes(hub):
    """Experts (MXFP4 blocks + scales + biases), dense weights (sinks and biases included), KV per
    token and the device slots of an 8 GiB CUDA budget, as `expertcache plan` computes them."""
    import torch

    from expertcache.config import EngineConfig
    from expertcache.plan.model import device_plan, model_sizes, plan_memory, read_model

    name, spec, d, total = hub
    L, E = spec["layers"], spec["experts"]
    info = read_model(d)
    config = EngineConfig.from_kwargs(device="cuda", device_memory="100%")
    s = model_sizes(info, config)
    assert s.expert_stored == s.expert_fast == EXPERT_BYTES and s.stored_dtype == "mxfp4"
    assert s.experts_stored == L * E * EXPERT_BYTES
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    attn = (2 * H * q + 2 * H * kv + 2 * q + 2 * kv + H - q) * 2 + HEADS * 2  # q, k, v, o (+ biases), sinks
    per_layer = attn + (E * H + E) * 2 + 2 * H * 2  # router, two norms
    assert s.dense_stored == total - L * E * EXPERT_BYTES == 2 * VOCAB * H * 2 + H * 2 + L * per_layer
    assert s.dense_compute == device_plan(info, config).terms["dense"]  # the one dense figure
    assert s.kv_per_token == L * 2 * kv * 2  # k and v, bf16
    plan = plan_memory(info, torch.device("cuda"), torch.bfloat16, "8GiB", "16GiB")
    assert plan.device.slots == min(
        E, ((8 << 30) - EXPERT_BYTES) // (L * EXPERT_BYTES)
    )  # less one staging slot


def test_plan_command(tmp_path, capsys):
    """The command on gpt-oss-20b (one model: its speed band replays every layer's experts)."""
    d = tmp_path
    write_hub_layout(d, "openai/gpt-oss-20b")
    # 8 GiB is the whole GPU: dense 3.35 GiB, KV 1 GiB, logits bounded at ~274 MiB, the rest slots
    rc = main(
        [
            "plan",
            str(d),
            "--device",
            "cuda",
            "--device-memory",
            "6GiB",
            "--host-memory",
            "16GiB",
            "--gpu",
            "rtx4060-8gb",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1 and "does not fit" in out and "give at least 6.98 GiB" in out, out
    rc = main(
        [
            "plan",
            str(d),
            "--device",
            "cuda",
            "--device-memory",
            "8GiB",
            "--host-memory",
            "16GiB",
            "--gpu",
            "rtx4060-8gb",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "GptOssForCausalLM" in out and "one expert: 12.62 MiB stored (mxfp4)" in out
    assert "7 slots/layer x 24 layers" in out and "of 8.00 GiB" in out
