"""`expertcache trace ...` subcommands. The main CLI calls
`add_trace_subcommands(subparsers)` and then `args.func(args)` (returns an exit code).

    trace replay TRACE (--capacity K[,K..] | --budget BYTES) --policy P|all
                 [--prefetch [--prefetch-waste W] [--no-prefetch-gate]] [--sweep] [--stats TRACE]
                 [--json] [--png FILE]
    trace stats TRACE [--png FILE] [--json]
    trace synth OUT --layers --experts --top-k --tokens [--seqs] --zipf --reuse [--shift-every] [--seed]
    trace import JSONL OUT.npz --num-experts E [--model NAME] [--expert-bytes BYTES]
    trace export TRACE OUT.jsonl
    trace simulate TRACE --capacity K --profile NAME|FILE.toml[:NAME] [--policy P] [--schedule]
                   [--model-config config.json] [--prefetch] [--no-cpu-compute] [--from-disk] [--json]

--budget is the device budget for all MoE layers together:
capacity = budget // (expert_bytes * layers). --sweep replays capacities 1..num_experts.
--json (replay) prints a list with one object per (policy, capacity):
{policy, capacity, hit_rate, min_hit_rate, bytes_moved, per_layer, prefetch_issued, prefetch_useful}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import ConfigError
from ..experts.policy import ONLINE, POLICIES
from ..units import fmt_bytes as format_bytes
from ..units import parse_bytes
from .format import RoutingTrace, load_trace


def check_capacities(caps: list[int], num_experts: int, flag: str = "--capacity") -> list[int]:
    bad = [c for c in caps if not 1 <= c <= num_experts]
    if bad:
        raise ConfigError(
            f"{flag} {bad[0]}: slots per layer must be between 1 and {num_experts} "
            f"(the trace's experts per layer)"
        )
    return caps


def _capacities(args, trace: RoutingTrace) -> list[int]:
    if args.sweep:
        return list(range(1, trace.num_experts + 1))
    if args.budget is not None:
        if not trace.expert_bytes:
            raise ValueError("--budget: the trace has no expert_bytes; use --capacity")
        cap = parse_bytes(args.budget) // (trace.expert_bytes * trace.num_layers)
        if cap < 1:
            raise ValueError(
                f"--budget: {args.budget} holds no expert per layer "
                f"({format_bytes(trace.expert_bytes)} each, {trace.num_layers} layers)"
            )
        return [int(cap)]
    if args.capacity is None:
        raise ValueError("replay: give --capacity, --budget or --sweep")
    try:
        caps = [int(x) for x in str(args.capacity).split(",")]
    except ValueError:
        raise ValueError(
            f"--capacity: expected integers separated by commas, got {args.capacity!r}"
        ) from None
    return check_capacities(caps, trace.num_experts)


def _cmd_replay(args) -> int:
    from .replay import sweep
    from .stats import use_counts

    trace = load_trace(args.trace, "trace")
    policies = list(ONLINE) if args.policy == "all" else args.policy.split(",")
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"--policy: unknown {p!r}; choose from {sorted(POLICIES)} or all")
    stats = use_counts(load_trace(args.stats, "--stats")) if args.stats else None
    results = sweep(
        trace,
        policies,
        _capacities(args, trace),
        prefetch=args.prefetch,
        stats=stats,
        prefetch_gate=None if args.no_prefetch_gate else 0.0,
        prefetch_waste=args.prefetch_waste,
    )
    if args.json:
        keys = (
            "policy",
            "capacity",
            "hit_rate",
            "min_hit_rate",
            "bytes_moved",
            "per_layer",
            "prefetch_issued",
            "prefetch_useful",
        )
        print(json.dumps([{k: getattr(r, k) for k in keys} for r in results], indent=1))
    else:
        print(f"{'policy':<12}{'slots':>6}{'hit':>8}{'MIN':>8}{'of MIN':>8}{'moved':>12}")
        for r in results:
            print(
                f"{r.policy:<12}{r.capacity:>6}{r.hit_rate:>8.3f}{r.min_hit_rate:>8.3f}"
                f"{r.hit_rate / max(r.min_hit_rate, 1e-12):>8.3f}{format_bytes(r.bytes_moved):>12}"
            )
    if args.png:
        from .stats import plot_sweep

        plot_sweep(
            results,
            args.png,
            title=f"{Path(args.trace).name}: model {trace.model or '?'}, top-{trace.top_k} "
            f"of {trace.num_experts} experts, {trace.num_layers} MoE layers"
            + (", prefetch" if args.prefetch else ""),
        )
        print(f"wrote the hit-rate plot to {args.png}", file=sys.stderr)
    return 0


def _cmd_stats(args) -> int:
    from .stats import plot_heatmap, summary

    trace = load_trace(args.trace, "trace")
    s = summary(trace)
    if args.json:
        print(json.dumps(s, default=str))
    else:
        for k, v in s.items():
            print(f"{k}: {v}")
    if args.png:
        plot_heatmap(
            trace,
            args.png,
            title=f"{Path(args.trace).name}: expert use, model {trace.model or '?'}, "
            f"top-{trace.top_k}, {len(trace)} tokens",
        )
        print(f"wrote the heatmap to {args.png}", file=sys.stderr)
    return 0


def _cmd_synth(args) -> int:
    from .synthetic import synth_trace

    zipf = [float(z) for z in args.zipf.split(",")]
    t = synth_trace(
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        tokens=args.tokens,
        seqs=args.seqs,
        zipf=zipf if len(zipf) > 1 else zipf[0],
        reuse=args.reuse,
        shift_every=args.shift_every,
        seed=args.seed,
        expert_bytes=parse_bytes(args.expert_bytes),
    )
    t.save(args.out)
    print(f"wrote {args.out}: {len(t)} rows x {t.num_layers} layers x top-{t.top_k}")
    return 0


def _cmd_import(args) -> int:
    t = RoutingTrace.from_jsonl(
        args.jsonl,
        num_experts=args.num_experts,
        model=args.model,
        expert_bytes=parse_bytes(args.expert_bytes),
        num_layers=args.layers,
    )
    t.save(args.out)
    print(f"wrote {args.out}: {len(t)} rows x {t.num_layers} layers")
    return 0


def _cmd_export(args) -> int:
    load_trace(args.trace, "trace").to_jsonl(args.out)
    return 0


def _cmd_simulate(args) -> int:
    from ..cost.profiles import get_profile
    from .replay import replay
    from .simulate import ModelShape, simulate

    trace = load_trace(args.trace, "trace")
    check_capacities([args.capacity], trace.num_experts)
    prof = get_profile(args.profile)
    if args.model_config:
        shape = ModelShape.from_config(args.model_config)
    else:
        if not trace.expert_bytes:
            raise ValueError("simulate: the trace has no expert_bytes; pass --model-config")
        shape = ModelShape(expert_params=trace.expert_bytes // 2, dense_params=0)
        print("note: no --model-config, dense compute ignored", file=sys.stderr)
    if args.schedule:
        return _print_schedule(args, trace, shape, prof)
    res = replay(trace, args.policy, args.capacity, prefetch=args.prefetch, with_min=False)
    pred = simulate(res, shape, prof, cpu_compute=not args.no_cpu_compute, from_disk=args.from_disk)
    if args.json:
        print(json.dumps({"profile": prof.name, "hit_rate": res.hit_rate, **pred.to_dict()}))
    else:
        print(f"{prof.name}: {pred.tok_s:.1f} tok/s (hit rate {res.hit_rate:.3f})")
        for k, v in pred.to_dict().items():
            print(f"  {k}: {v:.6g}" if isinstance(v, float) else f"  {k}: {v}")
    return 0


def _print_schedule(args, trace, shape, prof) -> int:
    """`simulate --schedule`: the schedule model (copies, device MoE, the CPU job and prefetch on their
    own queues, as the CUDA executor runs them) instead of the first-order sum."""
    from .simulate import simulate_schedule

    if args.from_disk:
        raise ValueError(
            "simulate --schedule: the schedule model keeps every expert in host RAM; drop --from-disk"
        )
    if not args.model_config:
        raise ValueError(
            "simulate --schedule: pass --model-config (the schedule model needs the hidden size)"
        )
    hidden = json.loads(Path(args.model_config).read_text()).get("hidden_size")
    if not isinstance(hidden, int):
        raise ValueError(f"simulate --schedule: {args.model_config} has no integer hidden_size")
    pred = simulate_schedule(
        trace,
        shape,
        prof,
        args.policy,
        args.capacity,
        hidden,
        cpu_compute=not args.no_cpu_compute,
        prefetch=args.prefetch,
    )
    out = {
        "profile": prof.name,
        "tok_s": pred.tok_s,
        "decode_s": pred.decode_s,
        "decode_rows": pred.decode_rows,
        "misses_on_cpu": pred.misses_on_cpu,
        "misses_admitted": pred.misses_admitted,
        "critical": pred.critical,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{prof.name}: {pred.tok_s:.1f} tok/s (schedule model)")
        for k, v in out.items():
            if k not in ("profile", "tok_s"):
                print(f"  {k}: {v:.6g}" if isinstance(v, float) else f"  {k}: {v}")
    return 0


def _wrap(fn):
    def run(args) -> int:
        try:
            return fn(args)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2

    return run


def add_trace_subcommands(subparsers) -> argparse.ArgumentParser:
    tp = subparsers.add_parser("trace", help="record, inspect, replay and simulate routing traces")
    sub = tp.add_subparsers(dest="trace_cmd", required=True)
    for add in (_add_replay, _add_stats, _add_synth, _add_import, _add_export, _add_simulate):
        add(sub)
    return tp


def _add_replay(sub) -> None:
    p = sub.add_parser("replay", help="hit rates of cache policies on a trace (vs. MIN)")
    p.add_argument("trace")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--capacity", help="slots per layer, e.g. 4 or 3,4,6")
    g.add_argument("--budget", help="device bytes for all layers, e.g. 512MiB")
    g.add_argument("--sweep", action="store_true", help="capacities 1..num_experts")
    p.add_argument("--policy", default="lru", help=f"one of {sorted(POLICIES)}, comma list, or all")
    p.add_argument("--prefetch", action="store_true", help="insert lookahead experts before each layer")
    p.add_argument(
        "--prefetch-waste",
        type=float,
        default=1.0,
        help="the prefetch gate's price of an unused read: 1.0 as the engine on CPU, 0.25 as with CUDA",
    )
    p.add_argument("--no-prefetch-gate", action="store_true", help="prefetch on every step (no gate)")
    p.add_argument("--stats", help="trace whose use counts feed the static policy")
    p.add_argument("--json", action="store_true")
    p.add_argument("--png", help="plot hit rate vs capacity")
    p.set_defaults(func=_wrap(_cmd_replay))


def _add_stats(sub) -> None:
    p = sub.add_parser("stats", help="use heatmap, reuse distance, token-to-token reuse")
    p.add_argument("trace")
    p.add_argument("--png", help="write the layer x expert heatmap")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_wrap(_cmd_stats))


def _add_synth(sub) -> None:
    p = sub.add_parser("synth", help="write a synthetic trace")
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--seqs", type=int, default=1)
    p.add_argument("--zipf", default="1.0", help="skew, one value or one per layer (comma list)")
    p.add_argument("--reuse", type=float, default=0.3, help="P(token keeps each previous expert)")
    p.add_argument("--shift-every", type=int, default=0, help="re-draw the hot set every M tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expert-bytes", default="1MiB")
    p.set_defaults(func=_wrap(_cmd_synth))


def _add_import(sub) -> None:
    p = sub.add_parser("import", help="JSONL -> .npz")
    p.add_argument("jsonl")
    p.add_argument("out")
    p.add_argument("--num-experts", type=int, required=True)
    p.add_argument("--layers", type=int, help="expected MoE layer count (checked)")
    p.add_argument("--model", default="")
    p.add_argument("--expert-bytes", default="0")
    p.set_defaults(func=_wrap(_cmd_import))


def _add_export(sub) -> None:
    p = sub.add_parser("export", help=".npz -> JSONL")
    p.add_argument("trace")
    p.add_argument("out")
    p.set_defaults(func=_wrap(_cmd_export))


def _add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="predicted decode tok/s on a hardware profile")
    p.add_argument("trace")
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--profile", required=True, help="built-in name or FILE.toml[:NAME]")
    p.add_argument("--policy", default="adaptive")
    p.add_argument("--model-config", help="config.json of the model (for dense compute)")
    p.add_argument("--prefetch", action="store_true")
    p.add_argument("--no-cpu-compute", action="store_true")
    p.add_argument("--from-disk", action="store_true", help="experts not held in host RAM")
    p.add_argument(
        "--schedule",
        action="store_true",
        help="the schedule model (copies, device MoE, the CPU job, prefetch overlapping as the CUDA "
        "executor runs them; needs a GPU profile and --model-config)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_wrap(_cmd_simulate))


def main(argv=None) -> int:
    """Standalone entry: `python -m expertcache.trace.cli trace replay ...`."""
    ap = argparse.ArgumentParser(prog="expertcache")
    add_trace_subcommands(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
