"""The device-memory plan: every byte the engine takes on its compute device, decided from config.json,
the safetensors headers and the device's (or a named card's) properties, before a weight byte is read.

Terms (bytes; TERMS order), for T = max_num_batched_tokens, B = max_num_seqs, M = max_model_len,
H = hidden size, V = vocab, s = the compute dtype's bytes:
    dense            the non-expert weights as they will be held there: compute dtype, bf16/fp16 kept as
                     stored where the CPU kernels read them (kernels.dense_dtype), fp32 routers where the
                     family keeps them, --dense / --lm-head formats at their packed size, a GGUF file's
                     lm_head / attention / dense MLP matrices in a type the CPU kernels read at their file
                     bytes (on the CPU, without --lm-head / --dense: fill.py), a GGUF embedding table in a
                     block type at its file bytes (on the CPU: models/embedding.py `held_blocks`), rotary
                     frequencies, the linear-attention layers' tensors derived at load; not an untied
                     embedding table under --low-memory on the CPU (its rows are read per token)
    kv_cache         num_blocks x bytes_per_block (plan_kv: auto, or --kv-cache-memory)
    linear_state     (B + 1) x the linear-attention state of one sequence (hybrid models)
    activations      T x (6 H + widest) x 4 + 2 B x M x kv_token x s, where widest = the widest projection
                     a token makes (q|k|v, the dense or shared MLP's gate|up, top_k x the experts' gate|up)
                     and kv_token = the KV elements of one token in one layer (the torch attention gathers
                     each running sequence's padded context)
    logits           R x V x (s + 4)  (a step's logits in the compute dtype, then in float32),
                     R = min(T, B + F), F = logits_block_rows: the rows of prompt tokens that need
                     logits (prompt logprobs, LLM.logits) are capped at F per step
    expert_slots     the fastest tier: slots per layer x MoE layers x one expert in its format
    staging          one expert in the fastest tier's format (CUDA: waves stream through it)
    peer_buffers     expert parallelism with the peer tier on a tiered cache: top_k experts in the stored
                     format, the experts received from other ranks for one layer (parallel/peer.py)
    cuda_context     what the CUDA context takes (measured on the device, or the card profile's figure)
    allocator_slack  SLACK x (dense + kv_cache + linear_state + activations + logits) + SLACK_FLOOR: the
                     caching allocator's rounding and fragmentation, its small-block segments and
                     cuBLAS's workspaces
`ALLOCATED` terms are persistent tensors build/allocate.py makes through the Ledger (build/ledger.py);
the others are transient or outside torch's allocator.

What a budget means (experts/config.py parse_budget reads them; `plan_device` is the one place they
are resolved, on every device):
- device_memory on CUDA: SIZE is the total of all terms; `auto` is the device's free memory plus what
  this process's context already took, less AUTO_MARGIN; "N%" is that share of the experts in the
  device tier, the other terms added to it.
- device_memory on the CPU: the fastest expert tier's bytes ("N%" of all routed experts; `auto` half
  of available RAM, or under --low-memory the RAM left after every other term, the host tier and a
  margin); the other terms are counted beside it (and under ledger.simulate's cap, the total).
- host_memory: the host tier's experts in their stored format ("N%", a size, `auto` = half of
  available RAM; 0 only under --low-memory on the CPU: misses read from disk into device slots).
Available RAM is MemAvailable, or the room under this process's memory cgroup limit (ramlimit.py).
Slots are split evenly across MoE layers; a tier that cannot hold top_k experts of a layer is an
error at startup, never a failure mid-generation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from .. import kernels, ramlimit
from ..engine.kv_cache import KVCache, auto_kv_blocks
from ..engine.state_cache import StateCache
from ..errors import BudgetError, ConfigError
from ..experts.config import parse_budget
from ..experts.layout import parts_at, parts_nbytes
from ..layers.basic import load_quant_method
from ..models import embedding
from ..spec.model_config import ModelConfig, rope_inv_freq
from ..units import fmt_bytes

TERMS = (
    "dense",
    "kv_cache",
    "linear_state",
    "activations",
    "logits",
    "expert_slots",
    "staging",
    "peer_buffers",
    "cuda_context",
    "allocator_slack",
)
ALLOCATED = ("dense", "kv_cache", "linear_state", "expert_slots", "staging", "peer_buffers")
NAMES = {
    "dense": "dense weights",
    "kv_cache": "KV cache",
    "linear_state": "linear-attention state",
    "activations": "activations",
    "logits": "logits",
    "expert_slots": "expert slots",
    "staging": "staging",
    "peer_buffers": "peer receive buffers",
    "cuda_context": "CUDA context",
    "allocator_slack": "allocator slack",
}
SLACK = 0.03  # of the non-expert terms: the caching allocator's block rounding and fragmentation
SLACK_FLOOR = 64 << 20  # 2 MiB small-block segments, cuBLAS workspaces
AUTO_MARGIN = 512 << 20  # left free by --device-memory auto on CUDA (other processes, cuBLAS workspaces)
_SCALE = re.compile(r"_scale(_inv)?$|_scales$")  # quantization scales: folded in at load, not kept


@dataclass(frozen=True)
class GpuSpec:
    """What the plan needs to know about a CUDA device: its memory, what its context takes, capability."""

    name: str
    total: int
    free: int  # free now (a card profile: total less the context)
    context: int
    capability: tuple[int, int]

    @classmethod
    def from_profile(cls, prof) -> GpuSpec:
        """A named card profile (cost/profiles.py: vram_gib, context_mib, capability)."""
        if not prof.vram_gib:
            raise ConfigError(
                f"--gpu {prof.name}: this profile has no card fields (vram_gib, context_mib, "
                "capability); pick a card profile, e.g. rtx4060-8gb"
            )
        total, ctx = int(prof.vram_gib * (1 << 30)), int(prof.context_mib * (1 << 20))
        major, minor = divmod(round(prof.capability * 10), 10)
        return cls(prof.name, total, total - ctx, ctx, (major, minor))

    @classmethod
    def from_device(cls, device: torch.device) -> GpuSpec:
        """The visible device: memory from cudaMemGetInfo; the context = in use outside torch's allocator."""
        free, total = torch.cuda.mem_get_info(device)
        p = torch.cuda.get_device_properties(device)
        ctx = max(0, total - free - torch.cuda.memory_reserved(device))
        return cls(p.name, total, free, ctx, (p.major, p.minor))


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    state_slots: int  # hybrid models: one per running sequence, plus one for logits()
    state_bytes_per_sequence: int

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def state_bytes(self) -> int:
        return self.state_slots * self.state_bytes_per_sequence


