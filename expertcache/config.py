"""EngineConfig: every engine option, once, validated before anything is read (vLLM's EngineArgs -> VllmConfig).

    config = EngineConfig.from_kwargs(model="path", device="cpu", device_memory="8GiB")
    config.load.device, config.scheduler.max_num_seqs, config.cache.device_memory, config.parallel

Groups (each a frozen dataclass whose fields are the keywords `LLM(**kwargs)` takes):
    load       which checkpoint and where it runs: model, revision, device, dtype, check_finite
    scheduler  the batch and its KV cache: max_model_len, max_num_seqs, max_num_batched_tokens,
               kv_cache_memory, block_size, prefix_caching
    kernels    how the dense math runs: lm_head, dense (load-time formats), cpu_math, cuda_graphs
    cache      the expert cache (experts/config.py CacheConfig: device_memory, host_memory, cache_policy,
               low_memory, moe_kernel, ... and the CacheAblation switches)
    parallel   expert parallelism (parallel/config.py ParallelConfig; keyword `expert_parallel`) or None
and three that only shape the output: progress (a bool, or a callable(bytes_read, bytes_total)),
verbose, record_routing. An unknown keyword is refused by name. `to_dict` / `from_dict`: plain data,
what expert-parallel ranks are started from (the whole config, progress left out).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from .errors import ConfigError
from .experts.config import KEYWORDS as CACHE_ALIASES
from .experts.config import CacheAblation, CacheConfig, parse_budget
from .parallel.config import ParallelConfig


def _int(value, name: str, low: int = 1, none: bool = False) -> None:
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}: an integer >= {low}, got {value!r}")


def _bool(value, name: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: must be True or False, got {value!r}")


@dataclass(frozen=True)
class LoadConfig:
    model: str | None = None  # directory, hub id or hub-cache folder; None: the demo model
    revision: str | None = None  # hub ids: branch, tag or commit
    device: str = "cpu"
    dtype: str | None = None  # compute dtype; None: float32 on the CPU, bfloat16 on CUDA
    check_finite: bool = True  # NaN/inf scan of dense weights at load, of each expert at its first read
    tokenizer: str | None = None  # a directory with tokenizer.json to use instead of the model's own

    def __post_init__(self):
        if isinstance(self.model, Path):
            object.__setattr__(self, "model", str(self.model))
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f"model: a directory or hub id, got {self.model!r}")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"device: expected cpu or cuda, got {self.device!r}") from None
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"device: expected cpu or cuda, got {self.device!r}")
        object.__setattr__(self, "device", str(dev))
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype is not None and not (
            isinstance(self.dtype, str)
            and isinstance(getattr(torch, self.dtype, None), torch.dtype)
            and getattr(torch, self.dtype).is_floating_point
        ):
            raise ConfigError(
                f"dtype: a torch floating dtype such as bfloat16 or float32, got {self.dtype!r}"
            )
        if isinstance(self.tokenizer, Path):
            object.__setattr__(self, "tokenizer", str(self.tokenizer))
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ConfigError(f"tokenizer: a directory holding tokenizer.json, got {self.tokenizer!r}")
        _bool(self.check_finite, "check_finite")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype (these CPUs have no bf16 matrix instructions: float32 there by default)."""
        if self.dtype is not None:
            return getattr(torch, self.dtype)
        return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int | None = None  # None: min(the model's max_position_embeddings, 4096)
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_memory: str | int | None = "auto"  # a size, or auto (engine/kv_cache.py auto_kv_blocks)
    block_size: int = 16
    prefix_caching: bool = True

    def __post_init__(self):
        _int(self.max_model_len, "max_model_len", none=True)
        _int(self.max_num_seqs, "max_num_seqs")
        _int(self.max_num_batched_tokens, "max_num_batched_tokens")
        _int(self.block_size, "block_size")
        budget = parse_budget(self.kv_cache_memory, "kv_cache_memory")
        if budget is not None and budget.share:
            raise ConfigError(f"kv_cache_memory: a size or 'auto', got {self.kv_cache_memory!r}")
        _bool(self.prefix_caching, "prefix_caching")


