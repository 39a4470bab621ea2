"""GPT-OSS (gpt-oss-20b, gpt-oss-120b).

Attention: a learned sink logit per head, sliding-window and full layers as `layer_types` says,
q/k/v/o biases, YaRN. Router: linear with bias, top-k of the logits, softmax over those k.
Experts: fused `experts.gate_up_proj` [E, H, 2I] (gate/up interleaved by row: gate = even) and
`experts.down_proj` [E, I, H] with biases, activation (up + 1) * g * sigmoid(alpha * g) after
clamping g <= limit and |up| <= limit. As shipped, experts are MXFP4 (`*_blocks` / `*_scales`,
quantization_config.quant_method "mxfp4", [E, out, in/32, 16]) and the dense weights bf16.

Defaults for fields a config.json leaves out are transformers' GptOssConfig defaults. Fields
with no effect on inference (router_aux_loss_coef, attention_dropout, initializer_range, the
legacy `experts_per_token` / `initial_context_length`, and `hidden_act`, which GPT-OSS experts
do not use) are not read.
"""

from __future__ import annotations

from ..spec.model_config import RouterSpec, require
from .common import base_fields, finish, raise_cfg
from .family import Family, WeightNames, register

LAYER_TYPES = ("sliding_attention", "full_attention")
DEFAULTS = dict(
    rms_norm_eps=1e-5,
    rope_theta=150000.0,
    num_key_value_heads=8,
    head_dim=64,
    sliding_window=128,
    attention_bias=True,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    num_experts_per_tok=4,
)
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def parse(hf: dict):
    hf = {**DEFAULTS, **hf}  # absent fields only: an explicit null means what transformers makes of it
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        hf["rope_parameters"] = dict(DEFAULT_ROPE)
    hf["hidden_act"] = "silu"  # not used by GPT-OSS (its expert activation is fixed)
    f = base_fields(hf, "gpt_oss")
    n = f["num_layers"]
    types = hf.get("layer_types") or [LAYER_TYPES[(i + 1) % 2 == 0] for i in range(n)]
    if len(types) != n:
        raise_cfg(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise_cfg(f"layer_types {bad} are not supported (supported: {list(LAYER_TYPES)})")
    window = hf.get("sliding_window")
    if window is None and "sliding_attention" in types:
        raise_cfg("layer_types has sliding_attention layers but sliding_window is null")
    alpha, limit = _number(hf, "swiglu_alpha"), _number(hf, "swiglu_limit")
    if not limit > 0:
        raise_cfg(f"swiglu_limit={limit!r} must be positive")
    bias = bool(hf["attention_bias"])
    return finish(
        {
            **f,
            "qkv_bias": bias,
            "o_bias": bias,
            "qk_norm": None,
            "clip_qkv": None,
            "sliding_window": tuple(int(window) if t == "sliding_attention" else None for t in types),
            "num_experts": int(require(hf, "num_local_experts", "num_experts")),
            "norm_topk_prob": False,
            "moe_intermediate_size": int(require(hf, "intermediate_size")),
            "intermediate_size": 0,
            "moe_layers": (True,) * n,
            "shared_expert_intermediate_size": 0,
            "shared_expert_gate": False,
            "attn_sinks": True,
            "router_bias": True,
            "router": RouterSpec(kind="topk_softmax"),
            "expert_bias": True,
            "expert_act": "clamped_swiglu",
            "swiglu_alpha": alpha,
            "swiglu_limit": limit,
        }
    )


def _number(hf: dict, key: str) -> float:
    v = hf[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise_cfg(f"{key}={v!r} must be a number")
    return float(v)


FAMILY = register(
    Family(
        "gpt_oss",
        ("GptOssForCausalLM",),
        parse,
        WeightNames(
            ("mlp",),
            "router",
            ("gate_proj", "up_proj", "down_proj"),
            fused_transposed=True,
            gate_up_interleaved=True,
        ),
    )
)
