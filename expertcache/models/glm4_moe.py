"""GLM-4.5 / GLM-4.5-Air (Glm4MoeForCausalLM) and GLM-4.7-Flash (Glm4MoeLiteForCausalLM).

GLM-4.5: grouped-query attention with partial rotary (`partial_rotary_factor`, 0.5 when absent,
as transformers defaults it), q/k/v bias (`attention_bias`; o_proj has none), optional per-head
q/k RMSNorm (`use_qk_norm`), DeepSeek-V3 routing (sigmoid + correction bias, groups), shared
experts, dense first layers (`first_k_dense_replace`).
GLM-4.7-Flash: the same routing with DeepSeek's multi-head latent attention, `mlp_layer_types`
choosing dense or sparse per layer.
"""

from __future__ import annotations

from ..errors import ConfigError
from .common import base_fields, finish, get_float
from .deepseek import NAMES, mla_fields, moe_fields, router_fields
from .family import Family, register

ROUTING = {"noaux_tc": "noaux_tc"}


def parse(hf: dict):
    hf = {
        **hf,
        "partial_rotary_factor": hf.get(
            "partial_rotary_factor", (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5)
        ),
    }
    f = base_fields(hf, "glm4_moe", partial_rotary=True)
    e, n = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0), f["num_layers"]
    first = int(hf.get("first_k_dense_replace", 1) or 0)
    rotary = int(f["head_dim"] * get_float(f["rope"], "partial_rotary_factor", 1.0, positive=True))
    if rotary % 2 or not 0 < rotary <= f["head_dim"]:
        raise ConfigError(
            f"config.json: partial_rotary_factor={f['rope']['partial_rotary_factor']} of head_dim="
            f"{f['head_dim']} gives {rotary} rotary dims (must be even and positive)"
        )
    return finish(
        {
            **f,
            **router_fields(hf, ROUTING, "sigmoid", e),
            **moe_fields(hf, e, tuple(i >= first for i in range(n))),
            "rotary_dim": rotary,
            "qkv_bias": bool(hf.get("attention_bias", False)),
            "o_bias": False,
            "qk_norm": "head" if hf.get("use_qk_norm") else None,
            "clip_qkv": None,
            "sliding_window": (None,) * n,
        }
    )


def parse_lite(hf: dict):
    f = base_fields(hf, "glm4_moe_lite")
    e, n = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0), f["num_layers"]
    types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1)
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise ConfigError(
            f"config.json: mlp_layer_types={types} must list 'dense' or 'sparse' for each of the {n} layers"
        )
    leading = next((i for i, t in enumerate(types) if t == "sparse"), n)
    first = hf.get("first_k_dense_replace")
    if first is not None and int(first) != leading:
        raise ConfigError(
            f"config.json: first_k_dense_replace={first} disagrees with mlp_layer_types {types} "
            f"({leading} leading dense layers); transformers follows mlp_layer_types"
        )
    return finish(
        {
            **f,
            **mla_fields(hf, f),
            **router_fields(hf, ROUTING, "sigmoid", e),
            **moe_fields(hf, e, tuple(t == "sparse" for t in types)),
            "qk_norm": None,
            "clip_qkv": None,
            "sliding_window": (None,) * n,
            "rope_interleave": bool(hf.get("rope_interleave", True)),
        }
    )


GLM4_MOE = register(Family("glm4_moe", ("Glm4MoeForCausalLM",), parse, NAMES))
GLM4_MOE_LITE = register(Family("glm4_moe_lite", ("Glm4MoeLiteForCausalLM",), parse_lite, NAMES))
