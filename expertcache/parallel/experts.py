"""`ExpertParallelExperts`: the expert provider of one rank in an expert-parallel group.

Every rank runs the same forward on the same batch (attention and dense weights are
replicated, so every rank already holds x for every token). Per MoE layer:

    ranks [T, K] = assign_ranks(ids)          who computes each routed pair (replicas split by token)
    y_local [T, H] = sum over my pairs of w * FFN_e(x)   through this rank's own tiered cache
    y = all_reduce(y_local)                   one collective of T x H values per MoE layer

With the peer tier (parallel.peer) a rank's misses that another rank holds in memory are moved
rank to rank before the layer's compute, and the all-reduce carries N x E more values: every
rank's residency codes of the next MoE layer, which plan that layer's transfers.

Why all-reduce and not all-to-all dispatch: with attention replicated nothing has to be sent to an
expert's owner (x is already there); the only exchange is the sum of partial outputs, a ring
all-reduce of 2 (N-1)/N x T x H values per rank. An all-to-all dispatch + combine would move each
routed pair's row out and back, 2 (N-1)/N x T x K x H values, K times more (K = top_k >= 2).

Placement changes (EPLB) are decided by rank 0 and sent with a step's batch (`control`); every
rank prepares its new experts in the background and the group switches at the first step
boundary where all ranks are ready (`all_true`), so serving never waits for a rearrangement.
Counters: per-step routed pairs per rank (balance = max / mean), load per logical expert over a
sliding window (the balancer's input), rearrangements and the bytes they read.
"""

from __future__ import annotations

from collections import deque

import torch

from ..experts.provider import ExpertProvider
from .config import ParallelConfig
from .group import EPGroup
from .peer import PeerTier
from .placement import Placement, assign_ranks, balanced_placement, worth_moving

BALANCE_HISTORY = 1000  # steps of per-rank load kept for /stats


