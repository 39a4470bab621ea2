"""DeepSeek-V2 / V3 (DeepSeek-V2-Lite, DeepSeek-V3, Kimi-K2): multi-head latent attention, shared
experts, dense first layers; V2 routes by softmax (greedy or group-limited), V3 by sigmoid scores
with a correction bias and expert groups (noaux_tc).

The MLA and router fields are shared with GLM-4.7-Flash (models/glm4_moe.py).
"""

from __future__ import annotations

from ..errors import ConfigError
from ..spec.model_config import MLA, ModelConfig, RouterSpec, check_value, require, yarn_mscale
from .common import base_fields, finish, get_float
from .family import Family, WeightNames, register

NAMES = WeightNames(("mlp",), "gate", ("gate_proj", "up_proj", "down_proj"), shared_expert="shared_experts")


def mla_fields(hf: dict, f: dict) -> dict:
    """MLA dims, head_dim (N + P) and the softmax scale (YaRN's mscale_all_dim squared, as the
    reference applies it). f: base_fields(hf)."""
    m = MLA(
        q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]),
        kv_lora_rank=int(require(hf, "kv_lora_rank")),
        qk_nope_head_dim=int(require(hf, "qk_nope_head_dim")),
        qk_rope_head_dim=int(require(hf, "qk_rope_head_dim")),
        v_head_dim=int(require(hf, "v_head_dim")),
    )
    if f["num_kv_heads"] != f["num_heads"]:
        raise ConfigError(
            f"config.json: num_key_value_heads={f['num_kv_heads']} must equal num_attention_heads="
            f"{f['num_heads']} for multi-head latent attention"
        )
    if m.qk_rope_head_dim % 2:
        raise ConfigError(f"config.json: qk_rope_head_dim={m.qk_rope_head_dim} must be even")
    rope = f["rope"]
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            "config.json: partial_rotary_factor != 1 is not supported with multi-head latent attention"
        )
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        scale *= (
            yarn_mscale(get_float(rope, "factor", 1.0, positive=True), get_float(rope, "mscale_all_dim", 0.0))
            ** 2
        )
    return dict(
        mla=m,
        head_dim=m.qk_nope_head_dim + m.qk_rope_head_dim,
        rotary_dim=m.qk_rope_head_dim,
        attn_scale=scale,
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
    )


def router_fields(hf: dict, methods: dict[str, str], scoring: str, num_experts: int) -> dict:
    """topk_method (methods: config value -> router kind), scoring_func, groups, norm_topk_prob,
    routed_scaling_factor."""
    method = check_value(hf, "topk_method", set(methods), next(iter(methods)))
    check_value(hf, "scoring_func", {scoring}, scoring)
    kind = methods[method]
    n_group = int(hf.get("n_group") or 1) if kind != "softmax" else 1
    topk_group = int(hf.get("topk_group") or 1) if kind != "softmax" else 1
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ConfigError(
            f"config.json: n_group={n_group} must divide n_routed_experts={num_experts} "
            f"and topk_group={topk_group} must be in 1..n_group"
        )
    top_k = int(require(hf, "num_experts_per_tok"))
    if kind == "noaux_tc" and top_k > topk_group * (num_experts // n_group):
        raise ConfigError(
            f"config.json: num_experts_per_tok={top_k} exceeds the experts of topk_group={topk_group} groups"
        )
    if kind == "noaux_tc" and num_experts // n_group < 2:
        raise ConfigError(
            f"config.json: noaux_tc routing needs at least 2 experts per group (n_group={n_group})"
        )
    spec = RouterSpec(
        kind=kind,
        n_group=n_group,
        topk_group=topk_group,
        scaling=get_float(hf, "routed_scaling_factor", 1.0, positive=True),
        float32_logits=True,
    )
    return dict(router=spec, norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def moe_fields(hf: dict, num_experts: int, sparse: tuple[bool, ...]) -> dict:
    """Routed + shared experts (n_shared_experts x moe_intermediate_size, no gate) and dense layers."""
    inter = int(require(hf, "moe_intermediate_size"))
    if hf.get("mlp_bias"):
        raise ConfigError("config.json: mlp_bias=true is not supported")
    return dict(
        num_experts=num_experts,
        moe_intermediate_size=inter,
        moe_layers=sparse,
        intermediate_size=int(
            hf.get("intermediate_size") or 0 if all(sparse) else require(hf, "intermediate_size")
        ),
        shared_expert_intermediate_size=inter * int(hf.get("n_shared_experts") or 0),
        shared_expert_gate=False,
    )


def deepseek_sparse_layers(hf: dict, n: int) -> tuple[bool, ...]:
    """Layer i has routed experts iff i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    first, freq = int(hf.get("first_k_dense_replace") or 0), int(hf.get("moe_layer_freq") or 1)
    return tuple(i >= first and i % freq == 0 for i in range(n))


def _parse(hf: dict, family: str, methods: dict[str, str], scoring: str) -> ModelConfig:
    f = base_fields(hf, family)
    e = int(require(hf, "n_routed_experts", "num_experts", "num_local_experts"))
    router = router_fields(hf, methods, scoring, e)
    if family == "deepseek_v2" and router["norm_topk_prob"]:
        raise ConfigError(
            "config.json: norm_topk_prob=true is not supported for DeepseekV2ForCausalLM "
            "(transformers' DeepSeek-V2 does not renormalise)"
        )
    n = f["num_layers"]
    return finish(
        {
            **f,
            **mla_fields(hf, f),
            **router,
            **moe_fields(hf, e, deepseek_sparse_layers(hf, n)),
            "qk_norm": None,
            "clip_qkv": None,
            "sliding_window": (None,) * n,
            # V2's reference rotates pairs (complex multiply) always; V3 when rope_interleave (default true)
            "rope_interleave": family == "deepseek_v2" or bool(hf.get("rope_interleave", True)),
        }
    )


def parse_v2(hf: dict):
    return _parse(
        hf, "deepseek_v2", {"greedy": "softmax", "group_limited_greedy": "group_limited_greedy"}, "softmax"
    )


def parse_v3(hf: dict):
    return _parse(hf, "deepseek_v3", {"noaux_tc": "noaux_tc"}, "sigmoid")


V2 = register(Family("deepseek_v2", ("DeepseekV2ForCausalLM",), parse_v2, NAMES))
V3 = register(Family("deepseek_v3", ("DeepseekV3ForCausalLM",), parse_v3, NAMES))
