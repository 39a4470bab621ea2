"""The prepared device check: run it on a machine with a CUDA GPU from the repository root, nothing to
install (torch, triton, numpy, safetensors, tokenizers, transformers and pytest are all it imports;
`make setup` needs network). On a lent machine `bash bench/device_run.sh` runs it with the probe first.

    python bench/gpu_check.py [--quick] [--out DIR] [--results DIR] [--skip-tests] [--deadline S]
                              [--only CONFIG ...] [--routings recorded random] [--tokens 32] [--prompt 128]
    python bench/gpu_check.py --device cpu      # the dry run CI runs: toy sizes, every line, no GPU

1. the `gpu`-marked tests (every tests/ file that marks one: gpu_test_files()) and the Triton MoE tests
   compiled for the device (TRITON_INTERPRET=0: the test modules turn the interpreter on only without a
   CUDA device), each pytest's output in OUT/logs/, a junit file and one summary line;
2. a random checkpoint of Qwen3-30B-A3B's shape ratios written with safetensors alone (bench/gpu_check_model.py:
   12 layers x 64 experts of 9.4 MB, 7.2 GB of experts) into OUT (never into the results folder),
   VRAM capped with torch.cuda.set_per_process_memory_fraction at the engine's own device plan for the
   configuration less its CUDA context (not the allocator's) + 256 MiB (`--share`, 25%: the experts are
   4x their VRAM); then, each configuration in
   its own process (a failure is a line, not the end; its stderr in OUT/logs/), prefill and decode tok/s
   at batch 1:
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
   The cached configurations are driven by recorded routing (the trained demo model's routing of its
   held-out text, replayed through the engine's route_override: hit rates of real text) and by uniform
   random routing (the worst case), in the order `--routings` gives. Each line also gives the counters
   (hit rate, share of misses computed on the CPU, waves, prefetch issued/useful), host syncs per decode
   step (torch's sync-debug warnings plus CUDA event synchronize calls, decode steps only), the
   child's wall seconds and its load seconds (`seconds=`, `load_s=`);
3. ratios: default over each baseline, per routing.

Lines: `gpu_check config=NAME routing=R key=value ...` (an `error="..."` line when a configuration fails,
`skipped="deadline"` when `--deadline` seconds would be passed). `--results DIR`: only a summary goes
there (summary.txt: every gpu_check line, appended to; child-logs.txt: the tail of each log in OUT/logs; the junit files).
`--tests-only`: the pytest runs only.
`--quick`: tests/engine/test_gpu.py and the Triton tests only, 6 layers, 16 tokens, recorded routing only, no
cpu-compute-off or torch-moe.
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
ROUTINGS = ("recorded", "random")
LINE = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
MARGIN = 256 << 20  # above the device plan less its CUDA context (which the allocator cap does not limit)
TRITON_TEST_FILES = ("tests/kernels/test_triton_moe.py",)  # test_triton_models.py needs the interpreter
LOG_TAIL = 4000  # characters of each log in the results folder's child-logs.txt


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """Every tests/ file with a `gpu`-marked test (`mark.gpu` in its text), sorted."""
    return sorted(
        f.relative_to(root).as_posix()
        for f in (root / "tests").rglob("test_*.py")
        if re.search(r"\bmark\.gpu\b", f.read_text(errors="replace"))
    )


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
        return {
            **cache,
            "host_memory": ctx["host_slot_bytes"] * (E - 1),
            "cache_policy": "lru",
            "prefetch": "off",
            "cpu_compute": "never",
            "overlap_io": False,
            "prefill_admit_tokens": 1 << 30,
        }
    if name == "cpu-moe":
        # top_k device slots per layer: the smallest plan there is (plan.model.budget_for_slots)
        return {**cache, "device_memory": ctx["top_k_budget"], "prefetch": "off", "cpu_compute": "always"}
    raise ValueError(f"unknown configuration {name!r}; choose one of {', '.join(CONFIGS)}")


# -- one configuration (child process) -----------------------------------------------------------------
def cuda_device(device: torch.device) -> torch.device:
    """`device` with its index: torch.cuda.set_per_process_memory_fraction refuses an index-less one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def cap_memory(device: torch.device, cap: int) -> None:
    """Cap this process's CUDA allocator at `cap` bytes of the device's memory."""
    device = cuda_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device.index)


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
    head = f"gpu_check config={args.one} routing={args.routing}"
    llm = None
    cap = 0
    try:
        from expertcache import LLM, SamplingParams
        from expertcache.build.plan import GpuSpec
        from expertcache.config import EngineConfig
        from expertcache.llm import default_dtype
        from expertcache.plan.model import budget_for_slots, device_plan, read_model

        device = cuda_device(torch.device(args.device))
        cuda = device.type == "cuda"
        info = read_model(args.model)
        cfg, source = info.cfg, info.source
        L, E, K = len(source.layers), cfg.num_experts, cfg.top_k
        dtype = default_dtype(device)
        # the KV cache: two sequences of max_model_len (k and v per layer), given to the engine as its budget
        kv = 2 * args.max_model_len * 2 * L * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        base = {"device": str(device), "max_model_len": args.max_model_len, "kv_cache_memory": kv}
        gpu = GpuSpec.from_device(device) if cuda else None
        ctx = {
            "num_experts": E,
            "top_k": K,
            "host_slot_bytes": source.stored_nbytes * L,
            "top_k_budget": budget_for_slots(
                info, EngineConfig.from_kwargs(**base, device_memory="auto"), K, gpu
            ),
        }
        kw = options(args.one, args.share, ctx)
        experts_bytes = source.total_nbytes
        if cuda and args.one != "resident":
            # the engine's own device plan for this configuration is the cap (every term counted there)
            plan = device_plan(info, EngineConfig.from_kwargs(**base, **{"host_memory": "auto", **kw}), gpu)
            # the allocator's cap: the plan less the CUDA context (outside the allocator), plus a margin
            cap = plan.total - plan.terms.get("cuda_context", 0) + MARGIN
            cap_memory(device, cap)
        t0 = time.monotonic()
        # check_finite off: the checkpoint is generated here, so it is known to be finite
        llm = LLM(
            args.model,
            device=str(device),
            max_model_len=args.max_model_len,
            kv_cache_memory=kv,
            check_finite=False,
            **kw,
        )
        load_s = time.monotonic() - t0
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
            return timed_generate(
                llm, prompt(), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            )

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
        free, total = torch.cuda.mem_get_info(device) if cuda else (0, 0)
        used = (total - free) / 2**30  # what the driver holds: the plan counts the context, the cap does not
        print(
            f"{head} decode_tok_s={decode:.2f} prefill_tok_s={prefill:.2f} hit_rate={s.get('hit_rate', 1.0):.3f} "
            f"cpu_computed_share={s.get('cpu_computed_share', 0.0):.3f} misses={s.get('misses', 0)} waves={waves} "
            f"prefetch_issued={pf['issued']} prefetch_useful={pf['useful']} syncs_per_decode_step={syncs} "
            f"device_slots={getattr(llm.experts, 'device_slots', E)} experts_gib={experts_bytes / 2**30:.2f} "
            f"cap_gib={cap / 2**30:.2f} reserved_gib={reserved:.2f} device_used_gib={used:.2f} "
            f"load_s={load_s:.1f}",
            flush=True,
        )
        return 0
    except Exception as e:  # the parent reads this line; the other configurations still run
        import traceback

        traceback.print_exc()
        print(f"{head} error={json.dumps(f'{type(e).__name__}: {e}'[:400])}", flush=True)
        return 1
    finally:
        if llm is not None:
            llm.close()


