"""Engine construction in one order for every provider kind (resident, tiered, low memory, expert parallel):

    made = build_engine(EngineConfig.from_kwargs(model="path", device="cuda", device_memory="8GiB"))

1. checkpoint (checkpoint.py): config.json, the safetensors headers, the experts' byte ranges; an
   option the model cannot honour is refused (the options themselves were checked by config.py);
2. plan (plan.py): every byte on the device by term, from headers and the device's (or a simulated
   cap's) memory: refused in one line before a weight byte is read when it does not fit;
3. allocate (allocate.py), every persistent tensor through the Ledger (ledger.py): KV cache and
   linear-attention state, then the dense weights as fill.py reads them, then expert slots and staging;
4. fill (fill.py): the experts read into their slots; the model assembled from what was read (it
   reads nothing itself);
5. the runner and the engine.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from tqdm import tqdm

from .. import kernels
from ..engine.llm_engine import LLMEngine
from ..engine.runner import ModelRunner
from ..layers.basic import LOAD_FORMATS
from ..loader.disk import drop_cached
from ..models import embedding
from ..models.transformer import MoETransformer
from ..units import fmt_bytes
from . import ledger as ledger_module
from .allocate import Memory, expert_provider, kv_and_state, parallel_provider, peer_decision, placement_of
from .checkpoint import Checkpoint, read_checkpoint
from .fill import fill_experts, read_dense
from .plan import GpuSpec, logits_block_rows, plan_device


@dataclass
class Made:
    """What construction made: the checkpoint's answers, the memory plan with its ledger, the engine."""

    checkpoint: Checkpoint
    memory: Memory
    engine: LLMEngine
    group: object = None  # the expert-parallel group (None without expert parallelism)


def build_engine(config, group=None, serve=None) -> Made:
    """`config`: an EngineConfig; `group`: an expert-parallel worker rank's joined group (rank 0 starts it,
    spawning ranks that call `serve(payload, group)`)."""
    # ==== checkpoint: headers only ====
    ck = read_checkpoint(config)
    device, dtype, sched = config.load.torch_device, config.load.torch_dtype, config.scheduler
    started = config.parallel is not None and group is None
    placement = experts = None
    try:
        if config.parallel is not None:
            group = _join_group(ck, config, group, serve)
            placement = placement_of(ck, config, group)
        # ==== plan: before a weight byte is read ====
        memory = _plan(ck, config, group, placement)
        bar, show = _progress(config, ck.index.nbytes())
        # ==== allocate and fill, in one order for every provider kind ====
        drop_cached({t.file for t in ck.index.tensors.values()})
        try:
            kv, states = kv_and_state(ck, config, memory.plan, memory.ledger)
            dense = read_dense(ck, config, memory.ledger, bar.update)
            experts = expert_provider(
                ck, config, memory.plan, memory.ledger, memory.lines, show, bar.update, placement, group
            )
            fill_experts(experts, bar.update)
        finally:
            bar.close()  # before an error is printed: no half progress bar on its line
        if placement is not None:
            experts = parallel_provider(ck, config, group, placement, experts, memory)
        model = MoETransformer(ck.cfg, dense, experts, device, dtype, config.kernels.cpu_math)
    except BaseException:
        if experts is not None:
            experts.close()  # its I/O threads
        if started and group is not None:
            group.close()  # the ranks it spawned
        raise
    memory.loaded_lines = _loaded_lines(ck, config, memory.plan, model, states)
    memory.lines += memory.loaded_lines
    # ==== runner and engine ====
    if group is not None:
        from ..parallel.runner import ParallelRunner

        runner = ParallelRunner(model, kv, group, experts)
    else:
        runner = ModelRunner(model, kv, states, config.kernels.cuda_graphs, sched.max_num_seqs)
    rows = logits_block_rows(ck.cfg.vocab_size, dtype, device, sched.max_num_batched_tokens)
    engine = LLMEngine(
        runner,
        ck.tokenizer,
        eos_ids(ck.cfg, ck.tokenizer),
        ck.max_model_len,
        sched.max_num_seqs,
        sched.max_num_batched_tokens,
        max_logits_rows=rows,
    )
    engine.nonfinite_experts, engine.expert_name = ck.source.nonfinite, ck.source.expert_name
    return Made(ck, memory, engine, group)


