"""The checkpoint as construction sees it before a weight byte is read: config.json, the safetensors
headers, the experts' byte ranges, the tokenizer (`read_checkpoint`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.kv_cache import default_max_model_len
from ..engine.tokenizer import Tokenizer, load_tokenizer
from ..errors import CheckpointError, ConfigError
from ..experts.compute import with_moe_kernel
from ..experts.layout import ExpertSource
from ..loader.checks import check_layer_count
from ..models.mtp import drop_mtp_layers
from ..models.registry import open_index, read_config
from ..quant.checkpoint import method_from_config


@dataclass(frozen=True)
class Checkpoint:
    model_dir: Path
    family: object  # models.registry.Family
    cfg: object  # spec.model_config.ModelConfig
    hf_config: dict
    index: object  # loader.safetensors_index.TensorIndex (the MTP layers dropped)
    mtp_layers: list
    quant: object  # the checkpoint's QuantMethod, or None
    source: ExpertSource
    tokenizer: Tokenizer | None
    max_model_len: int
    prefix_caching: bool


def _tokenizer(model_dir, tokenizer_dir) -> Tokenizer | None:
    """The model's tokenizer (or --tokenizer's); None when the model has none and none was given (token-id
    prompts still work; text raises)."""
    try:
        return load_tokenizer(model_dir, tokenizer_dir)
    except CheckpointError as e:
        if tokenizer_dir is not None or "missing tokenizer.json" not in str(e):
            raise
        return None


def _check_options(config, family, cfg, model_dir) -> None:
    """Options this model cannot honour, refused by name before anything is read."""
    mml = config.scheduler.max_model_len
    if mml is not None and mml > cfg.max_position_embeddings:
        raise ConfigError(
            f"max_model_len={mml} exceeds the model's max_position_embeddings="
            f"{cfg.max_position_embeddings} ({model_dir / 'config.json'})"
        )
    if config.parallel is not None and cfg.linear_attn is not None:
        raise ConfigError(
            f"expert_parallel: {family.name} is a hybrid linear-attention model; "
            "expert parallelism supports softmax-attention models only"
        )


def read_checkpoint(config) -> Checkpoint:
    """Headers only; an option the model cannot honour is refused here (ConfigError naming it)."""
    load, sched = config.load, config.scheduler
    model = load.model
    if model is None:
        from ..demo import demo_model_dir

        model = demo_model_dir(progress=config.progress)
    from ..hub import resolve_model

    model_dir = resolve_model(model, load.revision, download=True, progress=bool(config.progress))
    device = load.torch_device
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch.cuda.is_available() is False")
    family, cfg, hf_config = read_config(model_dir)
    _check_options(config, family, cfg, model_dir)
    index = open_index(model_dir, family)
    mtp_layers = drop_mtp_layers(index, cfg, hf_config)
    check_layer_count(index, cfg.num_layers)
    quant = method_from_config(hf_config)
    source = ExpertSource(index, cfg, family.names, quant)
    source.check_finite = load.check_finite  # experts: at their first read into any tier
    source.ffn = with_moe_kernel(source.ffn, config.cache.moe_kernel, device, quant)
    tokenizer = _tokenizer(model_dir, load.tokenizer)
    prefix_caching = sched.prefix_caching
    if cfg.linear_attn is not None and prefix_caching:
        print(
            "note: prefix caching is off for hybrid linear-attention models (a cached prefix's KV "
            "blocks cannot restore the linear-attention state)",
            file=sys.stderr,
        )
        prefix_caching = False
    return Checkpoint(
        model_dir,
        family,
        cfg,
        hf_config,
        index,
        mtp_layers,
        quant,
        source,
        tokenizer,
        sched.max_model_len or default_max_model_len(cfg.max_position_embeddings),
        prefix_caching,
    )
