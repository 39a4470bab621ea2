"""`expertcache plan MODEL_DIR`: will this model run under these budgets, and how fast?

Reads config.json and the safetensors headers only (never a weight byte) and prints, in
about a second: sizes by kind, the engine's own memory plan per tier (plan/model.py), whether
it fits, room for the KV cache and a predicted decode tok/s band (plan/speed.py).

    expertcache plan MODEL_DIR --device-memory 8GiB [--host-memory 32GiB] [--device cuda|cpu]
                     [--gpu rtx4060-8gb] [--max-model-len N] [--max-num-seqs N]
                     [--max-num-batched-tokens N] [--kv-cache-memory SIZE] [--dense int8] [--lm-head int8]
                     [--low-memory] [--profile NAME|FILE.toml[:NAME]|this-cpu] [--trace TRACE.npz]
                     [--policy adaptive] [--json]

On cuda, --device-memory SIZE is everything the engine takes on the GPU (build/plan.py: dense
weights, KV cache, activations, logits, expert slots, staging, CUDA context, allocator slack); the
card comes from --gpu NAME (a card profile), else the visible GPU, else DEFAULT_CARD.

Exit codes: 0 fits, 1 a budget cannot hold top_k experts per layer (the engine's
BudgetError text), 2 bad input (unsupported architecture, bad config, trace not of this model).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..cost.model import DEFAULT_PROFILE
from ..errors import BudgetError
from ..units import fmt_bytes

DEFAULT_CARD = "rtx4090-24gb"  # a cuda plan with neither --gpu nor a visible GPU


def add_plan_subcommand(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="memory plan and predicted decode speed, from headers only")
    for add in (_add_model_and_budgets, _add_engine_shape, _add_speed_and_output):  # in --help's order
        add(p)
    p.set_defaults(func=cmd_plan)
    return p


def _add_model_and_budgets(p) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model directory, hub id found in the Hugging Face cache (plan never downloads), or "
        "hub-cache folder (default: the built-in demo model)",
    )
    p.add_argument("--revision", default=None, help="hub id only: branch, tag or commit (default: main)")
    p.add_argument(
        "--device-memory",
        default="auto",
        help="cuda: everything the engine takes on the GPU, e.g. 8GiB; cpu: the experts' fastest tier; "
        "25%%: that share of the experts in the fastest tier (default: auto, as the engine computes it)",
    )
    p.add_argument("--host-memory", default="auto", help="expert budget in host RAM (default: auto)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu); cuda plans need no GPU here")
    p.add_argument("--dtype", default=None, help="compute dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument(
        "--gpu",
        default=None,
        metavar="CARD",
        help="card profile for a cuda plan without that GPU (rtx4060-8gb, rtx3060-12gb, rtx4090-24gb, "
        f"a100-80gb, h200-141gb; default: the visible GPU, else {DEFAULT_CARD}); also the speed "
        "band's profile unless --profile is given",
    )


def _add_engine_shape(p) -> None:
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="as for generate/serve (default: the model's, at most 4096)",
    )
    p.add_argument("--max-num-seqs", type=int, default=16, help="as for generate/serve (default: 16)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="as for generate/serve (default: 2048)"
    )
    p.add_argument("--kv-cache-memory", default="auto", help="as for generate/serve (default: auto)")
    p.add_argument("--dense", default=None, help="as for generate/serve: dense projections' load-time format")
    p.add_argument("--lm-head", default=None, help="as for generate/serve: lm_head's load-time format")
    p.add_argument(
        "--low-memory",
        action="store_true",
        help="as for generate/serve (cpu): the checkpoint's format in RAM, no embedding table, "
        "--host-memory 0 allowed",
    )


def _add_speed_and_output(p) -> None:
    p.add_argument(
        "--profile",
        default=None,
        help="hardware profile: built-in name, FILE.toml[:NAME], or this-cpu (measured now, ~2 s); "
        f"default {DEFAULT_PROFILE['cpu']} for cpu, {DEFAULT_PROFILE['cuda']} for cuda",
    )
    p.add_argument(
        "--trace", default=None, help="routing trace (.npz, e.g. from --record-routing) for the speed band"
    )
    p.add_argument("--policy", default="adaptive", help="cache policy for the high end of the band")
    p.add_argument("--json", action="store_true", help="one JSON object with stable keys")
    p.add_argument(
        "--png",
        default=None,
        metavar="FILE",
        help="also draw the plan: tiers as stacked bars against their budgets (needs matplotlib)",
    )


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        report = build_report(args)  # a BudgetError is recorded in the report, not raised
    except ValueError as e:  # ConfigError, CheckpointError, bad trace or profile
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else "\n".join(text_lines(report)))
    if args.png and report["plan"]["fits"]:
        from .picture import plot_plan

        plot_plan(report, args.png)
        print(f"wrote the memory plan picture to {args.png}", file=sys.stderr)
    if not report["plan"]["fits"]:
        if args.json:
            print(f"error: {report['plan']['error']}", file=sys.stderr)
        return 1
    return 0


def _profile(spec: str | None, device: str, model_dir):
    """(Profile, how it was chosen): cost.measure.resolve_profile, the engine's own resolution."""
    from ..cost.measure import resolve_profile

    prof, how = resolve_profile(spec, device, model_dir)
    return prof, how.replace("device ", "--device ")