def _plan(ck, config, group, placement) -> Memory:
    """The device plan (against the device's memory, a card's, or a simulated cap) and its ledger, whose
    cap is the plan's budget less the transient terms. Expert parallelism: the peer tier is decided
    first (its receive buffers are a term)."""
    from ..parallel.peer import receive_buffers

    device = config.load.torch_device
    cap = ledger_module.simulated_cap() if device.type == "cpu" else None
    gpu = GpuSpec.from_device(device) if device.type == "cuda" else None
    owned = peer = None
    if placement is not None:
        owned = sum(len(v) for v in placement.owned(group.rank).values())
        peer = peer_decision(ck, config, group)
    peer_slots = receive_buffers(ck.cfg.top_k) if peer is not None and peer[0] else 0
    plan = plan_device(ck.source, ck.family.names, config, ck.max_model_len, gpu, cap, owned, peer_slots)
    transient = sum(plan.terms[k] for k in plan.terms if k not in plan.allocated)
    memory = Memory(
        plan,
        ledger_module.Ledger(device, None if plan.budget is None else plan.budget - transient),
        peer=peer,
    )
    if placement is not None:
        memory.lines.append(_placement_line(config, group, placement, ck))
    return memory


def eos_ids(cfg, tokenizer) -> tuple[int, ...]:
    ids = set(cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _join_group(ck, config, group, serve):
    """The expert-parallel group: rank 0 starts it (its ranks are spawned with the whole config as plain
    data: EngineConfig.to_dict), a worker rank has joined it; every rank checks it sees the same
    checkpoint and config as rank 0."""
    import json
    from dataclasses import replace

    from ..parallel import checkpoint_fingerprint, start

    rank_config = replace(
        config, load=replace(config.load, model=str(ck.model_dir)), verbose=False, record_routing=None
    ).to_dict()
    if group is None:
        _, group = start(config.parallel, config.load.torch_device, {"config": rank_config}, serve)
    group.check_same("checkpoint (config.json + safetensors headers)", checkpoint_fingerprint(ck.model_dir))
    same = {
        **rank_config,
        "load": {**rank_config["load"], "model": None},
    }  # (torchrun: paths may differ by machine)
    group.check_same("engine config", json.dumps(same, sort_keys=True))
    return group


def _placement_line(config, group, placement, ck) -> str:
    ep, layers, E = config.parallel, ck.source.layers, ck.cfg.num_experts
    n = sum(len(v) for v in placement.owned(group.rank).values())
    return (
        f"expert parallel: rank {group.rank} of {group.world_size} holds {n} of {len(layers) * E} experts "
        f"({ep.num_redundant_experts} redundant per layer; EPLB {'on' if ep.eplb else 'off'})"
    )


def _progress(config, total: int):
    """(bar, show): the load's progress bar (or the callback config.progress(bytes_read, bytes_total),
    e.g. the server's /health) and how the memory plan is shown before the long load."""
    progress = config.progress
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="loading weights",
        disable=not progress or callable(progress),
        leave=False,
    )
    if callable(progress):
        read = [0]

        def report(n: int) -> None:
            read[0] += n
            progress(read[0], total)

        bar.update = report
    show_plan = bool(progress) and not callable(progress)

    def show(lines):
        if show_plan:
            tqdm.write("\n".join(lines), file=sys.stderr)

    return bar, show


def _loaded_lines(ck, config, plan, model, states) -> list[str]:
    """The plan's lines known only after the load."""
    k, index, block = config.kernels, ck.index, config.scheduler.block_size
    lines = []
    if k.cpu_math != "exact":
        lines.append(f"cpu math: {k.cpu_math} ({kernels.CPU_MATH_NOTES[k.cpu_math]})")
    if k.dense is not None:
        qw = model.dense_quantized
        lines.append(
            f"dense projections: {k.dense} (group {LOAD_FORMATS[k.dense]['group_size']}), "
            f"quantized at load: {len(qw)} matrices, {fmt_bytes(sum(w.nbytes for w in qw))}"
            f"{'' if qw else ' (this model has none of the standard attention / dense MLP kind)'}"
        )
    if k.lm_head is not None:
        lines.append(
            f"lm_head: {k.lm_head} (group {LOAD_FORMATS[k.lm_head]['group_size']}), quantized at "
            f"load: {fmt_bytes(model.lm_head.nbytes)} read per token"
        )
    nb = plan.kv.num_blocks
    table = (
        f" (the embedding table's {fmt_bytes(index.info(embedding.EMBED).nbytes)} of them stay on disk, rows "
        "read per token)"
        if embedding.on_disk(ck.cfg, index, config.load.torch_device, config.cache.low_memory)
        else ""
    )
    lines.append(
        f"dense weights {fmt_bytes(plan.terms['dense'])}{table}; KV cache {nb} blocks x {block} tokens = "
        f"{fmt_bytes(plan.kv.kv_bytes)} ({nb * block} tokens)"
    )
    if states is not None:
        lines.append(
            f"linear-attention state: {plan.kv.state_slots} sequences x "
            f"{fmt_bytes(plan.kv.state_bytes_per_sequence)} = {fmt_bytes(plan.kv.state_bytes)} "
            f"(fixed per sequence, any context length)"
        )
    return lines