def plan_kv(
    cfg: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    kv_cache_memory,
) -> KVPlan:
    """The paged KV cache (auto, or a --kv-cache-memory budget) and the linear-attention state."""
    kv_layers = len(cfg.attention_layer_ids)  # hybrid models: linear-attention layers keep no KV
    per_block = max(1, KVCache.bytes_per_block(kv_layers, block_size, cfg.kv_token_shapes, dtype))
    state_slots = max_num_seqs + 1 if cfg.linear_attn is not None else 0
    min_blocks = math.ceil(max_model_len / block_size)
    b = parse_budget(kv_cache_memory, "kv_cache_memory")
    budget = None if b is None or b.auto else int(b.amount)
    if budget is None:
        num_blocks = auto_kv_blocks(max_model_len, max_num_seqs, per_block, block_size)
    else:
        num_blocks = budget // per_block
        if num_blocks < min_blocks:
            raise ConfigError(
                f"kv_cache_memory={fmt_bytes(budget)} holds {num_blocks * block_size} tokens, fewer than "
                f"max_model_len={max_model_len}; raise it or lower max_model_len"
            )
    return KVPlan(num_blocks, block_size, per_block, state_slots, StateCache.bytes_per_sequence(cfg, dtype))


def dense_bytes(
    index,
    cfg: ModelConfig,
    names,
    dtype: torch.dtype,
    device: torch.device,
    low_memory: bool = False,
    dense: str | None = None,
    lm_head: str | None = None,
) -> int:
    """The dense weights as models/transformer.py holds them, from the headers alone (`names`: the
    family's WeightNames). An embedding whose rows stay on disk (models/embedding.py `on_disk`: low
    memory on the CPU, untied) is not held, so not counted; one held as its GGUF blocks (`held_blocks`)
    is counted at its file bytes."""
    dense_q = None if dense is None else load_quant_method(dense, "dense")
    head_q = None if lm_head is None else load_quant_method(lm_head)
    tied = embedding.tied(cfg, index)
    embed_on_disk = embedding.on_disk(cfg, index, device, low_memory)
    embed_blocks = embedding.held_blocks(cfg, index, device, low_memory, lm_head) is not None
    fp32_names = (f".{names.router}.weight", f".{names.router}.bias") if cfg.router.float32_logits else ()
    total = 0
    for n, t in index.tensors.items():
        if ".experts." in n or _SCALE.search(n) or not t.dtype.is_floating_point:
            continue
        if n == embedding.EMBED and embed_on_disk:
            continue
        if n == embedding.EMBED and embed_blocks:
            total += t.nbytes  # held as the file's blocks (tied: lm_head reads them too)
            continue
        shape = tuple(t.shape)
        if n == embedding.EMBED and not tied and t.dtype.itemsize < dtype.itemsize:
            held = t.dtype  # only gathered from: kept as stored
        elif n.endswith(fp32_names) or n.endswith("e_score_correction_bias"):
            held = torch.float32
        else:
            held = kernels.dense_dtype(t.dtype, len(shape), device, dtype, low_memory)
        if n == "lm_head.weight" and head_q is not None:
            total += head_q.nbytes(shape)
            continue
        if file_blocks(index, n, cfg, names, device, dense, lm_head) is not None:
            total += t.nbytes  # held as the file's blocks
            continue
        if dense_q is not None and _quantized_by_dense(n, cfg, names):
            total += dense_q.nbytes(shape)
            continue
        total += math.prod(shape) * held.itemsize
    if tied and head_q is not None:  # the embedding stays; lm_head is its packed copy
        total += head_q.nbytes((cfg.vocab_size, cfg.hidden_size))
    la = cfg.linear_attn
    if (
        la is not None
    ):  # derived at load per linear-attention layer: -exp(A_log) in float32, the conv transposed
        total += sum(la.layers) * (la.num_v_heads * 4 + la.conv_dim * la.conv_kernel * dtype.itemsize)
    inv, _ = rope_inv_freq(cfg)
    return total + inv.numel() * inv.element_size()


