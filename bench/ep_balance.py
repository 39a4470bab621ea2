"""Expert-parallel load balance on real routing, and a simulated peer-memory tier.

    .venv/bin/python bench/ep_balance.py TRACE.npz [TRACE2.npz ...] [--ranks 2 4] [--batch 1 8]
        [--window 64] [--interval 32]

Part 1 (measured on the traces, no timing): per step, routed (token, expert) pairs per rank under
the placement the engine would use — the static split (expert e on rank e % N) and EPLB with
E/16 and E/8 redundant experts (rebalanced online every --interval steps from the last --window
steps' load, exactly the functions `expertcache.parallel` runs) — and an offline "oracle"
placement balanced on the whole trace. Prints balance = max/mean pairs per rank (mean over
steps, and p95), rearrangements, and the expert bytes the rearrangements load.
`--batch B` replays B sequences of the trace in lockstep (one decode step = B tokens).

Part 2 (SIMULATED, not measured): decode time per token spent moving experts for a model whose
experts exceed one device, 2 GPUs each holding C expert slots per layer; misses of a rank's own
experts come from host RAM over PCIe, from a peer GPU's spare memory (the peer tier) over NVLink,
PCIe P2P or Ethernet, or from NVMe. Per-layer LRU on the trace's routing, expert bytes of
Qwen3-30B-A3B (bf16, 9.4 MB). One line per configuration.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict, deque
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware_line  # noqa: E402

from expertcache.parallel.placement import (
    balanced_placement,
    coactivation,
    rank_loads,  # noqa: E402
    static_placement,
    worth_moving,
)
from expertcache.trace.format import RoutingTrace  # noqa: E402

LINKS_GBS = {"nvlink": 300.0, "pcie-p2p": 25.0, "ethernet-100g": 12.5}
HOST_GBS, NVME_GBS = 25.0, 6.0
EXPERT_BYTES = 3 * 2048 * 768 * 2  # Qwen3-30B-A3B expert in bf16


def lockstep_steps(tr: RoutingTrace, batch: int) -> list[np.ndarray]:
    """-> list of [B, L, K] expert ids per decode step, B sequences advancing together."""
    seqs = [tr.experts[tr.seq == s] for s in np.unique(tr.seq)]
    out = []
    for g in range(0, len(seqs) - batch + 1, batch):
        group = seqs[g : g + batch]
        n = min(len(s) for s in group)
        out += [np.stack([s[t] for s in group]) for t in range(n)]
    return out


def balance_run(steps, L, E, N, redundant, window, interval, eplb):
    layers = list(range(L))
    if redundant:
        pl = balanced_placement(torch.zeros(L, E), layers, N, redundant)
    else:
        pl = static_placement(layers, E, N)
    tables = {l: pl.rank_table(l) for l in layers}
    hist: deque = deque(maxlen=window)
    bal, rearr, moved = [], 0, 0
    for i, st in enumerate(steps):
        ids = torch.from_numpy(st.astype(np.int64))  # [B, L, K]
        if eplb and i and i % interval == 0:
            load = torch.stack(list(hist)).sum(0)
            new = balanced_placement(load, layers, N, redundant, pl.version + 1)
            if new.replicas != pl.replicas and worth_moving(pl, new, load, layers):
                moved += sum(
                    len(set(new.owned(r)[l]) - set(pl.owned(r)[l])) for r in range(N) for l in layers
                )
                pl, rearr = new, rearr + 1
                tables = {l: pl.rank_table(l) for l in layers}
        pairs = torch.zeros(N, dtype=torch.int64)
        load = torch.zeros(L, E, dtype=torch.int64)
        for l in layers:
            pairs += rank_loads(ids[:, l], *tables[l], N, i)
            load[l] = torch.bincount(ids[:, l].reshape(-1), minlength=E)
        hist.append(load)
        bal.append((pairs.max() / pairs.double().mean()).item())
    b = np.array(bal)
    return b.mean(), np.percentile(b, 95), rearr, moved


def oracle_run(steps, L, E, N, redundant, coact=False):
    layers = list(range(L))
    load = torch.zeros(L, E, dtype=torch.int64)
    co = torch.zeros(L, E, E) if coact else None
    for st in steps:
        for l in layers:
            ids = torch.from_numpy(st[:, l].astype(np.int64))
            load[l] += torch.bincount(ids.reshape(-1), minlength=E)
            if coact:
                co[l] += coactivation(ids, E)
    pl = balanced_placement(load, layers, N, redundant, coact=co)
    bal = []
    for i, st in enumerate(steps):
        ids = torch.from_numpy(st.astype(np.int64))
        pairs = sum(rank_loads(ids[:, l], *pl.rank_table(l), N, i) for l in layers)
        bal.append((pairs.max() / pairs.double().mean()).item())
    return np.mean(bal), np.percentile(bal, 95)


def peer_sim(steps, L, E, slots, peer_slots):
    """Per-layer two-level LRU (device slots, then the peer's spare slots, exclusive) on rank 0's
    experts (static split over 2 ranks): -> (device hits, peer hits, misses) per step (means)."""
    dev = [OrderedDict() for _ in range(L)]
    peer = [OrderedDict() for _ in range(L)]
    h = p = m = 0
    for st in steps:
        for l in range(L):
            need = sorted({int(e) for e in st[:, l].reshape(-1) if int(e) % 2 == 0})
            for e in need:
                if e in dev[l]:
                    dev[l].move_to_end(e)
                    h += 1
                    continue
                if e in peer[l]:
                    del peer[l][e]
                    p += 1
                else:
                    m += 1
                dev[l][e] = True
                if len(dev[l]) > slots:
                    v, _ = dev[l].popitem(last=False)
                    if v not in need:
                        peer[l][v] = True
                        if len(peer[l]) > peer_slots:
                            peer[l].popitem(last=False)
    n = len(steps)
    return h / n, p / n, m / n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--interval", type=int, default=32)
    args = ap.parse_args(argv)
    print(hardware_line())
    for path in args.traces:
        tr = RoutingTrace.load(path)
        L, E = tr.experts.shape[1], tr.num_experts
        for B in args.batch:
            steps = lockstep_steps(tr, B)
            for N in args.ranks:
                for name, red, eplb in (
                    ("static", 0, False),
                    (f"eplb-E/16={max(1, E // 16)}", max(1, E // 16), True),
                    (f"eplb-E/8={max(1, E // 8)}", max(1, E // 8), True),
                ):
                    mean, p95, rearr, moved = balance_run(
                        steps, L, E, N, red, args.window, args.interval, eplb
                    )
                    print(
                        f"balance trace={Path(path).name} batch={B} ranks={N} placement={name} steps={len(steps)} "
                        f"max_over_mean={mean:.3f} p95={p95:.3f} rearrangements={rearr} "
                        f"experts_moved={moved} bytes_moved={moved * tr.expert_bytes}"
                    )
                for name, red, co in (
                    ("oracle-static", 0, False),
                    (f"oracle-E/8={max(1, E // 8)}", max(1, E // 8), False),
                    ("oracle-coact", 0, True),
                    (f"oracle-coact-E/8={max(1, E // 8)}", max(1, E // 8), True),
                ):
                    mean, p95 = oracle_run(steps, L, E, N, red, co)
                    print(
                        f"balance trace={Path(path).name} batch={B} ranks={N} placement={name} steps={len(steps)} "
                        f"max_over_mean={mean:.3f} p95={p95:.3f}"
                    )
        # Part 2: simulated peer tier, 2 ranks, rank 0 owns E/2 experts per layer
        steps = lockstep_steps(tr, 1)
        own = E // 2
        for frac in (0.25, 0.5):
            slots = max(tr.top_k, int(own * frac))
            h, p0, m0 = peer_sim(steps, L, E, slots, 0)
            _, p1, m1 = peer_sim(steps, L, E, slots, own - slots)
            base = {
                "host": m0 * EXPERT_BYTES / (HOST_GBS * 1e9),
                "nvme": m0 * EXPERT_BYTES / (NVME_GBS * 1e9),
            }
            for src, t in base.items():
                print(
                    f"SIMULATED peer trace={Path(path).name} device_share={frac} tier={src} "
                    f"misses_per_token={m0:.2f} move_ms_per_token={t * 1e3:.2f}"
                )
            for link, bw in LINKS_GBS.items():
                t = p1 * EXPERT_BYTES / (bw * 1e9) + m1 * EXPERT_BYTES / (HOST_GBS * 1e9)
                print(
                    f"SIMULATED peer trace={Path(path).name} device_share={frac} tier=peer-{link}+host "
                    f"peer_hits_per_token={p1:.2f} misses_per_token={m1:.2f} move_ms_per_token={t * 1e3:.2f} "
                    f"speedup_vs_host={base['host'] / t if t else float('inf'):.2f}x"
                )


if __name__ == "__main__":
    main()