# -- the whole check (parent) -----------------------------------------------------------------------------
class Report:
    """Prints each gpu_check line and keeps it; `--results`: only a summary goes there (summary.txt with
    every line, written as they come, so a run cut short still leaves them)."""

    def __init__(self, results: str | None):
        self.lines: list[str] = []
        self.dir = Path(results) if results else None
        if self.dir is not None:
            self.dir.mkdir(
                parents=True, exist_ok=True
            )  # appended to: bench/device_run.sh runs the check twice

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)
        if self.dir is not None:
            with open(self.dir / "summary.txt", "a") as f:
                f.write(line + "\n")

    def file(self, name: str) -> Path | None:
        return None if self.dir is None else self.dir / name

    def child_logs(self, logs: Path) -> None:
        """The tail of every log under `logs` into child-logs.txt (one file: the results folder takes few)."""
        if self.dir is None or not logs.is_dir():
            return
        with open(self.dir / "child-logs.txt", "w") as f:
            for log in sorted(logs.glob("*.log")):
                text = log.read_text(errors="replace")
                f.write(f"== {log.name} ({len(text)} chars; the last {LOG_TAIL})\n{text[-LOG_TAIL:]}\n")


def pytest_run(args, report: Report, name: str, extra: list[str], files: list[str], env=None) -> None:
    """One pytest process: its output to OUT/logs/pytest-NAME.log, a junit file (into the results
    folder when given), one `gpu_check tests=NAME` line with the counts."""
    log = Path(args.out) / "logs" / f"pytest-{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    junit = report.file(f"junit-{name}.xml") or log.with_suffix(".xml")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "--tb=short",
        "--durations=15",
        f"--junitxml={junit}",
        *extra,
        *files,
    ]
    t = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd,
                check=False,
                cwd=ROOT,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=args.test_timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout-{args.test_timeout}s"
    tail = log.read_text(errors="replace").strip().splitlines()
    counts = next(
        (x.strip("= ") for x in reversed(tail) if re.search(r"\d+ (passed|failed|error|skipped)", x)), ""
    )
    report(
        f"gpu_check tests={name} rc={rc} seconds={time.monotonic() - t:.0f} result={json.dumps(counts)} "
        f"log={log}"
    )


