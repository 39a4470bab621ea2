"""The cost of GGUF types per layer: the same expert bytes through the per-projection method (one layout,
`gguf-mixed`) and through `gguf-layers` (parts keyed by type, slot pools grouped by layout).

    python bench/gguf_layers.py [--rounds 5] [--tokens 48] [--budgets resident,30%]

A tiny Qwen3-MoE (tests/checkpoints.py's builder: hidden 256, expert width 256, 8 layers, 8 experts,
top-2; vocab 320) written as GGUF with the gguf package's writer (tests/gguf_files.py), every layer's
experts gate/up Q4_K and down Q6_K (random valid blocks, seed 0): one layout, so it loads as
gguf-mixed:q4_k,q4_k,q6_k; the second configuration forces the same file through gguf-layers (the config
rebuilt from the file asks for it), which a Q4_K_M file (down Q6_K in some layers only) takes. Greedy
decode of --tokens tokens from a fixed prompt, one warm-up generate, then --rounds alternating rounds;
the time is the process's CPU time (time.process_time: all its threads; what the work costs, not how long
a busy machine keeps it waiting), the median of the rounds. One line per configuration:

    gguf_layers method=gguf-mixed budget=resident tok_per_cpu_s=... rounds=[...]
    gguf_layers method=gguf-layers budget=resident tok_per_cpu_s=... rounds=[...] same_tokens=True
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from common import hardware_line

import expertcache.gguf as G
from expertcache import LLM, SamplingParams

PROMPT = [1, 5, 9, 33, 100, 7, 250, 3]
H = I = 256
LAYERS, E = 8, 8


def write_file(root: Path) -> Path:
    import checkpoints as C
    from gguf_files import gguf_names, qwen3moe_metadata, random_blocks, tokenizer_metadata, write_gguf

    ckpt = C.make_checkpoint(
        root, "qwen3_moe", name="m", hidden_size=H, moe_intermediate_size=I, num_hidden_layers=LAYERS
    )
    cfg = json.loads((ckpt / "config.json").read_text())
    meta = qwen3moe_metadata(cfg) + tokenizer_metadata(ckpt / "tokenizer.json", "qwen2", cfg["vocab_size"])
    arrays = {k: v for k, v in gguf_names(C.read_tensors(ckpt)).items() if "_exps" not in k}
    raw = {}
    for layer in range(LAYERS):
        for n, (proj, t) in enumerate((("gate", "Q4_K"), ("up", "Q4_K"), ("down", "Q6_K"))):
            rows, cols = (H, I) if proj == "down" else (I, H)
            blocks = random_blocks(t, E * rows, cols, seed=3 * layer + n)
            raw[f"blk.{layer}.ffn_{proj}_exps.weight"] = (t, blocks.reshape(E, rows, -1))
    return write_gguf(root / "m.gguf", "qwen3moe", arrays, meta, raw=raw)


def load(path: Path, method: str, budget: str) -> LLM:
    """The file's experts as `method`: gguf-mixed as the file asks, or forced to gguf-layers."""
    orig = G._quantization
    if method == "gguf-layers":
        G._quantization = lambda p, gf: {**orig(p, gf), "experts": "gguf-layers"}
    G._CACHE.clear()
    try:
        llm = LLM(str(path), **({} if budget == "resident" else {"device_memory": budget}))
    finally:
        G._quantization = orig
    assert llm.source.method.name.startswith(method), llm.source.method.name
    return llm


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--budgets", default="resident,30%")
    args = ap.parse_args(argv)
    print(hardware_line())
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as d:
        path = write_file(Path(d))
        for budget in args.budgets.split(","):
            llms = {m: load(path, m, budget) for m in ("gguf-mixed", "gguf-layers")}
            try:
                tokens = {
                    m: llm.generate([PROMPT], params)[0].token_ids for m, llm in llms.items()
                }  # warm-up
                rates: dict[str, list[float]] = {m: [] for m in llms}
                for _ in range(args.rounds):
                    for m, llm in llms.items():
                        t0 = time.process_time()
                        out = llm.generate([PROMPT], params)[0]
                        rates[m].append(len(out.token_ids) / (time.process_time() - t0))
                for m, v in rates.items():
                    same = f" same_tokens={tokens[m] == tokens['gguf-mixed']}" if m == "gguf-layers" else ""
                    print(
                        f"gguf_layers method={m} budget={budget} tok_per_cpu_s={statistics.median(v):.1f} "
                        f"rounds={[round(x, 1) for x in v]}{same}"
                    )
            finally:
                for llm in llms.values():
                    llm.close()


if __name__ == "__main__":
    main()
