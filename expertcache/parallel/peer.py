"""The peer tier: an expert missing from a rank's memory tiers that another rank holds in memory comes
over the link (torch.distributed point-to-point, the group's own backend) instead of from disk.

Shape legend: N ranks, E logical experts per layer, T tokens, K routed experts per token
    codes [N, E] int   per rank, per expert: 2 stored-format bytes in memory (can be sent),
                       1 in memory in another format, 0 only on disk (TieredExperts.memory_codes)
    ids, ranks [T, K]  the step's routed experts and the rank that computes each pair

Planned the same way on every rank, so sender and receiver agree with no extra message:
1. every rank knows every rank's codes for layer l: each rank writes its row into a tail of the
   previous MoE layer's all-reduce (`carry`), after that layer's forward planned its prefetch for
   l; nothing changes a layer's residency between that all-reduce and the layer's own forward.
   (The first MoE layer of a step rides on the last one of the previous step; the very first
   forward has no codes and fetches nothing from peers.)
2. `plan(codes, ids, ranks)`: for each rank r, the experts its pairs need that are only on its disk
   (code 0), in expert order, each from a rank that can send it (code 2), the first such rank after
   r in ring order that is shifted by the expert id (spreads the senders); at most `slots` per rank
   per layer (the receive buffers).
3. `exchange`: every rank posts its sends and receives of the plan in plan order with one
   batch_isend_irecv and waits; then the rank's cache (`TieredExperts.peer = self`) takes a
   received expert instead of its disk read (`take`), for this layer only.
A stale code can only cost time, never correctness or a hang: a sender whose expert left its
memory reads it from disk to send; a receiver that needs no longer drops it. Only the bytes of
the stored format travel (the receiver would read the same from disk), so outputs are unchanged.

Counters (per rank): peer hits (received experts used), bytes in (received), bytes out (sent),
experts received but not used.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

from ..cost.model import ExpertCost
from ..experts.layout import ExpertSource
from ..experts.manager import TieredExperts
from .group import EPGroup


def plan_transfers(
    codes: torch.Tensor, ids: torch.Tensor, ranks: torch.Tensor, slots: int
) -> list[tuple[int, int, int]]:
    """codes [N, E], ids/ranks [T, K] -> [(sender, receiver, expert)] in receiver, expert order."""
    N, E = codes.shape
    need = torch.zeros(N, E, dtype=torch.bool)
    need[ranks.reshape(-1), ids.reshape(-1)] = True
    want = need & (codes == 0)
    can = (codes == 2).tolist()
    plan = []
    for r in range(N):
        taken = 0
        for e in torch.nonzero(want[r]).flatten().tolist():
            order = [(r + 1 + (e + j) % (N - 1)) % N for j in range(N - 1)]
            s = next((s for s in order if can[s][e]), None)
            if s is None:
                continue
            plan.append((s, r, e))
            taken += 1
            if taken == slots:
                break
    return plan


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A part's bytes as one flat uint8 tensor (what travels; any dtype, no copy)."""
    return t.reshape(-1).view(torch.uint8)


def receive_buffers(top_k: int) -> int:
    """How many experts a rank's receive buffers hold (the most it takes from peers per layer)."""
    return max(1, top_k)


