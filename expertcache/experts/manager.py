"""TieredExperts: the expert cache the model sees (an ExpertProvider); it carries out the step planner's plans.

    disk (safetensors, DiskReader) -> host slots (stored dtype, pinned on CUDA) -> device slots (compute dtype)

Every cache decision (hits, fills and their victims, CPU-computed misses, waves, demotions,
prefetches) is made by experts.planner.StepPlanner, which trace replay drives too. This module
moves bytes and computes, one way on every device. Per MoE layer and forward step:

    ids read (the host's one wait) -> plan -> the next layer's prefetch planned
        -> a schedule of ops (experts/schedule.py) -> bound to the cache's buffers (experts/bindings.py)
        -> run by the executor (experts/executor.py)

The executor: "inline" on a CPU device (ops in issue order on the calling thread; disk reads on
two I/O lanes so the hits compute while the misses' reads are in flight, unless `overlap_io=False`:
vLLM #37190 v1's one synchronous read and copy per miss), "cuda" on CUDA (streams, per-slot
events, the CPU job on a worker), "threads" in tests (the CUDA semantics on worker threads).
Prefetch (layer L+1's predicted experts, handed to `prefetch` before layer L runs) and exclusive
tiers' demotions are ops of the same schedule.

The step's expert ids (and the held prediction's) reach the host once per layer, in one small copy
(experts/host_routing.py `to_host`: on CUDA the layer's only device -> host read, non-blocking
into pinned memory): the distinct experts, their token counts, the use counts, the prefetch's
experts, the pairs of each compute pass and of each off-slot expert all come from it; lookup tables
stay on the host.

Slot tables and lookup tensors agree at all times (`check()`); with `verify=True` every
slot fill is compared with the checkpoint's bytes (tests).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from ..cost.model import ExpertCost, default_profile
from ..errors import ConfigError
from ..loader.disk import DiskReader
from .backends import backend_for
from .bindings import SMALL, Bindings
from .config import CacheConfig
from .executor import make_executor
from .host_routing import to_host
from .layout import ExpertSource, LayerParts, parts_at, parts_key
from .planner import Demotion, PlannerConfig, StepPlanner
from .pool import SlotPool
from .prefetch import resolve_prefetch
from .provider import ExpertProvider
from .schedule import ScheduleBuilder
from .slots import SlotTable
from .stats import LayerCounters, collect, save_stats

log = logging.getLogger("expertcache")


def is_direct(device: torch.device, dev_parts, source_parts) -> bool:
    """The device slots are host RAM in the stored format (CPU: the kernels read it, or low memory):
    a miss with no host slot can be read from disk straight into its device slot, with no conversion
    or copy."""
    return device.type == "cpu" and parts_key(dev_parts) == parts_key(source_parts)


def demotable(cuda: bool, dev_parts, source_parts) -> bool:
    """Device slot bytes can go back to the stored format exactly: the same dtype, or bf16/fp16
    widened to fp32. CPU only for now (a CUDA demotion would be a d2h op on its side stream into a
    pinned host slot; its binding is not built)."""
    if isinstance(dev_parts, LayerParts) or isinstance(source_parts, LayerParts):  # per-layer layouts
        return not cuda and parts_key(dev_parts) == parts_key(source_parts)
    src = {p.name: p for p in source_parts}
    exact = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}
    return not cuda and all(
        p.name in src
        and tuple(p.shape) == tuple(src[p.name].shape)
        and (p.dtype == src[p.name].dtype or (src[p.name].dtype, p.dtype) in exact)
        for p in dev_parts
    )


def _flat_list(t: torch.Tensor) -> list[int]:
    """A host [T, K] tensor's values, flat, as a list (one row: no reshape)."""
    rows = t.tolist()
    return rows[0] if len(rows) == 1 else [e for r in rows for e in r]