def file_blocks(
    index, name: str, cfg: ModelConfig, names, device, dense: str | None = None, lm_head: str | None = None
) -> str | None:
    """The QuantMethod dense matrix `name` is held in as its GGUF file's blocks, or None: on the CPU, in a
    type the kernels read as stored (gguf/index.py `block_method`), the lm_head (unless `--lm-head`
    requantizes it) and the matrices `--dense` would quantize (unless it is given)."""
    block_method = getattr(index, "block_method", None)
    if block_method is None or torch.device(device).type != "cpu":
        return None
    if name == "lm_head.weight":
        take = lm_head is None
    else:
        take = dense is None and _quantized_by_dense(name, cfg, names)
    return block_method(name) if take else None


def _quantized_by_dense(name: str, cfg: ModelConfig, names) -> bool:
    """The matrices --dense quantizes at load: standard attention's q/k/v/o, shared experts, dense MLPs."""
    m = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", name)
    if not m:
        return False
    i, rest = int(m.group(1)), m.group(2)
    if rest in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
        return cfg.mla is None and not cfg.is_linear(i)
    if rest in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        return not cfg.moe_layers[i]
    return (
        cfg.moe_layers[i]
        and bool(cfg.shared_expert_intermediate_size)
        and re.search(rf"\.{re.escape(names.shared_expert)}\.(gate|up|down)_proj$", rest) is not None
    )


