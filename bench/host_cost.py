"""Host cost of one MoE layer per decode step: the planner, the rest of the cache step, aten dispatches.

    python bench/host_cost.py [--steps 24] [--reps 5] [--tokens 24] [--policies default,lru,...] [--no-engine]

Two parts, for Qwen3-30B-A3B's shape (E=128, top-8, H=2048, I=768) and gpt-oss-20b's (E=32, top-4,
H=2880), the default policy and each online one:

* planner: `StepPlanner` alone at the shape's E and top-k, 48 layers, device slots = 25% of the
  experts, every expert in host RAM, cpu_compute "cost" (the per-miss rule of the shape's experts
  under the default CUDA profile), prefetch "device", random routing and an uninformed predictor
  (random experts); each layer's call is plan_prefetch + plan_step + end_step, each timed apart.
* engine: a tiny checkpoint with the shape's real E and top-k (hidden 64, expert width 32,
  tests/checkpoints.py's builder), `LLM(device_memory="25%", cache_policy=P)`, greedy decode of
  --tokens tokens; the cache's public entry `llm.experts.forward(layer, x, ids, weights)` is
  wrapped: CPU time per decode call (one row), the planner's share inside it (its three public
  methods wrapped on the instance), the schedule build's share where the cache has a
  `builder.layer` (experts/schedule.py; nan where the step built none), the rest = bindings, byte
  movement, compute and dispatch; and, in a round of its own, the aten ops the main thread
  dispatches per call (a TorchDispatchMode counter; executor threads are not counted).

Times are thread CPU time (time.thread_time: what the host spends, not how long a busy machine
keeps it waiting), the median of --reps alternating rounds. One line per configuration:

    host_cost part=planner shape=qwen3-30b-a3b policy=adaptive planner=native plan_step_us=... plan_prefetch_us=...
              end_step_us=... planner_us=...
    host_cost part=engine shape=qwen3-30b-a3b policy=adaptive planner=native layer_us=... planner_us=... schedule_us=...
              rest_us=... aten_ops=...

`planner=`: which code made the decisions: native (the C++ core, experts/policy.py `native_core`) or
python (EXPERTCACHE_PLANNER=python, or a policy the core does not run, e.g. static).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from common import hardware_line

from expertcache.cost.model import ExpertCost, default_profile
from expertcache.experts.planner import PlannerConfig, StepPlanner
from expertcache.experts.policy import DEFAULT_POLICY, ONLINE

# name -> (experts, top_k, hidden, expert intermediate width)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "gpt-oss-20b": (32, 4, 2880, 2880)}
LAYERS = 48


def shape_cost(E: int, K: int, H: int, inter: int) -> ExpertCost:
    """bf16 experts of the shape under the default CUDA profile (cost.model.DEFAULT_PROFILE)."""
    params = 3 * H * inter
    return ExpertCost(default_profile("cuda"), 2 * params, params)


def planner_rounds(shape: str, policies: list[str], steps: int, reps: int, seed: int = 0) -> dict:
    E, K, H, inter = SHAPES[shape]
    cost = shape_cost(E, K, H, inter)
    rng = np.random.default_rng(seed)
    total = 8 + steps * reps
    routes = [[rng.choice(E, K, replace=False).tolist() for _ in range(LAYERS)] for _ in range(total)]
    preds = [[rng.choice(E, K, replace=False).tolist() for _ in range(LAYERS)] for _ in range(total)]
    cfg = {
        p: PlannerConfig(
            num_experts=E,
            device_slots=E // 4,
            host_slots=None,
            expert_bytes=cost.expert_bytes,
            policy=p,
            cpu_compute="cost",
            prefetch="device",
        )
        for p in policies
    }
    planners = {p: StepPlanner(cfg[p], LAYERS, cpu_faster=cost.cpu_faster) for p in policies}
    ones = [1] * K
    clock = {p: 0 for p in policies}
    out: dict[str, dict[str, list[float]]] = {
        p: {"plan_step": [], "plan_prefetch": [], "end_step": []} for p in policies
    }

    def run(p: str, n: int, record: bool) -> None:
        pl, tt = planners[p], time.thread_time
        a = b = c = 0.0
        for s in range(clock[p], clock[p] + n):
            for i in range(LAYERS):
                t0 = tt()
                pl.plan_prefetch(i, preds[s][i], 1, s)
                t1 = tt()
                plan = pl.plan_step(i, routes[s][i], ones, 1, s)
                t2 = tt()
                pl.end_step(i, plan)
                t3 = tt()
                a, b, c = a + t1 - t0, b + t2 - t1, c + t3 - t2
        clock[p] += n
        if record:
            for k, v in (("plan_prefetch", a), ("plan_step", b), ("end_step", c)):
                out[p][k].append(v / (n * LAYERS) * 1e6)

    for p in policies:
        run(p, 8, False)  # warm-up: the slots fill
    for _ in range(reps):
        for p in policies:
            run(p, steps, True)
    impl = {p: pl.implementation for p, pl in planners.items()}
    return {p: {**{k: statistics.median(v) for k, v in d.items()}, "impl": impl[p]} for p, d in out.items()}


class _Counter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def checkpoint(shape: str, root: Path) -> Path:
    import checkpoints as C

    E, K, _, _ = SHAPES[shape]
    path = root / f"host-cost-{shape}"
    if not (path / "config.json").exists():
        C.make_checkpoint(
            root,
            "qwen3_moe",
            name=path.name,
            num_experts=E,
            num_experts_per_tok=K,
            num_hidden_layers=4,
            hidden_size=64,
            moe_intermediate_size=32,
        )
    return path


def engine_policy(path: Path, p: str, tokens: int, reps: int) -> dict:
    """The engine part for one policy (module doc)."""
    from expertcache import LLM, SamplingParams

    llm = LLM(str(path), device_memory="25%", cache_policy=p, max_model_len=256, kv_cache_memory="16MiB")
    cache = llm.experts
    acc = {
        "layer": 0.0,
        "planner": 0.0,
        "schedule": 0.0,
        "schedule_calls": 0,
        "ops": 0,
        "calls": 0,
        "counted": 0,
    }
    timing = {"on": False, "count": False}

    def timed(fn, key):
        def wrapper(*a, **k):
            if not timing["on"]:
                return fn(*a, **k)
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                acc[key] += time.thread_time() - t0
                acc[key + "_calls"] = acc.get(key + "_calls", 0) + 1

        return wrapper

    for m in ("plan_step", "plan_prefetch", "end_step"):
        setattr(cache.planner, m, timed(getattr(cache.planner, m), "planner"))
    builder = getattr(cache, "builder", None)
    if builder is not None and hasattr(builder, "layer"):
        builder.layer = timed(builder.layer, "schedule")
    forward = cache.forward

    def counted(layer, x, ids, weights):
        if x.shape[0] != 1:  # prefill: not counted
            return forward(layer, x, ids, weights)
        if timing["count"]:  # a round of its own: the counter's Python slows every op it sees
            counter = _Counter()
            with counter:
                y = forward(layer, x, ids, weights)
            acc["ops"] += counter.n
            acc["counted"] += 1
            return y
        timing["on"] = True
        t0 = time.thread_time()
        try:
            return forward(layer, x, ids, weights)
        finally:
            acc["layer"] += time.thread_time() - t0
            timing["on"] = False
            acc["calls"] += 1

    cache.forward = counted
    params = SamplingParams(max_tokens=tokens, temperature=0)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    for k in acc:
        acc[k] = 0
    for r in range(reps):
        llm.generate([[5 + r, 6, 7, 8]], params)
    timing["count"] = True
    llm.generate([[5, 6, 7, 8]], params)
    n = max(acc["calls"], 1)
    sched = acc["schedule"] / n * 1e6 if acc["schedule_calls"] else float("nan")  # nan: no schedule built
    r = {
        "layer_us": acc["layer"] / n * 1e6,
        "planner_us": acc["planner"] / n * 1e6,
        "schedule_us": sched,
        "aten_ops": acc["ops"] / max(acc["counted"], 1),
        "calls": acc["calls"],
        "impl": cache.planner.implementation,
    }
    r["rest_us"] = r["layer_us"] - r["planner_us"] - (sched if acc["schedule_calls"] else 0.0)
    llm.close()
    return r


def engine_rounds(shape: str, policies: list[str], tokens: int, reps: int, root: Path) -> dict:
    path = checkpoint(shape, root)
    return {p: engine_policy(path, p, tokens, reps) for p in policies}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24, help="planner: decode steps per round")
    ap.add_argument("--reps", type=int, default=5, help="alternating rounds (median kept)")
    ap.add_argument("--tokens", type=int, default=24, help="engine: tokens decoded per round")
    ap.add_argument("--policies", default="default," + ",".join(ONLINE))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-engine", action="store_true", help="the planner part only")
    ap.add_argument("--dir", default=None, help="where the tiny checkpoints go (default: a temporary folder)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print(hardware_line())
    names = list(dict.fromkeys(DEFAULT_POLICY if p == "default" else p for p in a.policies.split(",")))
    for p in names:
        if p not in ONLINE:
            raise SystemExit(f"--policies: {p!r} is not an online policy ({', '.join(ONLINE)})")
    for shape in a.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown {shape!r}; known: {', '.join(SHAPES)}")
        for p, r in planner_rounds(shape, names, a.steps, a.reps).items():
            impl = r.pop("impl")
            tot = sum(r.values())
            print(
                f"host_cost part=planner shape={shape} policy={p} default={int(p == DEFAULT_POLICY)} planner={impl} "
                f"plan_step_us={r['plan_step']:.1f} plan_prefetch_us={r['plan_prefetch']:.1f} "
                f"end_step_us={r['end_step']:.1f} planner_us={tot:.1f}",
                flush=True,
            )
    if a.no_engine:
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.dir) if a.dir else Path(tmp)
        for shape in a.shapes.split(","):
            for p, r in engine_rounds(shape, names, a.tokens, a.reps, root).items():
                print(
                    f"host_cost part=engine shape={shape} policy={p} default={int(p == DEFAULT_POLICY)} "
                    f"planner={r['impl']} "
                    f"layer_us={r['layer_us']:.1f} planner_us={r['planner_us']:.1f} "
                    f"schedule_us={r['schedule_us']:.1f} rest_us={r['rest_us']:.1f} "
                    f"aten_ops={r['aten_ops']:.1f} calls={r['calls']}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