class PeerTier:
    def __init__(
        self,
        group: EPGroup,
        cache: TieredExperts,
        source: ExpertSource,
        layers: list[int],
        slots: int,
        alloc=None,
    ):
        """`alloc(shape, dtype)`: how the receive buffers are allocated (build/allocate.py: through the
        Ledger, as the plan's `peer_buffers` term); default torch.empty on the backend's device."""
        self.group, self.cache, self.source, self.layers = group, cache, source, layers
        self.rank, self.N, self.E = group.rank, group.world_size, source.cfg.num_experts
        self.slots = slots
        self.next_of = {layer: layers[(i + 1) % len(layers)] for i, layer in enumerate(layers)}
        # receive buffers: `slots` experts in the stored format, on the backend's device
        dev = group.device if group.device.type == "cuda" else torch.device("cpu")
        alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype, device=dev))
        self.buffers = [{p.name: alloc(p.shape, p.dtype) for p in source.parts} for _ in range(slots)]
        self.dev = dev
        self.known: dict[int, torch.Tensor] = {}  # layer -> codes [N, E] carried by the previous all-reduce
        self.offer: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.used: set[tuple[int, int]] = set()
        self.engine_thread = threading.get_ident()  # the thread that runs the forwards (set per layer)
        self.hits = self.bytes_in = self.bytes_out = self.unused = self.stale_sends = 0
        self.received: deque[tuple[int, int]] = deque(maxlen=256)  # (layer, expert) of recent hits (checks)
        cache.peer = self

    # -- the cache's side (TieredExperts._read / _submit_read) ----------------------------------------
    # Only the engine thread takes received bytes: the buffers are reused by the next layer, so a read
    # on the mover thread (a prefetch) goes to disk as before.
    def offers(self, layer: int, e: int) -> bool:
        return threading.get_ident() == self.engine_thread and (layer, e) in self.offer

    def take(self, layer: int, e: int, dst: dict[str, torch.Tensor]) -> bool:
        got = self.offer.get((layer, e)) if threading.get_ident() == self.engine_thread else None
        if got is None:
            return False
        for n, t in dst.items():
            t.copy_(got[n])
        if (layer, e) not in self.used:
            self.used.add((layer, e))
            self.received.append((layer, e))
            self.hits += 1
        return True

    # -- one MoE layer (every rank, same order) -----------------------------------------------------------
    def before(self, layer: int, ids: torch.Tensor, ranks: torch.Tensor) -> None:
        """Plan from the carried codes and move the planned experts' bytes."""
        self.engine_thread = threading.get_ident()
        codes = self.known.pop(layer, None)
        if codes is None:
            return
        plan = plan_transfers(codes, ids, ranks, self.slots)
        sends, recvs, n_in = [], [], 0
        for s, r, e in plan:
            if s == self.rank:
                parts = self.cache.stored_bytes(layer, e)
                if parts is None:  # left this rank's memory since its codes were sent: read it to send
                    parts = self.source.read(layer, e)
                    self.stale_sends += 1
                for p in self.source.parts:
                    t = parts[p.name].contiguous()
                    sends.append((_wire(t.to(self.dev)), r))
                self.bytes_out += self.source.expert_nbytes
            elif r == self.rank:
                buf = self.buffers[n_in]
                n_in += 1
                recvs += [(_wire(buf[p.name]), s) for p in self.source.parts]
                self.offer[layer, e] = buf
                self.bytes_in += self.source.expert_nbytes
        self.group.exchange(sends, recvs)

    def after(self, layer: int) -> None:
        """The layer's forward is done: received bytes are no longer offered."""
        self.unused += sum(1 for key in self.offer if key not in self.used)
        self.offer.clear()
        self.used.clear()

    def codes_row(self, layer: int) -> torch.Tensor:
        """This rank's codes for the next MoE layer after `layer` (to ride on `layer`'s all-reduce)."""
        return torch.tensor(self.cache.memory_codes(self.next_of[layer]), dtype=torch.float32)

    def carry(self, layer: int, gathered: torch.Tensor) -> None:
        """gathered [N, E] (summed rows, one per rank) for the next MoE layer after `layer`."""
        self.known[self.next_of[layer]] = gathered.float().round().to(torch.int64).cpu()

    # -- stats -----------------------------------------------------------------------------------------
    def counters(self) -> dict:
        return {
            "hits": self.hits,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "unused": self.unused,
            "stale_sends": self.stale_sends,
        }

    def into(self, stats: dict) -> dict:
        """A rank's cache stats with the peer tier: per_tier["peer"] (hits, bytes received, received but
        unused; the bytes it sent are in the expert_parallel section), and the
        disk reads its hits replaced taken off the disk tier (the planner counted them as disk reads)."""
        per_tier = dict(stats.get("per_tier") or {})
        per_tier["peer"] = {"hits": self.hits, "bytes_in": self.bytes_in, "unused": self.unused}
        if "disk" in per_tier:
            disk = dict(per_tier["disk"])
            disk["bytes_read"] = disk.get("bytes_read", 0) - self.hits * self.source.expert_nbytes
            per_tier["disk"] = disk
        return {**stats, "per_tier": per_tier}


