"""Config parsing shared by the families: the fields every Llama-like MoE has."""

from __future__ import annotations

import math

from ..spec.model_config import ModelConfig, as_int, check_value, get_int, require_int, rope_parameters


def base_fields(hf: dict, family: str, partial_rotary: bool = False) -> dict:
    """Fields whose names are common to all supported families (partial_rotary: see rope_parameters)."""
    check_value(hf, "hidden_act", {"silu"}, "silu")
    hidden = require_int(hf, "hidden_size")
    heads = require_int(hf, "num_attention_heads")
    eos = hf.get("eos_token_id")
    eos = (
        ()
        if eos is None
        else tuple(as_int(e, "eos_token_id", 0) for e in (eos if isinstance(eos, list) else [eos]))
    )
    num_layers = require_int(hf, "num_hidden_layers")
    return dict(
        family=family,
        vocab_size=require_int(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=get_int(hf, "num_key_value_heads", heads, 1),
        head_dim=get_int(hf, "head_dim", hidden // heads, 1),
        rms_norm_eps=get_float(hf, "rms_norm_eps", 1e-6, positive=True),
        max_position_embeddings=get_int(hf, "max_position_embeddings", 32768, 1),
        tie_word_embeddings=get_bool(hf, "tie_word_embeddings", False),
        top_k=require_int(hf, "num_experts_per_tok"),
        rope=rope_parameters(hf, partial_rotary),
        eos_token_ids=eos,
        bos_token_id=hf.get("bos_token_id"),
    )


def get_float(hf: dict, key: str, default: float, positive: bool = False) -> float:
    """hf[key] as a finite float (an int passes; absent or null: default); ConfigError naming the field
    and config.json otherwise (a string such as "tiny", a bool, NaN/inf, or <= 0 where `positive`)."""
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise_cfg(f"{key} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise_cfg(f"{key} must be > 0, got {value!r}")
    return float(value)


def get_bool(hf: dict, key: str, default: bool) -> bool:
    """hf[key] as a JSON boolean (absent or null: default); ConfigError naming the field otherwise
    (the string "false" is not False)."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise_cfg(f"{key} must be true or false, got {value!r}")
    return value


def sparse_layers(hf: dict, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    """Qwen-style placement: mlp_only_layers and decoder_sparse_step pick the dense layers."""
    only = set(hf.get("mlp_only_layers") or [])
    step = get_int(hf, "decoder_sparse_step", 1) or 1
    return tuple(i not in only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def finish(fields: dict) -> ModelConfig:
    cfg = ModelConfig(**fields)
    if cfg.num_heads % cfg.num_kv_heads:
        raise_cfg("num_attention_heads must be a multiple of num_key_value_heads")
    if not 0 < cfg.top_k <= cfg.num_experts:
        raise_cfg(f"num_experts_per_tok={cfg.top_k} must be in 1..{cfg.num_experts}")
    return cfg


def raise_cfg(msg: str):
    from ..errors import ConfigError

    raise ConfigError(f"config.json: {msg}")
