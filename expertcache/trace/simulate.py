"""Cost model: predicted decode tokens/s from replay counters and a hardware Profile.

Notation: eb = bytes of one expert, Pe = parameters of one expert, Pd = dense
parameters read per token (attention, router, norms, lm head) with bytes Bd,
u = rows per use = pairs / uses (1 for one-token decode steps), S = steps,
bandwidths in bytes/s and throughputs in FLOP/s (a matmul costs 2 FLOP/param/row).

    dense      = S * max(Bd / gpu_mem, 2 Pd u_step / gpu_flops)   (u_step = rows / S)
    gpu_exp    = max(eb / gpu_mem, 2 Pe u / gpu_flops)           one use of a resident expert
    cpu_exp    = max(eb / cpu_mem, 2 Pe u / cpu_flops)           one use computed on the CPU
    xfer       = eb / link   (+ eb / disk when from_disk: experts live on disk, not in RAM)
    hit        -> gpu_exp
    miss       -> min(xfer + gpu_exp, cpu_exp)  if cpu_compute, else xfer + gpu_exp
                  (the cheaper side is chosen per missing expert; with from_disk
                  the CPU path also pays eb / disk)
    prefetch   -> issued * xfer on the link, overlapped with dense + hit compute:
                  prefetch_stall = max(0, issued * xfer - (dense + hits * gpu_exp))
    total      = dense + hits * gpu_exp + sum(miss costs) + prefetch_stall
                 + S * (step_overhead + moe_layers * layer_overhead)
    tok/s      = rows / total

The per-use terms are cost.model.ExpertCost's, the same the engine's per-miss choice uses.
Without a GPU (profile.gpu_tflops == 0) dense and every use run on the CPU
(cpu_exp), misses cost only the disk read when from_disk. It is a first-order
model: no overlap of demand transfers with compute; kernel launch and Python dispatch
costs only through profile.step_overhead_ms (0 unless calibrated, e.g. by
bench/simulate_validate.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..cost.model import ExpertCost
from ..cost.profiles import Profile
from .replay import ReplayResult, replay


@dataclass(frozen=True)
class ModelShape:
    expert_params: int
    dense_params: int  # per token, all layers plus lm head
    bytes_per_param: float = 2.0

    @property
    def expert_bytes(self) -> int:
        return int(self.expert_params * self.bytes_per_param)

    @classmethod
    def from_config(cls, cfg: dict | str | Path, bytes_per_param: float = 2.0) -> "ModelShape":
        """From a Hugging Face MoE config (dict or path to config.json / its folder)."""
        if not isinstance(cfg, dict):
            p = Path(cfg)
            cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            cfg = cfg["text_config"]  # a multimodal checkpoint: the decoder's fields
        try:
            h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
            inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
            nh = cfg["num_attention_heads"]
            nkv = cfg.get("num_key_value_heads", nh)
            hd = cfg.get("head_dim") or h // nh
            ne = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
            vocab = cfg["vocab_size"]
        except KeyError as err:
            raise ValueError(f"config: missing field {err.args[0]!r}") from None
        attn = h * nh * hd * 2 + h * nkv * hd * 2
        if cfg.get("kv_lora_rank"):  # multi-head latent attention: low-rank q and kv projections
            r, ql, v = cfg["kv_lora_rank"], cfg.get("q_lora_rank"), cfg["v_head_dim"]
            qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
            q = (h * ql + ql * nh * qk) if ql else h * nh * qk
            attn = q + h * (r + cfg["qk_rope_head_dim"]) + r * nh * (cfg["qk_nope_head_dim"] + v) + nh * v * h
        dense = layers * (attn + h * (ne or 0)) + h * vocab
        return cls(expert_params=3 * h * inter, dense_params=dense, bytes_per_param=bytes_per_param)


@dataclass
class Prediction:
    tok_s: float
    total_s: float
    dense_s: float
    expert_compute_s: float  # hits plus transferred misses, on the GPU
    transfer_stall_s: float  # demand transfers of misses computed on the GPU
    cpu_miss_s: float  # misses computed on the CPU because that was cheaper
    prefetch_stall_s: float
    misses_on_cpu: int
    misses_transferred: int
    overhead_s: float = 0.0  # steps * profile.step_overhead_ms

    def to_dict(self) -> dict:
        return asdict(self)


def simulate(
    result: ReplayResult | object,
    shape: ModelShape,
    profile: Profile,
    cpu_compute: bool = True,
    from_disk: bool = False,
    policy: str | None = None,
    capacity: int | None = None,
    prefetch: bool = False,
) -> Prediction:
    """`result` is a ReplayResult, or a RoutingTrace replayed here with policy/capacity."""
    if not isinstance(result, ReplayResult):
        if policy is None or capacity is None:
            raise ValueError("simulate: a trace needs policy= and capacity=")
        result = replay(result, policy, capacity, prefetch=prefetch, with_min=False)
    gb, tf = 1e9, 1e12
    uses = result.hits + result.misses
    if uses == 0 or result.rows == 0:
        raise ValueError("simulate: the replay has no uses")
    eb = result.expert_bytes or shape.expert_bytes
    u = result.pairs / uses if result.pairs else 1.0
    u_step = result.rows / max(result.steps, 1)
    bd = shape.dense_params * shape.bytes_per_param
    over = result.steps * (profile.step_overhead_ms + len(result.per_layer) * profile.layer_overhead_ms) / 1e3
    cost = ExpertCost(profile, eb, shape.expert_params)  # the engine's per-miss terms
    disk = cost.disk() if from_disk else 0.0
    cpu_exp = cost.cpu_use(u)
    if not profile.has_gpu:
        dense = result.steps * max(
            bd / (profile.cpu_mem_gbs * gb), 2 * shape.dense_params * u_step / (profile.cpu_gflops * 1e9)
        )
        exp = uses * cpu_exp
        total = dense + exp + result.misses * disk + over
        return Prediction(
            result.rows / total, total, dense, 0.0, result.misses * disk, exp, 0.0, result.misses, 0, over
        )
    dense = result.steps * max(
        bd / (profile.gpu_mem_gbs * gb), 2 * shape.dense_params * u_step / (profile.gpu_tflops * tf)
    )
    gpu_exp = cost.gpu_use(u)
    xfer = cost.transfer(from_disk)
    on_cpu = cpu_compute and cost.cpu_faster(u, from_disk)
    m = result.misses
    hit_s = result.hits * gpu_exp
    if on_cpu:
        exp_s, stall, cpu_s, n_cpu, n_x = hit_s, 0.0, m * (cpu_exp + disk), m, 0
    else:
        exp_s, stall, cpu_s, n_cpu, n_x = hit_s + m * gpu_exp, m * xfer, 0.0, 0, m
    pf = max(0.0, result.prefetch_issued * xfer - (dense + hit_s)) if result.prefetch_issued else 0.0
    total = dense + exp_s + stall + cpu_s + pf + over
    return Prediction(result.rows / total, total, dense, exp_s, stall, cpu_s, pf, n_cpu, n_x, over)


@dataclass
class ScheduledPrediction:
    """Decode time from the schedule model: every decode step's layers planned by the engine's
    planner, built into schedules (experts/schedule.py) and evaluated event by event
    (experts/schedule_time.py); `critical` counts the critical path's ops by kind."""

    tok_s: float
    decode_s: float
    decode_rows: int
    misses_on_cpu: int
    misses_admitted: int
    critical: dict[str, int]