LOGITS_BLOCK_BYTES = 256 << 20  # off the CPU: a step's prompt-token logits (both dtypes) fit this


def logits_block_rows(
    vocab_size: int, dtype: torch.dtype, device: torch.device, max_num_batched_tokens: int
) -> int:
    """F: the prompt tokens whose logits one step may compute (prompt logprobs, LLM.logits): the rows
    whose compute-dtype and float32 logits fit LOGITS_BLOCK_BYTES, on every device (the scheduler holds
    a step to it, so the plan's logits term is a bound: on a CPU under a memory limit it is RAM too;
    gpt-oss's 201,088-token vocabulary at 2048 rows would be 2.5 GB of float32 + bf16 logits)."""
    return max(1, min(max_num_batched_tokens, LOGITS_BLOCK_BYTES // (vocab_size * (dtype.itemsize + 4))))


def workspace_bytes(
    cfg: ModelConfig,
    dtype: torch.dtype,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    device: torch.device | None = None,
) -> tuple[int, int]:
    """(activations, logits) of the widest step: the formulas in the module docstring (device None: the CPU)."""
    device = torch.device("cpu") if device is None else device
    T, H = max_num_batched_tokens, cfg.hidden_size
    q_rows = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
    widest = max(
        q_rows + 2 * cfg.num_kv_heads * cfg.head_dim,
        2 * (cfg.intermediate_size or 0),
        2 * (cfg.shared_expert_intermediate_size or 0),
        cfg.top_k * 2 * cfg.moe_intermediate_size,
    )
    kv_token = sum(math.prod(s) for s in cfg.kv_token_shapes)
    gather = 2 * max_num_seqs * max_model_len * kv_token * dtype.itemsize if cfg.attention_layer_ids else 0
    rows = min(T, max_num_seqs + logits_block_rows(cfg.vocab_size, dtype, device, T))
    return T * (6 * H + widest) * 4 + gather, rows * cfg.vocab_size * (dtype.itemsize + 4)


# -- the expert tiers ---------------------------------------------------------------------------

# left free by a low-memory CPU plan's auto budget (at least; 5% of the room above it): what the process grows by
# beside the planned terms (the kernels' and tokenizer's buffers, the allocator's free lists). 256 MiB was too
# little: Qwen3-30B-A3B's 48 layers in a 7.9 GiB cgroup reached the limit (peak RSS 7.67 GiB) and were killed.
LOW_MEMORY_MARGIN = 768 << 20


def resolve(value, total: int, auto: int, name: str) -> int:
    """A budget in bytes: a share of `total`, `auto` for None or "auto", else the size."""
    b = parse_budget(value, name)
    return auto if b is None else b.bytes(total, auto)


@dataclass(frozen=True)
class TierPlan:
    slots: int  # per MoE layer
    expert_bytes: int  # one expert in this tier's format
    budget: int

    def describe(self, name: str, num_layers: int, num_experts: int) -> str:
        used = self.slots * num_layers * self.expert_bytes
        return (
            f"{name}: {self.slots} slots/layer x {num_layers} layers x {fmt_bytes(self.expert_bytes)} = "
            f"{fmt_bytes(used)} ({self.slots / num_experts:.0%} of experts; budget {fmt_bytes(self.budget)})"
        )


def plan_tier(
    value,
    name: str,
    expert_bytes: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    auto: int,
    reserve: int = 0,
) -> TierPlan:
    total = expert_bytes * num_layers * num_experts
    budget = resolve(value, total, auto, name)
    slots = min(num_experts, max(0, budget - reserve) // (expert_bytes * num_layers))
    if slots < top_k:
        need = top_k * expert_bytes * num_layers + reserve
        raise BudgetError(
            f"{name}={fmt_bytes(budget)} holds {slots} experts per layer, but a token needs top_k={top_k}: "
            f"give at least {fmt_bytes(need)} ({top_k} x {num_layers} layers x {fmt_bytes(expert_bytes)}"
            + (f" + {fmt_bytes(reserve)} staging" if reserve else "")
            + ")"
        )
    return TierPlan(slots, expert_bytes, budget)


@dataclass
class MemoryPlan:
    """The tiers the engine allocates for given budgets; `host` is None when every expert is on the device."""

    device: TierPlan
    host: TierPlan | None
    staging: int  # one expert in the fastest tier's format on CUDA (experts streamed in waves)
    layers: int
    dev_parts: tuple = ()  # the fastest tier's parts (compute format, or stored in low-memory mode)
    lines: list[str] = field(default_factory=list)

    @property
    def resident(self) -> bool:
        return self.host is None

    @property
    def device_used(self) -> int:
        return self.device.slots * self.device.expert_bytes * self.layers + self.staging

    @property
    def host_used(self) -> int:
        return 0 if self.host is None else self.host.slots * self.host.expert_bytes * self.layers


def _is_auto(value) -> bool:
    return value is None or parse_budget(value, "budget").auto


def _share(value) -> bool:
    return value is not None and parse_budget(value, "budget").share


def plan_tiers(
    source,
    device: torch.device,
    dtype: torch.dtype,
    device_memory=None,
    host_memory=None,
    low_memory: bool = False,
    other_ram: int = 0,
) -> MemoryPlan:
    """Budgets -> the expert tiers, with the lines the engine prints (plan_device's expert half: on
    CUDA it is handed what is left of the GPU after every other term). Reads headers only.

    Low memory on a CPU device: the fastest tier keeps the stored format (converted per use) and
    host_memory may be 0 (no second copy in RAM: misses are read from disk into device slots). There
    an `auto` device budget is the RAM left after `other_ram` (every other term of the engine's plan:
    dense weights, KV cache, activations, logits), the host tier (0 when it is auto too: a second copy
    in the same RAM buys nothing) and a margin; available RAM honours a memory cgroup's limit.
    """
    cfg = source.cfg
    L, E, K = len(source.layers), cfg.num_experts, cfg.top_k
    low_cpu = low_memory and device.type == "cpu"
    dev_parts = fastest_parts(source, device, dtype, low_memory)
    dev_bytes = parts_nbytes(dev_parts)  # per-layer layouts: the mean over the layers, rounded up
    lines = [
        (
            f"experts: {L} layers x {E} experts x {fmt_bytes(source.stored_nbytes)} = "
            f"{fmt_bytes(source.total_nbytes)} on disk ({source.dtype}); fastest tier "
            f"{fmt_bytes(dev_bytes)}/expert ({parts_at(dev_parts, 0)[0].dtype})"
        )
    ]
    ram, why = ramlimit.available()  # read once per plan: every `auto` budget below takes it
    ram_text = f"available RAM {fmt_bytes(ram)} ({why})"
    if _is_auto(device_memory) and device.type == "cuda":
        raise ValueError(
            "device_memory 'auto' on cuda is resolved by plan_device; give the fastest tier's "
            "budget in bytes or as a share here"
        )
    if _is_auto(device_memory) and low_cpu and _is_auto(host_memory):
        host_memory = 0  # a second copy in the same RAM buys nothing
    auto_dev = _auto_cpu_device(source, device_memory, host_memory, low_cpu, other_ram, ram, ram_text, lines)
    staging = dev_bytes if device.type == "cuda" else 0
    dplan = plan_tier(
        "auto" if device_memory is None else device_memory,
        "device_memory",
        dev_bytes,
        L,
        E,
        K,
        auto_dev,
        reserve=staging,
    )
    if dplan.slots >= E:
        lines.append(dplan.describe("device", L, E) + ": every expert resident, loaded once")
        return MemoryPlan(dplan, None, 0, L, dev_parts, lines)
    lines.append(dplan.describe("device", L, E) + (f" + staging {fmt_bytes(staging)}" if staging else ""))
    hplan = _host_tier(source, host_memory, low_cpu, ram, ram_text, lines)
    lines.append(f"disk: {fmt_bytes(source.total_nbytes)} in {source.index.model_dir}")
    return MemoryPlan(dplan, hplan, staging, L, dev_parts, lines)


def _host_tier(source, host_memory, low_cpu: bool, ram: int, ram_text: str, lines: list[str]) -> TierPlan:
    """The host tier (stored format) from host_memory (`auto`: half of available RAM); 0 only under low
    memory on the CPU (misses read from disk into device slots). Its lines appended to `lines`."""
    cfg = source.cfg
    L, E, K = len(source.layers), cfg.num_experts, cfg.top_k
    host_auto = ram // 2
    if (
        low_cpu
        and not _is_auto(host_memory)
        and resolve(host_memory, source.total_nbytes, 0, "host_memory") == 0
    ):
        hplan = TierPlan(0, source.expert_nbytes, 0)
    else:
        if not _is_auto(host_memory) and resolve(host_memory, source.total_nbytes, 0, "host_memory") == 0:
            raise BudgetError(
                "host_memory=0: no expert could be staged in RAM; on CPU add --low-memory (misses "
                "are then read from disk straight into the expert slots), or give a host budget"
            )
        hplan = plan_tier(
            "auto" if host_memory is None else host_memory,
            "host_memory",
            source.expert_nbytes,
            L,
            E,
            K,
            host_auto,
        )
    if _is_auto(host_memory):
        lines.append(f"auto host budget = half of {ram_text} = {fmt_bytes(host_auto)}")
    lines.append(
        hplan.describe("host", L, E)
        + (": every expert in RAM" if hplan.slots >= E else "; the rest streamed from disk")
    )
    return hplan


def _auto_cpu_device(
    source,
    device_memory,
    host_memory,
    low_cpu: bool,
    other_ram: int,
    ram: int,
    ram_text: str,
    lines: list[str],
) -> int:
    """The fastest tier's `auto` budget on the CPU (0 when device_memory is not auto), its line appended."""
    if not _is_auto(device_memory):
        return 0
    if not low_cpu:
        lines.append(f"auto device budget (CPU) = half of {ram_text} = {fmt_bytes(ram // 2)}")
        return ram // 2
    host = resolve(host_memory, source.total_nbytes, 0, "host_memory")
    margin = max(LOW_MEMORY_MARGIN, ram // 20)
    auto_dev = max(0, ram - other_ram - host - margin)
    lines.append(
        f"auto device budget (CPU, low memory) = {ram_text} - the engine's other terms "
        f"{fmt_bytes(other_ram)} - host tier {fmt_bytes(host)} - margin {fmt_bytes(margin)} = "
        f"{fmt_bytes(auto_dev)}"
    )
    return auto_dev


# -- every term on the device ------------------------------------------------------------------


@dataclass
class DevicePlan:
    """The engine's bytes on its device by term, the expert tiers, and the lines printed before the load."""

    device: torch.device
    budget: int | None  # the total the engine may take there (None: no limit given, CPU)
    terms: dict[str, int]
    experts: MemoryPlan | None  # None: every expert resident without a budget (no tiered cache)
    kv: KVPlan
    host_bytes: int  # the host tier's experts (0 when none)
    gpu: GpuSpec | None = None
    lines: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    @property
    def allocated(self) -> dict[str, int]:
        """The persistent tensors' terms (what build/ledger.py's Ledger counts)."""
        return {k: self.terms[k] for k in ALLOCATED}

    def arithmetic(self) -> str:
        parts = " + ".join(f"{NAMES[k]} {fmt_bytes(v)}" for k, v in self.terms.items() if v)
        return f"{parts} = {fmt_bytes(self.total)}"


def plan_device(
    source,
    names,
    config,
    max_model_len: int,
    gpu: GpuSpec | None = None,
    cap: int | None = None,
    owned: int | None = None,
    peer_slots: int = 0,
) -> DevicePlan:
    """Every byte the engine takes on its device, by term, and the expert tiers: the one answer to
    "how many bytes may X take on device D". `config`: an EngineConfig (config.py); `gpu`: the CUDA
    device or a card (None on the CPU); `cap`: a CPU stand-in's limit (build/ledger.py simulate);
    `owned`: an expert-parallel rank's experts (all layers) when it holds them all resident;
    `peer_slots`: the peer tier's receive buffers (experts, stored format) when it is on (parallel/peer.py
    decide_for), counted when the experts are tiered (an all-resident cache receives nothing).
    Raises BudgetError in one line naming every term and the smallest budget that fits."""
    cfg, cache = source.cfg, config.cache
    device, dtype, low_memory = config.load.torch_device, config.load.torch_dtype, cache.low_memory
    kv, fixed = _fixed_terms(source, names, config, max_model_len)
    cuda = device.type == "cuda"
    slack = int(SLACK * sum(fixed.values())) + SLACK_FLOOR if cuda else 0
    fixed["peer_buffers"] = peer_slots * parts_nbytes(source.parts) if cache.tiered else 0
    context = gpu.context if cuda and gpu is not None else 0
    outside = sum(fixed.values()) + context + slack  # every term but the experts'
    L, E, K = len(source.layers), cfg.num_experts, cfg.top_k
    per_expert = parts_nbytes(fastest_parts(source, device, dtype, low_memory))
    staging = per_expert if cuda else 0
    value, lines = cache.device_memory, []
    budget = cap if not cuda else _cuda_budget(value, cache.tiered, gpu, lines)
    label = _label(cap, budget, value)
    need = outside + staging + K * L * per_expert  # the smallest plan: top_k slots per layer
    refusal = BudgetError(_refusal(label, fixed, context, slack, staging, K, L, per_expert, need, cuda))
    if budget is not None and budget < need:
        raise refusal
    experts = None
    if cache.tiered:
        tier_budget = value if (not cuda or _share(value)) else max(0, budget - outside)
        experts = _tiers(source, config, tier_budget, 0 if cuda else outside, refusal)
        lines = experts.lines[:1] + lines + experts.lines[1:]
        if experts.resident:  # no tiers: no peer tier, its buffers not made
            fixed["peer_buffers"] = 0
        slots, staging, host = experts.device.slots * L * per_expert, experts.staging, experts.host_used
    else:
        slots, staging, host = (L * E if owned is None else owned) * per_expert, 0, 0
    terms = {
        **fixed,
        "expert_slots": slots,
        "staging": staging,
        "cuda_context": context,
        "allocator_slack": slack,
    }
    terms = {k: terms[k] for k in TERMS}
    plan = DevicePlan(device, budget, terms, experts, kv, host, gpu, lines)
    _check_total(plan, label)
    return plan


def _label(cap: int | None, budget: int | None, value) -> str:
    """How a refusal names the budget it was held to."""
    if cap is not None:
        return f"the device cap {fmt_bytes(cap)}"
    if budget is not None and _is_auto(value):
        return f"device_memory=auto ({fmt_bytes(budget)})"
    return f"device_memory={fmt_bytes(budget or 0)}"


def _tiers(source, config, tier_budget, other_ram: int, refusal: BudgetError) -> MemoryPlan:
    """plan_tiers for the engine's options; on CUDA a tier that does not fit raises the device plan's
    own refusal (naming every term) instead."""
    cache, device = config.cache, config.load.torch_device
    try:
        return plan_tiers(
            source,
            device,
            config.load.torch_dtype,
            tier_budget,
            cache.host_memory,
            cache.low_memory,
            other_ram=other_ram,
        )
    except BudgetError:
        if device.type != "cuda":
            raise
        raise refusal from None


def _fixed_terms(source, names, config, max_model_len: int) -> tuple[KVPlan, dict[str, int]]:
    """The KV plan and the terms that do not depend on the expert tiers: dense, KV cache, linear state,
    activations, logits."""
    cfg, sched = source.cfg, config.scheduler
    device, dtype = config.load.torch_device, config.load.torch_dtype
    kv = plan_kv(cfg, dtype, max_model_len, sched.max_num_seqs, sched.block_size, sched.kv_cache_memory)
    act, logits = workspace_bytes(
        cfg, dtype, sched.max_num_batched_tokens, sched.max_num_seqs, max_model_len, device
    )
    k = config.kernels
    dense = dense_bytes(source.index, cfg, names, dtype, device, config.cache.low_memory, k.dense, k.lm_head)
    return kv, {
        "dense": dense,
        "kv_cache": kv.kv_bytes,
        "linear_state": kv.state_bytes,
        "activations": act,
        "logits": logits,
    }


def _check_total(plan: DevicePlan, label: str) -> None:
    """On CUDA the plan's sum appended to its lines; the total against the budget and, on a visible GPU,
    against its free memory (BudgetError)."""
    budget, gpu = plan.budget, plan.gpu
    cuda = plan.device.type == "cuda"
    if cuda:
        where = f"{gpu.name}, {fmt_bytes(gpu.total)}" if gpu is not None else "no card given"
        plan.lines.append(
            f"device memory ({where}): {plan.arithmetic()}"
            + (f" of {fmt_bytes(budget)}" if budget is not None else "")
        )
    if budget is not None and plan.total > budget:
        raise BudgetError(
            f"{label} does not fit the engine: {plan.arithmetic()}; give at "
            f"least {fmt_bytes(plan.total)}, or smaller expert tiers"
        )
    if cuda and gpu is not None and plan.total - gpu.context > gpu.free:
        raise BudgetError(
            f"device_memory: the plan needs {fmt_bytes(plan.total - gpu.context)} besides the CUDA "
            f"context but {gpu.name} has {fmt_bytes(gpu.free)} free ({plan.arithmetic()}); "
            "give a smaller --device-memory"
        )


def fastest_parts(source, device: torch.device, dtype: torch.dtype, low_memory: bool) -> tuple:
    """The fastest tier's expert parts: the stored format under low memory on the CPU (converted per
    use), else the compute format (ExpertSource.compute_parts)."""
    return source.parts if low_memory and device.type == "cpu" else source.compute_parts(dtype, device)


def _cuda_budget(value, tiered: bool, gpu: GpuSpec | None, lines: list[str]) -> int | None:
    """The engine's total on CUDA: None (every expert resident without a budget, or a share of the
    experts), a size, or `auto` from the GPU's free memory (its line appended to `lines`)."""
    if not tiered or _share(value):
        return None
    if not _is_auto(value):
        return parse_budget(value, "device_memory").bytes(0, 0)
    if gpu is None:
        raise ConfigError("device_memory: 'auto' on cuda needs a visible GPU or a card (--gpu NAME)")
    budget = max(0, gpu.free + gpu.context - AUTO_MARGIN)
    lines.append(
        f"auto device budget = free {fmt_bytes(gpu.free)} + CUDA context {fmt_bytes(gpu.context)} - "
        f"margin {fmt_bytes(AUTO_MARGIN)} = {fmt_bytes(budget)} ({gpu.name})"
    )
    return budget


def _refusal(label, fixed, context, slack, staging, K, L, per_expert, need, cuda) -> str:
    terms = {**fixed, "cuda_context": context, "allocator_slack": slack}
    parts = [f"{NAMES[k]} {fmt_bytes(v)}" for k, v in terms.items() if v]
    parts.append(
        f"top_k={K} expert slots per layer ({K} x {L} layers x {fmt_bytes(per_expert)}) "
        f"{fmt_bytes(K * L * per_expert)}"
    )
    if staging:
        parts.append(f"staging {fmt_bytes(staging)}")
    return (
        f"{label} does not fit the engine on the {'GPU' if cuda else 'device'}: "
        f"{' + '.join(parts)} = {fmt_bytes(need)}; give at least {fmt_bytes(need)} (or lower --max-model-len, "
        f"--kv-cache-memory, --max-num-batched-tokens)"
    )


__all__ = [
    "ALLOCATED",
    "TERMS",
    "DevicePlan",
    "GpuSpec",
    "KVPlan",
    "MemoryPlan",
    "TierPlan",
    "dense_bytes",
    "fastest_parts",
    "file_blocks",
    "plan_device",
    "plan_kv",
    "plan_tiers",
    "workspace_bytes",
]
