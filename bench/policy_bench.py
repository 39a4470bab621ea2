"""Every cache policy against Belady MIN on routing the policies were not tuned on.

    python bench/policy_bench.py [--dir /tmp/expertcache-policy] [--policies all] [--threads 2]

Traces (built once into --dir and reused; `tuned` marks the one the policies were designed on):
  tinymoe-tune     tinymoe-py16, 8 x 256 held-out ids from offset 0, one row per step   [tuned]
  tinymoe-heldout  the same model, 8 x 256 ids from offset 150000, one row per step
  tinymoe-prefill  16 prompts of 160 ids (offset 170000) in 32-row prefill chunks, then 32 decode steps
                   each: prefill-heavy (4 of every 9 steps are a 32-row chunk)
  tinymoe-batch4   4 sequences of 256 ids decoding together: 4 rows per step (offset 200000)
  tinymoe-batch16  16 sequences of 128 ids decoding together: 16 rows per step (offset 205000)
  moe32k4-heldout  the model bench/train_moe.py trains (32 experts, top-4, 4 layers) on ids [0, 120000),
                   8 x 256 ids from offset 150000, one row per step
  moe32k4-batch8   the same model, 8 sequences of 192 ids decoding together (offset 210000)
  synth-zipf       synthetic: 8 layers x 64 experts, top-4, Zipf 1.0, reuse 0.3
  synth-shift      synthetic: 16 layers x 64 experts, top-8, Zipf 1.1, reuse 0.4, topic shift every 256
  synth-8x2        synthetic: 32 layers x 8 experts, top-2, Zipf 0.6, reuse 0.35 (the shape of a model
                   the project has never seen), batch 1
Batched and prefill layouts come from the same per-token routing as decode (routing does not depend on
the batch); rows of one step are the batch's tokens, so a step's union of experts is large.

Replay uses the engine's planner with the engine's defaults (every expert in host RAM, prefill
admission at 64 rows, no prefetch, no CPU compute); capacities are 1.5x, 2x and 3x top_k per layer
(capped below the expert count). One line per (trace, capacity, policy):
    trace=T tuned=0|1 slots=S policy=P hit=H min=M of_min=F
then per policy `mean_of_min_untuned=...` over every untuned trace and capacity, and per batched
trace the hit-rate change from pinning the whole step before choosing victims (LRU; the old order
evicted by first appearance).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware_line  # noqa: E402

from expertcache.experts.policy import ONLINE, make_policy  # noqa: E402
from expertcache.experts.slots import SlotTable  # noqa: E402
from expertcache.trace.format import RoutingTrace  # noqa: E402
from expertcache.trace.replay import replay, schedule  # noqa: E402
from expertcache.trace.synthetic import synth_trace  # noqa: E402

BENCH = Path(__file__).resolve().parent
TINYMOE = BENCH.parents[1] / "shared/models/tinymoe-py16"


def layout(ex, wt, la, batch: int = 1, prefill: int = 0, chunk: int = 32) -> dict:
    """Per-sequence routing [S, T, L, K] -> trace arrays. `batch` sequences decode together (one row
    each per step); with `prefill`, each sequence's first `prefill` tokens go in `chunk`-row steps."""
    S, T = ex.shape[:2]
    rows: list[tuple[int, int, int, int]] = []  # (seq, token, phase, step)
    step = 0
    for g in range(0, S, batch):
        group = list(range(g, min(g + batch, S)))
        pos = {s: 0 for s in group}
        if prefill:
            for s in group:  # each prompt in chunks, one after another (chunked prefill)
                for a in range(0, prefill, chunk):
                    rows += [(s, t, 0, step) for t in range(a, min(a + chunk, prefill))]
                    step += 1
                pos[s] = prefill
        while any(pos[s] < T for s in group):
            for s in group:
                if pos[s] < T:
                    rows.append((s, pos[s], 1, step))
                    pos[s] += 1
            step += 1
    seq, tok, ph, st = (np.array(c) for c in zip(*rows))
    return dict(
        experts=ex[seq, tok],
        weights=wt[seq, tok],
        lookahead=la[seq, tok],
        seq=seq,
        token=tok,
        phase=ph.astype(np.int8),
        step=st,
    )


def routed(model_dir: Path, offset: int, seqs: int, tokens: int):
    from trace_tinymoe import route
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.load(TINYMOE / "heldout_ids.pt").flatten()[offset : offset + seqs * tokens]
    assert ids.numel() == seqs * tokens, f"heldout_ids.pt too short for offset {offset}"
    cfg = model.config
    return route(model, ids.reshape(seqs, tokens)), cfg


