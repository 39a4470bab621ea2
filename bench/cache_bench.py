"""Expert cache modes side by side, same run: tok/s, hit rate per tier, GB/s moved.

Configurations (one line each, per model and routing source):
  resident   every expert in the fastest tier (the upper bound)
  no-cache   top_k slots per layer in every tier, no prefetch: each expert read on demand
  sync-lru   vLLM #37190 v1 behaviour: LRU slots, one synchronous read + copy per miss, no prefetch,
             no CPU compute
  static     hottest experts pinned from saved statistics (KTransformers / llama.cpp placement)
  default    expertcache's default: the adaptive policy, a step's disk reads in parallel while its hits
             compute, CPU compute by cost model, prefetch auto (CUDA: into device slots;
             CPU-only: disk reads ahead into host RAM)
  default+prefetch   the same with next-layer prefetch into the fastest tier forced on
  inclusive  default with inclusive tiers (no demotion of device evictions into host RAM; ablation)
The fastest tier holds `--device-share` of the experts (default 30%). On a CPU-only
machine it holds the stored bytes where the C++ kernels read them (else fp32 compute copies), the host tier
bf16 bytes, the rest streams from
disk with O_DIRECT (no page cache). Routing comes from the model's routers ("router") or
from a synthetic trace with realistic skew and locality ("synthetic"; its next-layer
predictions keep each true expert with probability 0.83, the recall measured for the trained
tinymoe-py16's routers, and draw the rest by popularity). Models: "demo" (random
weights, all experts in RAM), "big" (random weights, experts 4x the host tier, the rest on
disk), "tinymoe" (../shared/models/tinymoe-py16, trained: its own routers give real skew,
locality and lookahead; prompt from its held-out text; experts 4x the host tier).

Every configuration of a (model, routing) pair is loaded at once and the timed runs go
round-robin (`--repeats`, a different prompt each round, caches warm from the rounds before);
each line reports the median decode and prefill tok/s, the runs, and the counters over all rounds.

    python bench/cache_bench.py [--models demo big tinymoe] [--routing router synthetic] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import hardware_line, timed_generate


class TraceRouter:
    """route_override that replays a synthetic trace: the next row per token, in step order;
    the next-layer prediction comes from the trace's lookahead (modelled recall)."""

    def __init__(self, trace, first_layer: int, moe_layers: list[int]):
        self.ex, self.row, self.first = torch.from_numpy(trace.experts.astype(np.int64)), 0, first_layer
        self.la = torch.from_numpy(trace.lookahead.astype(np.int64))
        self.li = {layer: i for i, layer in enumerate(moe_layers)}
        self.T = 0

    def __call__(self, layer, ids, w):
        if layer == self.first:
            self.row += self.T
            self.T = ids.shape[0]
        return self.ex[self._rows(ids), self.li[layer]].to(ids.device), w

    def _rows(self, ids):
        return torch.arange(self.row, self.row + ids.shape[0]) % self.ex.shape[0]

    def lookahead(self, layer, ids):
        return self.la[self._rows(ids), self.li[layer]].to(ids.device)


def configs(share: float, host: str | None):
    cache = {"device_memory": f"{share:.0%}", "host_memory": host}
    return {
        "resident": {},
        "no-cache": {
            "cache_policy": "lru",
            "prefetch": False,
            "cpu_compute": "never",
            "min_slots": True,
            "exclusive": False,
        },
        "sync-lru": {
            **cache,
            "cache_policy": "lru",
            "prefetch": False,
            "cpu_compute": "never",
            "overlap_io": False,
            "exclusive": False,
        },
        "static": {**cache, "cache_policy": "static", "prefetch": False, "load_stats": True},
        "default": {**cache},
        "default+prefetch": {**cache, "prefetch": "device"},
        "inclusive": {**cache, "exclusive": False},
    }


