"""The yardstick model (README, Results), measured here: a random-weight Qwen3-MoE with 16 layers, 64 experts
top-8, hidden 1024, moe intermediate 512, 16/4 heads, head_dim 64, vocab 151936, untied (3.9 GB bf16,
experts 3.0 GiB). Each configuration runs in its own process so its peak RSS is its own.

    python bench/yardstick.py [--dir /tmp/expertcache-yardstick] [--configs resident stream-13 transformers]

resident      every expert in RAM (fp32 compute copies), batch 1
stream-13     13% of experts (top_k per layer) in fp32 slots and in the host tier, the rest read from disk (O_DIRECT)
lowmem-13     --low-memory: bf16 dense weights and expert slots (13%, converted per use), no host tier:
              a step's misses read from disk straight into slots in parallel while its hits compute,
              the next layer's predicted experts read ahead (the defaults). With --cgroup-mib 1536
              each configuration runs in a memory cgroup of that size, page cache dropped first
              (as the README's cgroup figures)
lowmem-13-sync  the same with one synchronous read per miss and no prefetch (the ablation)
transformers  transformers fp32 on the same checkpoint (the reference engine)
One line per configuration: decode/prefill tok/s, peak RSS, GB read from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

SIZES = dict(
    num_layers=16,
    num_experts=64,
    top_k=8,
    hidden=1024,
    moe_intermediate=512,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    vocab=151936,
    num_shards=4,
)


def run_one(model_dir: str, config: str, prompt_len: int, gen: int) -> dict:
    import torch

    prompt = torch.randint(3, 2000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    if config == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = torch.tensor([prompt])
        kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
        with torch.inference_mode():
            model.generate(
                ids[:, :8], max_new_tokens=2, **{**kw, "attention_mask": torch.ones_like(ids[:, :8])}
            )
            t0 = time.perf_counter()
            model(ids)
            pre = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, **kw)
            total = time.perf_counter() - t0
        return {
            "prefill_tok_s": prompt_len / pre,
            "decode_tok_s": (gen - 1) / max(total - pre, 1e-9),
            "disk_GB": 0.0,
        }
    sys.path.insert(0, str(Path(__file__).parent))
    from common import timed_generate

    from expertcache import LLM, SamplingParams

    kw = {
        "resident": {},
        "stream-13": {"device_memory": "13%", "host_memory": "13%"},  # 8 of 64 per layer: top_k
        "lowmem-13": {"device_memory": "13%", "host_memory": 0, "low_memory": True},
        "lowmem-13-sync": {
            "device_memory": "13%",
            "host_memory": 0,
            "low_memory": True,
            "prefetch": False,
            "overlap_io": False,
        },
    }[config]
    llm = LLM(model_dir, max_model_len=256, kv_cache_memory="16MiB", **kw)
    llm.generate([prompt[:8]], SamplingParams(max_tokens=2, temperature=0.0))
    r = timed_generate(llm, [prompt], SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    s = llm.expert_stats()
    return {
        "prefill_tok_s": r["prefill_tok_s"],
        "decode_tok_s": r["decode_tok_s"],
        "device_hit": s.get("hit_rate", 1.0),
        "disk_GB": s.get("per_tier", {}).get("disk", {}).get("bytes_read", 0) / 1e9,
    }


def memory_cgroup(mib: int) -> list[str]:
    """A command prefix running the command in a fresh memory cgroup of `mib` MiB (cgroup v1 or v2),
    after syncing and dropping the page cache. Needs root."""
    v1 = Path("/sys/fs/cgroup/memory")
    group = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"expertcache-bench-{os.getpid()}"
    group.mkdir(exist_ok=True)
    limit = str(mib << 20)
    (group / ("memory.limit_in_bytes" if v1.is_dir() else "memory.max")).write_text(limit)
    subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)
    return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/expertcache-yardstick")
    ap.add_argument("--configs", nargs="+", default=["resident", "stream-13", "transformers"])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument(
        "--cgroup-mib", type=int, default=0, help="run each configuration in a memory cgroup (MiB)"
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        out = run_one(args.dir, args.one, args.prompt_len, args.gen)
        out["peak_rss_GB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        print("RESULT " + json.dumps(out))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from common import hardware_line

    from expertcache.demo import build_demo_model

    print(hardware_line(), flush=True)
    if not (Path(args.dir) / "config.json").exists():
        t0 = time.perf_counter()
        build_demo_model(args.dir, **SIZES)
        print(f"built {args.dir} in {time.perf_counter() - t0:.0f} s", flush=True)
    for config in args.configs:
        cmd = [
            sys.executable,
            __file__,
            "--dir",
            args.dir,
            "--one",
            config,
            "--prompt-len",
            str(args.prompt_len),
            "--gen",
            str(args.gen),
        ]
        if args.cgroup_mib:
            cmd = memory_cgroup(args.cgroup_mib) + cmd
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(
                f"model=yardstick config={config} mem_limit_MiB={args.cgroup_mib or 'none'} failed: exit code "
                f"{p.returncode} (-9: killed by the memory limit) {p.stderr[-500:].strip()}",
                flush=True,
            )
            continue
        r = json.loads(line[7:])
        print(
            f"model=yardstick config={config} mem_limit_MiB={args.cgroup_mib or 'none'} "
            f"decode_tok_s={r['decode_tok_s']:.2f} prefill_tok_s={r['prefill_tok_s']:.1f} "
            f"peak_rss_GB={r['peak_rss_GB']:.2f} disk_read_GB={r['disk_GB']:.2f}"
            + (f" device_hit={r['device_hit']:.3f}" if "device_hit" in r else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