def simulate_schedule(
    trace,
    shape: ModelShape,
    profile: Profile,
    policy: str,
    capacity: int,
    hidden: int,
    cpu_compute: bool = True,
    prefetch: bool = False,
    io_lanes: int = 4,
) -> ScheduledPrediction:
    """Decode tok/s of `trace` on `profile` with the overlap the executor gives: copies, device
    MoE, the CPU job and the next layer's prefetch on their own queues, each layer's dense part
    (attention, router: `dense` per step / layers) on the device queue before it. Every expert is
    in host RAM (no disk reads). Rows of the trace's prefill phase warm the cache and are not
    counted. Needs a GPU profile."""
    from .replay import schedule

    if not profile.has_gpu:
        raise ValueError(f"simulate_schedule: profile {profile.name!r} has no GPU figures")
    cost = ExpertCost(profile, shape.expert_bytes, shape.expert_params)
    planner = _step_planner(trace, shape, cost, policy, capacity, cpu_compute, prefetch)
    scheds, cut, rows, dense_sec = _schedules(trace, schedule(trace), planner, shape, profile, prefetch)
    if rows == 0:
        raise ValueError("simulate_schedule: the trace has no decode rows after its last prefill row")
    return _timed(scheds, cut, rows, dense_sec, cost, hidden, io_lanes)