def make_llm(model_dir, kw, stats_path, device="cpu"):
    from expertcache import LLM
    from expertcache.experts.layout import ExpertSource, parts_nbytes
    from expertcache.loader.safetensors_index import TensorIndex
    from expertcache.models.registry import read_config

    kw = {k: v for k, v in kw.items() if v is not None}
    if kw.pop("min_slots", False):  # smallest legal budget: top_k slots per layer in each tier
        family, cfg, _ = read_config(model_dir)
        source = ExpertSource(TensorIndex(model_dir), cfg, family.names)
        per_slot = cfg.top_k * len(source.layers)
        fast = torch.float32 if device == "cpu" else torch.bfloat16
        staging = 1 if device != "cpu" else 0  # CUDA reserves one staging slot for waves
        kw["device_memory"] = (per_slot + staging) * parts_nbytes(source.compute_parts(fast, device))
        kw["host_memory"] = per_slot * source.expert_nbytes
    if kw.pop("load_stats", False):
        kw["load_stats"] = stats_path
    return LLM(model_dir, device=device, **kw)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["demo", "big", "tinymoe"])
    ap.add_argument("--routing", nargs="+", default=["router", "synthetic"])
    ap.add_argument("--device-share", type=float, default=0.30)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="round-robin runs per configuration (median)")
    ap.add_argument("--only", nargs="*", default=None, help="subset of configurations")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the fastest tier's device)")
    args = ap.parse_args()
    from expertcache import SamplingParams
    from expertcache.demo import build_demo_model, random_demo_dir

    torch.manual_seed(0)
    print(hardware_line(), flush=True)
    tmp = tempfile.mkdtemp(prefix="expertcache-bench-")
    for model in args.models:
        prompt_ids = None
        if model == "demo":
            model_dir, host = str(random_demo_dir()), None
        elif model == "tinymoe":
            model_dir, host = str(Path(__file__).resolve().parents[2] / "shared/models/tinymoe-py16"), "25%"
            prompt_ids = torch.load(Path(model_dir) / "heldout_ids.pt").flatten().tolist()
        else:  # 1.5 GiB of bf16 experts; host RAM tier holds a quarter, the rest streams from disk
            model_dir = str(
                build_demo_model(
                    f"{tmp}/big",
                    num_layers=16,
                    num_experts=64,
                    top_k=8,
                    hidden=512,
                    moe_intermediate=512,
                    num_heads=8,
                    num_kv_heads=4,
                    num_shards=4,
                )
            )
            host = "25%"
        stats_path = f"{tmp}/{model}-stats.json"
        for routing in args.routing:
            params = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
            rng = torch.Generator().manual_seed(1)
            prompts = [
                torch.randint(3, 2000, (args.prompt_len,), generator=rng).tolist()
                for _ in range(args.repeats)
            ]
            warm_prompt = torch.randint(3, 2000, (args.prompt_len,), generator=rng).tolist()
            if prompt_ids:  # real text: held-out stretches, the warm-up statistics from a different one
                n = args.prompt_len
                prompts = [prompt_ids[r * 1000 : r * 1000 + n] for r in range(args.repeats)]
                warm_prompt = prompt_ids[50000 : 50000 + n]
            llms = {}
            for name, kw in configs(args.device_share, host).items():
                if args.only and name not in args.only:
                    continue
                if name == "static":  # statistics from a different prompt, saved by a warm-up run
                    warm = make_llm(
                        model_dir, configs(args.device_share, host)["sync-lru"], stats_path, args.device
                    )
                    _route(warm, routing, 2)
                    warm.generate([warm_prompt], params)
                    warm.experts.save_stats(stats_path)
                    warm.close()
                llm = make_llm(model_dir, kw, stats_path, args.device)
                _route(llm, routing, 0)
                llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
                llms[name] = llm
            # every configuration stays loaded; repeats go round-robin so drift on a shared machine
            # hits all of them alike, and each reports its median
            runs = {name: [] for name in llms}
            walls = dict.fromkeys(llms, 0.0)
            for prompt in prompts:
                for name, llm in llms.items():
                    t0 = time.perf_counter()
                    runs[name].append(timed_generate(llm, [prompt], params))
                    walls[name] += time.perf_counter() - t0
            results = {}
            for name, llm in llms.items():
                dec = statistics.median(r["decode_tok_s"] for r in runs[name])
                pre = statistics.median(r["prefill_tok_s"] for r in runs[name])
                s = llm.expert_stats() or {
                    "hit_rate": 1.0,
                    "bytes_moved": 0,
                    "per_tier": {"host": {"hits": 0, "misses": 0}},
                }
                host_t = s["per_tier"]["host"]
                hu = host_t["hits"] + host_t["misses"]
                results[name] = dec
                print(
                    f"model={model} routing={routing} config={name} decode_tok_s={dec:.2f} prefill_tok_s={pre:.1f} "
                    f"decode_runs={','.join(format(r['decode_tok_s'], '.1f') for r in runs[name])} "
                    f"device_hit={s['hit_rate']:.3f} host_hit={host_t['hits'] / hu if hu else 1.0:.3f} "
                    f"host_prefetch={host_t.get('prefetch_useful', 0)}/{host_t.get('prefetch_issued', 0)} "
                    f"moved_GB={s['bytes_moved'] / 1e9:.3f} GB_per_s={s['bytes_moved'] / 1e9 / walls[name]:.3f}",
                    flush=True,
                )
                llm.close()
            if {"default", "sync-lru", "resident"} <= set(results):
                print(
                    f"model={model} routing={routing} default/sync-lru={results['default'] / results['sync-lru']:.2f}x "
                    f"default/resident={results['default'] / results['resident']:.2f}x",
                    flush=True,
                )


_TRACES = {}
LOOKAHEAD_RECALL = 0.83  # the next layer's router on the trained tinymoe-py16 (bench/trace_tinymoe.py)


def _route(llm, routing: str, seed: int) -> None:
    if routing != "synthetic":
        llm.model.route_override = None
        return
    from expertcache.trace.synthetic import synth_trace

    cfg = llm.cfg
    key = (cfg.num_layers, cfg.num_experts, cfg.top_k, seed)
    if key not in _TRACES:
        _TRACES[key] = synth_trace(
            layers=len(cfg.moe_layer_ids),
            experts=cfg.num_experts,
            top_k=cfg.top_k,
            tokens=4096,
            zipf=1.1,
            reuse=0.4,
            shift_every=256,
            seed=seed,
            lookahead_recall=LOOKAHEAD_RECALL,
        )
    llm.model.route_override = TraceRouter(_TRACES[key], cfg.moe_layer_ids[0], cfg.moe_layer_ids)


if __name__ == "__main__":
    main()
