"""What each op of one layer's schedule does on the cache's buffers (experts/schedule.py legend).

Shape legend: T tokens, K top_k, H hidden, E experts, R rows routed to a CPU-computed expert.
    x [T, H], weights [T, K], ids [T, K] host ids, flat: the same as a list [T*K] (pair = t * K + k),
    step: ids flat [T*K], hit_slots [T, K] host (hits, -1 else)

`Bindings(cache, ...).fns(sched)` -> one callable per op (None for the ids and dense ops: the host
reads the ids itself, the model runs the dense part), aligned with `sched.ops`. Nothing an op makes
outlives its consumer: the rows op's copies and the CPU job's partial sums live in `res` until the
add takes them, and the closures (with `x`, `out` and the transient buffers) die with the executor's
reference to them once they ran. The layer output `out` is made by its first writer when the
executor runs ops in issue order (inline), else up front.
"""

from __future__ import annotations

import numpy as np
import torch

from .compute import expert_ffn, moe_ffn
from .host_routing import to_device
from .layout import parts_at
from .schedule import STAGE, LayerSchedule

SMALL = 64  # up to this many pairs a slot table is built in Python (a few µs), above it by indexing


class Bindings:
    """The ops of one layer's step on `cache` (a TieredExperts): see the module doc."""

    def __init__(self, cache, i: int, x, ids, flat: list[int], weights, hit_slots, plan, lazy_out: bool):
        self.c, self.i, self.x, self.ids, self.flat, self.w = cache, i, x, ids, flat, weights
        self.hit_slots, self.plan = hit_slots, plan
        self.T, self.K = hit_slots.shape
        self._step = None
        self.out = None if lazy_out else torch.zeros_like(x)
        self.bufs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # transient reads
        self.res: dict[str, object] = {}
        self.compute = torch.cuda.current_stream(x.device) if cache.cuda else None

    @property
    def step(self) -> torch.Tensor:
        """The host ids flat [T*K] (made at first use: an all-hits step needs none)."""
        if self._step is None:
            self._step = self.ids.reshape(-1)
        return self._step

    def fns(self, sched: LayerSchedule) -> list:
        return [None if o.kind in ("ids", "dense") else getattr(self, o.kind)(o) for o in sched.ops]

    def output(self) -> torch.Tensor:
        if self.out is None:
            self.out = torch.zeros_like(self.x)
        return self.out

    # -- buffers ------------------------------------------------------------------------------------
    def _host_views(self, i: int, e: int, hs: int):
        if hs >= 0:
            return self.c.slot_views(self.c.host, i, hs)
        buf = self.bufs.get((i, e))
        if buf is None:
            buf = self.bufs[(i, e)] = {
                p.name: torch.empty(p.shape, dtype=p.dtype) for p in parts_at(self.c.source.parts, i)
            }
        return buf

    def _dev_views(self, i: int, s: int):
        return self.c.stage if s == STAGE else self.c.slot_views(self.c.dev, i, s)

    def _slots(self, pairs) -> torch.Tensor:
        """Host [T, K]: the slot of each pair whose expert is in `pairs` (expert, slot), -1 else."""
        if len(self.flat) <= SMALL:
            of = dict(pairs)
            table = np.array([of.get(e, -1) for e in self.flat], dtype=np.int64)
            return torch.from_numpy(table.reshape(self.T, self.K))
        table = np.full(self.c.E, -1, dtype=np.int64)
        table[[e for e, _ in pairs]] = [s for _, s in pairs]
        return torch.take(torch.from_numpy(table), self.ids)

    def _pairs_of(self, e: int):
        """(token, k) of every pair routed to expert e, on the compute device."""
        pair = to_device((self.step == e).nonzero().squeeze(1), self.x.device)
        return pair // self.K, pair % self.K

    # -- the ops --------------------------------------------------------------------------------------
    def read(self, o):
        e, c = o.experts[0], self.c
        dst = self._dev_views(o.layer, o.slot) if o.slot != -1 else self._host_views(o.layer, e, o.host_slot)

        def run():
            c.read_into(o.layer, e, dst)

        if c.peer is not None and c.peer.offers(c.layers[o.layer], e):
            run.on_caller = True  # a peer rank's bytes: only the engine thread takes them
        return run

    def h2d(self, o):
        src = self._host_views(o.layer, o.experts[0], o.host_slot)
        dst, nb = self._dev_views(o.layer, o.slot), self.c.cuda

        def run():
            for n in dst:
                dst[n].copy_(src[n], non_blocking=nb)

        return run

    def demote(self, o):
        """Exclusive tiers: device slot bytes back into a host slot: a plain copy where both hold the
        stored format (CPU kernels), else fp32 narrowed back to the stored bf16/fp16 exactly."""
        c = self.c
        src, dst = c.slot_views(c.dev, o.layer, o.reads[0]), c.slot_views(c.host, o.layer, o.host_slot)

        def run():
            for n, t in dst.items():
                t.copy_(src[n])

        return run

    def moe(self, o):
        c, x, w = self.c, self.x, self.w
        if o.tag == "wave":
            return self._wave(o)
        if o.tag == "hits":
            slots = self.hit_slots
        elif o.tag == "fills":
            slots = self._slots([(f.expert, f.slot) for f in self.plan.fills if not f.on_cpu])
        else:  # all: hits and fills in one call
            slots = self._slots(
                self.plan.hits + [(f.expert, f.slot) for f in self.plan.fills if not f.on_cpu]
            )
        pool, method, ffn = c.dev.layer(self.i), c.method, c.ffn
        backend = c.backend(self.i, x, pool)

        def run():
            self.out = moe_ffn(x, slots, w, pool, method, out=self.out, ffn=ffn, host=True, backend=backend)

        return run

    def _wave(self, o):
        """An off-slot expert: from the staging slot (CUDA), or from its host bytes (a CPU device)."""
        c, x, w, e = self.c, self.x, self.w, o.experts[0]
        hs = o.host_reads[0] if o.host_reads else -1
        if not o.reads and hs >= 0 and x.is_cpu and x.dtype == torch.float32:
            # a CPU device: the MoE kernel over the host slot (as the CPU job computes), no per-pair indexing
            slots, pool, ffn = self._slots([(e, hs)]), c.host.layer(o.layer), c.host_ffn

            def from_host():
                self.out = moe_ffn(x, slots, w, pool, c.method, out=self.out, ffn=ffn, host=True)

            return from_host
        tok, k = self._pairs_of(e)
        if o.reads:  # staged

            def run():
                y = expert_ffn(x[tok], c.stage, c.method, c.ffn)
                self.output().index_put_((tok,), y * w[tok, k, None], accumulate=True)

            return run
        src = self._host_views(o.layer, e, hs)

        def unstaged():
            y = expert_ffn(x[tok].to("cpu", torch.float32), src, c.method, c.ffn).to(x.device, x.dtype)
            self.output().index_put_((tok,), y * w[tok, k, None], accumulate=True)

        return unstaged

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
        x, w, cuda, res, compute = self.x, self.w, self.c.cuda, self.res, self.compute

        def run():  # on the d2h queue: the row indices go up on it too, so no other queue races them
            idx = res["rows_dev"] = to_device(rows, x.device)
            if compute is not None:  # made on this side stream, read by the add on the compute stream
                idx.record_stream(compute)
            xr = torch.empty((rows.shape[0], x.shape[1]), dtype=torch.float32, pin_memory=cuda)
            wr = torch.empty((rows.shape[0], w.shape[1]), dtype=torch.float32, pin_memory=cuda)
            xr.copy_(x[idx], non_blocking=True)  # CUDA: into pinned memory, on the d2h stream (no host wait)
            wr.copy_(w[idx], non_blocking=True)
            res["xw"] = (xr, wr)

        return run

    def cpu(self, o):
        c, res = self.c, self.res
        rows, slots, _ = res.setdefault("pairs", self._cpu_pairs(o))
        transient = [e for e, hs in self._on_cpu() if hs < 0]
        pool, ffn = c.host.layer(o.layer), c.host_ffn
        step, T, K, bufs = self.step, self.T, self.K, self.bufs

        def run():
            xr, wr = res.pop("xw")
            y = torch.zeros_like(xr)
            if (slots >= 0).any():
                moe_ffn(xr, slots, wr, pool, c.method, out=y, ffn=ffn, host=True)
            for e in transient:  # no host slot could be had: its bytes in a transient buffer
                r, k = (step.view(T, K)[rows] == e).nonzero(as_tuple=True)
                y.index_put_(
                    (r,),
                    expert_ffn(xr[r], bufs[(o.layer, e)], c.method, ffn) * wr[r, k, None],
                    accumulate=True,
                )
            res["y"] = y.pin_memory() if c.cuda else y

        return run

    def add(self, o):
        res, cuda = self.res, self.c.cuda

        def run():
            y, idx = res.pop("y"), res.pop("rows_dev")
            out = self.output()
            out.index_put_((idx,), y.to(out.device, out.dtype, non_blocking=cuda), accumulate=True)

        return run
