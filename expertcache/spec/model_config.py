"""ModelConfig: the math-relevant fields of a Hugging Face MoE config.json, normalised.

Families (models/<family>.py) fill it from their own field names; everything
after loading reads only this object. A field the engine does not implement
raises ConfigError naming it, so no checkpoint silently becomes another model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention dims (DeepSeek-V2/V3, GLM-4.7-Flash). Per token the KV cache holds
    the normed latent (kv_lora_rank) and the shared roped key (qk_rope_head_dim), not expanded heads."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class RouterSpec:
    """How a MoE layer picks its experts: `kind` names a router in layers/moe.ROUTERS."""

    kind: str = "softmax"  # softmax | topk_softmax | group_limited_greedy | noaux_tc
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0  # routed_scaling_factor: multiplies the chosen experts' weights
    float32_logits: bool = False  # router logits from float32 x and weight (else the compute dtype)


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: str | None  # None | "head" (per head_dim, Qwen3) | "full" (whole projection, OLMoE)
    clip_qkv: float | None
    sliding_window: tuple[int | None, ...]  # per layer, None = full attention
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_intermediate_size: int
    intermediate_size: int  # dense MLP layers
    moe_layers: tuple[bool, ...]  # per layer: routed experts (True) or dense MLP
    shared_expert_intermediate_size: int  # 0 = no shared expert
    shared_expert_gate: bool
    rope: dict = field(default_factory=dict)  # normalised rope parameters (rope_type, rope_theta, ...)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    attn_sinks: bool = False  # a learned logit per head in the softmax denominator (self_attn.sinks)
    router_bias: bool = False
    expert_bias: bool = False  # routed experts carry gate_up / down biases
    expert_act: str = "silu"  # experts.compute.ACTIVATIONS: "silu" | "clamped_swiglu"
    swiglu_alpha: float = 1.0  # clamped_swiglu only
    swiglu_limit: float = float("inf")
    rotary_dim: int | None = None  # dims rotated per head (partial rotary); None = all of head_dim
    rope_interleave: bool = False  # rotary dims stored as interleaved pairs (permuted to half-split at load)
    mla: MLA | None = None  # multi-head latent attention instead of q/k/v projections
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    router: RouterSpec = field(default_factory=RouterSpec)
    attn_output_gate: bool = (
        False  # q_proj also yields a per-head gate: o = attn * sigmoid(gate) (Qwen3-Next)
    )
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): 1.0 for zero-centred norms (Qwen3-Next)
    linear_attn: LinearAttnConfig | None = None  # hybrid models: the Gated DeltaNet layers

    @property
    def moe_layer_ids(self) -> list[int]:
        return [i for i, m in enumerate(self.moe_layers) if m]

    def is_linear(self, layer: int) -> bool:
        return self.linear_attn is not None and self.linear_attn.layers[layer]

    @property
    def attention_layer_ids(self) -> list[int]:
        """Layers with softmax attention (the ones that own KV cache blocks)."""
        return [i for i in range(self.num_layers) if not self.is_linear(i)]

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def kv_token_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per layer and token, the shapes of the tensors the KV cache stores: (k, v) heads, or the
        MLA latent [kv_lora_rank + qk_rope_head_dim] alone."""
        if self.mla is not None:
            return ((self.mla.kv_lora_rank + self.mla.qk_rope_head_dim,),)
        return ((self.num_kv_heads, self.head_dim),) * 2


@dataclass(frozen=True)
class LinearAttnConfig:
    """Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5-MoE linear_attention layers)."""

    layers: tuple[bool, ...]  # per layer: linear attention (True) or softmax attention
    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads: each q/k head serves num_v_heads // num_k_heads v heads
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # causal depthwise conv width; the conv state keeps conv_kernel - 1 inputs

    @property
    def conv_dim(self) -> int:  # channels of the convolved q|k|v projection
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


def require(hf: dict, key: str, *aliases: str):
    """hf[key] (or the first alias present); ConfigError naming the field when absent."""
    for k in (key, *aliases):
        if hf.get(k) is not None:
            return hf[k]
    raise ConfigError(f"config.json: missing required field {key!r}")


def as_int(value, key: str, minimum: int = 1) -> int:
    """A config number the math needs as an integer (an integral float such as 2048.0 passes);
    ConfigError naming the file, field and value otherwise."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config.json: {key} must be an integer >= {minimum}, got {value!r}")
    return value


def require_int(hf: dict, key: str, *aliases: str, minimum: int = 1) -> int:
    """hf[key] (or the first alias present) as an integer >= minimum; ConfigError naming the field."""
    name = next((k for k in (key, *aliases) if hf.get(k) is not None), key)
    return as_int(require(hf, key, *aliases), name, minimum)


def get_int(hf: dict, key: str, default: int, minimum: int = 0) -> int:
    """hf[key] as an integer >= minimum, or default when absent or null."""
    value = hf.get(key)
    return default if value is None else as_int(value, key, minimum)


def check_value(hf: dict, key: str, allowed, default=None):
    value = hf.get(key, default)
    if value not in allowed:
        raise ConfigError(
            f"config.json: {key}={value!r} is not supported (supported: {sorted(map(str, allowed))})"
        )
    return value


def rope_parameters(hf: dict, partial_rotary: bool = False) -> dict:
    """Merge the v5 `rope_parameters` and the legacy `rope_theta`/`rope_scaling` fields.

    partial_rotary: the family rotates `partial_rotary_factor` of each head (a top-level field
    is moved into the result); otherwise a factor != 1 is an error."""
    rope = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    for k, v in legacy.items():
        rope.setdefault(k, v)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if rope["rope_type"] not in ROPE_TYPES:
        raise ConfigError(
            f"config.json: rope type {rope['rope_type']!r} is not supported (supported: {ROPE_TYPES})"
        )
    if hf.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    if not partial_rotary and rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("config.json: partial_rotary_factor != 1 is not supported for this family")
    return rope


ROPE_TYPES = ("default", "linear", "yarn", "llama3")


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_dim/2] and the cos/sin scale for cfg.rope."""
    r, dim = cfg.rope, cfg.rope_dim
    base = float(r["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    kind = r["rope_type"]
    if kind == "default":
        return inv, 1.0
    factor = float(r["factor"])
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        old = r["original_max_position_embeddings"]
        low_wl, high_wl = old / r["low_freq_factor"], old / r["high_freq_factor"]
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (old / wl - r["low_freq_factor"]) / (r["high_freq_factor"] - r["low_freq_factor"])
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wl >= high_wl) & (wl <= low_wl)
        return torch.where(mid, smoothed, scaled), 1.0
    # yarn
    orig = r.get("original_max_position_embeddings") or cfg.max_position_embeddings

    attn = r.get("attention_factor")
    if attn is None:
        m, m_all = r.get("mscale"), r.get("mscale_all_dim")
        attn = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if (m and m_all) else yarn_mscale(factor)
    beta_fast, beta_slow = r.get("beta_fast") or 32, r.get("beta_slow") or 1

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if r.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp
    return (inv / factor) * (1 - extrap) + inv * extrap, float(attn)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
