"""TieredExperts: the expert cache the model sees (an ExpertProvider); it carries out the step planner's plans.

    disk (safetensors, DiskReader) -> host slots (stored dtype, pinned on CUDA) -> device slots (compute dtype)

Every cache decision (hits, fills and their victims, CPU-computed misses, waves, demotions,
prefetches) is made by experts.planner.StepPlanner, which trace replay drives too. This module
moves bytes and computes. Per MoE layer and forward step:

    plan -> issue the byte movement (the misses' disk reads together on the I/O pool, demotions)
         -> compute the hits from the device slots while the reads are in flight -> wait
         -> fill the device slots -> compute the fills -> the off-slot experts (CPU or waves)

(`overlap_io=False`: one synchronous read and copy per miss, vLLM #37190 v1's behaviour.)
That is the CPU device's path. On CUDA (and with `use_executor("threads")`, the CPU backend tests
drive) a step is instead a schedule of ops (experts/schedule.py: copies that wait only on their
slot's events, the hits' MoE, one CPU job for every CPU-computed expert beside it, the add) run by
an executor (experts/executor.py); `_Bindings` says what each op does on the cache's buffers.
The step's expert ids (and the held prediction's) reach the host once per layer, in one small copy
(experts/host_routing.py `to_host`: on CUDA the layer's only device -> host read, non-blocking
into pinned memory): the distinct experts, their token counts, the use counts, the prefetch's
experts, the pairs of each compute pass (grouped by slot on the host) and of each off-slot expert
all come from it; lookup tables stay on the host.

Prefetch: the model hands layer L+1's predicted experts to `prefetch` before layer L runs; they
are planned after layer L's own demand reads went out.
- "device" (CUDA): the byte movement is queued on one mover thread: disk -> host -> device, FIFO.
- "host" (CPU compute with a partial host tier): only disk reads into host slots, on the I/O pool.
Every slot with bytes in flight has an `InFlight` handle in its tier's `SlotPool`; a slot is waited
for before it is read, overwritten or computed with. On CUDA the copy runs on a side stream and the
compute stream waits on its event.

Slot tables and lookup tensors agree at all times (`check()`); with `verify=True` every
slot fill is compared with the checkpoint's bytes (tests).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from ..cost.model import ExpertCost, default_profile
from .compute import expert_ffn, moe_ffn
from .executor import make_executor
from .schedule import STAGE, LayerSchedule, ScheduleBuilder
from .host_routing import to_device, to_host
from .config import CacheConfig
from ..loader.disk import DiskReader
from .layout import ExpertSource
from .planner import Demotion, HostSource, PlannerConfig, StepPlanner
from .pool import InFlight, SlotPool
from .prefetch import resolve_prefetch
from .provider import ExpertProvider
from .slots import SlotTable
from .stats import LayerCounters, collect, save_stats

log = logging.getLogger("expertcache")


def is_direct(device: torch.device, dev_parts, source_parts) -> bool:
    """The device slots are host RAM in the stored format (CPU: the kernels read it, or low memory):
    a miss with no host slot can be read from disk straight into its device slot, with no conversion
    or copy."""
    key = [(p.name, p.dtype, tuple(p.shape)) for p in dev_parts]
    return device.type == "cpu" and key == [(p.name, p.dtype, tuple(p.shape)) for p in source_parts]


def demotable(cuda: bool, dev_parts, source_parts) -> bool:
    """Device slot bytes can go back to the stored format exactly: the same dtype, or bf16/fp16
    widened to fp32. CPU only for now (a CUDA demotion would be a device -> host copy on the copy
    stream; not built)."""
    src = {p.name: p for p in source_parts}
    exact = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}
    return not cuda and all(p.name in src and tuple(p.shape) == tuple(src[p.name].shape) and (
        p.dtype == src[p.name].dtype or (src[p.name].dtype, p.dtype) in exact) for p in dev_parts)


class TieredExperts(ExpertProvider):
    """The tiered cache for the slot counts of a memory plan and a validated CacheConfig
    (policy, prefetch mode, cpu_compute, prefill admission; ablation switches in cfg.ablation)."""

    def __init__(self, source: ExpertSource, device: torch.device, dtype: torch.dtype, device_slots: int,
                 host_slots: int | None, options: CacheConfig | None = None, stats: torch.Tensor | None = None,
                 progress=None, dev_parts=None, cost: ExpertCost | None = None, executor: str | None = None):
        """`executor`: how forward carries out a step: None = "cuda" on a CUDA device (the schedule of
        experts/schedule.py on streams, events and worker threads), else the synchronous path; "threads"
        = the schedule on the CPU backend (tests of the CUDA path's ordering on a CPU)."""
        options = options or CacheConfig(device_memory="auto")
        abl = options.ablation
        policy, prefetch, cpu_compute = options.policy_name, options.prefetch, options.cpu_compute
        prefill_admit_tokens, exclusive, verify = options.prefill_admit_tokens, abl.exclusive, abl.verify
        cfg = source.cfg
        self.source, self.device, self.dtype = source, device, dtype
        self.serving = False  # set once the startup load is done
        self.E, self.K = cfg.num_experts, cfg.top_k
        self.layers = source.layers
        self.li = {layer: i for i, layer in enumerate(self.layers)}
        dev_parts = dev_parts or source.compute_parts(dtype, device)
        self.direct = is_direct(device, dev_parts, source.parts)
        # device slots hold the stored format (a peer rank can be sent their bytes as they are)
        self.dev_stored = [(p.name, p.dtype, tuple(p.shape)) for p in dev_parts] == [
            (p.name, p.dtype, tuple(p.shape)) for p in source.parts]
        self.peer = None  # expert parallelism: offers this layer's missing experts from other ranks (parallel.peer)
        partial = host_slots is not None and host_slots > 0
        self.prefetch_mode = resolve_prefetch(prefetch, device, self.direct, partial)
        self.wants_prefetch = self.prefetch_mode != "off"
        self.overlap_io, self.verify = abl.overlap_io, verify
        self.ahead: tuple[int, torch.Tensor] | None = None  # prefetch waiting for the demand reads
        self.cuda = device.type == "cuda"
        executor = executor or ("cuda" if self.cuda else None)
        # per missing expert on CUDA (cpu_compute auto): computed on the CPU when that beats moving it
        self.cost = cost or ExpertCost(default_profile(device.type), source.expert_nbytes,
                                       3 * cfg.hidden_size * cfg.moe_intermediate_size)
        nbytes = source.expert_nbytes
        # exclusive tiers: an expert leaving the device tier keeps its bytes in a host slot (demotion)
        # and one promoted from a host slot frees it, so RAM + device hold disjoint experts
        can = demotable(self.cuda, dev_parts, source.parts) and partial
        if exclusive and not can:
            raise ValueError("exclusive=True needs a CPU device, a partial host tier and device slots that "
                             "widen the stored format exactly (bf16/fp16 -> fp32, or the same dtype)")
        self.exclusive = can if exclusive is None else exclusive
        self.device_slots = device_slots
        self.host_all = host_slots is None
        self.host_slots = self.E if self.host_all else host_slots
        L = len(self.layers)
        self.planner = StepPlanner(PlannerConfig(
            num_experts=self.E, device_slots=device_slots, host_slots=host_slots, expert_bytes=nbytes, policy=policy,
            cpu_compute={"auto": "cost" if self.cuda else "never"}.get(cpu_compute, cpu_compute),
            prefetch=self.prefetch_mode, prefill_admit_tokens=prefill_admit_tokens, exclusive=self.exclusive,
            direct=self.direct, staged_waves=self.cuda, gate_threshold=abl.prefetch_gate,
            gate_waste=0.25 if self.cuda else 1.0), L, stats,
            cpu_faster=self.cost.cpu_faster)
        self.reader = DiskReader(o_direct=abl.o_direct)
        self.mover = ThreadPoolExecutor(1, thread_name_prefix="expert-mover")
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.t = 0
        self.use_counts = torch.zeros(L, self.E, dtype=torch.int64)
        self.method, self.ffn = source.method, source.ffn
        # device tier: compute dtype; lookup expert -> slot (host only: pairs' slots are looked up on the host)
        self.dev = SlotPool(dev_parts, L, device_slots, device)
        self.lut = torch.full((L, self.E), -1, dtype=torch.int64)
        self.stage = ({p.name: torch.empty(p.shape, dtype=p.dtype, device=device) for p in dev_parts}
                      if self.cuda else None)
        self.executor, self.builder = None, ScheduleBuilder()
        # host tier: stored dtype; all experts (slot = expert id) when host_slots is None
        self.host = SlotPool(source.parts, L, self.host_slots, torch.device("cpu"), pin=self.cuda)
        if self.host_all:
            for i, layer in enumerate(self.layers):
                for e in range(self.E):
                    self._read(layer, e, self.host.views(i, e))
                    if (layer, e) in source.nonfinite:  # read at load: an error, like a dense weight
                        raise source.nonfinite_error(layer, e)
                    if progress:
                        progress(source.expert_nbytes)
        if stats is not None:
            self._warm(stats)
        self.use_executor(executor)
        self.serving = True

    def use_executor(self, kind: str | None) -> None:
        """Carry out steps through an executor of the schedule ("cuda", "threads") or synchronously
        (None; CPU devices only). Bytes in flight are landed first, so it may switch between steps."""
        if kind is None and self.cuda:
            raise ValueError("executor: a CUDA device runs its steps through the 'cuda' executor")
        if kind is not None and self.exclusive:
            raise ValueError("exclusive tiers (demotions) run on the synchronous CPU path only, not with an executor")
        self.dev.drain()
        self.host.drain()
        if self.executor is not None:
            self.executor.drain()
            self.executor.close()
        self.executor = make_executor(kind, self.device) if kind else None
        if kind is not None and self.stage is None:
            self.stage = {n: torch.empty(t.shape[2:], dtype=t.dtype, device=self.device) for n, t in self.dev.buf.items()}

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

    def _submit_read(self, layer: int, e: int, views: dict[str, torch.Tensor], sync: bool) -> InFlight | None:
        """Disk -> views: on the I/O pool (-> its handle), or now on this thread when `sync` (or when a
        peer rank sent the bytes: a memory copy)."""
        if sync or (self.peer is not None and self.peer.offers(layer, e)):
            self._read(layer, e, views)
            return None
        return InFlight(self.reader.submit_parts(self.source.ranges(layer, e), views,
                                                 then=lambda: self._check(layer, e, views)))

    def _copy(self, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]):
        """host views -> device views; on CUDA async on the copy stream, returns its event."""
        if not self.cuda:
            for n in dst:
                dst[n].copy_(src[n])
            return None
        # the destination slot may still be read by kernels queued before its expert was evicted
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for n in dst:
                dst[n].copy_(src[n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
        return ev

    def _source(self, i: int, layer: int, e: int, src: HostSource, sync: bool):
        """Issue what a miss's host copy needs -> (host views or None for a transient read, pending read)."""
        if src.transient:
            return None, None
        views = self.host.views(i, src.slot)
        if self.host_all:
            return views, None
        pending = self.host.take(i, src.slot)
        if src.read:
            if pending is not None:
                pending.wait(self.device, host_write=True)  # an earlier read-ahead or copy of the old expert
            return views, self._submit_read(layer, e, views, sync)
        if pending is not None and sync:  # a read-ahead of this expert still in flight
            pending.landed()
            pending = None
        return views, pending

    def _host_now(self, layer: int, e: int, got) -> dict[str, torch.Tensor]:
        """The host bytes of a `_source` result, once they are in (a transient buffer when no slot)."""
        views, pending = got
        if pending is not None:
            pending.landed()
        if views is None:
            views = {p.name: torch.empty(p.shape, dtype=p.dtype) for p in self.source.parts}
            self._read(layer, e, views)
        return views

    def _demote(self, i: int, d: Demotion) -> None:
        """Exclusive tiers: device slot bytes back into a host slot: a plain copy where both hold the stored
        format (CPU kernels), else fp32 narrowed back to the stored bf16/fp16 exactly."""
        self.dev.settle(i, d.dev_slot, self.device)
        self.host.settle(i, d.host_slot, self.device, host_write=True)
        for n, t in self.host.views(i, d.host_slot).items():
            t.copy_(self.dev.buf[n][i, d.dev_slot])

    def _fill(self, i: int, layer: int, e: int, s: int, src: dict[str, torch.Tensor]) -> None:
        """Demand fill of device slot s with expert e from its host copy `src`."""
        dst = self.dev.views(i, s)
        ev = self._copy(src, dst)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
            if not self.host_all:
                ev.synchronize()  # the host slot may be refilled by the next demand read
        if self.verify:
            self._verify(layer, e, dst)

    def _verify(self, layer: int, e: int, dst: dict[str, torch.Tensor]) -> None:
        ref = self.source.read(layer, e)
        for n, t in dst.items():
            if not torch.equal(t.cpu(), ref[n].to(t.dtype)):
                raise AssertionError(f"slot bytes of layer {layer} expert {e} part {n} differ from the checkpoint")

    # -- provider interface --------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.t += 1

    def _step_ids(self, ids: torch.Tensor):
        """The step's ids [T*K] and the held prediction's on the host, in one copy (the layer's one
        device read) -> (step ids, (prediction's layer, its ids, its rows) or None)."""
        flat = ids.reshape(-1)
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return to_host(flat), None
        layer, pred = ahead
        both = to_host(torch.cat([flat, pred.reshape(-1)]))
        n = flat.shape[0]
        return both[:n], (layer, both[n:], pred.shape[0])

    def _distinct(self, i: int, step: torch.Tensor) -> tuple[list[int], list[int]]:
        """Host ids -> (distinct experts in order of first appearance, their token counts); the use
        counts are added on the way."""
        counts = torch.bincount(step, minlength=self.E)
        self.use_counts[i] += counts
        n = counts.tolist()
        experts = list(dict.fromkeys(step.tolist()))
        return experts, [n[e] for e in experts]

    def forward(self, layer, x, ids, weights):
        if self.executor is not None:
            return self._forward_scheduled(layer, x, ids, weights)
        i = self.li[layer]
        T, K = ids.shape
        step, ahead = self._step_ids(ids)
        experts, tokens = self._distinct(i, step)
        plan = self.planner.plan_step(i, experts, tokens, x.shape[0], self.t)
        lut, pool = self.lut[i], self.dev.layer(i)
        for _, s in plan.hits:
            self.dev.settle(i, s, self.device)
        for f in plan.fills:
            if f.evicted >= 0:
                lut[f.evicted] = -1
            self.dev.settle(i, f.slot, self.device)
        # the misses' disk reads go out together, then demotions, direct reads, the next layer's prefetch
        sync = not self.overlap_io
        got = {f.expert: self._source(i, layer, f.expert, f.src, sync) for f in plan.fills if f.src is not None}
        got.update((o.expert, self._source(i, layer, o.expert, o.src, sync)) for o in plan.off_slot)
        for d in plan.demotions:
            self._demote(i, d)
        direct = {f.expert: self._submit_read(layer, f.expert, self.dev.views(i, f.slot), sync)
                  for f in plan.fills if f.src is None}
        self._issue_prefetch(ahead)
        out = None
        if any(p is not None for _, p in got.values()) or any(p is not None for p in direct.values()):
            # compute the hits while the reads are in flight (slot -1: not resident yet)
            out = moe_ffn(x, lut[step].view(T, K), weights, pool, self.method, ffn=self.ffn, host=True)
        for f in plan.fills:
            if f.src is None:
                if direct[f.expert] is not None:
                    direct[f.expert].landed()
                if self.verify:
                    self._verify(layer, f.expert, self.dev.views(i, f.slot))
            else:
                self._fill(i, layer, f.expert, f.slot, self._host_now(layer, f.expert, got[f.expert]))
            lut[f.expert] = f.slot
        slots = lut[step].view(T, K)
        if out is None:
            out = moe_ffn(x, slots, weights, pool, self.method, ffn=self.ffn, host=True)
        elif plan.fills:  # (an admitted fill the planner put on the CPU: here the device is the CPU)
            new = torch.zeros(self.E, dtype=torch.bool)
            new[[f.expert for f in plan.fills]] = True
            moe_ffn(x, torch.where(new[step].view(T, K), slots, -1), weights, pool, self.method, ffn=self.ffn,
                    out=out, host=True)
        for o in plan.off_slot:
            self._off_slot(o.expert, o.on_cpu, x, step, weights, out, self._host_now(layer, o.expert, got[o.expert]))
        self.planner.end_step(i, plan)
        return out

    # -- the scheduled path (CUDA, and the CPU backend of tests): experts/schedule.py's ops -----------
    def _forward_scheduled(self, layer, x, ids, weights):
        """The step as a schedule run by the executor: the ids read is the one host wait; copies
        wait on per-slot events; the CPU experts run in one call on the CPU queue beside the hits."""
        i = self.li[layer]
        T, K = ids.shape
        step, ahead = self._step_ids(ids)
        experts, tokens = self._distinct(i, step)
        plan = self.planner.plan_step(i, experts, tokens, T, self.t)
        lut = self.lut[i]
        hit_slots = lut[step].view(T, K).clone()  # only the hits are in the lookup now
        for f in plan.fills:
            if f.evicted >= 0:
                lut[f.evicted] = -1
        pf = None
        if ahead is not None:
            j = self.li[ahead[0]]
            pf = (j, self.planner.plan_prefetch(j, ahead[1].tolist(), ahead[2], self.t))
        sched = self.builder.layer(i, plan, experts, tokens, pf)
        out = torch.zeros_like(x)
        fns = _Bindings(self, i, x, step, weights, out, hit_slots, plan).fns(sched)
        for f in plan.fills:
            lut[f.expert] = f.slot
        for p in pf[1] if pf else []:
            if p.slot >= 0:
                if p.evicted >= 0:
                    self.lut[pf[0], p.evicted] = -1
                self.lut[pf[0], p.expert] = p.slot
        self.executor.run_layer(sched, fns)
        self.planner.end_step(i, plan)
        last = [o.id for o in sched.ops if o.queue == "device"]
        if last:
            self.executor.layer_done(last[-1])
        if self.verify:
            self.executor.drain()
            for f in plan.fills:
                self._verify(layer, f.expert, self.dev.views(i, f.slot))
        return out

    def read_into(self, i: int, e: int, dst: dict[str, torch.Tensor]) -> None:
        """Expert e of MoE layer index i from disk (or a peer rank) into dst (any thread)."""
        self._read(self.layers[i], e, dst)

    def _off_slot(self, e, on_cpu, x, step, weights, out, src) -> None:
        """Compute expert e without caching it: on the CPU from its host copy `src`, or (a wave)
        through a staging slot loaded once for this step. On a CPU device both read `src` directly.
        Its pairs come from the step's host ids `step` [T*K]."""
        pair = to_device((step == e).nonzero().squeeze(1), x.device)  # host work, one copy
        tok, k = pair // weights.shape[1], pair % weights.shape[1]
        if self.cuda and not on_cpu:
            ev = self._copy(src, self.stage)  # waits for kernels still reading the previous wave
            torch.cuda.current_stream(self.device).wait_event(ev)
            if not self.host_all:
                ev.synchronize()
            y = expert_ffn(x[tok], self.stage, self.method, self.ffn)
        else:
            y = expert_ffn(x[tok].to("cpu", torch.float32), src, self.method, self.ffn).to(x.device, x.dtype)
        out.index_put_((tok,), y * weights[tok, k, None], accumulate=True)

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        if self.wants_prefetch:
            self.ahead = (layer, ids)  # planned by the current layer's forward, after its own demand reads

    def _issue_prefetch(self, ahead) -> None:
        """Plan and issue the held prediction `ahead` (its layer, host ids [rows*K], rows), or nothing."""
        if ahead is None:
            return
        layer, ids, rows = ahead
        i = self.li[layer]
        lut = self.lut[i]
        for item in self.planner.plan_prefetch(i, ids.tolist(), rows, self.t):
            if isinstance(item, Demotion):
                lut[item.expert] = -1
                self._demote(i, item)
                continue
            if item.slot < 0:  # host read-ahead: disk -> host slot on the I/O pool
                self.host.settle(i, item.src.slot, self.device, host_write=True)
                self.host.mark(i, item.src.slot, self._submit_read(layer, item.expert,
                                                                   self.host.views(i, item.src.slot), False))
                continue
            self.dev.settle(i, item.slot, self.device)
            if item.evicted >= 0:
                lut[item.evicted] = -1
            lut[item.expert] = item.slot
            dst = self.dev.views(i, item.slot)
            if item.src is None:  # direct: disk -> device slot on the I/O pool
                self.dev.mark(i, item.slot, self._submit_read(layer, item.expert, dst, False))
                continue
            hs = item.src.slot
            self.host.settle(i, hs, self.device, host_write=item.src.read)
            h = InFlight(self.mover.submit(self._prefetch_job, layer, item.expert, self.host.views(i, hs),
                                           item.src.read, dst))
            self.dev.mark(i, item.slot, h)
            if not self.host_all:
                self.host.mark(i, hs, h)

    def _prefetch_job(self, layer, e, host_views, need_read, dev_views):
        if need_read:
            self._read(layer, e, host_views)
        ev = self._copy(host_views, dev_views)
        if self.verify:
            if ev is not None:
                ev.synchronize()
            self._verify(layer, e, dev_views)
        return ev

    # -- warm start, stats, checks ------------------------------------------------------------------------
    def _warm(self, counts: torch.Tensor) -> None:
        for i, layer in enumerate(self.layers):
            order = torch.argsort(counts[i], descending=True).tolist()
            for e, s in self.planner.warm(i, order):
                self._fill(i, layer, e, s, self._host_now(layer, e, (None, None) if not self.host_all else
                                                          (self.host.views(i, e), None)))
                self.lut[i, e] = s

    def stats(self) -> dict:
        s = collect(self.counters, self.use_counts, self.device_slots, None if self.host_all else self.host_slots)
        s["residency"] = self.residency()
        return s

    def residency(self) -> list[list[int]]:
        """Per MoE layer, per expert, where it is now: 2 a device slot, 1 host RAM, 0 only on disk."""
        rows = []
        for i in range(len(self.layers)):
            row = [1 if self.host_all else 0] * self.E
            for e in (self.host_tables[i].resident() if self.host_tables else []):
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
        for e in (self.host_tables[i].resident() if self.host_tables else []):
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
            s = ht.slot_of[e]
            self.host.settle(i, s, self.device)
            return self.host.views(i, s)
        dt = self.dev_tables[i]
        if self.dev_stored and e in dt:
            s = dt.slot_of[e]
            self.dev.settle(i, s, self.device)
            return self.dev.views(i, s)
        return None

    def save_stats(self, path) -> None:
        save_stats(path, self.use_counts, self.layers, str(self.source.index.model_dir))

    def check(self, contents: bool = False) -> None:
        """Invariants: tables consistent, lookup = table, (contents) slot bytes = checkpoint bytes."""
        if self.executor is not None:
            self.executor.drain()
        self.dev.drain()
        self.host.drain()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for i, (st, layer) in enumerate(zip(self.planner.layers, self.layers)):
            table = st.device
            table.check()
            assert not table.pinned, "pins must not outlive a layer's step"
            lut = self.lut[i].tolist()
            for e in range(self.E):
                assert lut[e] == table.slot_of[e], f"layer {layer}: lookup says expert {e} in slot {lut[e]}, table {table.slot_of[e]}"
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
        self.mover.shutdown(wait=True)
        self.reader.close()


class _Bindings:
    """What each op of one layer's schedule does on the cache's buffers (experts/schedule.py legend).

    Shapes: T tokens, K top_k, H hidden, R rows routed to a CPU-computed expert.
    x [T, H], weights [T, K], step [T*K] host ids, hit_slots [T, K] host (hits only, -1 else)."""

    def __init__(self, cache: TieredExperts, i, x, step, weights, out, hit_slots, plan):
        self.c, self.i, self.x, self.step, self.w, self.out = cache, i, x, step, weights, out
        self.hit_slots, self.plan = hit_slots, plan
        self.T, self.K = hit_slots.shape
        self.bufs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # transient reads
        self.res: dict[str, object] = {}

    def fns(self, sched: LayerSchedule) -> dict:
        return {o.id: getattr(self, o.kind)(o) for o in sched.ops if o.kind not in ("ids", "dense")}

    def _host_views(self, i: int, e: int, hs: int):
        if hs >= 0:
            return self.c.host.views(i, hs)
        return self.bufs.setdefault((i, e), {p.name: torch.empty(p.shape, dtype=p.dtype)
                                             for p in self.c.source.parts})

    def _dev_views(self, i: int, s: int):
        return self.c.stage if s == STAGE else self.c.dev.views(i, s)

    def read(self, o):
        e = o.experts[0]
        dst = self._dev_views(o.layer, o.slot) if o.slot != -1 else self._host_views(o.layer, e, o.host_slot)
        return lambda: self.c.read_into(o.layer, e, dst)

    def h2d(self, o):
        src = self._host_views(o.layer, o.experts[0], o.host_slot)
        dst, nb = self._dev_views(o.layer, o.slot), self.c.cuda

        def run():
            for n in dst:
                dst[n].copy_(src[n], non_blocking=nb)
        return run

    def moe(self, o):
        c, x, w, out = self.c, self.x, self.w, self.out
        pool = c.dev.layer(self.i)
        if o.tag == "hits":
            slots = self.hit_slots
        elif o.tag == "fills":
            of = torch.full((c.E,), -1, dtype=torch.int64)
            fills = [f for f in self.plan.fills if not f.on_cpu]
            of[[f.expert for f in fills]] = torch.tensor([f.slot for f in fills], dtype=torch.int64)
            slots = of[self.step].view(self.T, self.K)
        else:  # a wave through the staging slot
            pair = to_device((self.step == o.experts[0]).nonzero().squeeze(1), x.device)
            tok, k = pair // self.K, pair % self.K

            def wave():
                y = expert_ffn(x[tok], c.stage, c.method, c.ffn)
                out.index_put_((tok,), y * w[tok, k, None], accumulate=True)
            return wave
        return lambda: moe_ffn(x, slots, w, pool, c.method, out=out, ffn=c.ffn, host=True)

    def _on_cpu(self):
        """(expert, host slot or -1) of every expert the CPU job computes (off-slot or admitted)."""
        return [(f.expert, f.src.slot) for f in self.plan.off_slot + self.plan.fills if f.on_cpu]

    def _cpu_pairs(self, o):
        """Host: the R rows routed to the op's experts, and their [R, K] host-slot table."""
        hs = dict(self._on_cpu())
        table = torch.full((self.c.E,), -1, dtype=torch.int64)
        for e in o.experts:
            table[e] = hs[e] if hs[e] >= 0 else -1
        mine = torch.zeros(self.c.E, dtype=torch.bool)
        mine[list(o.experts)] = True
        sel = mine[self.step].view(self.T, self.K)
        rows = sel.any(1).nonzero().squeeze(1)
        return rows, table[self.step].view(self.T, self.K)[rows], sel[rows]

    def rows(self, o):
        rows, _, _ = self.res.setdefault("pairs", self._cpu_pairs(o))
        x, w, cuda = self.x, self.w, self.c.cuda

        def run():  # on the d2h queue: the row indices go up on it too, so no other queue races them
            idx = self.res["rows_dev"] = to_device(rows, x.device)
            xr = torch.empty((rows.shape[0], x.shape[1]), dtype=torch.float32, pin_memory=cuda)
            wr = torch.empty((rows.shape[0], w.shape[1]), dtype=torch.float32, pin_memory=cuda)
            xr.copy_(x[idx], non_blocking=cuda)
            wr.copy_(w[idx], non_blocking=cuda)
            self.res["xw"] = (xr, wr)
        return run

    def cpu(self, o):
        c = self.c
        rows, slots, sel = self.res.setdefault("pairs", self._cpu_pairs(o))
        transient = [e for e, hs in self._on_cpu() if hs < 0]
        pool = c.host.layer(o.layer)
        ffn = c.ffn  # the host pool is computed on the CPU whatever kernel computes the device's
        if getattr(ffn, "kernel", "torch") != "torch":
            ffn = dataclasses.replace(ffn, kernel="torch")

        def run():
            xr, wr = self.res["xw"]
            y = torch.zeros_like(xr)
            if (slots >= 0).any():
                moe_ffn(xr, slots, wr, pool, c.method, out=y, ffn=ffn, host=True)
            for e in transient:  # no host slot could be had: its bytes in a transient buffer
                r, k = (self.step.view(self.T, self.K)[rows] == e).nonzero(as_tuple=True)
                y.index_put_((r,), expert_ffn(xr[r], self.bufs[(o.layer, e)], c.method, ffn)
                             * wr[r, k, None], accumulate=True)
            return y.pin_memory() if c.cuda else y
        return run

    def add(self, o):
        out, cuda = self.out, self.c.cuda

        def run():
            y = self.c.executor.join(o.waits[0])
            out.index_put_((self.res["rows_dev"],), y.to(out.device, out.dtype, non_blocking=cuda), accumulate=True)
        return run