def build(name: str, d: Path) -> RoutingTrace:
    path = d / f"{name}.npz"
    if path.exists():
        return RoutingTrace.load(path)
    if name.startswith("synth-"):
        kw = {
            "synth-zipf": dict(layers=8, experts=64, top_k=4, tokens=2048, zipf=1.0, reuse=0.3, seed=11),
            "synth-shift": dict(
                layers=16, experts=64, top_k=8, tokens=4096, zipf=1.1, reuse=0.4, shift_every=256, seed=12
            ),
            "synth-8x2": dict(layers=32, experts=8, top_k=2, tokens=600, zipf=0.6, reuse=0.35, seed=13),
        }[name]
        t = synth_trace(**kw)
    else:
        model_name, kind = name.split("-", 1)
        model_dir = TINYMOE if model_name == "tinymoe" else d / "moe32k4"
        if model_name == "moe32k4" and not (model_dir / "config.json").exists():
            subprocess.run([sys.executable, str(BENCH / "train_moe.py"), str(model_dir)], check=True)
        spec = {
            "tune": (0, 8, 256, {}),
            "heldout": (150_000, 8, 256, {}),
            "prefill": (170_000, 16, 192, dict(prefill=160)),
            "batch4": (200_000, 4, 256, dict(batch=4)),
            "batch16": (205_000, 16, 128, dict(batch=16)),
            "batch8": (210_000, 8, 192, dict(batch=8)),
        }[kind]
        offset, seqs, tokens, lay = spec
        (ex, wt, la), cfg = routed(model_dir, offset, seqs, tokens)
        arrays = layout(ex, wt, la, **lay)
        t = RoutingTrace(
            num_experts=cfg.num_experts,
            model=model_name,
            layer_ids=list(range(ex.shape[2])),
            expert_bytes=3 * cfg.hidden_size * cfg.moe_intermediate_size * 2,
            **arrays,
        )
    t.save(path)
    return t


TRACES = [
    "tinymoe-tune",
    "tinymoe-heldout",
    "tinymoe-prefill",
    "tinymoe-batch4",
    "tinymoe-batch16",
    "moe32k4-heldout",
    "moe32k4-batch8",
    "synth-zipf",
    "synth-shift",
    "synth-8x2",
]
TUNED = {"tinymoe-tune"}


def capacities(t: RoutingTrace) -> list[int]:
    k = t.top_k
    return sorted({min(t.num_experts - 1, max(k, round(k * f))) for f in (1.5, 2.0, 3.0)})


def first_appearance_lru(t: RoutingTrace, capacity: int) -> float:
    """LRU driven the old way: misses take victims in order of first appearance, before the step's
    later experts are pinned (so a step can evict an expert it is about to use)."""
    hits = uses = 0
    for li, ls in enumerate(schedule(t)):
        table = SlotTable(t.num_experts, capacity, make_policy("lru", t.num_experts, capacity, li))
        for st in ls:
            for e in st.experts:
                table.access(e, st.t)
            table.unpin_all()
        hits, uses = hits + table.hits, uses + table.hits + table.misses
    return hits / uses


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/expertcache-policy")
    ap.add_argument("--policies", default="all")
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    policies = list(ONLINE) if args.policies == "all" else args.policies.split(",")
    print(hardware_line())
    frac: dict[str, list[float]] = {p: [] for p in policies}
    t0 = time.perf_counter()
    for name in args.traces.split(","):
        t = build(name, d)
        sched = schedule(t)
        for cap in capacities(t):
            mn = replay(t, "min", cap, with_min=False, sched=sched).hit_rate
            for p in policies:
                h = replay(t, p, cap, with_min=False, sched=sched).hit_rate
                print(
                    f"trace={name} tuned={int(name in TUNED)} slots={cap} policy={p} hit={h:.4f} min={mn:.4f} "
                    f"of_min={h / mn:.4f}",
                    flush=True,
                )
                if name not in TUNED:
                    frac[p].append(h / mn)
            if "batch" in name or "prefill" in name:
                old = first_appearance_lru(t, cap)
                new = replay(t, "lru", cap, with_min=False, sched=sched).hit_rate
                print(
                    f"trace={name} slots={cap} pin_whole_step lru_first_appearance={old:.4f} lru_pinned={new:.4f} "
                    f"change={new - old:+.4f}",
                    flush=True,
                )
    for p in policies:
        if frac[p]:
            print(
                f"policy={p} mean_of_min_untuned={statistics.fmean(frac[p]):.4f} min_of_min_untuned={min(frac[p]):.4f} "
                f"n={len(frac[p])}"
            )
    print(f"wall_s={time.perf_counter() - t0:.0f}")


if __name__ == "__main__":
    main()
