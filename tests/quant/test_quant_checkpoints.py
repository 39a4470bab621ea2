"""Quantized checkpoints as they ship, hand-built from a tiny fp32 one, and their error messages.

(a) block fp8, DeepSeek-V3 / Qwen3-*-FP8 style: `quant_method: fp8`, `weight_block_size: [32, 32]`;
    every Linear weight (attention q/k/v/o, dense MLP, routed experts) float8_e4m3fn with
    `*.weight_scale_inv` [ceil(out/32), ceil(in/32)] (float32 as DeepSeek-V3 ships it, bf16 as the
    Qwen3 FP8 checkpoints do); embeddings, norms, routers (`mlp.gate`) and lm_head stay bf16, as
    `modules_to_not_convert` says in the real configs. Dims are NOT multiples of 32 (hidden 80,
    head_dim 20, kv 40, moe_intermediate 48, dense intermediate 72): ragged edge blocks everywhere.
(b) compressed-tensors fp8 (llm-compressor FP8_DYNAMIC / FP8): per-channel `*.weight_scale`
    [out, 1] (bf16) and per-tensor [1] or [] (float32, with static `*.input_scale` the engine ignores).
(c) mxfp4 (GPT-OSS encoding): per-expert `*.weight_blocks` [out, in/32, 16] u8 and
    `*.weight_scales` [out, in/32] u8 (e8m0); attention / router / embeddings / lm_head bf16.

Each is compared with a plain fp32 checkpoint built from the dequantized weights
(`dequantized_dense_checkpoint`): engine vs engine (atol 1e-5), transformers on the dense one,
and a tight cache (verify=True) vs resident. Checkpoints are written as two shards, so an
expert's weight and its scale can live in different files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import checkpoints
import pytest
import torch
from safetensors.torch import save_file
from safetensors_reference import independent_slot_checks
from test_quant_e2e import dequantized_dense_checkpoint

from expertcache import LLM, SamplingParams
from expertcache.errors import CheckpointError, ConfigError
from expertcache.quant.fp8_block import quantize_fp8_block
from expertcache.quant.fp8_channel import quantize_fp8_channel
from expertcache.quant.mxfp4 import quantize_mxfp4
from expertcache.quantize.rewrite import quantize_checkpoint


@pytest.fixture(autouse=True)
def _slot_checks_read_safetensors(monkeypatch):
    """verify=True and check(contents=True) compare slots with the checkpoint read by safetensors."""
    independent_slot_checks(monkeypatch)


B = 32
RAGGED = dict(
    hidden_size=80,
    head_dim=20,
    num_attention_heads=4,
    num_key_value_heads=2,
    moe_intermediate_size=48,
    intermediate_size=72,
    num_hidden_layers=3,
    mlp_only_layers=[1],
    num_experts=16,
    num_experts_per_tok=2,
)
MX = dict(
    hidden_size=64, moe_intermediate_size=64, num_hidden_layers=2, num_experts=16, num_experts_per_tok=2
)
SEQ = [(i * 29 + 7) % 300 + 3 for i in range(40)]
PROMPT = [5, 17, 42, 99, 7, 3]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
TIGHT = dict(device_memory="13%", host_memory="13%", cache_policy="lru", verify=True)
ERRORS = (CheckpointError, ConfigError, ValueError)
EXPERT = "model.layers.0.mlp.experts.3.up_proj"
ATTN = "model.layers.2.self_attn.k_proj"


# ---------------------------------------------------------------------------
# builders


def is_linear(name: str, t: torch.Tensor) -> bool:
    """Every nn.Linear weight of a Qwen3-MoE except the routers (`mlp.gate`) and lm_head."""
    return t.dim() == 2 and name.endswith("_proj.weight")


def write_checkpoint(
    src: Path, dst: Path, tensors: dict[str, torch.Tensor], qcfg: dict, shards: int = 2
) -> Path:
    """config.json (+ quantization_config), tensors in `shards` files + index, tokenizer files copied."""
    dst.mkdir(parents=True, exist_ok=True)
    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"] = qcfg
    hf["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(hf, indent=2))
    for f in src.iterdir():
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name not in ("config.json", "model.safetensors.index.json")
        ):
            (dst / f.name).write_bytes(f.read_bytes())
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]  # interleaved: a weight and its scale usually land in different files
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.nbytes for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return dst


def ship_fp8_block(src: Path, dst: Path, scale_dtype=torch.float32) -> Path:
    cfg = json.loads((src / "config.json").read_text())
    out = {}
    for name, t in checkpoints.read_tensors(src).items():
        t = t.to(torch.bfloat16)
        if is_linear(name, t):
            q, s = quantize_fp8_block(t.float(), (B, B))
            out[name] = q
            out[name[: -len("weight")] + "weight_scale_inv"] = s.to(scale_dtype)
        else:
            out[name] = t
    routers = [
        f"model.layers.{i}.mlp.gate"
        for i in range(cfg["num_hidden_layers"])
        if i not in cfg.get("mlp_only_layers", [])
    ]
    qcfg = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [B, B],
        "modules_to_not_convert": ["lm_head", *routers],
    }
    return write_checkpoint(src, dst, out, qcfg)


def ship_compressed_tensors(src: Path, dst: Path, strategy: str, scale_shape: str = "default") -> Path:
    out = {}
    for name, t in checkpoints.read_tensors(src).items():
        t = t.to(torch.bfloat16)
        if is_linear(name, t):
            q, s = quantize_fp8_channel(t.float(), strategy)
            base = name[: -len(".weight")]
            out[name] = q
            if strategy == "channel":
                out[f"{base}.weight_scale"] = s.to(torch.bfloat16)  # llm-compressor keeps the model dtype
            else:
                out[f"{base}.weight_scale"] = s.reshape(()) if scale_shape == "scalar" else s
                out[f"{base}.input_scale"] = torch.tensor([0.0123], dtype=torch.float32)
        else:
            out[name] = t
    act = (
        {"dynamic": True, "num_bits": 8, "strategy": "token", "symmetric": True, "type": "float"}
        if strategy == "channel"
        else {"dynamic": False, "num_bits": 8, "strategy": "tensor", "symmetric": True, "type": "float"}
    )
    qcfg = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "type": "float",
                    "num_bits": 8,
                    "strategy": strategy,
                    "symmetric": True,
                    "dynamic": False,
                    "group_size": None,
                    "block_structure": None,
                    "observer": "minmax",
                },
                "input_activations": act,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "kv_cache_scheme": None,
    }
    return write_checkpoint(src, dst, out, qcfg)


def ship_mxfp4(src: Path, dst: Path) -> Path:
    out = {}
    for name, t in checkpoints.read_tensors(src).items():
        t = t.to(torch.bfloat16)
        if ".mlp.experts." in name:
            blocks, scales = quantize_mxfp4(t.float())
            base = name[: -len(".weight")]
            out[f"{base}.weight_blocks"], out[f"{base}.weight_scales"] = blocks, scales
        else:
            out[name] = t
    qcfg = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    return write_checkpoint(src, dst, out, qcfg)


def edit_tensors(path: Path, fn) -> None:
    """Apply fn(dict) in place to a sharded checkpoint (rewrites it as one file)."""
    checkpoints.rewrite_tensors(path, fn)


# ---------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def ragged(checkpoint) -> Path:
    return checkpoint("qwen3_moe", **RAGGED)


@pytest.fixture(scope="module")
def mx_base(checkpoint) -> Path:
    return checkpoint("qwen3_moe", **MX)


@pytest.fixture(scope="module")
def fp8_shipped(ragged, tmp_path_factory) -> Path:
    return ship_fp8_block(ragged, tmp_path_factory.mktemp("fp8") / "model")


# ---------------------------------------------------------------------------
# as shipped == dense dequantized


def check_against_dense(shipped: Path, tmp_path: Path, oracle: bool = True) -> None:
    dense = dequantized_dense_checkpoint(shipped, tmp_path / "dense")
    q = LLM(str(shipped))
    d = LLM(str(dense))
    try:
        assert q.quant is not None and d.quant is None
        q_logits = q.logits(SEQ)
        torch.testing.assert_close(q_logits, d.logits(SEQ), atol=1e-5, rtol=1e-5)  # fp32 rounding order
        q_tokens = q.generate([PROMPT], GREEDY)[0].token_ids
        assert q_tokens == d.generate([PROMPT], GREEDY)[0].token_ids
    finally:
        d.close()
    tight = LLM(str(shipped), **TIGHT)
    try:
        assert tight.experts.device_slots == 2 and tight.experts.host_slots == 2, tight.plan_lines
        torch.testing.assert_close(tight.logits(SEQ), q_logits, atol=1e-5, rtol=0)
        assert tight.generate([PROMPT], GREEDY)[0].token_ids == q_tokens
        tight.experts.check(contents=True)
    finally:
        tight.close()
        q.close()
    if oracle:
        ref = checkpoints.load_reference(dense)
        torch.testing.assert_close(checkpoints.reference_logits(ref, SEQ), q_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=["f32-scales", "bf16-scales"])
def test_block_fp8_as_shipped(ragged, tmp_path, scale_dtype, fp8_shipped):
    shipped = (
        fp8_shipped if scale_dtype == torch.float32 else ship_fp8_block(ragged, tmp_path / "q", scale_dtype)
    )
    t = checkpoints.read_tensors(shipped)
    # the builder did what real checkpoints do
    assert t[f"{ATTN}.weight"].dtype == torch.float8_e4m3fn
    assert t[f"{ATTN}.weight_scale_inv"].shape == (2, 3)  # k_proj [40, 80], ragged both ways
    assert t["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn  # dense MLP layer
    assert t["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (3, 3)  # [80, 72]
    assert t[f"{EXPERT}.weight_scale_inv"].shape == (2, 3)  # [48, 80]
    for n in (
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate.weight",
        "model.norm.weight",
    ):
        assert t[n].dtype == torch.bfloat16, n
    check_against_dense(shipped, tmp_path, oracle=scale_dtype == torch.float32)


@pytest.mark.parametrize(
    "strategy,scale_shape", [("channel", "default"), ("tensor", "default"), ("tensor", "scalar")]
)
def test_compressed_tensors_fp8_as_shipped(ragged, tmp_path, strategy, scale_shape):
    shipped = ship_compressed_tensors(ragged, tmp_path / "q", strategy, scale_shape)
    t = checkpoints.read_tensors(shipped)
    want = {("channel", "default"): (48, 1), ("tensor", "default"): (1,), ("tensor", "scalar"): ()}
    assert tuple(t[f"{EXPERT}.weight_scale"].shape) == want[strategy, scale_shape]
    check_against_dense(shipped, tmp_path, oracle=scale_shape == "default")


def test_mxfp4_as_shipped(mx_base, tmp_path):
    shipped = ship_mxfp4(mx_base, tmp_path / "q")
    t = checkpoints.read_tensors(shipped)
    assert t[f"{EXPERT}.weight_blocks"].shape == (64, 2, 16) and t[f"{EXPERT}.weight_scales"].shape == (64, 2)
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    check_against_dense(shipped, tmp_path)


def test_quantize_refuses_already_quantized(fp8_shipped, tmp_path):
    with pytest.raises(ValueError, match=r"already quantized \(fp8\)") as e:
        quantize_checkpoint(fp8_shipped, tmp_path / "again", "int4", group_size=16)
    assert str(fp8_shipped) in str(e.value)
    assert not (tmp_path / "again").exists()


# ---------------------------------------------------------------------------
# clear errors


def broken(src: Path, tmp_path: Path, fn=None, **config) -> Path:
    dst = checkpoints.copy_checkpoint(src, tmp_path / "broken")
    if fn is not None:
        edit_tensors(dst, fn)
    if config:
        checkpoints.edit_config(dst, **config)
    return dst


def drop(name):
    def fn(t):
        del t[name]
        return t

    return fn


def replace(name, value):
    def fn(t):
        t[name] = value
        return t

    return fn


@pytest.mark.parametrize(
    "name", [f"{EXPERT}.weight_scale_inv", f"{ATTN}.weight_scale_inv"], ids=["expert", "attention"]
)
def test_missing_scale_names_tensor(fp8_shipped, tmp_path, name):
    path = broken(fp8_shipped, tmp_path, drop(name))
    with pytest.raises(ERRORS, match=re.escape(name[: -len(".weight_scale_inv")])) as e:
        LLM(str(path))
    assert "scale" in str(e.value)


@pytest.mark.parametrize(
    "name", [f"{EXPERT}.weight_scale_inv", f"{ATTN}.weight_scale_inv"], ids=["expert", "attention"]
)
def test_scale_with_wrong_shape_names_tensor(fp8_shipped, tmp_path, name):
    path = broken(fp8_shipped, tmp_path, replace(name, torch.ones(4, 4)))
    with pytest.raises(ERRORS, match=re.escape(name[: -len("_inv")] if "self_attn" in name else name)) as e:
        LLM(str(path))
    assert "[4, 4]" in str(e.value)


def test_block_size_in_config_vs_scale_shape(fp8_shipped, tmp_path):
    qcfg = json.loads((fp8_shipped / "config.json").read_text())["quantization_config"]
    path = broken(fp8_shipped, tmp_path, quantization_config={**qcfg, "weight_block_size": [64, 64]})
    with pytest.raises(ERRORS, match=r"model\.layers\.\d+\..*weight_scale") as e:
        LLM(str(path))
    assert "[2, 3]" in str(e.value)  # the scale it found (32x32 blocks) ...
    # ... and what 64x64 blocks need for that weight: a [2, 3] scale at 32 means out in 33..64 and in
    # in 65..96, so [ceil(out/64), ceil(in/64)] = [1, 2]
    assert "[1, 2]" in str(e.value)


def test_unknown_quant_method(fp8_shipped, tmp_path):
    path = broken(
        fp8_shipped, tmp_path, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}
    )
    with pytest.raises(ConfigError, match=r"quant_method.*'bitsandbytes'"):
        LLM(str(path))


def test_config_layout_without_its_tensors(fp8_shipped, tmp_path):
    """A config naming GPTQ over fp8 tensors: the first expert tensor GPTQ needs is named as missing."""
    path = broken(fp8_shipped, tmp_path, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(
        CheckpointError, match=r"missing tensor model\.layers\.0\.mlp\.experts\.0\.gate_proj\.qweight"
    ):
        LLM(str(path))


def test_unsupported_compressed_tensors_scheme(ragged, tmp_path):
    shipped = ship_compressed_tensors(ragged, tmp_path / "q", "channel")
    qcfg = json.loads((shipped / "config.json").read_text())["quantization_config"]
    qcfg["config_groups"]["group_0"]["weights"].update(
        type="int", num_bits=4, strategy="group", group_size=128
    )
    checkpoints.edit_config(shipped, quantization_config=qcfg)
    with pytest.raises(ConfigError, match="compressed-tensors format .* weights .* not supported"):
        LLM(str(shipped))


def test_fp8_tensor_without_quantization_config(fp8_shipped, tmp_path):
    path = broken(fp8_shipped, tmp_path, quantization_config=checkpoints.DELETE)
    with pytest.raises(ERRORS, match=r"model\.layers\.\d+\.(self_attn|mlp)\.\S+weight.*float8_e4m3fn"):
        LLM(str(path))


def test_mxfp4_blocks_with_wrong_shape(mx_base, tmp_path):
    shipped = ship_mxfp4(mx_base, tmp_path / "q")
    name = f"{EXPERT}.weight_blocks"
    edit_tensors(shipped, replace(name, torch.zeros(64, 1, 16, dtype=torch.uint8)))  # hidden 32 instead of 64
    with pytest.raises(CheckpointError, match=re.escape(name)):
        LLM(str(shipped))


@pytest.mark.parametrize("which", ["mxfp4-blocks", "fp8-scale-transposed"])
def test_expert_part_with_same_numel_but_wrong_shape(mx_base, fp8_shipped, tmp_path, which):
    """Regression (fixed in c524aeb): parts were compared by element count only and reinterpreted."""
    if which == "mxfp4-blocks":
        path = ship_mxfp4(mx_base, tmp_path / "q")
        name = f"{EXPERT}.weight_blocks"
        edit_tensors(path, replace(name, torch.zeros(64, 4, 8, dtype=torch.uint8)))  # [64, 2, 16] expected
    else:
        name = f"{EXPERT}.weight_scale_inv"
        path = broken(fp8_shipped, tmp_path, replace(name, torch.ones(3, 2)))  # [2, 3] expected
    with pytest.raises(ERRORS, match=re.escape(name)):
        LLM(str(path))


def test_scale_of_wrong_dtype(fp8_shipped, tmp_path):
    name = f"{EXPERT}.weight_scale_inv"
    path = broken(fp8_shipped, tmp_path, replace(name, torch.ones(2, 3, dtype=torch.int32)))
    with pytest.raises(ERRORS, match=re.escape(name)):
        LLM(str(path))


def test_every_expert_scale_of_wrong_dtype_fails_at_load(fp8_shipped, tmp_path):
    """Regression (fixed in c524aeb): an int32 scale passed load and failed at the first forward."""

    def all_int(t):
        for k in list(t):
            if ".experts." in k and k.endswith("weight_scale_inv"):
                t[k] = t[k].to(torch.int32)
        return t

    path = broken(fp8_shipped, tmp_path, all_int)
    with pytest.raises(ERRORS, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight_scale_inv"):
        LLM(str(path))


def test_fp8_experts_without_quantization_config(fp8_shipped, tmp_path):
    """Regression (fixed in c524aeb): fp8 experts without a config ran as plain weights, scales ignored."""
    from expertcache.quant.fp8_block import dequantize_fp8_block

    def dense_bf16(t):  # only the experts stay fp8
        for k in list(t):
            if k.endswith(".weight") and t[k].dtype == torch.float8_e4m3fn and ".experts." not in k:
                t[k] = dequantize_fp8_block(
                    t[k], t.pop(f"{k[: -len('weight')]}weight_scale_inv"), (B, B)
                ).bfloat16()
        return t

    path = broken(fp8_shipped, tmp_path, dense_bf16, quantization_config=checkpoints.DELETE)
    with pytest.raises(ConfigError, match=r"experts.*float8_e4m3fn"):
        LLM(str(path))
