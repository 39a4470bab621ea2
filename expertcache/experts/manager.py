"""TieredExperts: the expert cache the model sees (an ExpertProvider).

    disk (safetensors, DiskReader) -> host slots (stored dtype, pinned on CUDA) -> device slots (compute dtype)

Per MoE layer and forward step:
1. the distinct experts U the batch routed to are looked up in the device SlotTable
   and pinned (a pinned expert is never evicted before the layer's step ends);
2. each miss is either fetched into a device slot (host copy first, from disk if the
   host tier lacks it) or computed on the CPU from its host copy, by the cost model
   (`cpu_compute`: auto | always | never); when no slot can be had (every slot pinned,
   or admission refused during prefill) the expert goes through a staging slot in waves,
   loaded once for this step and not cached;
3. the grouped FFN runs over the device slots; the rest add their partial sums.
Prefill (more than `prefill_admit_tokens` tokens) only fills free slots: it never
evicts the decode working set wholesale.

Disk reads of a step's misses go out together on the reader's I/O pool, and the hits are
computed while they are in flight; the misses follow with a second grouped FFN
(`overlap_io=False`: one synchronous read and copy per miss, vLLM #37190 v1's behaviour).

Prefetch (`prefetch`: "device" | "host" | "off"): the model hands layer L+1's predicted
experts to `prefetch` before layer L runs.
- "device" (CUDA): device (and host) slots are assigned on the calling thread (all table
  state is touched by that thread only) and the byte movement is queued on one mover
  thread: disk -> host -> device, FIFO.
- "host" (CPU compute with a partial host tier): only the disk reads into host slots,
  issued on the I/O pool right after layer L's own demand reads. The "device" copy on a
  CPU is a conversion that needs the same cores as compute; a disk read does not.
Every slot with bytes in flight has a handle in `busy`; a slot is waited for before it is
read, overwritten or computed with. On CUDA the copy runs on a side stream and the compute
stream waits on its event.

Slot tables and lookup tensors agree at all times (`check()`); with `verify=True` every
slot fill is compared with the checkpoint's bytes (tests).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .compute import expert_ffn, moe_ffn
from .disk import DiskReader
from .layout import ExpertSource
from .policy import make_policy
from .prefetch import PrefetchGate, most_predicted, resolve_prefetch
from .provider import ExpertProvider
from .slots import SlotTable
from .stats import LayerCounters, collect, save_stats

log = logging.getLogger("expertcache")


@dataclass
class CostModel:
    """Per missing expert: compute on the CPU when that beats moving its bytes to the device."""

    link_gbps: float = 25.0  # host -> device (PCIe 4 x16 ~25 GB/s effective)
    cpu_mem_gbps: float = 20.0
    cpu_gflops: float = 100.0

    def cpu_faster(self, nbytes: int, tokens: int, flops_per_token: int) -> bool:
        t_move = nbytes / (self.link_gbps * 1e9)
        t_cpu = nbytes / (self.cpu_mem_gbps * 1e9) + tokens * flops_per_token / (self.cpu_gflops * 1e9)
        return t_cpu < t_move


DIRECT = "direct"  # marks a demand read that goes straight into a device slot


def is_direct(device: torch.device, dev_parts, source_parts) -> bool:
    """The device slots are host RAM in the stored format (CPU, low memory): a miss with no host
    slot can be read from disk straight into its device slot, with no conversion or copy."""
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


def distinct(ids: torch.Tensor) -> list[int]:
    """Distinct expert ids in order of first appearance (the order replay uses, so counters agree)."""
    return list(dict.fromkeys(ids.reshape(-1).tolist()))


class TieredExperts(ExpertProvider):
    """Options (all reachable as LLM(...) keywords):
    policy          device-tier eviction policy (experts.policy registry)
    prefetch        auto | device | host | off, or a bool (resolve_prefetch)
    cpu_compute     auto (cost model, CUDA) | always | never
    overlap_io      a step's disk reads in parallel with its hits (False: one synchronous read per miss)
    prefetch_gate   PrefetchGate threshold; None never gates
    exclusive       RAM tiers hold disjoint experts (None: where `demotable`)
    prefill_admit_tokens, o_direct, verify (slot bytes checked against the checkpoint at every fill)
    """

    def __init__(self, source: ExpertSource, device: torch.device, dtype: torch.dtype, device_slots: int,
                 host_slots: int | None, policy: str = "lru", prefetch: bool | str | None = True, cpu_compute: str = "auto",
                 stats: torch.Tensor | None = None, prefill_admit_tokens: int = 64, o_direct: bool = True,
                 cost: CostModel | None = None, verify: bool = False, progress=None, dev_parts=None,
                 overlap_io: bool = True, prefetch_gate: float | None = 0.0, exclusive: bool | None = None):
        cfg = source.cfg
        self.source, self.device, self.dtype = source, device, dtype
        self.E, self.K = cfg.num_experts, cfg.top_k
        self.layers = source.layers
        self.li = {layer: i for i, layer in enumerate(self.layers)}
        dev_parts = dev_parts or source.compute_parts(dtype, device)
        self.direct = is_direct(device, dev_parts, source.parts)
        partial = host_slots is not None and host_slots > 0
        self.prefetch_mode = resolve_prefetch(prefetch, device, self.direct, partial)
        self.wants_prefetch = self.prefetch_mode != "off"
        self.cpu_compute, self.overlap_io = cpu_compute, overlap_io
        self.ahead: tuple[int, torch.Tensor] | None = None  # prefetch waiting for the demand reads
        if cpu_compute not in ("auto", "always", "never"):
            raise ValueError(f"cpu_compute must be auto, always or never, got {cpu_compute!r}")
        self.prefill_admit_tokens, self.verify = prefill_admit_tokens, verify
        self.cost = cost or CostModel()
        self.flops_per_token = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
        self.cuda = device.type == "cuda"
        L = len(self.layers)
        self.reader = DiskReader(o_direct=o_direct)
        self.mover = ThreadPoolExecutor(1, thread_name_prefix="expert-mover")
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.busy: dict[tuple[str, int, int], Future] = {}
        self.t = 0
        self.counters = {layer: LayerCounters() for layer in self.layers}
        self.use_counts = torch.zeros(L, self.E, dtype=torch.int64)
        self.prefetched: list[set[int]] = [set() for _ in range(L)]
        self.host_prefetched: list[set[int]] = [set() for _ in range(L)]
        # exclusive tiers: an expert leaving the device tier keeps its bytes in a host slot (demotion)
        # and one promoted from a host slot frees it, so RAM + device hold disjoint experts
        can = demotable(self.cuda, dev_parts, source.parts) and partial
        if exclusive and not can:
            raise ValueError("exclusive=True needs a CPU device, a partial host tier and device slots that "
                             "widen the stored format exactly (bf16/fp16 -> fp32, or the same dtype)")
        self.exclusive = can if exclusive is None else exclusive
        self.gate = PrefetchGate(L, prefetch_gate, waste=0.25 if self.cuda else 1.0)  # None: never gate
        self.step_issued, self.step_used, self.step_harm = [0] * L, [0] * L, [0] * L  # for the layer's next step
        self.pf_evicted: list[set[int]] = [set() for _ in range(L)]  # experts those prefetches evicted

        # device tier: compute dtype, slot tables per layer, lookup expert -> slot
        self.device_slots = device_slots
        self.method, self.ffn = source.method, source.ffn
        self.dev = {p.name: torch.empty((L, device_slots, *p.shape), dtype=p.dtype, device=device) for p in dev_parts}
        self.dev_tables = [SlotTable(self.E, device_slots, make_policy(policy, self.E, device_slots, layer, stats))
                           for layer in self.layers]
        self.lut = torch.full((L, self.E), -1, dtype=torch.int64)  # CPU mirror, uploaded once per layer step
        self.stage = ({p.name: torch.empty(p.shape, dtype=p.dtype, device=device) for p in dev_parts}
                      if self.cuda else None)
        # host tier: stored dtype; all experts when host_slots is None
        self.host_all = host_slots is None
        hs = self.E if self.host_all else host_slots
        self.host_slots = hs
        self.host = {p.name: torch.empty((L, hs, *p.shape), dtype=p.dtype, pin_memory=self.cuda) for p in source.parts}
        self.host_tables = None if self.host_all else [
            SlotTable(self.E, hs, make_policy("lru", self.E, hs, layer)) for layer in self.layers]
        if self.host_all:
            for i, layer in enumerate(self.layers):
                for e in range(self.E):
                    self._read(layer, e, {n: t[i, e] for n, t in self.host.items()})
                    if (layer, e) in source.nonfinite:  # read at load: an error, like a dense weight
                        raise source.nonfinite_error(layer, e)
                    if progress:
                        progress(source.expert_nbytes)
        if stats is not None:
            self._warm(stats)
        # counters describe serving: the startup load and warm start are not "bytes moved"
        self.counters = {layer: LayerCounters() for layer in self.layers}

    # -- byte movement -------------------------------------------------------------------------------
    def _read(self, layer: int, e: int, dst: dict[str, torch.Tensor]) -> None:
        """Expert e's bytes from disk into dst (any thread; the caller counts disk_bytes)."""
        ranges = self.source.ranges(layer, e)
        for name, t in dst.items():
            self.reader.read_into(ranges[name], t)
        if self.source.check_read(layer, e, dst) and hasattr(self, "counters"):  # serving (not loading):
            log.warning("%s", self.source.nonfinite_error(layer, e))  # requests routed to e fail on their logits

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

    def _wait(self, key, host_write: bool = False) -> None:
        fut = self.busy.pop(key, None)
        if fut is None:
            return
        ev = fut.result()
        if ev is not None:
            if host_write:
                ev.synchronize()  # the H2D copy reading this host slot must finish first
            else:
                torch.cuda.current_stream(self.device).wait_event(ev)

    def _host_views(self, i: int, s: int) -> dict[str, torch.Tensor]:
        return {n: t[i, s] for n, t in self.host.items()}

    def _dev_views(self, i: int, s: int) -> dict[str, torch.Tensor]:
        return {n: t[i, s] for n, t in self.dev.items()}

    def _host_slot(self, layer: int, e: int, pin: bool, ahead: bool = False) -> tuple[int, bool]:
        """Host slot of e (assigning one if needed) -> (slot, needs_read); slot -1 = no slot free.
        `ahead`: a host read-ahead (its evictions are what the prefetch gate charges)."""
        i = self.li[layer]
        if self.host_all:
            return e, False
        if pin and e in self.pf_evicted[i] and self.prefetch_mode == "host":
            self.step_harm[i] += e not in self.host_tables[i]
        table = self.host_tables[i]
        a = table.access(e, self.t, pin=pin) if pin else table.insert(e, self.t)
        c = self.counters[layer]
        if pin:
            c.host_hits += a.hit
            c.host_misses += not a.hit
            if a.hit and e in self.host_prefetched[i]:
                c.host_prefetch_useful += 1
                self.step_used[i] += 1
        if a.slot >= 0 and not a.hit:
            self._wait(("host", i, a.slot), host_write=True)
            self.host_prefetched[i].discard(a.evicted)
            if ahead and a.evicted >= 0:
                self.pf_evicted[i].add(a.evicted)
        return a.slot, a.slot >= 0 and not a.hit

    def _host_expert(self, layer: int, e: int, sync: bool = True):
        """Host copy of e -> (views, pending read or None). Demand path, calling thread.

        A disk read is done now (`sync`) or issued on the I/O pool; a slot a prefetch is still
        filling returns that read. With no host slot free (every one pinned by this step) views
        is None: `_host_now` reads into a transient buffer at use, so at most one is alive."""
        i = self.li[layer]
        s, need = self._host_slot(layer, e, pin=True)
        if s < 0:
            return None, None
        views = self._host_views(i, s)
        fut = self.busy.pop(("host", i, s), None)
        if fut is not None and sync:
            fut.result()
            fut = None
        if need:
            fut = self._submit_read(layer, e, views, sync)
        return views, fut

    def _submit_read(self, layer: int, e: int, views: dict[str, torch.Tensor], sync: bool = False) -> Future | None:
        """Disk -> views: on the I/O pool (-> its future), or now on this thread when `sync`."""
        self.counters[layer].disk_bytes += self.source.expert_nbytes
        if sync:
            self._read(layer, e, views)
            return None
        return self.reader.pool.submit(self._read, layer, e, views)

    def _demote(self, layer: int, e: int, s: int) -> None:
        """Exclusive tiers: e leaves device slot s; keep its bytes in a host slot (narrowed back to
        the stored format, exactly) so that a later miss on it does not go to disk."""
        i = self.li[layer]
        hs, need = self._host_slot(layer, e, pin=False)
        if need:
            for n, t in self._host_views(i, hs).items():
                t.copy_(self.dev[n][i, s])
            self.counters[layer].demoted += 1

    def _landed(self, layer: int, e: int, s: int, fut: Future | None) -> None:
        """A device slot read straight from disk (`direct`) is complete and counted."""
        if fut is not None:
            fut.result()
        self.counters[layer].bytes_moved += self.source.expert_nbytes
        if self.verify:
            self._verify(layer, e, self._dev_views(self.li[layer], s))

    def _transient(self, layer: int, e: int) -> dict[str, torch.Tensor]:
        views = {p.name: torch.empty(p.shape, dtype=p.dtype) for p in self.source.parts}
        self.counters[layer].disk_bytes += self.source.expert_nbytes
        self._read(layer, e, views)
        return views

    def _host_now(self, layer: int, e: int, got) -> dict[str, torch.Tensor]:
        """The views of a `_host_expert(sync=False)` result, once their bytes are in."""
        views, fut = got
        if fut is not None:
            fut.result()
        return self._transient(layer, e) if views is None else views

    def _fill(self, layer: int, e: int, s: int, src: dict[str, torch.Tensor] | None = None) -> None:
        """Demand fill of device slot s with expert e (from `src`, its host copy, when given)."""
        i = self.li[layer]
        src = src if src is not None else self._host_now(layer, e, self._host_expert(layer, e))
        dst = self._dev_views(i, s)
        ev = self._copy(src, dst)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
            if not self.host_all:
                ev.synchronize()  # the host slot may be refilled by the next demand read
        self.counters[layer].bytes_moved += self.source.expert_nbytes
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

    def forward(self, layer, x, ids, weights):
        i, c = self.li[layer], self.counters[layer]
        T = x.shape[0]
        self.use_counts[i] += torch.bincount(ids.reshape(-1).cpu(), minlength=self.E)
        table, lut = self.dev_tables[i], self.lut[i]
        pool = {n: t[i] for n, t in self.dev.items()}
        admit = T <= self.prefill_admit_tokens
        per_expert = torch.bincount(ids.reshape(-1), minlength=self.E).tolist()
        fills: list[tuple[int, int]] = []  # (expert, device slot) filled this step
        leaving: list[tuple[int, int]] = []  # (expert, device slot) evicted by those fills
        off_slot: list[tuple[int, bool]] = []  # (expert, on_cpu) computed outside the device slots
        for e in distinct(ids):
            if e in table:
                s = table.access(e, self.t).slot
                c.hits += 1
                if e in self.prefetched[i]:
                    c.prefetch_useful += 1
                    self.step_used[i] += 1
                    self.prefetched[i].discard(e)
                self._wait(("dev", i, s))
                continue
            if self.prefetch_mode == "device" and e in self.pf_evicted[i]:
                self.step_harm[i] += 1
            cpu = self.cpu_compute == "always" or (self.cpu_compute == "auto" and self.cuda and self.cost.cpu_faster(
                self.source.expert_nbytes, per_expert[e], self.flops_per_token))
            if cpu or not (admit or table.free):
                c.misses += 1
                table.misses += 1
                c.cpu_computed += cpu
                off_slot.append((e, cpu))
                continue
            a = table.access(e, self.t)
            c.misses += 1
            if a.slot < 0:
                off_slot.append((e, False))
                continue
            if a.evicted >= 0:
                lut[a.evicted] = -1
                self.prefetched[i].discard(a.evicted)
                leaving.append((a.evicted, a.slot))
            self._wait(("dev", i, a.slot))
            fills.append((e, a.slot))
        # host copies of the misses: their disk reads go out together, then the next layer's prefetch
        sync = not self.overlap_io
        host = {e: self._host_expert(layer, e, sync) for e in dict.fromkeys([e for e, _ in fills + off_slot])}
        for e, s in leaving if self.exclusive else []:  # after the misses pinned their host slots
            self._demote(layer, e, s)
        for e, s in fills:
            if host[e][0] is None and self.direct:  # no host slot: read from disk straight into the slot
                host[e] = (DIRECT, self._submit_read(layer, e, self._dev_views(i, s), sync))
        self._issue_prefetch()
        pending = any(f is not None for _, f in host.values())
        out = None
        if pending:  # compute the hits while the reads are in flight
            slots = lut.to(x.device)[ids]
            out = moe_ffn(x, slots, weights, pool, self.method, ffn=self.ffn, mask=slots >= 0)
        for e, s in fills:
            if host[e][0] is DIRECT:
                self._landed(layer, e, s, host[e][1])
            else:
                self._fill(layer, e, s, self._host_now(layer, e, host[e]))
            lut[e] = s
        slots = lut.to(x.device)[ids]
        if out is None:
            out = moe_ffn(x, slots, weights, pool, self.method, ffn=self.ffn, mask=slots >= 0)
        elif fills:
            new = torch.zeros(self.E, dtype=torch.bool)
            new[[e for e, _ in fills]] = True
            moe_ffn(x, slots, weights, pool, self.method, ffn=self.ffn, out=out, mask=new.to(x.device)[ids])
        for e, on_cpu in off_slot:
            self._off_slot(layer, e, on_cpu, x, ids, weights, out, self._host_now(layer, e, host[e]))
        table.unpin_all()
        self.prefetched[i].clear()  # "useful" = prefetched for this step and used in it (as replay counts)
        if self.host_tables:
            self.host_tables[i].unpin_all()
            self.host_prefetched[i].clear()
            for e, _ in fills if self.exclusive else []:  # promoted: the host copy is a duplicate now
                self.host_tables[i].drop(e)
        self.gate.update(i, self.step_issued[i], self.step_used[i], self.step_harm[i])
        self.step_issued[i] = self.step_used[i] = self.step_harm[i] = 0
        self.pf_evicted[i].clear()
        return out

    def _off_slot(self, layer, e, on_cpu, x, ids, weights, out, src) -> None:
        """Compute expert e without caching it: on the CPU from its host copy `src`, or (a wave)
        through a staging slot loaded once for this step. On a CPU device both read `src` directly."""
        c = self.counters[layer]
        tok, k = (ids == e).nonzero(as_tuple=True)
        if not on_cpu:
            c.waves += 1
        if self.cuda and not on_cpu:
            ev = self._copy(src, self.stage)  # waits for kernels still reading the previous wave
            torch.cuda.current_stream(self.device).wait_event(ev)
            if not self.host_all:
                ev.synchronize()
            c.bytes_moved += self.source.expert_nbytes
            y = expert_ffn(x[tok], self.stage, self.method, self.ffn)
        else:
            y = expert_ffn(x[tok].to("cpu", torch.float32), src, self.method, self.ffn).to(x.device, x.dtype)
        out.index_put_((tok,), y * weights[tok, k, None], accumulate=True)

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        if not self.wants_prefetch or ids.shape[0] > self.prefill_admit_tokens:
            return  # a prefill is not admitted into the slots, so nothing is fetched ahead for it
        self.ahead = (layer, ids)  # issued by the current layer's forward, after its own demand reads

    def _issue_prefetch(self) -> None:
        if self.ahead is None:
            return
        layer, ids = self.ahead
        self.ahead = None
        if not self.gate.allow(self.li[layer]):
            return
        if self.prefetch_mode == "host":
            self._prefetch_host(layer, ids)
            return
        i, c = self.li[layer], self.counters[layer]
        table, lut = self.dev_tables[i], self.lut[i]
        for e in most_predicted(ids.reshape(-1).tolist())[: self.device_slots]:
            if e in table:
                continue
            a = table.insert(e, self.t)
            if a.slot < 0:
                continue
            self._wait(("dev", i, a.slot))
            if a.evicted >= 0:
                lut[a.evicted] = -1
                self.prefetched[i].discard(a.evicted)
                self.pf_evicted[i].add(a.evicted)
                if self.exclusive:
                    self._demote(layer, a.evicted, a.slot)
            hs, need = self._host_slot(layer, e, pin=False)
            if hs < 0 and not self.direct:  # every host slot pinned: give the device slot back
                table.drop(e)
                continue
            lut[e] = a.slot
            self.prefetched[i].add(e)
            c.prefetch_issued += 1
            self.step_issued[i] += 1
            c.bytes_moved += self.source.expert_nbytes
            if hs < 0:  # direct: disk -> device slot on the I/O pool
                self.busy["dev", i, a.slot] = self._submit_read(layer, e, self._dev_views(i, a.slot))
                continue
            self._wait(("host", i, hs))
            c.disk_bytes += need * self.source.expert_nbytes
            fut = self.mover.submit(self._prefetch_job, layer, e, self._host_views(i, hs), need,
                                    self._dev_views(i, a.slot))
            self.busy["dev", i, a.slot] = fut
            if not self.host_all:
                self.busy["host", i, hs] = fut

    def _prefetch_host(self, layer: int, ids: torch.Tensor) -> None:
        """Disk -> host reads for the experts predicted for the next layer (prefetch "host")."""
        i, c = self.li[layer], self.counters[layer]
        for e in most_predicted(ids.reshape(-1).tolist())[: self.host_slots]:
            if e in self.dev_tables[i]:
                continue
            hs, need = self._host_slot(layer, e, pin=False, ahead=True)
            if not need:
                continue
            self.host_prefetched[i].add(e)
            c.host_prefetch_issued += 1
            self.step_issued[i] += 1
            self.busy["host", i, hs] = self._submit_read(layer, e, self._host_views(i, hs))

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
            for e in torch.argsort(counts[i], descending=True)[: self.device_slots].tolist():
                a = self.dev_tables[i].insert(e, 0)
                if a.slot >= 0:
                    self._fill(layer, e, a.slot)
                    self.lut[i, e] = a.slot

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

    def save_stats(self, path) -> None:
        save_stats(path, self.use_counts, self.layers, str(self.source.index.model_dir))

    def check(self, contents: bool = False) -> None:
        """Invariants: tables consistent, lookup = table, (contents) slot bytes = checkpoint bytes."""
        for fut in list(self.busy.values()):
            fut.result()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for i, (table, layer) in enumerate(zip(self.dev_tables, self.layers)):
            table.check()
            assert not table.pinned, "pins must not outlive a layer's step"
            lut = self.lut[i].tolist()
            for e in range(self.E):
                assert lut[e] == table.slot_of[e], f"layer {layer}: lookup says expert {e} in slot {lut[e]}, table {table.slot_of[e]}"
                if contents and lut[e] >= 0:
                    self._verify(layer, e, self._dev_views(i, lut[e]))
        for i, (table, layer) in enumerate(zip(self.host_tables or [], self.layers)):
            table.check()
            assert not table.pinned, "host pins must not outlive a layer's step"
            for e in table.resident() if contents else []:
                self._verify(layer, e, self._host_views(i, table.slot_of[e]))

    def close(self) -> None:
        self.mover.shutdown(wait=True)
        self.reader.close()