def _step_planner(trace, shape: ModelShape, cost: ExpertCost, policy, capacity, cpu_compute, prefetch):
    """The engine's step planner as the CUDA path configures it (staged waves, the CUDA prefetch gate)."""
    from ..experts.planner import PlannerConfig, StepPlanner

    config = PlannerConfig(
        num_experts=trace.num_experts,
        device_slots=min(capacity, trace.num_experts),
        host_slots=None,
        expert_bytes=shape.expert_bytes,
        policy=policy,
        cpu_compute="cost" if cpu_compute else "never",
        prefetch="device" if prefetch else "off",
        staged_waves=True,
        gate_waste=0.25,
    )
    return StepPlanner(config, trace.num_layers, cpu_faster=cost.cpu_faster)


def _schedules(trace, steps, p, shape: ModelShape, profile: Profile, prefetch: bool):
    """Every step's layers planned and built as schedules, each with its dense op's seconds ->
    (schedules, index of the first after the last prefill step, decode rows after it, dense seconds by
    op id)."""
    from ..experts.schedule import ScheduleBuilder

    L, b = trace.num_layers, ScheduleBuilder()
    bd = shape.dense_params * shape.bytes_per_param
    phase = trace.phase
    scheds, cut, rows, dense_sec = [], 0, 0, {}
    first_row = 0
    for k in range(len(steps[0]) if L else 0):
        n_rows = steps[0][k].rows
        dense_s = max(
            bd / (profile.gpu_mem_gbs * 1e9), 2 * shape.dense_params * n_rows / (profile.gpu_tflops * 1e12)
        )
        sec_dense = dense_s / L + profile.layer_overhead_ms / 1e3
        for i in range(L):
            st = steps[i][k]
            plan = p.plan_step(i, st.experts, st.tokens, st.rows, st.t)
            pf = None
            if prefetch and i + 1 < L:
                nxt = steps[i + 1][k]
                pf = (i + 1, p.plan_prefetch(i + 1, nxt.lookahead, nxt.rows, nxt.t))
            s = b.layer(i, plan, st.experts, st.tokens, prefetch=pf, dense=True)
            dense_sec[s.ops[0].id] = sec_dense
            scheds.append(s)
            p.end_step(i, plan)
        prefill = phase is not None and bool((phase[first_row : first_row + n_rows] == 0).any())
        first_row += n_rows
        if prefill:
            cut, rows = len(scheds), 0
        else:
            rows += n_rows
    return scheds, cut, rows, dense_sec


def _timed(scheds, cut: int, rows: int, dense_sec: dict, cost: ExpertCost, hidden: int, io_lanes: int):
    """The schedules timed on the executor's queues; decode counted from schedule `cut` on."""
    from ..experts.schedule_time import evaluate, op_seconds

    base = op_seconds(cost, hidden)

    def sec(o):
        return dense_sec[o.id] if o.kind == "dense" else base(o)

    tl = evaluate(scheds, sec, io_lanes)
    warm = evaluate(scheds[:cut], sec, io_lanes).makespan if cut else 0.0
    decode = [o for s in scheds[cut:] for o in s.ops]
    kinds = {o.id: o.kind for o in decode}
    crit: dict[str, int] = {}
    for i in tl.critical_path():
        if i in kinds:
            crit[kinds[i]] = crit.get(kinds[i], 0) + 1
    cpu = sum(len(o.experts) for o in decode if o.kind == "cpu")
    admitted = sum(1 for o in decode if o.kind == "h2d" and o.tag == "admit")
    return ScheduledPrediction(rows / (tl.makespan - warm), tl.makespan - warm, rows, cpu, admitted, crit)
