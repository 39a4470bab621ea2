"""Mixtral (8x7B, 8x22B): experts w1 (gate) / w3 (up) / w2 (down), top-k renormalised, sliding window."""

from ..spec.model_config import require_int
from .common import base_fields, finish
from .family import Family, WeightNames, register


def parse(hf: dict):
    f = base_fields(hf, "mixtral")
    n = f["num_layers"]
    return finish(
        {
            **f,
            "qkv_bias": False,
            "o_bias": False,
            "qk_norm": None,
            "clip_qkv": None,
            "sliding_window": (hf.get("sliding_window"),) * n,
            "num_experts": require_int(hf, "num_local_experts", "num_experts"),
            "norm_topk_prob": True,
            "moe_intermediate_size": require_int(hf, "intermediate_size"),
            "intermediate_size": require_int(hf, "intermediate_size"),
            "moe_layers": (True,) * n,
            "shared_expert_intermediate_size": 0,
            "shared_expert_gate": False,
        }
    )


FAMILY = register(
    Family(
        "mixtral",
        ("MixtralForCausalLM",),
        parse,
        WeightNames(("block_sparse_moe", "mlp"), "gate", ("w1", "w3", "w2")),
    )
)
