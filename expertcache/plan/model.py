"""What `expertcache plan` knows about a model without loading it: sizes and the memory plan.

Everything here comes from config.json and the safetensors headers (TensorIndex,
ExpertSource): no weight byte is read. `device_plan` is the engine's own plan
(build/plan.py plan_device, which build_engine calls), so the terms, slot counts and the dense
figure are the ones the engine allocates; tests/build/test_plan.py checks the printed lines against a
real LLM's and tests/build/test_device_plan.py the bytes against what the engine allocates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..build.plan import DevicePlan, GpuSpec, MemoryPlan, dense_bytes, plan_device, plan_tiers
from ..config import EngineConfig
from ..engine.kv_cache import KVCache, default_max_model_len
from ..engine.state_cache import StateCache
from ..experts.layout import ExpertSource, parts_at, parts_nbytes
from ..loader.safetensors_index import TensorIndex
from ..models.mtp import drop_mtp_layers
from ..models.registry import open_index, read_config
from ..quant.checkpoint import method_from_config


@dataclass
class ModelInfo:
    """A model directory read from its headers: config, index and the routed experts' layout."""

    model_dir: Path
    hf: dict
    source: ExpertSource
    dir_bytes: int  # every regular file in the directory
    names: object = None  # the family's WeightNames

    @property
    def cfg(self):
        return self.source.cfg

    @property
    def index(self) -> TensorIndex:
        return self.source.index


def read_model(model_dir: str | Path) -> ModelInfo:
    """config.json + safetensors headers -> ModelInfo (ConfigError / CheckpointError as the engine raises)."""
    model_dir = Path(model_dir)
    family, cfg, hf = read_config(model_dir)
    index = open_index(model_dir, family)
    drop_mtp_layers(index, cfg, hf)
    source = ExpertSource(index, cfg, family.names, method_from_config(hf))
    files = index.gguf.files if hasattr(index, "gguf") else [p for p in model_dir.iterdir() if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    return ModelInfo(model_dir, hf, source, size, family.names)


@dataclass
class Sizes:
    """Bytes by kind; "fast" = the fastest tier's format (compute dtype, or as stored when quantized)."""

    dense_stored: int
    dense_compute: int  # dense weights as the engine holds them: the device plan's dense term
    experts_stored: int
    expert_stored: int
    expert_fast: int
    expert_params: int
    stored_dtype: str
    fast_format: str
    quantized: str | None
    kv_per_token: int  # KV of the softmax-attention layers only
    state_per_sequence: int  # linear-attention conv + recurrent state (hybrid models), any context length


def model_sizes(info: ModelInfo, config: EngineConfig) -> Sizes:
    src, cfg = info.source, info.cfg
    dtype, device, k = config.load.torch_dtype, config.load.torch_device, config.kernels
    dense_stored = info.index.nbytes() - src.total_nbytes
    dense_compute = dense_bytes(
        info.index, cfg, info.names, dtype, device, config.cache.low_memory, k.dense, k.lm_head
    )
    fast_parts = src.compute_parts(dtype, device)
    fast = parts_nbytes(fast_parts)  # per-layer layouts (GGUF types per layer): the mean, rounded up
    first = parts_at(fast_parts, 0)
    method = src.method.name if src.method is not None else None
    stored = src.stored_method.name if src.stored_method is not None else None  # a shipped layout's own name
    return Sizes(
        dense_stored=dense_stored,
        dense_compute=int(dense_compute),
        experts_stored=src.total_nbytes,
        expert_stored=src.stored_nbytes,
        expert_fast=fast,
        expert_params=3 * cfg.hidden_size * cfg.moe_intermediate_size,
        stored_dtype=stored or str(src.dtype).removeprefix("torch."),
        fast_format=(
            (f"{method}, as stored" if fast == src.stored_nbytes else f"{method}, converted at load per type")
            if method == stored
            else f"{method}, repacked from {stored}"
        )
        if method
        else str(first[0].dtype).removeprefix("torch.") + (", as stored" if first[0].dtype != dtype else ""),
        quantized=method,
        kv_per_token=KVCache.bytes_per_block(len(cfg.attention_layer_ids), 1, cfg.kv_token_shapes, dtype),
        state_per_sequence=StateCache.bytes_per_sequence(cfg, dtype),
    )


def plan_memory(
    info: ModelInfo, device: torch.device, dtype: torch.dtype, device_memory="auto", host_memory="auto"
) -> MemoryPlan:
    """The expert tiers alone for a fastest-tier budget (build/plan.py plan_tiers, the function the
    device plan calls; on CUDA the device plan gives it what is left after every other term)."""
    return plan_tiers(info.source, device, dtype, device_memory, host_memory)


def device_plan(info: ModelInfo, config: EngineConfig, gpu: GpuSpec | None = None) -> DevicePlan:
    """Every byte the engine would take on the device, with its expert tiers, for this config: the
    function build_engine calls (build/plan.py plan_device)."""
    mml = config.scheduler.max_model_len or default_max_model_len(info.cfg.max_position_embeddings)
    return plan_device(info.source, info.names, config, mml, gpu)


def budget_for_slots(info: ModelInfo, config: EngineConfig, slots: int, gpu: GpuSpec | None = None) -> int:
    """The --device-memory that gives exactly `slots` expert slots per layer for this config (its
    device_memory replaced): on CUDA (the engine's total) every other term of the plan plus the slots,
    on the CPU (the expert tier alone) the slots; plus half a layer's worth of one more slot as margin
    for a CUDA context measured a little differently at start-up."""
    from dataclasses import replace

    p = device_plan(info, replace(config, cache=replace(config.cache, device_memory="100%")), gpu)
    layer_slot = len(info.source.layers) * p.experts.device.expert_bytes
    others = (
        sum(v for k, v in p.terms.items() if k != "expert_slots")
        if config.load.torch_device.type == "cuda"
        else 0
    )
    return others + slots * layer_slot + layer_slot // 2


def resolve_device(device: str, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """Device and compute dtype as LLM picks them (float32 on CPU, bfloat16 on CUDA by default)."""
    from ..config import LoadConfig

    load = LoadConfig(device=device, dtype=dtype)
    return load.torch_device, load.torch_dtype
