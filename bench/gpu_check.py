"""The prepared device check: run it once on a machine with a CUDA GPU, after `make setup` (no test extras).

    python bench/gpu_check.py [--quick] [--out DIR] [--skip-tests] [--tokens 32] [--prompt 128]
    python bench/gpu_check.py --device cpu      # the dry run CI runs: toy sizes, every line, no GPU

1. the `gpu`-marked tests (tests/test_gpu.py and the families' CUDA parity) and the Triton MoE tests
   compiled for the device (the interpreter off) when pytest is importable (else a line says so);
2. a random checkpoint of Qwen3-30B-A3B's shape ratios written with safetensors alone (bench/gpu_check_model.py:
   12 layers x 64 experts of 9.4 MB, 7.2 GB of experts), VRAM capped with
   torch.cuda.set_per_process_memory_fraction at dense + KV + the cached share of experts (`--share`,
   25%: the experts are 4x their VRAM) + the staging expert + 1 GiB (about 3.6 GB, half the experts);
   then, each configuration in its own process (a failure is a line, not the end), prefill and decode
   tok/s at batch 1:
     resident         every expert in VRAM, no cap
     default          the default cache: `--share` of the experts in VRAM, every expert in pinned RAM
     sync-lru         LRU, no prefetch, no CPU compute, one synchronous read + blocking copy per miss
                      (overlap_io off; the host tier one slot per layer short of every expert, so each
                      fill waits for its copy); every miss admitted: vLLM PR #37190's first mode
     cpu-moe          every expert computed on the CPU from RAM, attention on the GPU (llama.cpp --cpu-moe):
                      prefetch off, top_k device slots per layer (the least the plan allows), cpu_compute always
     cpu-compute-off  the default with CPU compute of misses off (every miss copied to the device)
     torch-moe        the default with the torch MoE code instead of the fused Triton kernel
                      (`moe_kernel="torch"`; the default picks Triton on CUDA where it reads the format)
   The cached configurations are driven twice: by recorded routing (the trained demo model's routing of
   its held-out text, replayed through the engine's route_override: hit rates of real text) and by
   uniform random routing (the worst case). Each line also gives the counters (hit rate, share of misses
   computed on the CPU, waves, prefetch issued/useful) and host syncs per decode step (torch's
   sync-debug warnings plus CUDA event synchronize calls, counted over the decode steps only).
3. ratios: default over each baseline, per routing.

Lines: `gpu_check config=NAME routing=R key=value ...` (an `error="..."` line when a configuration fails).
`--quick`: tests/test_gpu.py and the Triton tests only, 6 layers, 16 tokens, recorded routing only, no
cpu-compute-off or torch-moe (sized for about 2 minutes; not yet timed).
Nothing here has run on a GPU yet: the first run on a lent machine is its test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_model as M  # noqa: E402
from common import hardware_line, timed_generate  # noqa: E402

CACHED = ("default", "sync-lru", "cpu-moe", "cpu-compute-off", "torch-moe")
CONFIGS = ("resident", *CACHED)
LINE = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
MARGIN = 256 << 20  # above the engine's device plan (which counts activations, context and slack)


def parse_line(line: str) -> dict | None:
    """A `gpu_check config=...` line -> {key: value} (numbers as float, quoted strings unquoted)."""
    if not line.startswith("gpu_check config="):
        return None
    out = {}
    for k, v in LINE.findall(line):
        if v.startswith('"'):
            out[k] = json.loads(v)
        else:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out


def options(name: str, share: float, ctx) -> dict:
    """The LLM keywords of configuration `name` (ctx: what the plan needs, from the child)."""
    cache = {"device_memory": f"{share:.0%}", "host_memory": "100%"}
    if name == "resident":
        return {}
    if name == "default":
        return cache
    if name == "cpu-compute-off":
        return {**cache, "cpu_compute": "never"}
    if name == "torch-moe":
        return {**cache, "moe_kernel": "torch"}
    if name == "sync-lru":
        E = ctx["num_experts"]
        return {**cache, "host_memory": ctx["host_slot_bytes"] * (E - 1), "cache_policy": "lru", "prefetch": "off",
                "cpu_compute": "never", "overlap_io": False, "prefill_admit_tokens": 1 << 30}
    if name == "cpu-moe":
        # top_k device slots per layer: the smallest plan there is (plan.model.budget_for_slots)
        return {**cache, "device_memory": ctx["top_k_budget"],
                "prefetch": "off", "cpu_compute": "always"}
    raise ValueError(f"unknown configuration {name!r}; choose one of {', '.join(CONFIGS)}")


# -- one configuration (child process) -----------------------------------------------------------------
class SyncCounter:
    """Host syncs: torch's sync-debug warnings (item, .cpu(), nonzero, blocking copies, stream and device
    synchronize) plus CUDA event synchronize calls, which the debug mode does not see."""

    def __init__(self):
        import warnings

        self.n = 0
        self._warnings = warnings
        self._wrap(torch.cuda.Event, "synchronize")

    def _wrap(self, owner, name):
        orig = getattr(owner, name)

        def counted(*a, **k):
            self.n += 1
            return orig(*a, **k)

        setattr(owner, name, counted)

    def count(self, fn) -> int:
        with self._warnings.catch_warnings(record=True) as caught:
            self._warnings.simplefilter("always")
            before = self.n
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return self.n - before + sum("synchroniz" in str(w.message) for w in caught)


def run_one(args) -> int:
    from expertcache import LLM, SamplingParams
    from expertcache.llm import default_dtype

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    from expertcache.build.plan import GpuSpec
    from expertcache.config import EngineConfig
    from expertcache.plan.model import budget_for_slots, device_plan, read_model

    info = read_model(args.model)
    cfg, source = info.cfg, info.source
    L, E, K = len(source.layers), cfg.num_experts, cfg.top_k
    dtype = default_dtype(device)
    # the KV cache: two sequences of max_model_len (k and v per layer), given to the engine as its budget
    kv = 2 * args.max_model_len * 2 * L * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    base = {"device": args.device, "max_model_len": args.max_model_len, "kv_cache_memory": kv}
    gpu = GpuSpec.from_device(device) if cuda else None
    ctx = {"num_experts": E, "top_k": K, "host_slot_bytes": source.stored_nbytes * L,
           "top_k_budget": budget_for_slots(info, EngineConfig.from_kwargs(**base, device_memory="auto"), K, gpu)}
    kw = options(args.one, args.share, ctx)
    experts_bytes = source.total_nbytes
    cap = 0
    if cuda and args.one != "resident":
        # the engine's own device plan for this configuration is the cap (every term counted there)
        plan = device_plan(info, EngineConfig.from_kwargs(**base, **{"host_memory": "auto", **kw}), gpu)
        cap = plan.total + MARGIN
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    head = f"gpu_check config={args.one} routing={args.routing}"
    llm = None
    try:
        llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len, kv_cache_memory=kv, **kw)
        if args.routing == "recorded":
            import numpy as np

            z = np.load(args.trace, allow_pickle=False)
            table, ahead = M.map_trace(z["experts"], z["lookahead"], E, K, L)
        else:
            table, ahead = M.random_routing(args.prompt + args.tokens, E, K, L)
        router = M.TableRouter(table, ahead, cfg.moe_layer_ids, device)
        llm.model.route_override = router
        vocab = cfg.vocab_size
        gen = torch.Generator().manual_seed(0)

        def prompt():
            return [torch.randint(1, vocab, (args.prompt,), generator=gen).tolist()]

        def generate(n):
            router.restart()
            return timed_generate(llm, prompt(), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

        generate(args.tokens)  # warm-up: kernels, caches, the host tier's first reads
        runs = [generate(args.tokens) for _ in range(args.rounds)]
        decode = statistics.median(r["decode_tok_s"] for r in runs)
        prefill = statistics.median(r["prefill_tok_s"] for r in runs)
        syncs = "n/a"
        if cuda:
            counter = SyncCounter()
            only_prefill = counter.count(lambda: generate(1))
            with_decode = counter.count(lambda: generate(1 + args.sync_steps))
            syncs = f"{(with_decode - only_prefill) / args.sync_steps:.1f}"
        s = llm.expert_stats() if kw else {}
        c = s.get("per_layer", [])
        waves = sum(x.get("waves", 0) for x in c)
        pf = s.get("prefetch", {"issued": 0, "useful": 0})
        reserved = torch.cuda.memory_reserved(device) / 2**30 if cuda else 0.0
        print(f"{head} decode_tok_s={decode:.2f} prefill_tok_s={prefill:.2f} hit_rate={s.get('hit_rate', 1.0):.3f} "
              f"cpu_computed_share={s.get('cpu_computed_share', 0.0):.3f} misses={s.get('misses', 0)} waves={waves} "
              f"prefetch_issued={pf['issued']} prefetch_useful={pf['useful']} syncs_per_decode_step={syncs} "
              f"device_slots={getattr(llm.experts, 'device_slots', E)} experts_gib={experts_bytes / 2**30:.2f} "
              f"cap_gib={cap / 2**30:.2f} reserved_gib={reserved:.2f}", flush=True)
        return 0
    except Exception as e:  # the parent reads this line; the other configurations still run
        print(f"{head} error={json.dumps(f'{type(e).__name__}: {e}'[:400])}", flush=True)
        return 1
    finally:
        if llm is not None:
            llm.close()


# -- the whole check (parent) -----------------------------------------------------------------------------
def run_tests(args) -> None:
    try:
        import pytest  # noqa: F401
    except ImportError:
        print("gpu_check tests=not-run reason=\"pytest is not installed (pip install -e '.[test]')\"", flush=True)
        return
    t = time.monotonic()
    try:
        files = ["tests/test_gpu.py"] + ([] if args.quick else ["tests/test_families.py"])
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *files], cwd=ROOT,
                            timeout=args.test_timeout).returncode
    except subprocess.TimeoutExpired:
        rc = f"timeout-{args.test_timeout}s"
    print(f"gpu_check tests=gpu-marked rc={rc} seconds={time.monotonic() - t:.0f}", flush=True)
    # the Triton MoE compiled for the device: its tests take CUDA tensors when the interpreter is off
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    t = time.monotonic()
    try:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_triton_moe.py",
                             "tests/test_triton_models.py"], cwd=ROOT, env=env, timeout=args.test_timeout).returncode
    except subprocess.TimeoutExpired:
        rc = f"timeout-{args.test_timeout}s"
    print(f"gpu_check tests=triton-compiled rc={rc} seconds={time.monotonic() - t:.0f}", flush=True)


def child(args, config: str, routing: str, model: Path, trace: Path) -> dict:
    cmd = [sys.executable, __file__, "--one", config, "--routing", routing, "--model", str(model),
           "--trace", str(trace), "--device", args.device, "--tokens", str(args.tokens), "--prompt",
           str(args.prompt), "--rounds", str(args.rounds), "--share", str(args.share),
           "--max-model-len", str(args.max_model_len), "--sync-steps", str(args.sync_steps)]
    head = f"gpu_check config={config} routing={routing}"
    log = Path(args.out) / "logs" / f"{config}-{routing}.log"  # the child's stderr: its memory plan, tracebacks
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.config_timeout)
        out, err, why = r.stdout, r.stderr, f"process ended rc={r.returncode}: {r.stderr[-300:]}"
    except subprocess.TimeoutExpired as e:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        out, err, why = text(e.stdout), text(e.stderr), f"over {args.config_timeout}s"
    log.write_text(err)
    line = next((x for x in out.splitlines() if x.startswith(head)), None)
    if line is None:
        line = f"{head} error={json.dumps(why)}"
    print(line, flush=True)
    return parse_line(line)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check"), help="checkpoint + trace folder")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the dry run (toy sizes)")
    ap.add_argument("--quick", action="store_true", help="6 layers, 16 tokens, recorded routing only")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--tokens", type=int, default=None, help="decode tokens per timed run (default 32; quick 16)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; cpu 8)")
    ap.add_argument("--rounds", type=int, default=2, help="timed runs per configuration (median)")
    ap.add_argument("--share", type=float, default=0.25, help="share of the experts cached in VRAM")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--sync-steps", type=int, default=4, help="decode steps the host syncs are counted over")
    ap.add_argument("--config-timeout", type=int, default=240, help="seconds one configuration may take")
    ap.add_argument("--test-timeout", type=int, default=240)
    ap.add_argument("--only", nargs="*", default=None, help="a subset of the configurations")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: one configuration
    ap.add_argument("--routing", default="recorded", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    args.tokens = args.tokens or (4 if cpu else 16 if args.quick else 32)
    args.prompt = args.prompt or (8 if cpu else 128)
    if args.one:
        return run_one(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --device cpu for the dry run)", file=sys.stderr)
        return 2
    print(hardware_line(), flush=True)
    if not args.skip_tests and not cpu:
        run_tests(args)
    out = Path(args.out)
    shape = dict(M.TINY if cpu else M.BENCH)
    if args.quick and not cpu:
        shape["num_hidden_layers"] = 6
    t = time.monotonic()
    model = M.write_checkpoint(out / ("ckpt-tiny" if cpu else f"ckpt-{shape['num_hidden_layers']}"), shape)
    trace = M.record_demo_trace(out / f"demo-trace-{args.prompt}-{args.tokens}.npz", args.prompt, args.tokens)
    print(f"gpu_check setup checkpoint={model} experts_gib={M.expert_bytes(shape) / 2**30:.2f} "
          f"seconds={time.monotonic() - t:.0f}", flush=True)
    configs = [c for c in CONFIGS if args.only is None or c in args.only]
    routings = ("recorded",) if args.quick else ("recorded", "random")
    if args.quick:
        configs = [c for c in configs if c not in ("cpu-compute-off", "torch-moe")]
    results = {}
    for routing in routings:
        for config in configs:
            if config in ("resident", "torch-moe") and routing != "recorded":
                continue  # routing does not change what a resident model moves; the kernels' ratio needs one
            results[config, routing] = child(args, config, routing, model, trace)
    for routing in routings:
        base = results.get(("default", routing)) or {}
        for other in ("resident", *CACHED[1:]):
            b = results.get((other, "recorded" if other == "resident" else routing)) or {}
            for what in ("decode_tok_s", "prefill_tok_s"):
                if isinstance(base.get(what), float) and isinstance(b.get(what), float) and b[what] > 0:
                    print(f"gpu_check ratio routing={routing} {what} default/{other}={base[what] / b[what]:.2f}x",
                          flush=True)
    failed = [k for k, v in results.items() if v is None or "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
