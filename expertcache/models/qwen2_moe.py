"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v bias, shared expert behind a sigmoid gate."""

from ..spec.model_config import get_int, require_int
from .common import base_fields, finish, sparse_layers
from .family import Family, WeightNames, register


def parse(hf: dict):
    f = base_fields(hf, "qwen2_moe")
    e = require_int(hf, "num_experts", "num_local_experts")
    n = f["num_layers"]
    if hf.get("use_sliding_window"):
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 and i < hf.get("max_window_layers", 28) else "full_attention"
            for i in range(n)
        ]
        window = tuple(hf.get("sliding_window") if t == "sliding_attention" else None for t in types)
    else:
        window = (None,) * n
    return finish(
        {
            **f,
            "qkv_bias": bool(hf.get("qkv_bias", True)),
            "o_bias": False,
            "qk_norm": None,
            "clip_qkv": None,
            "sliding_window": window,
            "num_experts": e,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "moe_intermediate_size": require_int(hf, "moe_intermediate_size"),
            "intermediate_size": get_int(hf, "intermediate_size", 0),
            "moe_layers": sparse_layers(hf, n, e),
            "shared_expert_intermediate_size": get_int(hf, "shared_expert_intermediate_size", 0),
            "shared_expert_gate": True,
        }
    )


FAMILY = register(
    Family(
        "qwen2_moe",
        ("Qwen2MoeForCausalLM",),
        parse,
        WeightNames(("mlp",), "gate", ("gate_proj", "up_proj", "down_proj")),
    )
)
