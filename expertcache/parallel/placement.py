"""Where each logical expert lives across expert-parallel ranks, and how a new placement is chosen.

Shape legend:
    L MoE layers, E logical experts per layer, N ranks, R = E + redundant physical experts per layer
    load [L, E] tokens routed to each logical expert over the load window

A `Placement` maps every logical expert of every layer to one or more ranks (its replicas; a
rank holds at most one replica of an expert). Invariants, checked by `check()`:
- every logical expert has >= 1 replica, on distinct ranks;
- rank r holds at most `capacity(r)` experts of a layer (R split as evenly as possible: the
  first R % N ranks hold one more).
Tokens routed to a replicated expert are split between its replicas by token, step and top-k
position (pair k of token t in step s goes to replica (t + s + k) % replicas), so each replica
serves about the same share, at batch 1 too, and one token's replicated experts do not all land
on the same rank (every rank counts steps alike, so every rank makes the same choice).

`static_placement` is the split without load information (expert e on rank e % N).
`balanced_placement` is EPLB's recipe (DeepSeek's EPLB, as vLLM's `--enable-eplb` uses it):
first give the extra replicas one at a time to the expert with the highest load per replica,
then pack the physical experts (each carrying load / replicas) onto ranks heaviest first, each
to the least-loaded rank that still has room and does not already hold that expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def capacities(num_physical: int, num_ranks: int) -> list[int]:
    base, extra = divmod(num_physical, num_ranks)
    return [base + (1 if r < extra else 0) for r in range(num_ranks)]


@dataclass(frozen=True)
class Placement:
    """replicas[layer][e] = ranks holding logical expert e of that MoE layer (in replica order)."""

    num_ranks: int
    replicas: dict[int, tuple[tuple[int, ...], ...]]
    version: int = 0
    num_redundant: int = 0  # physical experts per layer beyond one per logical expert

    def owned(self, rank: int) -> dict[int, list[int]]:
        """layer -> sorted logical experts that `rank` holds."""
        return {
            layer: [e for e, rs in enumerate(reps) if rank in rs] for layer, reps in self.replicas.items()
        }

    def moves_to(self, new: "Placement") -> list[tuple[int, int, int, int]]:
        """[(from rank, to rank, layer, expert)]: every expert a rank holds in `new` but not here, taken
        from one of its current holders (spread by expert and rank), in layer, expert, rank order."""
        out = []
        for layer, reps in new.replicas.items():
            for e, rs in enumerate(reps):
                old = self.replicas[layer][e]
                out += [(old[(r + e) % len(old)], r, layer, e) for r in rs if r not in old]
        return out

    def rank_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (ranks [E, max_replicas] int64 padded with -1, replica count [E] int64)."""
        reps = self.replicas[layer]
        width = max(len(r) for r in reps)
        table = torch.full((len(reps), width), -1, dtype=torch.int64)
        for e, rs in enumerate(reps):
            table[e, : len(rs)] = torch.tensor(rs, dtype=torch.int64)
        return table, torch.tensor([len(r) for r in reps], dtype=torch.int64)

    def check(self) -> None:
        for layer, reps in self.replicas.items():
            held = [0] * self.num_ranks
            for e, rs in enumerate(reps):
                assert rs and len(set(rs)) == len(rs), f"layer {layer} expert {e}: replicas {rs}"
                for r in rs:
                    assert 0 <= r < self.num_ranks, f"layer {layer} expert {e}: rank {r}"
                    held[r] += 1
            cap = capacities(len(reps) + self.num_redundant, self.num_ranks)
            assert all(h <= c for h, c in zip(held, cap)), f"layer {layer}: experts per rank {held} > {cap}"


def static_placement(layers: list[int], num_experts: int, num_ranks: int) -> Placement:
    reps = tuple((e % num_ranks,) for e in range(num_experts))
    return Placement(num_ranks, {layer: reps for layer in layers})


def assign_ranks(ids: torch.Tensor, table: torch.Tensor, counts: torch.Tensor, step: int = 0) -> torch.Tensor:
    """ids [T, K] logical experts -> rank [T, K] that computes each pair (replicas split by token and step)."""
    tok = torch.arange(step, step + ids.shape[0], device=ids.device).unsqueeze(1)
    pos = torch.arange(ids.shape[1], device=ids.device)
    choice = (tok + pos) % counts[ids]
    return table[ids, choice]