# -- the link, measured once per group -----------------------------------------------------------------
def measure_link(group: EPGroup, nbytes: int, reps: int = 5) -> tuple[float, float]:
    """(GB/s, latency ms) of rank 0 <-> rank 1 over the group's backend, best of `reps` round trips:
    the latency from 1 byte, the bandwidth from max(nbytes, 8 MiB) (latency included: a conservative
    figure). Every rank calls it (ranks > 1 wait); every rank gets rank 0's figures."""
    dev = group.device if group.device.type == "cuda" else torch.device("cpu")
    big_n = min(max(nbytes, 8 << 20), 64 << 20)
    small = torch.zeros(1, dtype=torch.uint8, device=dev)
    big = torch.zeros(big_n, dtype=torch.uint8, device=dev)

    def one_way(t: torch.Tensor) -> float:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            if group.rank == 0:
                group.exchange([(t, 1)], [], startup=True)
                group.exchange([], [(t, 1)], startup=True)
            elif group.rank == 1:
                group.exchange([], [(t, 0)], startup=True)
                group.exchange([(t, 0)], [], startup=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t0)
        return best / 2

    lat, t_big = one_way(small), one_way(big)
    figures = (round(big_n / t_big / 1e9, 3), round(lat * 1e3, 4)) if group.rank == 0 else None
    return tuple(group.broadcast(figures, startup=True))


def decide(group: EPGroup, mode: str, cost: ExpertCost) -> tuple[bool, str]:
    """Whether this group uses the peer tier (rank 0 decides, every rank gets the same answer) and
    the line that says why."""
    from dataclasses import replace

    if mode == "off" or group.world_size < 2:
        return False, "peer tier: off"
    prof = cost.profile
    how = f"profile {prof.name}"
    if prof.peer_gbs <= 0:
        gbs, lat = measure_link(group, cost.expert_bytes)
        prof = replace(prof, peer_gbs=gbs, peer_latency_ms=lat)
        how = f"measured now over {'NCCL' if group.device.type == 'cuda' else 'gloo'}"
    cost = replace(cost, profile=prof)
    faster = cost.peer_faster()
    on = mode == "on" or faster
    line = (
        f"peer tier: {'on' if on else 'off'} ({'forced' if mode == 'on' else 'cost model'}): link "
        f"{prof.peer_gbs:g} GB/s + {prof.peer_latency_ms:g} ms ({how}): {cost.peer() * 1e3:.3f} ms per expert "
        f"vs disk {cost.disk() * 1e3:.3f} ms ({prof.disk_gbs:g} GB/s)"
    )
    on, line = group.broadcast((on, line) if group.rank == 0 else None, startup=True)
    return on, line


def decide_for(group: EPGroup, mode: str, source: ExpertSource, cost_profile: str | None):
    """-> (on, line or None): whether this group moves experts between ranks (the peer tier of a tiered
    cache, a rearrangement's bytes from the old ranks). Decided before the device plan (the receive
    buffers are one of its terms); every rank calls it at the same point."""
    from ..cost.measure import resolve_profile

    if mode == "off" or group.world_size < 2:
        return False, None
    prof, _ = resolve_profile(cost_profile, group.device.type, source.index.model_dir)
    cfg = source.cfg
    return decide(
        group, mode, ExpertCost(prof, source.expert_nbytes, 3 * cfg.hidden_size * cfg.moe_intermediate_size)
    )


def build(group: EPGroup, decision: tuple[bool, str | None], local, source: ExpertSource, alloc=None):
    """-> (PeerTier or None, rearrangement moves from peers: bool, plan line or None) for this rank's
    provider `local` and the group's `decide_for` answer: the tiered cache gets the peer tier (its
    receive buffers from `alloc(shape, dtype)`), the all-resident own experts (LocalExperts) take a
    rearrangement's bytes from their old ranks."""
    from .local import LocalExperts

    on, line = decision
    tiered, resident_own = isinstance(local, TieredExperts), isinstance(local, LocalExperts)
    if not (tiered or resident_own):  # every expert of a tiered cache resident: nothing to move
        return None, False, None
    if not on:
        return None, False, line
    if tiered:
        n = receive_buffers(source.cfg.top_k)
        return (
            PeerTier(group, local, source, source.layers, n, alloc),
            False,
            line + f"; receive buffers {n} x {source.expert_nbytes / 2**20:.2f} MiB",
        )
    return None, True, line + " (rearrangement moves)"
