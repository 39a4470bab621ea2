"""Which CPU math can be the default: held-out perplexity of the trained models and greedy agreement
with exact math on every family's tiny checkpoint, under `--cpu-math exact` and `fast`. Deterministic
(no timings): the same figures on every run on one machine.

    python bench/math_choice.py [--tolerance-ppl 0.005] [--tolerance-agree 0.90] [--windows 16] [--window 256]
        [--families all] [--prompts 8] [--new 32] [--work /tmp/math_choice]

Perplexity (`llm.logits` over --windows windows of --window held-out tokens, the nll summed in float64):
  demo        expertcache/demo_model (trained, bf16) on its heldout.txt; also its int4 and int8 experts
              (`expertcache quantize`, group 128) and tinymoe-py16 (/work/shared/models, bf16, and int4)
              on heldout_ids.pt where that folder exists.
Greedy agreement (each model, --prompts fixed prompts of 12 ids, --new greedy tokens, exact vs fast):
  `same` the share of prompts whose --new tokens are identical, `prefix` the mean share of tokens before
  the first difference, `top1` teacher-forced: the share of positions of exact's greedy sequences where
  fast's argmax equals exact's (one difference does not hide the rest). Every family of
  tests/checkpoints.py in bf16 (fast math acts on bf16, int8 and 4-bit weights; fp32 stays exact), its
  int4 experts (qwen3_moe), and gpt-oss with MXFP4 experts as shipped (tests/gpt_oss_checkpoints.py).

Lines: `ppl: model=... exact=... fast=... change=+x.xx%`, `agree: model=... same=... prefix=... top1=...`,
then `decision: default=fast|exact` with the tolerances and the first model outside them.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

TINYMOE = Path("/work/shared/models/tinymoe-py16")
DEMO = HERE.parent / "expertcache" / "demo_model"
FAMILIES = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "qwen3_next",
    "qwen3_5_moe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "glm4_moe_lite",
]


def load(path: Path, math_: str):
    import json

    from expertcache import LLM

    mpe = json.loads((path / "config.json").read_text()).get("max_position_embeddings", 1024)
    return LLM(
        str(path), max_model_len=min(1024, mpe), kv_cache_memory="32MiB", prefix_caching=False, cpu_math=math_
    )


def perplexity(llm, windows: list[list[int]]) -> float:
    nll, n = 0.0, 0
    for w in windows:
        lp = torch.log_softmax(llm.logits(w)[:-1].double(), dim=-1)
        nll -= lp.gather(1, torch.tensor(w[1:])[:, None]).sum().item()
        n += len(w) - 1
    return math.exp(nll / n)


def greedy(llm, prompts: list[list[int]], new: int) -> list[list[int]]:
    from expertcache import SamplingParams

    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, sp)]


def agreement(exact, fast, prompts: list[list[int]], new: int) -> dict:
    a, b = greedy(exact, prompts, new), greedy(fast, prompts, new)
    same = sum(x == y for x, y in zip(a, b)) / len(a)
    prefix = sum(
        next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), new) / new for x, y in zip(a, b)
    ) / len(a)
    hit = total = 0
    for p, x in zip(prompts, a):  # teacher-forced on exact's own continuation
        seq = p + x
        top_e, top_f = (
            exact.logits(seq)[len(p) - 1 : -1].argmax(-1),
            fast.logits(seq)[len(p) - 1 : -1].argmax(-1),
        )
        hit += (top_e == top_f).sum().item()
        total += top_e.numel()
    return {"same": same, "prefix": prefix, "top1": hit / total}


def quantized(src: Path, work: Path, fmt: str) -> Path:
    from expertcache.quantize.rewrite import quantize_checkpoint

    out = work / f"{src.name}-{fmt}"
    if not (out / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        quantize_checkpoint(src, out, fmt, group_size=128 if fmt in ("int4", "int8") else None)
        for f in src.glob("tokenizer*"):
            shutil.copyfile(f, out / f.name)
    return out


def tiny(work: Path, family: str) -> Path:
    import checkpoints as C

    out = work / f"{family}-bf16"
    if not (out / "config.json").exists():
        C.make_checkpoint(work, family, name=out.name, dtype=torch.bfloat16)
    return out


def tiny_gpt_oss(work: Path) -> Path:
    import gpt_oss_checkpoints as G

    out = work / "gpt_oss-mxfp4"
    if not (out / "config.json").exists():
        src = G.make_gpt_oss(work, name="gpt_oss-src")
        G.to_shipped_mxfp4(src, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tolerance-ppl", type=float, default=0.005, help="fast may raise perplexity by this share"
    )
    ap.add_argument(
        "--tolerance-agree",
        type=float,
        default=0.90,
        help="fast's teacher-forced top-1 agreement with exact must reach this share",
    )
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--families", nargs="+", default=["all"], help=f"tiny families: all or of {FAMILIES}")
    ap.add_argument("--work", type=Path, default=Path("/tmp/math_choice"))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from common import hardware_line

    from expertcache import kernels

    print(hardware_line(), flush=True)
    if kernels.cpu_math_unavailable("fast"):
        raise SystemExit(f"--cpu-math fast: {kernels.cpu_math_unavailable('fast')}")
    a.work.mkdir(parents=True, exist_ok=True)
    fams = FAMILIES if a.families == ["all"] else a.families
    bad = [f for f in fams if f not in FAMILIES + ["gpt_oss"]]
    if bad:
        raise SystemExit(f"--families: unknown {bad} (choose from {FAMILIES + ['gpt_oss']})")
    g = torch.Generator().manual_seed(0)
    failures = []

    # trained models: perplexity (and agreement) on held-out text
    trained = []
    from expertcache import LLM

    ids = (
        LLM(str(DEMO), max_model_len=64)
        .require_tokenizer()
        .encode((DEMO / "heldout.txt").read_text(), add_special_tokens=False)
    )
    trained += [(p, ids) for p in (DEMO, quantized(DEMO, a.work, "int4"), quantized(DEMO, a.work, "int8"))]
    if (TINYMOE / "heldout_ids.pt").exists():
        tids = torch.load(TINYMOE / "heldout_ids.pt").flatten().tolist()
        trained += [(TINYMOE, tids), (quantized(TINYMOE, a.work, "int4"), tids)]
    for path, tok in trained:
        n = min(a.windows, len(tok) // a.window)
        windows = [tok[i * a.window : (i + 1) * a.window] for i in range(n)]
        name = "demo" if path == DEMO else "tinymoe-py16" if path == TINYMOE else path.name
        exact, fast = load(path, "exact"), load(path, "fast")
        pe, pf = perplexity(exact, windows), perplexity(fast, windows)
        change = pf / pe - 1
        prompts = [tok[i * 997 % (len(tok) - 12) :][:12] for i in range(a.prompts)]
        ag = agreement(exact, fast, prompts, a.new)
        print(
            f"ppl: model={name} windows={n}x{a.window} exact={pe:.4f} fast={pf:.4f} change={change:+.3%}",
            flush=True,
        )
        print(
            f"agree: model={name} prompts={a.prompts} new={a.new} same={ag['same']:.3f} prefix={ag['prefix']:.3f} "
            f"top1={ag['top1']:.4f}",
            flush=True,
        )
        if change > a.tolerance_ppl:
            failures.append(f"{name} perplexity {change:+.2%}")
        if ag["top1"] < a.tolerance_agree:
            failures.append(f"{name} top1 {ag['top1']:.3f}")
        del exact, fast

    # random tiny checkpoints of every family: greedy agreement
    paths = []
    for fam in fams:
        if fam == "gpt_oss":
            continue
        paths.append((fam + " bf16", tiny(a.work, fam)))
        if fam == "qwen3_moe":
            paths.append((fam + " int4", quantized(tiny(a.work, fam), a.work, "int4")))
    if "gpt_oss" in fams or a.families == ["all"]:
        paths.append(("gpt_oss mxfp4", tiny_gpt_oss(a.work)))
    for name, path in paths:
        exact, fast = load(path, "exact"), load(path, "fast")
        V = exact.cfg.vocab_size
        prompts = [torch.randint(10, V, (12,), generator=g).tolist() for _ in range(a.prompts)]
        ag = agreement(exact, fast, prompts, a.new)
        print(
            f"agree: model={name.replace(' ', '-')} prompts={a.prompts} new={a.new} same={ag['same']:.3f} "
            f"prefix={ag['prefix']:.3f} top1={ag['top1']:.4f}",
            flush=True,
        )
        if ag["top1"] < a.tolerance_agree:
            failures.append(f"{name} top1 {ag['top1']:.3f}")
        del exact, fast
    print(
        f"decision: default={'exact' if failures else 'fast'} tolerance_ppl=+{a.tolerance_ppl:.1%} "
        f"tolerance_top1={a.tolerance_agree:.0%} outside={'; '.join(failures) or 'none'}",
        flush=True,
    )


if __name__ == "__main__":
    main()