def balanced_layer(
    load: list[float],
    num_ranks: int,
    num_redundant: int,
    coact: list[list[float]] | None = None,
    rank_load: list[float] | None = None,
) -> tuple[tuple[int, ...], ...]:
    """One layer's replicas for loads [E]: replicate the hottest, then pack heaviest-first.
    `coact` [E, E] (tokens routed to both experts): a rank's cost for an expert also counts the
    tokens it shares with the experts already there (per replica pair), so experts that fire together
    go to different ranks and one token's pairs spread over the group. `rank_load` [N]: the ranks'
    expected pairs from the layers packed before this one (updated in place), so the heaviest expert
    of every layer does not land on the same rank (a step's pairs per rank add up over its layers)."""
    E = len(load)
    num_redundant = min(num_redundant, E * (num_ranks - 1))  # at most one replica per rank
    count = [1] * E
    for _ in range(num_redundant):
        e = max(
            (e for e in range(E) if count[e] < num_ranks), key=lambda e: (load[e] / count[e], -count[e], -e)
        )
        count[e] += 1
    physical = sorted(
        ((load[e] / count[e], e) for e in range(E) for _ in range(count[e])), key=lambda p: (-p[0], p[1])
    )
    room = capacities(len(physical), num_ranks)
    rank_load = [0.0] * num_ranks if rank_load is None else rank_load
    holds: list[set[int]] = [set() for _ in range(num_ranks)]
    reps: list[list[int]] = [[] for _ in range(E)]
    for share, e in physical:
        fits = [r for r in range(num_ranks) if room[r] > 0 and e not in holds[r]]
        if not fits:  # only ranks that already hold e have room: this replica adds nothing, drop it
            continue
        if coact is None:
            r = min(fits, key=lambda r: (rank_load[r], r))
        else:
            r = min(
                fits,
                key=lambda r: (rank_load[r] + sum(coact[e][o] / (count[e] * count[o]) for o in holds[r]), r),
            )
        room[r] -= 1
        rank_load[r] += share
        holds[r].add(e)
        reps[e].append(r)
    return tuple(tuple(sorted(r)) for r in reps)


def balanced_placement(
    load: torch.Tensor,
    layers: list[int],
    num_ranks: int,
    num_redundant: int,
    version: int = 0,
    coact: torch.Tensor | None = None,
) -> Placement:
    """load [L, E] (rows in the order of `layers`) -> a Placement with `num_redundant` extra replicas per
    layer; `coact` [L, E, E]: co-activation counts (see balanced_layer)."""
    rows = load.double().tolist()
    co = coact.double().tolist() if coact is not None else [None] * len(rows)
    ranks = [0.0] * num_ranks  # expected pairs per rank over the layers packed so far
    return Placement(
        num_ranks,
        {
            layer: balanced_layer(row, num_ranks, num_redundant, c, ranks)
            for layer, row, c in zip(layers, rows, co)
        },
        version,
        num_redundant,
    )


def coactivation(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [T, K] of one layer -> [E, E] tokens routed to both experts (diagonal zero)."""
    m = torch.zeros(ids.shape[0], num_experts, dtype=torch.float32)
    m.scatter_(1, ids, 1.0)
    c = m.T @ m
    c.fill_diagonal_(0)
    return c


def rank_loads(
    ids: torch.Tensor, table: torch.Tensor, counts: torch.Tensor, num_ranks: int, step: int = 0
) -> torch.Tensor:
    """Routed pairs each rank computes for ids [T, K] -> [N]."""
    return torch.bincount(assign_ranks(ids, table, counts, step).reshape(-1), minlength=num_ranks)


MIN_GAIN = 0.05  # a new placement is taken only if it lowers the expected max/mean by this share


def expected_balance(placement: Placement, load: torch.Tensor, layers: list[int]) -> float:
    """max / mean of the expected routed pairs per rank for load [L, E] (replicas share equally)."""
    ranks = torch.zeros(placement.num_ranks, dtype=torch.float64)
    for row, layer in zip(load.double(), layers):
        for e, rs in enumerate(placement.replicas[layer]):
            for r in rs:
                ranks[r] += row[e] / len(rs)
    mean = ranks.mean().item()
    return ranks.max().item() / mean if mean else 1.0


def worth_moving(current: Placement, new: Placement, load: torch.Tensor, layers: list[int]) -> bool:
    """EPLB's guard: move experts only when the window's load says the new placement is clearly better."""
    return expected_balance(new, load, layers) < expected_balance(current, load, layers) * (1 - MIN_GAIN)