class ExpertParallelExperts(ExpertProvider):
    def __init__(
        self,
        group: EPGroup,
        local: ExpertProvider,
        placement: Placement,
        cfg: ParallelConfig,
        layers: list[int],
        num_experts: int,
        peer: PeerTier | None = None,
        peer_moves: bool = False,
    ):
        self.group, self.local, self.cfg, self.layers = group, local, cfg, layers
        self.peer = peer  # the peer tier over `local`'s memory tiers (None: off, or no tiers)
        self.peer_moves = peer_moves  # rearrangements take new experts' bytes from their old ranks
        self.row_of = {layer: i for i, layer in enumerate(layers)}
        self.rank, self.N, self.E = group.rank, group.world_size, num_experts
        self.wants_prefetch = local.wants_prefetch
        self._use(placement)
        self.window: deque[torch.Tensor] = deque(maxlen=cfg.eplb_window_size)
        self.step_load = torch.zeros(len(layers), num_experts, dtype=torch.int64)
        self.step_pairs = torch.zeros(self.N, dtype=torch.int64)
        self.balance: deque[tuple[list[int], float]] = deque(maxlen=BALANCE_HISTORY)
        self.steps = 0
        self.pending: Placement | None = None
        self.requested: Placement | None = None
        self.rearrangements = 0
        self.bytes_rearranged = 0  # read from the checkpoint by this rank for new placements
        self.bytes_rearranged_peer = 0  # received from other ranks for new placements
        self.rank_stats: list[dict] = []

    def _use(self, placement: Placement) -> None:
        self.placement = placement
        self.tables = {layer: placement.rank_table(layer) for layer in self.layers}

    # -- control (rank 0 decides, every rank applies) -------------------------------------------------
    def request_placement(self, placement: Placement) -> None:
        """Switch to `placement` at the next step boundary (tests, operators)."""
        self.requested = placement

    def control(self) -> dict:
        """Rank 0, before each step: what every rank must do with this step."""
        ctl: dict = {}
        if self.pending is None:
            new = self.requested
            if new is None and self.cfg.eplb and self.steps and self.steps % self.cfg.eplb_step_interval == 0:
                load = torch.stack(list(self.window)).sum(0) if self.window else self.step_load
                new = balanced_placement(
                    load, self.layers, self.N, self.cfg.num_redundant_experts, self.placement.version + 1
                )
                if not worth_moving(self.placement, new, load, self.layers):
                    new = None
            if new is not None:
                self.requested = None
                if new.replicas != self.placement.replicas:
                    ctl["placement"] = new
        return ctl

    def apply(self, ctl: dict) -> None:
        new = ctl.get("placement")
        if new is not None:
            self.pending = new
            if hasattr(self.local, "prepare"):
                moves = self.placement.moves_to(new) if self.peer_moves else None
                self.local.prepare(new.owned(self.rank), moves, self.group)

    def begin_step(self) -> None:
        if self.pending is not None:
            ready = self.local.ready() if hasattr(self.local, "ready") else True
            if self.group.all_true(ready):
                if hasattr(self.local, "swap"):
                    disk, peer = self.local.swap()
                    self.bytes_rearranged += disk
                    self.bytes_rearranged_peer += peer
                self._use(self.pending)
                self.pending = None
                self.rearrangements += 1
        self.step_pairs.zero_()
        self.step_load.zero_()
        self.local.begin_step()

    def end_step(self) -> None:
        self.local.end_step()
        self.steps += 1
        pairs = self.step_pairs.tolist()
        if sum(pairs):
            self.balance.append((pairs, max(pairs) / (sum(pairs) / self.N)))
            self.window.append(self.step_load.clone())

    # -- compute --------------------------------------------------------------------------------------
    def forward(self, layer, x, ids, weights):
        table, counts = self.tables[layer]
        ids_cpu = ids.cpu()
        ranks = assign_ranks(ids_cpu, table, counts, self.steps)
        if self.rank == 0:  # the balancer and the balance stats live on rank 0
            self.step_pairs += torch.bincount(ranks.reshape(-1), minlength=self.N)
            self.step_load[self.row_of[layer]] += torch.bincount(
                ids_cpu.reshape(-1), minlength=self.step_load.shape[1]
            )
        peer = self.peer
        if peer is not None:
            peer.before(layer, ids_cpu, ranks)
        tok, k = torch.nonzero(ranks == self.rank, as_tuple=True)
        n = x.numel()
        # [T x H | N x E]: the partial outputs, then (peer tier) every rank's codes of the next MoE layer
        buf = torch.zeros(n + (self.N * self.E if peer is not None else 0), dtype=x.dtype, device=x.device)
        out = buf[:n].view_as(x)
        if tok.numel():
            tok, k = tok.to(x.device), k.to(x.device)
            y = self.local.forward(layer, x[tok], ids[tok, k].unsqueeze(1), weights[tok, k].unsqueeze(1))
            out.index_put_((tok,), y, accumulate=True)
        if peer is not None:
            peer.after(layer)
            buf[n + self.rank * self.E : n + (self.rank + 1) * self.E] = peer.codes_row(layer).to(
                buf.device, buf.dtype
            )
        self.group.all_reduce_(buf)
        if peer is not None:
            peer.carry(layer, buf[n:].view(self.N, self.E))
        return out

    def prefetch(self, layer, ids):
        table, counts = self.tables[layer]
        ids_cpu = ids.cpu()
        mine = assign_ranks(ids_cpu, table, counts, self.steps) == self.rank
        if bool(mine.any()):
            self.local.prefetch(layer, ids_cpu[mine].unsqueeze(1).to(ids.device))

    # -- stats ----------------------------------------------------------------------------------------
    def gather_stats(self) -> None:
        """Every rank, in the same step: rank 0 collects each rank's own counters."""
        mine = {
            "rank": self.rank,
            "bytes_rearranged": self.bytes_rearranged,
            "bytes_rearranged_peer": self.bytes_rearranged_peer,
            "cache": self._cache_stats(),
            "peer": self.peer.counters() if self.peer is not None else None,
        }
        got = self.group.gather(mine)
        if got is not None:
            self.rank_stats = got

    def _cache_stats(self) -> dict:
        s = self.local.stats()
        return self.peer.into(s) if self.peer is not None else s

    def parallel_stats(self) -> dict:
        recent = [b for _, b in self.balance]
        last = self.balance[-1] if self.balance else ([0] * self.N, 0.0)
        ranks = self.rank_stats or [
            {
                "bytes_rearranged": self.bytes_rearranged,
                "bytes_rearranged_peer": self.bytes_rearranged_peer,
                "peer": self.peer.counters() if self.peer is not None else None,
            }
        ]
        peers = [r["peer"] for r in ranks if r.get("peer")]
        return {
            "world_size": self.N,
            "num_redundant_experts": self.placement.num_redundant,
            "placement_version": self.placement.version,
            "rearrangements": self.rearrangements,
            "rearrangement_pending": self.pending is not None,
            "pairs_per_rank_last_step": last[0],
            "balance_last_step": last[1],
            "balance_mean": sum(recent) / len(recent) if recent else 0.0,
            "balance_max": max(recent) if recent else 0.0,
            "bytes_rearranged": sum(r["bytes_rearranged"] for r in ranks),
            "bytes_rearranged_peer": sum(r.get("bytes_rearranged_peer", 0) for r in ranks),
            "peer_tier": self.peer is not None or self.peer_moves,
            "peer_hits": sum(p["hits"] for p in peers),
            "peer_bytes_in": sum(p["bytes_in"] for p in peers),
            "peer_bytes_out": sum(p["bytes_out"] for p in peers),
            "ranks": self.rank_stats,
        }

    def stats(self) -> dict:
        return {**self._cache_stats(), "expert_parallel": self.parallel_stats()}

    def save_stats(self, path):
        if hasattr(self.local, "save_stats"):
            self.local.save_stats(path)

    def close(self) -> None:
        self.local.close()


def summary_line(ep: dict) -> str:
    line = (
        f"expert parallel {ep['world_size']} ranks, balance max/mean {ep['balance_mean']:.2f} "
        f"(worst step {ep['balance_max']:.2f}), {ep['rearrangements']} rearrangements"
    )
    if ep.get("peer_tier"):
        line += (
            f", peer tier {ep['peer_hits']} hits, {ep['peer_bytes_in'] / 1e6:.2f} MB in"
            f" + {ep['bytes_rearranged_peer'] / 1e6:.2f} MB rearranged"
        )
    return line