def run_tests(args, report: Report) -> None:
    try:
        import pytest  # noqa: F401
    except ImportError:
        report("gpu_check tests=not-run reason=\"pytest is not installed (pip install -e '.[test]')\"")
        return
    env = dict(os.environ, TRITON_INTERPRET="0")  # compiled for the device; no test module turns it on here
    timeout = ["--timeout", str(args.test_timeout // 2)] if _has_pytest_timeout() else []
    files = ["tests/engine/test_gpu.py"] if args.quick else gpu_test_files()
    pytest_run(args, report, "gpu-marked", ["-m", "gpu", *timeout], files, env)
    pytest_run(args, report, "triton-compiled", timeout, list(TRITON_TEST_FILES), env)


def _has_pytest_timeout() -> bool:
    import importlib.util

    return importlib.util.find_spec("pytest_timeout") is not None


def child(args, config: str, routing: str, model: Path, trace: Path, timeout: int | None = None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--one",
        config,
        "--routing",
        routing,
        "--model",
        str(model),
        "--trace",
        str(trace),
        "--device",
        args.device,
        "--tokens",
        str(args.tokens),
        "--prompt",
        str(args.prompt),
        "--rounds",
        str(args.rounds),
        "--share",
        str(args.share),
        "--max-model-len",
        str(args.max_model_len),
        "--sync-steps",
        str(args.sync_steps),
    ]
    head = f"gpu_check config={config} routing={routing}"
    log = (
        Path(args.out) / "logs" / f"{config}-{routing}.log"
    )  # the child's stderr: its memory plan, tracebacks
    log.parent.mkdir(parents=True, exist_ok=True)
    timeout = timeout or args.config_timeout
    t = time.monotonic()
    try:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
        out, err, why = r.stdout, r.stderr, f"process ended rc={r.returncode}: {r.stderr[-300:]}"
    except subprocess.TimeoutExpired as e:

        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        out, err, why = text(e.stdout), text(e.stderr), f"over {timeout}s"
    log.write_text(err)
    line = next((x for x in out.splitlines() if x.startswith(head)), None)
    if line is None:
        line = f"{head} error={json.dumps(why)}"
    line += f" seconds={time.monotonic() - t:.1f}"
    (getattr(args, "report", None) or print)(line)
    return parse_line(line)


def gpu_name() -> str:
    """The GPU's name from nvidia-smi: this process never initialises CUDA (a context here would hold
    device memory the children's plans and the tests' exact slot counts do not expect)."""
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            check=False,
            capture_output=True,
            text=True,
            timeout=20,
        )
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else "none"
    except (OSError, subprocess.TimeoutExpired):
        return "none"


def parent_hardware_line(kernels: bool = True) -> str:
    """bench/common.py's hardware line, the GPU named without initialising CUDA; `kernels` False: without
    the C++ kernels' backend (asking builds them; bench/device_run.sh builds them beside the tests)."""
    real = torch.cuda.get_device_name
    torch.cuda.get_device_name = lambda *_: gpu_name()
    try:
        line = hardware_line() if kernels else None
    finally:
        torch.cuda.get_device_name = real
    if line is None:
        line = f"hardware: gpu={gpu_name()!r} torch={torch.__version__} cores={os.cpu_count()} cpu_kernels=not-asked"
    return line


def plan_runs(configs, routings) -> list[tuple[str, str]]:
    """(configuration, routing) in run order: routing by routing; resident and torch-moe with recorded
    routing only (routing does not change what a resident model moves; the kernels' ratio needs one)."""
    return [
        (c, r) for r in routings for c in configs if not (c in ("resident", "torch-moe") and r != "recorded")
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", default="/tmp/gpu_check", help="work folder: checkpoint, trace, logs (never $OUT)"
    )
    ap.add_argument(
        "--results", default=None, help="folder for the summary only (summary.txt, child-logs.txt, junit)"
    )
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the dry run (toy sizes)")
    ap.add_argument("--quick", action="store_true", help="6 layers, 16 tokens, recorded routing only")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument(
        "--tests-only", action="store_true", help="the pytest runs only (bench/device_run.sh's first phase)"
    )
    ap.add_argument(
        "--tokens", type=int, default=None, help="decode tokens per timed run (default 32; quick 16)"
    )
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; cpu 8)")
    ap.add_argument("--rounds", type=int, default=2, help="timed runs per configuration (median)")
    ap.add_argument("--share", type=float, default=0.25, help="share of the experts cached in VRAM")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--sync-steps", type=int, default=4, help="decode steps the host syncs are counted over")
    ap.add_argument("--config-timeout", type=int, default=90, help="seconds one configuration may take")
    ap.add_argument("--test-timeout", type=int, default=150, help="seconds one pytest run may take")
    ap.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds from the start: a configuration that could end past it is skipped with a line",
    )
    ap.add_argument("--only", nargs="*", default=None, help="a subset of the configurations")
    ap.add_argument(
        "--routings",
        nargs="*",
        default=None,
        choices=ROUTINGS,
        help="routings in run order (default recorded random; quick recorded)",
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: one configuration
    ap.add_argument("--routing", default="recorded", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    start = time.monotonic()
    cpu = args.device == "cpu"
    args.tokens = args.tokens or (4 if cpu else 16 if args.quick else 32)
    args.prompt = args.prompt or (8 if cpu else 128)
    if args.one:
        return run_one(args)
    if args.only is not None and (bad := sorted(set(args.only) - set(CONFIGS))):
        ap.error(f"--only: unknown configuration(s) {', '.join(bad)}; choose from {', '.join(CONFIGS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --device cpu for the dry run)", file=sys.stderr)
        return 2
    report = args.report = Report(args.results)
    report(parent_hardware_line(kernels=not args.tests_only))
    try:
        if not args.skip_tests and not cpu:
            run_tests(args, report)
        if args.tests_only:
            return 0
        out = Path(args.out)
        shape = dict(M.TINY if cpu else M.BENCH)
        if args.quick and not cpu:
            shape["num_hidden_layers"] = 6
        t = time.monotonic()
        model = M.write_checkpoint(
            out / ("ckpt-tiny" if cpu else f"ckpt-{shape['num_hidden_layers']}"), shape
        )
        trace = M.record_demo_trace(
            out / f"demo-trace-{args.prompt}-{args.tokens}.npz", args.prompt, args.tokens
        )
        report(
            f"gpu_check setup checkpoint={model} experts_gib={M.expert_bytes(shape) / 2**30:.2f} "
            f"seconds={time.monotonic() - t:.0f}"
        )
        configs = [c for c in CONFIGS if args.only is None or c in args.only]
        routings = args.routings or (("recorded",) if args.quick else ROUTINGS)
        if args.quick:
            configs = [c for c in configs if c not in ("cpu-compute-off", "torch-moe")]
        results = {}
        for config, routing in plan_runs(configs, routings):
            left = None if args.deadline is None else args.deadline - (time.monotonic() - start)
            if left is not None and left < min(args.config_timeout, 30):
                report(
                    f'gpu_check config={config} routing={routing} skipped="deadline" left_s={max(left, 0):.0f}'
                )
                results[config, routing] = None
                continue
            timeout = args.config_timeout if left is None else int(min(args.config_timeout, left))
            results[config, routing] = child(args, config, routing, model, trace, timeout)
        for routing in routings:
            base = results.get(("default", routing)) or {}
            for other in ("resident", *CACHED[1:]):
                b = results.get((other, "recorded" if other == "resident" else routing)) or {}
                for what in ("decode_tok_s", "prefill_tok_s"):
                    if isinstance(base.get(what), float) and isinstance(b.get(what), float) and b[what] > 0:
                        report(
                            f"gpu_check ratio routing={routing} {what} default/{other}={base[what] / b[what]:.2f}x"
                        )
        failed = [k for k, v in results.items() if v is None or "error" in v]
        report(f"gpu_check done failed={len(failed)} seconds={time.monotonic() - start:.0f}")
        return 1 if failed else 0
    finally:
        report.child_logs(Path(args.out) / "logs")


if __name__ == "__main__":
    sys.exit(main())
