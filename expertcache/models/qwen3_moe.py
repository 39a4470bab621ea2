"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head q/k RMSNorm, no shared expert."""

from ..spec.model_config import get_int, require_int
from .common import base_fields, finish, sparse_layers
from .family import Family, WeightNames, register


def parse(hf: dict):
    f = base_fields(hf, "qwen3_moe")
    e = require_int(hf, "num_experts", "num_local_experts")
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return finish(
        {
            **f,
            "qkv_bias": bool(hf.get("attention_bias", False)),
            "o_bias": bool(hf.get("attention_bias", False)),
            "qk_norm": "head",
            "clip_qkv": None,
            "sliding_window": (window,) * f["num_layers"],
            "num_experts": e,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "moe_intermediate_size": require_int(hf, "moe_intermediate_size"),
            "intermediate_size": get_int(hf, "intermediate_size", 0),
            "moe_layers": sparse_layers(hf, f["num_layers"], e),
            "shared_expert_intermediate_size": 0,
            "shared_expert_gate": False,
        }
    )


FAMILY = register(
    Family(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        parse,
        WeightNames(("mlp",), "gate", ("gate_proj", "up_proj", "down_proj")),
    )
)
