"""Hybrid linear-attention MoE: Qwen3-Next (Qwen3-Next-80B-A3B) and Qwen3.5/3.6-MoE (Qwen3.5-35B-A3B).

Both decoders mix Gated DeltaNet layers (`layer_types` "linear_attention", layers/gated_deltanet.py)
with gated softmax attention ("full_attention": q_proj also yields a per-head output gate, per-head
q/k RMSNorm, partial rotary). Their RMSNorms are zero-centred (scale 1 + weight), except the
gated norm inside the DeltaNet. MoE layers have a sigmoid-gated shared expert. The
multi-token-prediction head (`mtp.*`) is not used.

Qwen3-Next packs the DeltaNet projections per key head (`in_proj_qkvz`, `in_proj_ba`); Qwen3.5
stores them apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); gated_deltanet.load_weights
reads either. Qwen3.5-MoE always renormalises the top-k weights and has no dense layers. The hub's
`Qwen3_5MoeForConditionalGeneration` checkpoints (text + vision) keep the text model's fields under
`text_config` and its tensors under `model.language_model.*`: the text model is read, the vision
tower (`model.visual.*`) is not (prompts are text only).
"""

from ..spec.model_config import LinearAttnConfig, require
from .common import base_fields, finish, get_float, raise_cfg, sparse_layers
from .family import Family, WeightNames, register

LAYER_TYPES = ("linear_attention", "full_attention")


def linear_attn_config(hf: dict, num_layers: int) -> LinearAttnConfig:
    types = hf.get("layer_types")
    if types is None:  # transformers' default: every full_attention_interval-th layer is softmax attention
        every = int(hf.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise_cfg(f"layer_types must list {num_layers} entries from {LAYER_TYPES}, got {types!r}")
    la = LinearAttnConfig(
        layers=tuple(t == "linear_attention" for t in types),
        num_k_heads=int(require(hf, "linear_num_key_heads")),
        num_v_heads=int(require(hf, "linear_num_value_heads")),
        k_head_dim=int(require(hf, "linear_key_head_dim")),
        v_head_dim=int(require(hf, "linear_value_head_dim")),
        conv_kernel=int(require(hf, "linear_conv_kernel_dim")),
    )
    if la.num_v_heads % la.num_k_heads:
        raise_cfg("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if la.conv_kernel < 2:
        raise_cfg(f"linear_conv_kernel_dim={la.conv_kernel} must be >= 2")
    return la


def _parse(hf: dict, family: str, moe_layers) -> dict:
    f = base_fields(hf, family, partial_rotary=True)
    e = int(require(hf, "num_experts"))
    n = f["num_layers"]
    bias = bool(hf.get("attention_bias", False))
    rotary = int(f["head_dim"] * get_float(f["rope"], "partial_rotary_factor", 1.0, positive=True))
    if rotary % 2 or not 0 < rotary <= f["head_dim"]:
        raise_cfg(
            f"partial_rotary_factor of head_dim={f['head_dim']} gives {rotary} rotary dims "
            "(must be even and positive)"
        )
    return {
        **f,
        "rotary_dim": rotary,
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": "head",
        "clip_qkv": None,
        "sliding_window": (None,) * n,
        "num_experts": e,
        "moe_intermediate_size": int(require(hf, "moe_intermediate_size")),
        "moe_layers": moe_layers(hf, n, e),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0),
        "shared_expert_gate": True,
        "attn_output_gate": True,
        "norm_offset": 1.0,
        "linear_attn": linear_attn_config(hf, n),
    }


def parse_next(hf: dict):
    f = _parse(hf, "qwen3_next", sparse_layers)
    return finish(
        {
            **f,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "intermediate_size": int(hf.get("intermediate_size", 0)),
        }
    )


def parse_qwen35(hf: dict):
    if isinstance(hf.get("text_config"), dict):  # ConditionalGeneration config: the text model's fields
        text = hf["text_config"]
        hf = {**text, **{k: hf[k] for k in ("eos_token_id", "tie_word_embeddings") if hf.get(k) is not None}}
    f = _parse(hf, "qwen3_5_moe", lambda hf, n, e: (True,) * n)
    return finish({**f, "norm_topk_prob": True, "intermediate_size": 0})


def text_tensors(name: str) -> str | None:
    """Checkpoint name -> decoder name: `model.language_model.*` -> `model.*`; vision and MTP left out."""
    if name.startswith(("mtp.", "model.visual.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


NAMES = WeightNames(("mlp",), "gate", ("gate_proj", "up_proj", "down_proj"))
NEXT = register(Family("qwen3_next", ("Qwen3NextForCausalLM",), parse_next, NAMES, text_tensors))
QWEN35 = register(
    Family(
        "qwen3_5_moe",
        ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        parse_qwen35,
        NAMES,
        text_tensors,
    )
)
