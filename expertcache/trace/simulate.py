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


def simulate(result: ReplayResult | object, shape: ModelShape, profile: Profile, cpu_compute: bool = True,
             from_disk: bool = False, policy: str | None = None, capacity: int | None = None,
             prefetch: bool = False) -> Prediction:
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
        dense = result.steps * max(bd / (profile.cpu_mem_gbs * gb),
                                   2 * shape.dense_params * u_step / (profile.cpu_gflops * 1e9))
        exp = uses * cpu_exp
        total = dense + exp + result.misses * disk + over
        return Prediction(result.rows / total, total, dense, 0.0, result.misses * disk, exp, 0.0, result.misses, 0,
                          over)
    dense = result.steps * max(bd / (profile.gpu_mem_gbs * gb),
                               2 * shape.dense_params * u_step / (profile.gpu_tflops * tf))
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
