"""Engine construction, top-down: options -> config and index -> device plan -> allocate -> fill -> engine.

    built = build_engine(EngineOptions(model="path", device="cuda", cache_options={"device_memory": "8GiB"}))

1. resolve and check every option (CacheConfig, lengths, formats, device) before anything is read;
2. config.json and the safetensors headers: family, ModelConfig, the experts' byte ranges;
3. the device plan (engine/device_plan.py) from headers and the device's (or a simulated cap's)
   memory: refused in one line before a weight byte is read when it does not fit;
4. allocate in one order, counted by devmem.Ledger: KV cache and linear-attention state, then the
   dense weights (read as they are allocated) and the expert slots (a resident pool is allocated
   before the dense weights, which keep its kernel arguments), then the experts are read;
5. the runner and the engine.
Expert parallelism (parallel/) keeps its own order: its share of the experts, then the dense weights.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from . import devmem, kernels
from .engine.device_plan import DevicePlan, EngineShape, GpuSpec, logits_block_rows, plan_device
from .engine.kv_cache import KVCache, default_max_model_len
from .engine.llm_engine import LLMEngine
from .engine.runner import ModelRunner
from .engine.state_cache import StateCache
from .engine.tokenizer import Tokenizer
from .errors import CheckpointError, ConfigError
from .experts.compute import with_moe_kernel
from .experts.config import CacheConfig
from .experts.layout import ExpertSource
from .experts.provider import ExpertProvider, ResidentExperts
from .layers.basic import LOAD_FORMATS, load_quant_method
from .loader.checks import check_layer_count
from .models.mtp import drop_mtp_layers
from .models.registry import open_index, read_config
from .models import embedding
from .models.transformer import MoETransformer
from .quant.checkpoint import method_from_config
from .units import fmt_bytes


def default_dtype(device: torch.device) -> torch.dtype:
    # These CPUs have no bf16 matrix instructions: compute in float32 there.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class EngineOptions:
    """LLM's keywords (see LLM); `cache_options`: the expert cache's (CacheConfig.from_options)."""

    model: str | Path | None = None
    device: str = "cpu"
    dtype: str | torch.dtype | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_memory: str | int | None = "auto"
    block_size: int = 16
    prefix_caching: bool = True
    progress: object = False
    low_memory: bool = False
    expert_parallel: object = None
    check_finite: bool = True
    revision: str | None = None
    lm_head: str | None = None
    cpu_math: str = "exact"
    dense: str | None = None
    cache_options: dict = field(default_factory=dict)


@dataclass
class Built:
    """What LLM holds once construction is done."""

    cache_config: CacheConfig
    model_dir: Path
    device: torch.device
    dtype: torch.dtype
    family: object
    cfg: object
    hf_config: dict
    index: object
    mtp_layers: list
    quant: object
    source: ExpertSource
    parallel: object
    group: object
    tokenizer: Tokenizer | None
    max_model_len: int
    device_plan: DevicePlan
    ledger: devmem.Ledger
    plan_lines: list[str]
    loaded_lines: list[str]
    experts: ExpertProvider
    model: MoETransformer
    kv: KVCache
    states: StateCache | None
    engine: LLMEngine


class _Unbound(ExpertProvider):
    """The model's provider while its dense weights load ahead of a tiered cache (no kernel arguments,
    like TieredExperts); replaced before the first forward."""

    def forward(self, layer, x, ids, weights):
        raise RuntimeError("the expert cache is not built yet")


def build_engine(o: EngineOptions, worker_kwargs: dict | None = None, serve_rank=None) -> Built:
    # 1. options, every one checked before anything is read
    cache_config = CacheConfig.from_options(low_memory=o.low_memory, **o.cache_options)
    mml = o.max_model_len
    if mml is not None and (isinstance(mml, bool) or not isinstance(mml, int) or mml < 1):
        raise ConfigError(f"max_model_len: an integer >= 1, got {mml!r}")
    model = o.model
    if model is None:
        from .demo import demo_model_dir

        model = demo_model_dir(progress=o.progress)
    from .hub import resolve_model

    model_dir = resolve_model(model, o.revision, download=True, progress=bool(o.progress))
    device = torch.device(o.device)
    if o.lm_head is not None:
        load_quant_method(o.lm_head)  # an unknown format is an error before anything loads
    if o.dense is not None:
        load_quant_method(o.dense, "dense")
    try:
        unavailable = kernels.cpu_math_unavailable(o.cpu_math)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if unavailable:
        raise ConfigError(f"cpu_math={o.cpu_math!r}: {unavailable}; use cpu_math='exact'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch.cuda.is_available() is False")
    dtype = getattr(torch, o.dtype) if isinstance(o.dtype, str) else o.dtype or default_dtype(device)

    # 2. config.json and the headers
    family, cfg, hf_config = read_config(model_dir)
    if mml is not None and mml > cfg.max_position_embeddings:
        raise ConfigError(f"max_model_len={mml} exceeds the model's max_position_embeddings="
                          f"{cfg.max_position_embeddings} ({model_dir / 'config.json'})")
    index = open_index(model_dir, family)
    mtp_layers = drop_mtp_layers(index, cfg, hf_config)
    check_layer_count(index, cfg.num_layers)
    quant = method_from_config(hf_config)
    source = ExpertSource(index, cfg, family.names, quant)
    source.check_finite = o.check_finite  # experts: at their first read into any tier
    source.ffn = with_moe_kernel(source.ffn, cache_config.moe_kernel, device, quant)
    parallel = group = None
    if o.expert_parallel is not None and cfg.linear_attn is not None:
        raise ConfigError(f"expert_parallel: {family.name} is a hybrid linear-attention model; "
                          "expert parallelism supports softmax-attention models only")
    if o.expert_parallel is not None:
        from .parallel import checkpoint_fingerprint, start

        worker_kwargs = {**(worker_kwargs or {}), "model": str(model_dir)}
        parallel, group = start(o.expert_parallel, device, worker_kwargs, serve_rank)
        group.check_same("checkpoint (config.json + safetensors headers)", checkpoint_fingerprint(model_dir))
    try:
        tokenizer: Tokenizer | None = Tokenizer(model_dir)
    except CheckpointError as e:
        if "missing tokenizer.json" not in str(e):
            raise
        tokenizer = None  # token-id prompts still work; text raises
    max_model_len = mml or default_max_model_len(cfg.max_position_embeddings)
    prefix_caching = o.prefix_caching
    if cfg.linear_attn is not None and prefix_caching:
        print("note: prefix caching is off for hybrid linear-attention models (a cached prefix's KV "
              "blocks cannot restore the linear-attention state)", file=sys.stderr)
        prefix_caching = False

    # 3. the device plan, before a weight byte is read
    shape = EngineShape(max_model_len, o.max_num_seqs, o.max_num_batched_tokens, o.block_size, o.kv_cache_memory,
                        o.low_memory, o.dense, o.lm_head)
    cap = devmem.simulated_cap() if device.type == "cpu" else None
    gpu = GpuSpec.from_device(device) if device.type == "cuda" else None
    plan = plan_device(source, family.names, device, dtype, shape, cache_config, gpu, cap)
    transient = sum(plan.terms[k] for k in plan.terms if k not in plan.allocated)
    ledger = devmem.Ledger(device, None if plan.budget is None else plan.budget - transient)

    progress = o.progress
    bar = tqdm(total=index.nbytes(), unit="B", unit_scale=True, desc="loading weights",
               disable=not progress or callable(progress), leave=False)
    show_plan = bool(progress) and not callable(progress)
    if callable(progress):  # progress(bytes_read, bytes_total), e.g. the server's /health
        total, callback, read = index.nbytes(), progress, [0]

        def report(n: int) -> None:
            read[0] += n
            callback(read[0], total)

        bar.update = report

    def show(lines):  # the memory plan, before the long load
        if show_plan:
            tqdm.write("\n".join(lines), file=sys.stderr)

    # 4. allocate: KV and state, then dense weights and expert slots, then the experts are read
    kv_layers = len(cfg.attention_layer_ids)
    kv = KVCache(kv_layers, plan.kv.num_blocks, o.block_size, cfg.kv_token_shapes, dtype, device, prefix_caching)
    ledger.charge("kv_cache", kv.tensors)
    states = StateCache(cfg, plan.kv.state_slots, dtype, device) if plan.kv.state_slots else None
    if states is not None:
        ledger.charge("linear_state", list(states.layers.values()))
    plan_lines: list[str] = []

    def dense_model(experts: ExpertProvider) -> MoETransformer:
        m = MoETransformer(cfg, family, index, experts, device, dtype, bar.update, quant, low_memory=o.low_memory,
                           check_finite=o.check_finite, lm_head=o.lm_head, cpu_math=o.cpu_math, dense=o.dense)
        ledger.charge("dense", model_tensors(m))
        return m

    experts = None
    try:
        if group is not None:
            experts = _parallel_experts(parallel, group, source, device, dtype, cache_config, plan, plan_lines, show,
                                        bar.update)
            model_ = dense_model(experts)
        elif plan.experts is None or plan.experts.resident:
            def alloc(shp, dt):
                return ledger.alloc(shp, dt, "expert_slots")

            if plan.experts is None:
                plan_lines += [f"experts: {len(source.layers)} layers x {cfg.num_experts} x "
                               f"{fmt_bytes(source.expert_nbytes)} = {fmt_bytes(source.total_nbytes)}, all resident",
                               *plan.lines]
                show(plan_lines)
                experts = ResidentExperts(source, device, dtype, alloc=alloc, load=False)
            else:
                from .experts.build import build_expert_cache

                experts, lines = build_expert_cache(source, device, dtype, cache_config, plan.experts,
                                                    on_plan=lambda lines: show(_with_device(plan, lines)),
                                                    alloc=alloc, load=False)
                plan_lines += _with_device(plan, lines)
            model_ = dense_model(experts)
            experts.load(bar.update)
        else:
            from .experts.build import build_expert_cache

            model_ = dense_model(_Unbound())
            experts, lines = build_expert_cache(source, device, dtype, cache_config, plan.experts,
                                                progress=bar.update, on_plan=lambda lines: show(_with_device(plan, lines)))
            plan_lines += _with_device(plan, lines)
            ledger.charge("expert_slots", experts.dev.buf)
            ledger.charge("staging", experts.stage or {})
            model_.experts = experts
    except BaseException:
        if experts is not None:
            experts.close()  # its I/O threads
        raise
    finally:
        bar.close()  # before an error is printed: no half progress bar on its line

    # the plan's lines known only after the load
    shown = len(plan_lines)
    if o.cpu_math != "exact":
        plan_lines.append(f"cpu math: {o.cpu_math} ({kernels.CPU_MATH_NOTES[o.cpu_math]})")
    if o.dense is not None:
        qw = model_.dense_quantized
        plan_lines.append(f"dense projections: {o.dense} (group {LOAD_FORMATS[o.dense]['group_size']}), "
                          f"quantized at load: {len(qw)} matrices, {fmt_bytes(sum(w.nbytes for w in qw))}"
                          f"{'' if qw else ' (this model has none of the standard attention / dense MLP kind)'}")
    if o.lm_head is not None:
        plan_lines.append(f"lm_head: {o.lm_head} (group {LOAD_FORMATS[o.lm_head]['group_size']}), quantized at "
                          f"load: {fmt_bytes(model_.lm_head.nbytes)} read per token")
    nb = plan.kv.num_blocks
    table = (f" (the embedding table's {fmt_bytes(index.info(embedding.EMBED).nbytes)} of them stay on disk, rows "
             "read per token)" if embedding.on_disk(cfg, index, device, o.low_memory) else "")
    plan_lines.append(f"dense weights {fmt_bytes(index.nbytes() - source.total_nbytes)}{table}; KV cache {nb} blocks x "
                      f"{o.block_size} tokens = {fmt_bytes(plan.kv.kv_bytes)} ({nb * o.block_size} tokens)")
    if states is not None:
        plan_lines.append(
            f"linear-attention state: {plan.kv.state_slots} sequences x "
            f"{fmt_bytes(plan.kv.state_bytes_per_sequence)} = {fmt_bytes(plan.kv.state_bytes)} "
            f"(fixed per sequence, any context length)")

    # 5. runner and engine
    if group is not None:
        from .parallel.runner import ParallelRunner

        runner = ParallelRunner(model_, kv, group, experts)
    else:
        runner = ModelRunner(model_, kv, states)
    eos = eos_ids(cfg, tokenizer)
    # the plan's logits term is a bound: a step computes at most this many prompt tokens' logits
    engine = LLMEngine(runner, tokenizer, eos, max_model_len, o.max_num_seqs, o.max_num_batched_tokens,
                       max_logits_rows=logits_block_rows(cfg.vocab_size, dtype, device, o.max_num_batched_tokens))
    engine.nonfinite_experts, engine.expert_name = source.nonfinite, source.expert_name
    return Built(cache_config, model_dir, device, dtype, family, cfg, hf_config, index, mtp_layers, quant, source,
                 parallel, group, tokenizer, max_model_len, plan, ledger, plan_lines, plan_lines[shown:], experts,
                 model_, kv, states, engine)


def eos_ids(cfg, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    ids = set(cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _with_device(plan: DevicePlan, lines: list[str]) -> list[str]:
    """The expert cache's lines with the device plan's (CUDA: the auto budget and the total) in place."""
    n = len(plan.experts.lines)
    return plan.lines + lines[n:]


def model_tensors(model: MoETransformer) -> list[torch.Tensor]:
    """Every tensor the model holds besides its expert provider (dense weights, tables), found by walking
    its attributes: what the dense term is checked against."""
    out, seen = [], set()

    def walk(obj, depth=0):
        if id(obj) in seen or depth > 8:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, depth + 1)
        elif isinstance(obj, ExpertProvider):
            return
        elif type(obj).__module__.startswith("expertcache") and hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                walk(v, depth + 1)

    walk(model)
    return out


def _parallel_experts(cfg, group, source, device, dtype, options: CacheConfig, plan: DevicePlan, plan_lines, show,
                      on_bytes):
    """This rank's share of the experts (its own tiers when budgets are given), behind the EP provider."""
    from .parallel.experts import ExpertParallelExperts
    from .parallel.local import LocalExperts
    from .parallel.peer import build as build_peer
    from .parallel.placement import balanced_placement, static_placement

    layers, E = source.layers, source.cfg.num_experts
    if cfg.num_redundant_experts:
        placement = balanced_placement(torch.zeros(len(layers), E), layers, group.world_size, cfg.num_redundant_experts)
    else:
        placement = static_placement(layers, E, group.world_size)
    owned = placement.owned(group.rank)
    n = sum(len(v) for v in owned.values())
    plan_lines.append(
        f"expert parallel: rank {group.rank} of {group.world_size} holds {n} of {len(layers) * E} experts "
        f"({cfg.num_redundant_experts} redundant per layer; EPLB {'on' if cfg.eplb else 'off'})")
    if options.tiered:
        from .experts.build import build_expert_cache

        local, lines = build_expert_cache(source, device, dtype, options, plan.experts, progress=on_bytes,
                                          on_plan=lambda lines: show(plan_lines + _with_device(plan, lines)))
        plan_lines += _with_device(plan, lines)
    else:
        show(plan_lines)
        local = LocalExperts(source, device, dtype, owned, on_bytes)
    peer, moves, line = build_peer(group, cfg.peer_tier, local, source, options.cost_profile)
    if line:
        plan_lines.append(line)
    return ExpertParallelExperts(group, local, placement, cfg, layers, E, peer, moves)
