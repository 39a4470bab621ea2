"""OLMoE (OLMoE-1B-7B): RMSNorm over the whole q and k projections, optional clip_qkv."""

from ..spec.model_config import require_int
from .common import base_fields, finish
from .family import Family, WeightNames, register


def parse(hf: dict):
    f = base_fields(hf, "olmoe")
    n = f["num_layers"]
    return finish(
        {
            **f,
            "qkv_bias": bool(hf.get("attention_bias", False)),
            "o_bias": bool(hf.get("attention_bias", False)),
            "qk_norm": "full",
            "clip_qkv": hf.get("clip_qkv"),
            "sliding_window": (None,) * n,
            "num_experts": require_int(hf, "num_experts", "num_local_experts"),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "moe_intermediate_size": require_int(hf, "intermediate_size"),
            "intermediate_size": require_int(hf, "intermediate_size"),
            "moe_layers": (True,) * n,
            "shared_expert_intermediate_size": 0,
            "shared_expert_gate": False,
        }
    )


FAMILY = register(
    Family(
        "olmoe",
        ("OlmoeForCausalLM",),
        parse,
        WeightNames(("mlp",), "gate", ("gate_proj", "up_proj", "down_proj")),
    )
)
