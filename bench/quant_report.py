"""Quantized experts report: bytes, what fits in a byte budget, hit rate, decode speed, accuracy.

    .venv/bin/python bench/quant_report.py                        # demo + tinymoe-py16 (+ large with --models)
    .venv/bin/python bench/quant_report.py --models demo,tinymoe,large

For each model and format (bf16 baseline = the checkpoint as is; fp8 = 128x128 block fp8; int8 / int4 =
group 128; mxfp4 = OCP MX blocks of 32), quantized with `expertcache quantize` (quantize_checkpoint):

  bytes_per_expert  stored bytes of one expert (weights + scales + zero points)
  dev_bytes         bytes per expert in the device tier (compute format: on CPU a bf16 model's
                    experts are held in float32, quantized ones as stored)
  budget            fixed byte budget = --budget-frac (25%) of the bf16 model's expert bytes;
                    device_memory=budget, host_memory=100% (every expert in RAM)
  slots             device slots per layer the plan gives under that budget / experts per layer
  hit_rate          device-tier hit rate while decoding (after a warm-up)
  decode_tok_s      batch-1 greedy decode tokens per second under that budget
  top1              share of positions where the argmax of the logits equals the bf16 model's
  ppl, dppl         perplexity over the eval text (from llm.logits) and its change vs bf16

Eval text: tinymoe-py16 (trained): held-out ids (/work/shared/models/tinymoe-py16/heldout_ids.pt),
--eval-windows (8) windows of --eval-len (256) tokens at seeded random offsets. demo / large (random weights): a fixed
sequence sampled (temperature 1, seed 0) from the bf16 model itself, so its perplexity is that
model's own. Output: a `hardware` line, one `result` line per (model, format) as key=value with
units, then a markdown table. Fixed seeds; timings are after a warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from expertcache import LLM, SamplingParams  # noqa: E402
from expertcache.experts.layout import parts_nbytes  # noqa: E402
from expertcache.quantize.rewrite import quantize_checkpoint  # noqa: E402

TINYMOE = Path(__file__).resolve().parents[2] / "shared" / "models" / "tinymoe-py16"
FORMATS = [
    ("bf16", {}),
    ("fp8", {"block_size": 128}),
    ("int8", {"group_size": 128}),
    ("int4", {"group_size": 128}),
    ("mxfp4", {}),
]
LARGE = dict(
    num_layers=8,
    num_experts=64,
    top_k=4,
    hidden=512,
    moe_intermediate=512,
    num_heads=8,
    num_kv_heads=4,
    num_shards=4,
)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load(path, **kw) -> LLM:
    """LLM(path) with anything it prints sent to stderr (stdout stays parseable)."""
    with contextlib.redirect_stdout(sys.stderr):
        return LLM(str(path), prefix_caching=False, **kw)


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- models


def model_dir(name: str, work: Path) -> Path:
    if name == "tinymoe":
        if not (TINYMOE / "config.json").exists():
            raise FileNotFoundError(f"{TINYMOE} is absent")
        return TINYMOE
    from expertcache import demo

    if name == "demo":
        try:
            return demo.random_demo_dir(progress=False)
        except Exception as e:  # noqa: BLE001 - fall back to a private build
            log(f"random_demo_dir failed ({e}); building one in {work}")
            return demo.build_demo_model(work / "demo")
    if name == "large":
        out = work / "large"
        if not (out / "config.json").exists():
            t = time.perf_counter()
            demo.build_demo_model(out, **LARGE)
            log(f"built large model in {time.perf_counter() - t:.0f} s")
        return out
    raise ValueError(f"unknown model {name!r} (demo, tinymoe, large)")


def eval_windows(name: str, base: LLM, n: int, length: int) -> list[list[int]]:
    if name == "tinymoe":
        ids = torch.load(TINYMOE / "heldout_ids.pt").tolist()
        g = torch.Generator().manual_seed(0)
        starts = torch.randint(0, len(ids) - length, (n,), generator=g).tolist()
        return [ids[s : s + length] for s in starts]
    # random-weight model: text sampled from the bf16 model itself (fixed seed)
    prompt = base.tokenizer.encode("The quick brown fox") if base.tokenizer else [5, 6, 7, 8]
    out = []
    for i in range(n):
        sp = SamplingParams(max_tokens=length - len(prompt), temperature=1.0, seed=i, ignore_eos=True)
        out.append(prompt + base.generate([prompt], sp)[0].token_ids)
    return out


# ---------------------------------------------------------------------------- measurements


def accuracy(llm: LLM, windows: list[list[int]], ref: list[torch.Tensor] | None):
    """-> (perplexity, top-1 agreement with ref, logits per window)."""
    nll, n, agree, total = 0.0, 0, 0, 0
    logits = []
    for i, w in enumerate(windows):
        lg = llm.logits(w)
        logits.append(lg)
        lp = torch.log_softmax(lg[:-1].double(), dim=-1)
        tgt = torch.tensor(w[1:])
        nll += -lp.gather(1, tgt[:, None]).sum().item()
        n += len(w) - 1
        if ref is not None:
            agree += (lg.argmax(-1) == ref[i].argmax(-1)).sum().item()
            total += lg.shape[0]
    return math.exp(nll / n), (agree / total if ref is not None else 1.0), logits


def decode_speed(llm: LLM, prompt: list[int], tokens: int, repeats: int) -> tuple[float, float]:
    """Batch-1 greedy decode tok/s (best of `repeats`, prefill time subtracted) and the device hit
    rate over all measured runs, after a warm-up."""
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    llm.generate([prompt], sp(8))  # warm-up: code paths + cache
    best, hits, uses = 0.0, 0, 0
    for _ in range(repeats):
        t = time.perf_counter()
        llm.generate([prompt], sp(1))
        prefill = time.perf_counter() - t
        s0 = llm.expert_stats()
        t = time.perf_counter()
        llm.generate([prompt], sp(1 + tokens))
        total = time.perf_counter() - t
        s1 = llm.expert_stats()
        hits += s1["hits"] - s0["hits"]
        uses += s1["hits"] + s1["misses"] - s0["hits"] - s0["misses"]
        best = max(best, tokens / max(total - prefill, 1e-9))
    return best, hits / max(uses, 1)


def run_model(name: str, args, work: Path) -> list[dict]:
    src = model_dir(name, work)
    log(f"{name}: {src}")
    base = load(src)
    L, E = len(base.source.layers), base.cfg.num_experts
    bf16_bytes = base.source.expert_nbytes
    budget = int(args.budget_frac * bf16_bytes * L * E)
    nwin = args.eval_windows or (8 if name == "tinymoe" else 4)
    windows = eval_windows(name, base, nwin, args.eval_len)
    ppl0, _, ref = accuracy(base, windows, None)
    base.close()
    del base
    prompt = windows[0][: args.prompt_len]
    rows = []
    for fmt, params in FORMATS:
        t = time.perf_counter()
        if fmt == "bf16":
            path, qtime = src, 0.0
        else:
            path = quantize_checkpoint(src, work / f"{name}-{fmt}", fmt, **params)
            qtime = time.perf_counter() - t
        if fmt == "bf16":
            ppl, top1 = ppl0, 1.0
        else:
            llm = load(path)
            ppl, top1, _ = accuracy(llm, windows, ref)
            llm.close()
            del llm
        llm = load(path, device_memory=str(budget), host_memory="100%", cache_policy="lru")
        dev_bytes = parts_nbytes(llm.source.compute_parts(llm.dtype))
        slots = getattr(llm.experts, "device_slots", E)
        tok_s, hit = decode_speed(llm, prompt, args.decode_tokens, args.repeats)
        fit = min(E, budget // (L * llm.source.expert_nbytes))  # slots/layer the budget holds at stored bytes
        row = dict(
            model=name,
            fmt=fmt,
            params=",".join(f"{k}={v}" for k, v in params.items()) or "-",
            bytes_per_expert=llm.source.expert_nbytes,
            dev_bytes=dev_bytes,
            budget=budget,
            slots=slots,
            fit=fit,
            experts=E,
            layers=L,
            hit_rate=hit,
            decode_tok_s=tok_s,
            top1=top1,
            ppl=ppl,
            ppl_base=ppl0,
            dppl=100 * (ppl / ppl0 - 1),
            quantize_s=qtime,
        )
        llm.close()
        del llm
        if fmt != "bf16" and not args.keep:
            shutil.rmtree(path, ignore_errors=True)
        print(
            "result "
            + " ".join(
                [
                    f"model={name}",
                    f"fmt={fmt}",
                    f"params={row['params']}",
                    f"bytes_per_expert={row['bytes_per_expert']}B",
                    f"dev_bytes_per_expert={dev_bytes}B",
                    f"budget={budget}B",
                    f"fit_stored={fit}/{E}",
                    f"slots_per_layer={slots}/{E}",
                    f"hit_rate={hit:.3f}",
                    f"decode_tok_s={tok_s:.2f}tok/s",
                    f"top1_agree={top1:.4f}",
                    f"ppl={ppl:.4f}",
                    f"ppl_bf16={ppl0:.4f}",
                    f"dppl={row['dppl']:+.3f}%",
                    f"quantize_s={qtime:.1f}s",
                ]
            ),
            flush=True,
        )
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| model | format | B/expert | vs bf16 | fit in budget (stored) | dev B/expert | device slots/layer "
        "| hit rate | decode tok/s | top-1 agree | ppl | Δppl |"
    )
    lines = [head, "|" + "|".join(["---"] * 12) + "|"]
    base = {r["model"]: r["bytes_per_expert"] for r in rows if r["fmt"] == "bf16"}
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['fmt']} | {r['bytes_per_expert']:,} | {r['bytes_per_expert'] / base[r['model']]:.3f} "
            f"| {r['fit']}/{r['experts']} | {r['dev_bytes']:,} | {r['slots']}/{r['experts']} | {r['hit_rate']:.3f} "
            f"| {r['decode_tok_s']:.1f} "
            f"| {r['top1']:.4f} | {r['ppl']:.3f} | {r['dppl']:+.2f}% |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,tinymoe", help="comma list of demo, tinymoe, large")
    ap.add_argument(
        "--budget-frac", type=float, default=0.25, help="byte budget as a share of the bf16 experts"
    )
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="decode measurements per config (best is kept)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument(
        "--eval-windows",
        type=int,
        default=None,
        help="eval windows per model (default 8 for tinymoe, 4 for the sampled demo/large text)",
    )
    ap.add_argument("--eval-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--workdir", default=None, help="where quantized copies go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the quantized copies")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(
        f'hardware cpu="{cpu_model()}" cores={os.cpu_count()} threads={torch.get_num_threads()} '
        f"torch={torch.__version__} python={platform.python_version()} device=cpu",
        flush=True,
    )
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="quant-report-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.perf_counter()
    try:
        for name in args.models.split(","):
            t = time.perf_counter()
            try:
                rows += run_model(name.strip(), args, work)
            except FileNotFoundError as e:
                print(f'skipped model={name} reason="{e}"', flush=True)
            log(f"{name} took {time.perf_counter() - t:.0f} s")
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"total_s={time.perf_counter() - t0:.0f}s")
    print()
    print(table(rows))
    print()
    print(
        "note: device tier on CPU = compute format; a bf16 model's experts are held there in float32 (dev B/expert), "
        "so its device slots are half of what its stored bytes would fit; quantized experts stay as stored. "
        "decode tok/s is batch 1, best of --repeats, on a shared machine (noisy). demo/large are random-weight "
        "models: perplexity of text sampled from themselves is near the vocab size; top-1 agreement is the signal."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