class TieredExperts(ExpertProvider):
    """The tiered cache for the slot counts of a memory plan and a validated CacheConfig
    (policy, prefetch mode, cpu_compute, prefill admission; ablation switches in cfg.ablation)."""

    def __init__(
        self,
        source: ExpertSource,
        device: torch.device,
        dtype: torch.dtype,
        device_slots: int,
        host_slots: int | None,
        options: CacheConfig | None = None,
        stats: torch.Tensor | None = None,
        progress=None,
        dev_parts=None,
        cost: ExpertCost | None = None,
        executor: str | None = None,
    ):
        """`executor`: what runs a step's schedule: None = "cuda" on a CUDA device (streams, events and
        worker threads), else "inline" (the calling thread); "threads" = the CPU backend of the CUDA
        path (tests of its ordering on a CPU). Steps: the tiers' kinds, the planner, the buffers, the
        host tier's load, the warm start."""
        options = options or CacheConfig(device_memory="auto")
        cfg = source.cfg
        self.source, self.device, self.dtype = source, device, dtype
        self.serving = False  # set once the startup load is done
        self.E, self.K = cfg.num_experts, cfg.top_k
        self.layers = source.layers
        self.li = {layer: i for i, layer in enumerate(self.layers)}
        self.cuda = device.type == "cuda"
        self.peer = (
            None  # expert parallelism: offers a layer's missing experts from other ranks (parallel.peer)
        )
        self.ahead: tuple[int, torch.Tensor] | None = None  # prefetch waiting for the demand reads
        self.executor = None
        self.t = 0
        dev_parts = dev_parts or source.compute_parts(dtype, device)
        self._tiers(options, dev_parts, device_slots, host_slots)
        # per missing expert on CUDA (cpu_compute auto): computed on the CPU when that beats moving it
        self.cost = cost or ExpertCost(
            default_profile(device.type),
            source.expert_nbytes,
            3 * cfg.hidden_size * cfg.moe_intermediate_size,
        )
        self.planner = self._planner(options, host_slots, stats)
        self.reader = DiskReader(o_direct=options.ablation.o_direct)
        self._buffers(dev_parts)
        if self.host_all:
            self._load_host(progress)
        if stats is not None:
            self._warm(stats)
        self.use_executor(executor or ("cuda" if self.cuda else "inline"))
        self.serving = True

    def _tiers(self, options: CacheConfig, dev_parts, device_slots: int, host_slots: int | None) -> None:
        """What the tiers are: slot counts, direct reads, the prefetch mode, exclusive tiers."""
        source, abl = self.source, options.ablation
        self.direct = is_direct(self.device, dev_parts, source.parts)
        # device slots hold the stored format (a peer rank can be sent their bytes as they are)
        self.dev_stored = parts_key(dev_parts) == parts_key(source.parts)
        partial = host_slots is not None and host_slots > 0
        self.prefetch_mode = resolve_prefetch(options.prefetch, self.device, self.direct, partial)
        self.wants_prefetch = self.prefetch_mode != "off"
        self.overlap_io, self.verify = abl.overlap_io, abl.verify
        # exclusive tiers: an expert leaving the device tier keeps its bytes in a host slot (demotion)
        # and one promoted from a host slot frees it, so RAM + device hold disjoint experts
        can = demotable(self.cuda, dev_parts, source.parts) and partial
        if abl.exclusive and not can:
            raise ValueError(
                "exclusive=True needs a CPU device, a partial host tier and device slots that "
                "widen the stored format exactly (bf16/fp16 -> fp32, or the same dtype)"
            )
        self.exclusive = can if abl.exclusive is None else abl.exclusive
        self.device_slots = device_slots
        self.host_all = host_slots is None
        self.host_slots = self.E if self.host_all else host_slots

    def _planner(self, options: CacheConfig, host_slots: int | None, stats) -> StepPlanner:
        """The step planner of every cache decision, for these tiers and the options."""
        abl, cpu_compute = options.ablation, options.cpu_compute
        return StepPlanner(
            PlannerConfig(
                num_experts=self.E,
                device_slots=self.device_slots,
                host_slots=host_slots,
                expert_bytes=self.source.expert_nbytes,
                policy=options.policy_name,
                cpu_compute={"auto": "cost" if self.cuda else "never"}.get(cpu_compute, cpu_compute),
                prefetch=self.prefetch_mode,
                prefill_admit_tokens=options.prefill_admit_tokens,
                exclusive=self.exclusive,
                direct=self.direct,
                staged_waves=self.cuda,
                gate_threshold=abl.prefetch_gate,
                gate_waste=0.25 if self.cuda else 1.0,
            ),
            len(self.layers),
            stats,
            cpu_faster=self.cost.cpu_faster,
        )

    def _buffers(self, dev_parts) -> None:
        """The tiers' slot pools, the expert -> device slot lookup, the staging slot, the schedule's
        builder, use counts, and what a step looks up once and keeps (views, backends)."""
        L, E, source, device = len(self.layers), self.E, self.source, self.device
        self._uses = torch.zeros(L, E, dtype=torch.int64)  # use counts of big steps (bincount)
        self._small_uses = [[0] * E for _ in range(L)]  # and of small ones, counted in Python
        self.method, self.ffn = source.method, source.ffn
        self._host_ffn: tuple = (None, None)  # (self.ffn, its host twin): host_ffn
        self._views: dict[int, tuple] = {}  # id(a SlotPool) -> (its buf, {(layer index, slot): views})
        self._backends: dict[tuple, tuple] = {}  # (layer index, x's dtype, device) -> (method, ffn, backend)
        # device tier: compute dtype; lookup expert -> slot (host only: pairs' slots are looked up on the host)
        self.dev = SlotPool(dev_parts, L, self.device_slots, device)
        # per layer, expert -> device slot (-1 none), on the host: written through numpy (a few hundred ns),
        # read by the step through the torch tensors sharing its memory (one take per step)
        self.lut = np.full((L, E), -1, dtype=np.int64)
        self._lut_t = torch.from_numpy(self.lut)
        self._lut_rows = list(self._lut_t)  # each layer's row, made once (a view per step is a dispatch)
        if self.cuda and isinstance(dev_parts, LayerParts):
            raise ConfigError(
                f"{source.index.model_dir}: routed experts whose layout differs between layers (GGUF "
                "types per layer) are tiered on a CPU device only (the CUDA staging slot holds one layout)"
            )
        self.stage = (
            {p.name: torch.empty(p.shape, dtype=p.dtype, device=device) for p in dev_parts}
            if self.cuda
            else None
        )  # the waves' staging slot (a CPU device computes from the host)
        self.builder = ScheduleBuilder(staged_waves=self.cuda)
        # host tier: stored dtype; all experts (slot = expert id) when host_slots is None
        self.host = SlotPool(source.parts, L, self.host_slots, torch.device("cpu"), pin=self.cuda)

    def _load_host(self, progress) -> None:
        """Every expert read from disk into its host slot (slot = expert id); a non-finite one is an error."""
        source = self.source
        for i, layer in enumerate(self.layers):
            for e in range(self.E):
                self._read(layer, e, self.host.views(i, e))
                if (layer, e) in source.nonfinite:  # read at load: an error, like a dense weight
                    raise source.nonfinite_error(layer, e)
                if progress:
                    progress(source.expert_nbytes)

    def use_executor(self, kind: str) -> None:
        """Run steps through an executor of the schedule ("inline", "threads"; "cuda" on a CUDA
        device). Bytes in flight are landed first, so it may switch between steps."""
        if self.executor is not None:
            self.executor.drain()
            self.executor.close()
        self.executor = make_executor(kind, self.device, overlap_io=self.overlap_io)

    @property
    def use_counts(self) -> torch.Tensor:
        """[L, E] rows routed to each expert so far."""
        return self._uses + torch.tensor(self._small_uses, dtype=torch.int64)

    @property
    def dev_tables(self) -> list[SlotTable]:
        return [st.device for st in self.planner.layers]

    @property
    def host_tables(self) -> list[SlotTable] | None:
        return None if self.host_all or not self.host_slots else [st.host for st in self.planner.layers]

    @property
    def counters(self) -> dict[int, LayerCounters]:
        return {layer: st.counters for layer, st in zip(self.layers, self.planner.layers)}

    # -- byte movement -------------------------------------------------------------------------------
    def _read(self, layer: int, e: int, dst: dict[str, torch.Tensor]) -> None:
        """Expert e's bytes from disk (or the bytes a peer rank sent for this layer) into dst (any thread)."""
        if self.peer is None or not self.peer.take(layer, e, dst):
            self.reader.read_parts(self.source.ranges(layer, e), dst)
        self._check(layer, e, dst)

    def _check(self, layer: int, e: int, dst: dict[str, torch.Tensor]) -> None:
        """Non-finite values at an expert's first read are recorded (requests routed to it fail on
        their logits) and, when serving (not loading), logged."""
        if self.source.check_read(layer, e, dst) and self.serving:
            log.warning("%s", self.source.nonfinite_error(layer, e))

    def _verify(self, layer: int, e: int, dst: dict[str, torch.Tensor]) -> None:
        ref = self.source.read(layer, e)
        for n, t in dst.items():
            if not torch.equal(t.cpu(), ref[n].to(t.dtype)):
                raise AssertionError(
                    f"slot bytes of layer {layer} expert {e} part {n} differ from the checkpoint"
                )

    @property
    def host_ffn(self):
        """self.ffn for the host pool, computed on the CPU whatever kernel computes the device's (the CPU
        job, a CPU device's waves): made once per ffn object."""
        ffn = self.ffn
        if self._host_ffn[0] is not ffn:
            kernel = getattr(ffn, "kernel", "torch") != "torch"
            self._host_ffn = (ffn, dataclasses.replace(ffn, kernel="torch") if kernel else ffn)
        return self._host_ffn[1]

    def slot_views(self, pool: SlotPool, i: int, s: int) -> dict[str, torch.Tensor]:
        """pool.views(i, s), made once per slot (a view is a dispatch per part; the schedule's copies
        ask for the same slots step after step). The same dict every call: read it, do not modify it."""
        got = self._views.get(id(pool))
        if got is None or got[0] is not pool.buf:  # a new `buf` dict: new views
            got = self._views[id(pool)] = (pool.buf, {})
        v = got[1].get((i, s))
        if v is None:
            v = got[1][(i, s)] = pool.views(i, s)
        return v

    def backend(self, i: int, x: torch.Tensor, pool: dict[str, torch.Tensor]):
        """The MoE backend computing device pool `pool` of layer index i for activations like x
        (experts.backends.backend_for, asked once per layer, dtype and device: the pool, method and
        layout of a layer never change)."""
        key = (i, x.dtype, x.get_device())
        got = self._backends.get(key)
        if got is None or got[0] is not self.method or got[1] is not self.ffn:
            got = self._backends[key] = (self.method, self.ffn, backend_for(pool, x, self.method, self.ffn))
        return got[2]

    # -- provider interface --------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.t += 1

    def _step_ids(self, ids: torch.Tensor):
        """The step's ids and the held prediction's on the host -> (ids [T, K] on the host, the same flat
        [T*K] as a list, (prediction's layer, its flat ids as a list, its rows) or None). CUDA: in one
        copy (the layer's one device read); a CPU device: the ids are host memory already and are read
        in place (no op of the step writes them)."""
        ahead, self.ahead = self.ahead, None
        if not ids.is_cuda and type(ids) is torch.Tensor:
            pred = None if ahead is None else (ahead[0], _flat_list(ahead[1]), ahead[1].shape[0])
            return ids, _flat_list(ids), pred
        flat = ids.reshape(-1)
        if ahead is None:
            host = to_host(flat)
            return host.view(ids.shape), host.tolist(), None
        layer, pred = ahead
        both = to_host(torch.cat([flat, pred.reshape(-1)]))
        n = flat.shape[0]
        return both[:n].view(ids.shape), both[:n].tolist(), (layer, both[n:].tolist(), pred.shape[0])

    def _distinct(self, i: int, step: list[int], host_ids: torch.Tensor) -> tuple[list[int], list[int]]:
        """The step's ids (flat list, and [T, K] on the host) -> (distinct experts in order of first
        appearance, their token counts); the use counts are added on the way."""
        if len(step) <= SMALL:
            n: dict[int, int] = {}
            for e in step:
                n[e] = n.get(e, 0) + 1
            uses = self._small_uses[i]
            for e, c in n.items():
                uses[e] += c
            return list(n), list(n.values())
        counts = torch.bincount(host_ids.reshape(-1), minlength=self.E)
        self._uses[i] += counts
        n = counts.tolist()
        experts = list(dict.fromkeys(step))
        return experts, [n[e] for e in experts]

    def forward(self, layer, x, ids, weights):
        """The layer's step as a schedule run by the executor: the ids read is the one host wait;
        copies wait on per-slot events; the CPU experts run in one call on the CPU queue beside the hits."""
        i = self.li[layer]
        T = ids.shape[0]
        host_ids, step, ahead = self._step_ids(ids)
        experts, tokens = self._distinct(i, step, host_ids)
        plan = self.planner.plan_step(i, experts, tokens, T, self.t)
        lut = self.lut[i]
        hit_slots = torch.take(self._lut_rows[i], host_ids)  # [T, K]: only the hits are in the lookup now
        pf = None
        if ahead is not None:
            j = self.li[ahead[0]]
            pf = (j, self.planner.plan_prefetch(j, ahead[1], ahead[2], self.t))
        ex = self.executor
        # in issue order nothing is gained by computing the hits before fills whose bytes are in memory
        merge = (
            ex.inline
            and plan.fills
            and not any(f.src is None or f.src.read or f.src.transient for f in plan.fills)
        )
        sched = self.builder.layer(i, plan, experts, tokens, pf, merge=bool(merge))
        b = Bindings(self, i, x, host_ids, step, weights, hit_slots, plan, lazy_out=ex.inline)
        fns = b.fns(sched)
        for f in plan.fills:
            if f.evicted >= 0:
                lut[f.evicted] = -1
            lut[f.expert] = f.slot
        if pf and pf[1]:
            nl = self.lut[pf[0]]
            for p in pf[1]:
                if isinstance(p, Demotion):
                    nl[p.expert] = -1
                elif p.slot >= 0:
                    if p.evicted >= 0:
                        nl[p.evicted] = -1
                    nl[p.expert] = p.slot
        ex.run_layer(sched, fns)
        fns = None
        self.planner.end_step(i, plan)
        if not ex.inline:
            last = [o.id for o in sched.ops if o.queue == "device"]
            if last:
                ex.layer_done(last[-1])
        if self.verify:
            ex.drain()
            for f in plan.fills:
                self._verify(layer, f.expert, self.dev.views(i, f.slot))
            for p in pf[1] if pf else ():
                if not isinstance(p, Demotion) and p.slot >= 0:
                    self._verify(self.layers[pf[0]], p.expert, self.dev.views(pf[0], p.slot))
        return b.output()

    def read_into(self, i: int, e: int, dst: dict[str, torch.Tensor]) -> None:
        """Expert e of MoE layer index i from disk (or a peer rank) into dst (any thread)."""
        self._read(self.layers[i], e, dst)

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        if self.wants_prefetch:
            self.ahead = (layer, ids)  # planned by the current layer's forward, after its own demand reads

    # -- warm start, stats, checks ------------------------------------------------------------------------
    def _warm(self, counts: torch.Tensor) -> None:
        """Saved-statistics favourites into the device slots at startup (synchronous copies)."""
        for i, layer in enumerate(self.layers):
            order = torch.argsort(counts[i], descending=True).tolist()
            for e, s in self.planner.warm(i, order):
                dst = self.dev.views(i, s)
                if self.host_all:
                    src = self.host.views(i, e)
                else:
                    src = {
                        p.name: torch.empty(p.shape, dtype=p.dtype) for p in parts_at(self.source.parts, i)
                    }
                    self._read(layer, e, src)
                for n in dst:
                    dst[n].copy_(src[n])
                if self.verify:
                    self._verify(layer, e, dst)
                self.lut[i][e] = s

    def stats(self) -> dict:
        s = collect(
            self.counters, self.use_counts, self.device_slots, None if self.host_all else self.host_slots
        )
        s["residency"] = self.residency()
        return s

    def residency(self) -> list[list[int]]:
        """Per MoE layer, per expert, where it is now: 2 a device slot, 1 host RAM, 0 only on disk."""
        rows = []
        for i in range(len(self.layers)):
            row = [1 if self.host_all else 0] * self.E
            for e in self.host_tables[i].resident() if self.host_tables else []:
                row[e] = 1
            for e in self.dev_tables[i].resident():
                row[e] = 2
            rows.append(row)
        return rows

    # -- what other ranks may fetch from this one (expert parallelism, parallel.peer) ------------------
    def memory_codes(self, layer: int) -> list[int]:
        """Per expert of `layer`: 2 its stored-format bytes are in memory (a host slot, or a device slot
        holding the stored format), 1 in a device slot in another format, 0 only on disk. Bytes
        still in flight count as in memory (their slot is taken)."""
        i = self.li[layer]
        if self.host_all:
            return [2] * self.E
        row = [0] * self.E
        for e in self.dev_tables[i].resident():
            row[e] = 2 if self.dev_stored else 1
        for e in self.host_tables[i].resident() if self.host_tables else []:
            row[e] = 2
        return row

    def stored_bytes(self, layer: int, e: int) -> dict[str, torch.Tensor] | None:
        """Expert e's bytes in the stored format from memory, landed (a peer send); None: only on disk."""
        i = self.li[layer]
        if self.executor is not None:
            self.executor.drain()
        if self.host_all:
            return self.host.views(i, e)
        ht = self.host_tables[i] if self.host_tables else None
        if ht is not None and e in ht:
            return self.host.views(i, ht.slot_of[e])
        dt = self.dev_tables[i]
        if self.dev_stored and e in dt:
            return self.dev.views(i, dt.slot_of[e])
        return None

    def save_stats(self, path) -> None:
        save_stats(path, self.use_counts, self.layers, str(self.source.index.model_dir))

    def check(self, contents: bool = False) -> None:
        """Invariants: tables consistent, lookup = table, (contents) slot bytes = checkpoint bytes."""
        if self.executor is not None:
            self.executor.drain()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for i, (st, layer) in enumerate(zip(self.planner.layers, self.layers)):
            table = st.device
            table.check()
            assert not table.pinned, "pins must not outlive a layer's step"
            lut = self.lut[i]
            for e in range(self.E):
                assert lut[e] == table.slot_of[e], (
                    f"layer {layer}: lookup says expert {e} in slot {lut[e]}, table {table.slot_of[e]}"
                )
                if contents and lut[e] >= 0:
                    self._verify(layer, e, self.dev.views(i, lut[e]))
            if st.host is not None:
                st.host.check()
                assert not st.host.pinned, "host pins must not outlive a layer's step"
                for e in st.host.resident() if contents else []:
                    self._verify(layer, e, self.host.views(i, st.host.slot_of[e]))

    def close(self) -> None:
        if self.executor is not None:
            try:
                self.executor.drain()
            except Exception as e:  # noqa: BLE001 - a step failed with it already; closing goes on
                log.warning("expert cache: an operation failed before close: %s", e)
            self.executor.close()
        self.reader.close()