@dataclass(frozen=True)
class KernelConfig:
    lm_head: str | None = None  # quantize lm_head at load (layers/basic.py LOAD_FORMATS)
    dense: str | None = None  # quantize the dense projections at load
    cpu_math: str = (
        "auto"  # kernels.CPU_MATHS; auto: fast where this CPU has it, else exact (docs/numerics.md)
    )
    # decode's dense segments as CUDA graphs (engine/cuda_graphs.py); off until a GPU run has passed
    cuda_graphs: bool = False

    def __post_init__(self):
        from . import kernels
        from .layers.basic import load_quant_method

        try:
            for name in ("lm_head", "dense"):
                if getattr(self, name) is not None:
                    load_quant_method(getattr(self, name), name)  # an unknown format names the field
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.cpu_math == "auto":  # the default, chosen by held-out perplexity (bench/math_choice.py):
            # $EXPERTCACHE_CPU_MATH if set (the test suite sets exact: its oracle is transformers), else fast
            # where this CPU has it
            env = os.environ.get("EXPERTCACHE_CPU_MATH", "").strip()
            auto = "fast" if kernels.cpu_math_unavailable("fast") is None else "exact"
            object.__setattr__(self, "cpu_math", env or auto)
        try:
            unavailable = kernels.cpu_math_unavailable(self.cpu_math)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if unavailable:
            raise ConfigError(f"cpu_math={self.cpu_math!r}: {unavailable}; use cpu_math='exact'")
        _bool(self.cuda_graphs, "cuda_graphs")


GROUPS = {"load": LoadConfig, "scheduler": SchedulerConfig, "kernels": KernelConfig}
OUTPUT = ("progress", "verbose", "record_routing")


def cache_keywords() -> set[str]:
    """The keywords CacheConfig.from_options takes."""
    names = {f.name for f in fields(CacheConfig)} - {"policy", "ablation"}
    return names | set(CACHE_ALIASES) | {f.name for f in fields(CacheAblation)}


@dataclass(frozen=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig | None = None
    progress: object = False  # bool, or a callable(bytes_read, bytes_total) (the server's /health)
    verbose: bool = False  # print the memory plan
    record_routing: str | None = None  # a routing trace file written by LLM.close()

    def __post_init__(self):
        _bool(self.verbose, "verbose")
        if self.record_routing is not None and not isinstance(self.record_routing, (str, Path)):
            raise ConfigError(f"record_routing: a file name, got {self.record_routing!r}")
        if self.parallel is not None and not isinstance(self.parallel, ParallelConfig):
            object.__setattr__(self, "parallel", ParallelConfig.of(self.parallel))
        if self.kernels.cuda_graphs and self.load.torch_device.type != "cuda":
            raise ConfigError(
                f"cuda_graphs: CUDA graphs capture a GPU's decode step; device={self.load.device!r} has none "
                "(drop --cuda-graphs)"
            )
        if self.kernels.cuda_graphs and self.parallel is not None:
            raise ConfigError("cuda_graphs: not with expert_parallel (its ranks mirror each eager forward)")

    @staticmethod
    def keywords() -> list[str]:
        """Every keyword LLM(...) and from_kwargs take."""
        names = [f.name for g in GROUPS.values() for f in fields(g)]
        return sorted([*names, *cache_keywords(), "expert_parallel", *OUTPUT])

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """LLM's keywords -> the config, each keyword to the group that has a field of its name."""
        known = set(cls.keywords())
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown option {unknown[0]!r}; engine options: {', '.join(sorted(known))}")
        groups = {
            name: g(**{f.name: kwargs[f.name] for f in fields(g) if f.name in kwargs})
            for name, g in GROUPS.items()
        }
        cache = CacheConfig.from_options(**{k: v for k, v in kwargs.items() if k in cache_keywords()})
        ep = kwargs.get("expert_parallel")
        return cls(
            **groups,
            cache=cache,
            parallel=None if ep is None else ParallelConfig.of(ep),
            **{k: kwargs[k] for k in OUTPUT if k in kwargs},
        )

    def to_dict(self) -> dict:
        """Plain data (progress left out): what an expert-parallel rank is started from."""
        d = asdict(replace(self, progress=False))
        d["record_routing"] = None if self.record_routing is None else str(self.record_routing)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> EngineConfig:
        cache = dict(d["cache"])
        cache["ablation"] = CacheAblation(**cache["ablation"])
        ep = d["parallel"]
        if ep is not None and not ep["eplb"]:  # the EPLB defaults are filled in by ParallelConfig itself
            ep = {**ep, "eplb_window_size": None, "eplb_step_interval": None}
        return cls(
            **{name: g(**d[name]) for name, g in GROUPS.items()},
            cache=CacheConfig(**cache),
            parallel=None if ep is None else ParallelConfig(**ep),
            **{k: d[k] for k in OUTPUT},
        )
