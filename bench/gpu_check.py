"""The prepared device check: run it once on a machine with a CUDA GPU (budget: under 8 minutes).

    python bench/gpu_check.py [--out DIR] [--skip-tests] [--tokens 32]

1. the `gpu`-marked tests (tests/test_gpu.py, the families' CUDA parity) and the Triton fused MoE
   kernel compiled for the device (tests/test_triton_moe.py without the interpreter);
2. a generated Qwen3-30B-A3B-shaped checkpoint (hidden 2048, moe intermediate 768, 64 experts
   top-8, 8 layers, bf16: 4.8 GB of experts) with VRAM capped (torch.cuda.set_per_process_memory_fraction
   plus the expert budget) so the experts need ~4x the cap; decode tok/s, one parseable line each, for:
     resident      everything in VRAM (uncapped)
     default       the default cache, 30% of experts in VRAM
     sync-lru      LRU, one blocking read + copy per miss, no prefetch, no CPU compute (vLLM #37190 v1)
     cpu-moe       every expert computed on the CPU from RAM, attention on the GPU (llama.cpp --cpu-moe)
     cpu-compute-off  the default with CPU compute of misses turned off
   then the ratios the goals name (default/resident, default/sync-lru, default/cpu-moe), and the
   device-to-host syncs of one batch-1 decode step (torch.cuda.set_sync_debug_mode("warn")).
Nothing here has run on a GPU yet: the first run on a lent machine is its test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware_line, timed_generate  # noqa: E402

SHAPE = dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=64,
             num_experts_per_tok=8, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
             head_dim=128, vocab_size=32000)
CONFIGS = {
    "resident": {},
    "default": {"device_memory": "30%", "host_memory": "100%"},
    "sync-lru": {"device_memory": "30%", "host_memory": "100%", "cache_policy": "lru", "prefetch": "off",
                 "cpu_compute": "never", "overlap_io": False},
    "cpu-moe": {"device_memory": "30%", "host_memory": "100%", "cpu_compute": "always"},
    "cpu-compute-off": {"device_memory": "30%", "host_memory": "100%", "cpu_compute": "never"},
}


def build(root: Path) -> Path:
    import checkpoints

    model = root / "model"
    if not (model / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        checkpoints.make_checkpoint(root, "qwen3_moe", name="model", dtype=torch.bfloat16, **SHAPE)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check"))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    print(hardware_line(), flush=True)
    if not args.skip_tests:
        env = dict(os.environ, TRITON_INTERPRET="0")
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "gpu", "tests/test_gpu.py",
                            "tests/test_families.py"], cwd=ROOT, env=env)
        r2 = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_triton_moe.py"], cwd=ROOT, env=env)
        print(f"gpu_check tests gpu_marked_rc={r.returncode} triton_rc={r2.returncode} "
              f"seconds={time.monotonic() - t:.0f}", flush=True)
    from expertcache import LLM, SamplingParams

    model = build(Path(args.out) / "ckpt")
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    prompt = [list(range(100, 164))]
    results: dict[str, float] = {}
    for name, opts in CONFIGS.items():
        if name != "resident":
            total = torch.cuda.get_device_properties(0).total_memory
            # experts ~4x the cap: the cap leaves room for dense weights, KV and 30% of the experts
            torch.cuda.set_per_process_memory_fraction(min(1.0, 3.0e9 / total))
        try:
            llm = LLM(str(model), device="cuda", **opts)
            llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0))  # warm-up
            runs = [timed_generate(llm, prompt, params)["decode_tok_s"] for _ in range(args.rounds)]
            results[name] = statistics.median(runs)
            s = llm.expert_stats()
            print(f"gpu_check config={name} decode_tok_s={results[name]:.2f} hit_rate={s.get('hit_rate', 1.0):.3f} "
                  f"cpu_computed_share={s.get('cpu_computed_share', 0.0):.3f} "
                  f"reserved_gib={torch.cuda.memory_reserved() / 2**30:.2f}", flush=True)
            if name == "default":
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))
                    torch.cuda.set_sync_debug_mode("default")
                print(f"gpu_check syncs_in_2_token_generate={len(caught)}", flush=True)
            llm.close()
        except Exception as e:  # one failing configuration must not hide the others' figures
            print(f"gpu_check config={name} error={type(e).__name__}: {str(e)[:300]!r}", flush=True)
        del llm
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
    for a, b in (("default", "resident"), ("default", "sync-lru"), ("default", "cpu-moe")):
        if a in results and b in results and results[b]:
            print(f"gpu_check ratio {a}/{b}={results[a] / results[b]:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