def build_report(args: argparse.Namespace) -> dict:
    """Everything `plan` prints, as a JSON-ready dict (keys documented by tests/build/test_plan.py)."""
    from ..engine.kv_cache import default_max_model_len
    from .model import device_plan, model_sizes, read_model

    model_dir = _model_dir(args)
    config = engine_config(args)
    dev = config.load.torch_device
    info = read_model(model_dir)
    cfg, sizes = info.cfg, model_sizes(info, config)
    report = _sizes_report(info, config, sizes)
    mml = args.max_model_len or default_max_model_len(cfg.max_position_embeddings)
    gpu = _card(args.gpu, dev) if dev.type == "cuda" else None
    try:
        dp = device_plan(info, config, gpu)
    except BudgetError as e:
        report["plan"]["error"] = str(e)
        return report
    mp = dp.experts
    report["device_plan"] = {
        "card": None if gpu is None else gpu.name,
        "card_bytes": None if gpu is None else gpu.total,
        "max_model_len": mml,
        "budget": dp.budget,
        "terms": dict(dp.terms),
        "total": dp.total,
    }
    free = max(0, (dp.budget - dp.total) if dp.budget is not None else mp.device.budget - mp.device_used)
    report["plan"].update(
        fits=True,
        resident=mp.resident,
        device_slots=mp.device.slots,
        host_slots=None if mp.host is None else mp.host.slots,
        device_budget=mp.device.budget,
        host_budget=None if mp.host is None else mp.host.budget,
        device_used=mp.device_used,
        host_used=mp.host_used,
        staging=mp.staging,
        lines=dp.lines,
    )
    report["kv"].update(device_free=free, tokens_in_device_free=free // sizes.kv_per_token)
    report["speed"] = _speed(args, info, sizes, mp, dev.type, model_dir)
    return report


def _model_dir(args: argparse.Namespace):
    """The model argument resolved without downloading (the demo model when none is given)."""
    if args.model is None:
        from ..demo import demo_model_dir

        return demo_model_dir(progress=False)
    from ..hub import resolve_model

    return resolve_model(args.model, args.revision, download=False)


def _sizes_report(info, config, sizes) -> dict:
    """The report's keys, with what the checkpoint's headers alone give filled in (the plan's not yet)."""
    cfg = info.cfg
    return {
        "model": {
            "dir": str(info.model_dir),
            "dir_bytes": info.dir_bytes,
            "architecture": (info.hf.get("architectures") or ["?"])[0],
            "layers": cfg.num_layers,
            "moe_layers": len(info.source.layers),
            "num_experts": cfg.num_experts,
            "top_k": cfg.top_k,
        },
        "device": config.load.torch_device.type,
        "dtype": str(config.load.torch_dtype).removeprefix("torch."),
        "bytes": {
            "dense_stored": sizes.dense_stored,
            "dense_compute": sizes.dense_compute,
            "experts_stored": sizes.experts_stored,
            "expert_stored": sizes.expert_stored,
            "expert_fast": sizes.expert_fast,
            "stored_format": sizes.stored_dtype,
            "fast_format": sizes.fast_format,
        },
        "plan": {
            "fits": False,
            "error": None,
            **dict.fromkeys(("resident", "device_slots", "host_slots", "device_budget", "host_budget")),
            **dict.fromkeys(("device_used", "host_used", "staging")),
            "lines": [],
        },
        "device_plan": None,
        "kv": {
            "bytes_per_token": sizes.kv_per_token,
            "device_free": None,
            "tokens_in_device_free": None,
            "state_bytes_per_sequence": sizes.state_per_sequence,
            **_auto_kv(cfg, sizes.kv_per_token),
        },
        "speed": None,
    }


PLAN_FLAGS = (
    "device",
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory",
    "low_memory",
    "dense",
    "lm_head",
    "device_memory",
    "host_memory",
)  # EngineConfig keywords


def engine_config(args: argparse.Namespace):
    """The engine's own EngineConfig from the flags `plan` shares with generate/serve (config.py checks them)."""
    from ..config import EngineConfig

    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ValueError(f"--{name.replace('_', '-')}: an integer >= 1, got {v}")
    return EngineConfig.from_kwargs(**{name: getattr(args, name) for name in PLAN_FLAGS})


def _card(name: str | None, dev):
    """The GpuSpec of a cuda plan: --gpu's card profile, else the visible GPU, else DEFAULT_CARD."""
    import torch

    from ..build.plan import GpuSpec
    from ..cost.profiles import get_profile

    if name is None and torch.cuda.is_available():
        return GpuSpec.from_device(dev)
    return GpuSpec.from_profile(get_profile(name or DEFAULT_CARD))


def _auto_kv(cfg, kv_per_token: int, max_num_seqs: int = 16, block_size: int = 16) -> dict:
    """The KV cache `generate`/`serve` allocate with --kv-cache-memory auto and their default lengths."""
    from ..engine.kv_cache import auto_kv_blocks, default_max_model_len

    mml = default_max_model_len(cfg.max_position_embeddings)
    blocks = auto_kv_blocks(mml, max_num_seqs, max(1, kv_per_token * block_size), block_size)
    return {
        "auto_max_model_len": mml,
        "auto_max_num_seqs": max_num_seqs,
        "auto_tokens": blocks * block_size,
        "auto_bytes": blocks * block_size * kv_per_token,
    }


def _speed(args, info, sizes, mp, device: str, model_dir) -> dict:
    """The predicted decode tok/s band of plan `mp` (see plan/speed.py)."""
    from ..trace.format import load_trace
    from ..trace.simulate import ModelShape
    from .speed import SYNTH_HIGH, SYNTH_LOW, speed_band

    prof, how = _profile(args.profile or (args.gpu if device == "cuda" else None), device, model_dir)
    trace = load_trace(args.trace, "--trace") if args.trace else None
    cfg = info.cfg
    shape = ModelShape.from_config(info.hf, bytes_per_param=sizes.expert_fast / sizes.expert_params)
    from_disk = mp.host is not None and mp.host.slots < cfg.num_experts
    sb = speed_band(
        shape,
        prof,
        mp.device.slots,
        sizes.expert_fast,
        mp.resident,
        from_disk,
        list(info.source.layers),
        cfg.num_experts,
        cfg.top_k,
        args.policy,
        trace,
        args.trace or "",
    )

    schedule = None
    if device == "cuda" and not mp.resident:  # the executor's overlap of copies, device MoE and the CPU job
        schedule = _schedule_speeds(shape, prof, mp, info, args.policy, trace)
    return {
        "profile": prof.name,
        "profile_source": how,
        "step_overhead_ms": prof.step_overhead_ms,
        "layer_overhead_ms": prof.layer_overhead_ms,
        "source": sb.source,
        "synthetic": None if trace is not None else {"low": SYNTH_LOW, "high": SYNTH_HIGH},
        "from_disk": from_disk,
        "low": _estimate(sb.low),
        "high": _estimate(sb.high),
        "band_tok_s": [round(x, 2) for x in sb.band],
        "schedule": schedule,
    }


def _estimate(e) -> dict:
    return {
        "policy": e.policy,
        "prefetch": e.prefetch,
        "hit_rate": round(e.hit_rate, 4),
        "tok_s": round(e.tok_s, 2),
    }


def _schedule_speeds(shape, prof, mp, info, policy: str, trace) -> list[dict]:
    """The schedule model's decode tok/s with and without CPU compute and prefetch (a CUDA plan)."""
    from .speed import schedule_estimates

    cfg = info.cfg
    got = schedule_estimates(
        shape,
        prof,
        mp.device.slots,
        list(info.source.layers),
        cfg.num_experts,
        cfg.top_k,
        cfg.hidden_size,
        policy,
        trace,
    )
    return [{"cpu_compute": cpu, "prefetch": pf, "tok_s": round(v, 2)} for (cpu, pf), v in got.items()]


def text_lines(r: dict) -> list[str]:
    """The human-readable report."""
    m, b, p, kv = r["model"], r["bytes"], r["plan"], r["kv"]
    out = [
        f"model: {m['dir']} ({m['architecture']}, {fmt_bytes(m['dir_bytes'])} on disk)",
        (
            f"bytes: dense {fmt_bytes(b['dense_stored'])} stored, {fmt_bytes(b['dense_compute'])} as held "
            f"({r['dtype']}: the device plan's dense term); routed experts {fmt_bytes(b['experts_stored'])} "
            f"({m['moe_layers']} MoE layers x {m['num_experts']} experts, top_k {m['top_k']})"
        ),
        (
            f"one expert: {fmt_bytes(b['expert_stored'])} stored ({b['stored_format']}), "
            f"{fmt_bytes(b['expert_fast'])} in the fastest tier ({b['fast_format']})"
        ),
        f"memory plan (--device {r['device']}, the engine's own arithmetic):",
    ]
    if not p["fits"]:
        return out + [f"  does not fit: {p['error']}"]
    out += [f"  {line}" for line in p["lines"]]
    top = f"{p['device_slots']} of {m['num_experts']} experts per layer in the fastest tier (top_k {m['top_k']})"
    rest = (
        "every expert resident"
        if p["resident"]
        else "host RAM holds every expert"
        if p["host_slots"] >= m["num_experts"]
        else f"host RAM holds {p['host_slots']}/layer, the rest is read from disk on a miss"
    )
    out.append(f"fits: yes, {top}; {rest}")
    if r["device"] == "cuda":
        d = r["device_plan"]
        out.append(
            f"GPU memory: {fmt_bytes(d['total'])} of the {fmt_bytes(d['card_bytes'])} on {d['card']}"
            + (f", within --device-memory {fmt_bytes(d['budget'])}" if d["budget"] is not None else "")
            + f" (every term in the device memory line above; KV cache for {d['max_model_len']} tokens "
            "per sequence)" + ("" if p["resident"] else f"; host tier {fmt_bytes(p['host_used'])} in RAM")
        )
        return out + _speed_lines(r)
    dense = r["device_plan"]["terms"]["dense"]  # as the engine holds them (--low-memory: no embedding table)
    tier_total = dense + p["device_used"]
    out.append(
        f"RAM for weights: dense {fmt_bytes(dense)} + experts {fmt_bytes(p['device_used'])}"
        f" = {fmt_bytes(tier_total)}"
        + ("" if p["resident"] else f" (+ host tier {fmt_bytes(p['host_used'])})")
    )
    out.append(
        f"KV cache: {fmt_bytes(kv['bytes_per_token'])}/token; --kv-cache-memory auto (generate/serve "
        f"defaults: {kv['auto_max_num_seqs']} sequences x {kv['auto_max_model_len']} tokens, at most 1 GiB) "
        f"= {fmt_bytes(kv['auto_bytes'])} for {kv['auto_tokens']:,} tokens, besides the budgets above; the "
        f"unused {fmt_bytes(kv['device_free'])} of the device budget would hold "
        f"{kv['tokens_in_device_free']:,} tokens"
    )
    if kv["state_bytes_per_sequence"]:
        out.append(
            f"linear-attention state: {fmt_bytes(kv['state_bytes_per_sequence'])}/sequence at any context "
            "length (the engine holds max_num_seqs + 1 of them)"
        )
    return out + _speed_lines(r)


def _speed_lines(r: dict) -> list[str]:
    out = []
    s = r["speed"]
    lo, hi = s["band_tok_s"]
    out.append(
        f"decode speed, 1 sequence: {lo:.1f} - {hi:.1f} tok/s on profile {s['profile']} ({s['profile_source']})"
    )
    out.append(f"  from {s['source']}")
    for name in ("low", "high"):
        e = s[name]
        out.append(
            f"  {name}: {e['policy']}{' + prefetch' if e['prefetch'] else ''}, hit rate {e['hit_rate']:.2f}, "
            f"{e['tok_s']:.1f} tok/s"
        )
    if s["from_disk"]:
        out.append("  misses are costed as disk reads (the host tier does not hold every expert)")
    if not (s["step_overhead_ms"] or s["layer_overhead_ms"]):
        out.append(
            "  no fixed per-step cost in this profile (step_overhead_ms = 0): optimistic where dispatch "
            "overhead dominates, i.e. small models on CPU (bench/simulate_validate.py measures it)"
        )
    else:
        out.append(
            f"  includes a dispatch cost of {s['layer_overhead_ms']} ms per MoE layer per step "
            f"(+ {s['step_overhead_ms']} ms per step); first-order model (bench/simulate_validate.py "
            "checks it, docs/results.md)"
        )
    if s.get("schedule"):
        out.append(
            "  the schedule model (copies, device MoE and the CPU job overlapping as the executor runs them; "
            "every expert in host RAM, no disk reads): "
            + "; ".join(
                f"{e['tok_s']:.1f} tok/s with CPU compute of misses {'on' if e['cpu_compute'] else 'off'}"
                f", prefetch {'on' if e['prefetch'] else 'off'}"
                for e in s["schedule"]
            )
        )
    return out
