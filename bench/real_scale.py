"""expertcache and llama.cpp side by side at the shapes and formats people download: random-weight
checkpoints with the exact shapes and shipped layouts of gpt-oss-20b (MXFP4 experts) and
Qwen3-30B-A3B (bf16; int4), at the model's full depth (fewer layers with --layers, for quick runs),
converted with llama.cpp's own converter, llama-bench and expertcache run alternately in one run, 2 threads.

    python bench/real_scale.py --model gpt-oss-20b [--layers 24] [--rounds 3] [--threads 2]
        [--prompts 128 512] [--gen 32] [--cpu-math exact fast] [--parts resident cgroup]
        [--cgroup-share 0.45] [--dir ~/.cache/expertcache-realscale] [--keep]
    python bench/real_scale.py --model qwen3-30b-a3b --format bf16|int4 --layers 4 ...
    python bench/real_scale.py --model qwen3-30b-a3b --format int4 --dense int4 --lm-head int8 --llama-output q8_0 ...
        (the output matrix in the same bytes on both sides)
    python bench/real_scale.py --model gpt-oss-20b --layers 1 --write-only --dir D   (the checkpoint alone)

Checkpoints (under --dir, reused while their manifest matches): config.json with the real model's
fields (num_hidden_layers set to --layers), one safetensors shard per layer plus one for the
embeddings/lm_head, weights random with a fixed seed. gpt-oss-20b: experts as shipped,
`gate_up_proj_blocks` [32, 5760, 90, 16] / `_scales` [32, 5760, 90] (e2m1 codes and e8m0 scales drawn
at random) and down_proj's, expert biases, attention (with biases and sinks) and router in bf16.
Qwen3-30B-A3B: every tensor bf16, per-expert `mlp.experts.E.{gate,up,down}_proj.weight`; int4
through `expertcache quantize --experts int4` (ours) and llama-quantize Q4_0 (llama.cpp's).
Both carry the Qwen3 tokenizer (--tokenizer): the converter identifies a tokenizer by its
pre-tokenizer, the prompts are token ids, and the tokenizer changes no timing.

resident: everything in RAM (llama.cpp: mmap, warm page cache; expertcache: one long-lived process per
--cpu-math, prefix caching off). Where the checkpoint and the GGUF together do not fit in RAM (MemTotal
less --ram-reserve; the full gpt-oss-20b on a 24 GiB machine), the engines take turns: each round starts
every expertcache process (loaded and warmed up, not timed) and closes it before llama-bench, whose file
then fills the page cache again in its own warm-up run (`--fresh-workers` forces this). Per round: llama-bench
`-p 128,512 -n GEN -r 1` then each
expertcache process: a 128-token prompt and GEN tokens (decode after that prompt), then the 512-token
prompt alone. cgroup: each engine in its own memory cgroup (v1) of --cgroup-share x its model file's
size, page cache dropped before each llama-bench run; llama.cpp mmap, expertcache --low-memory (expert
slots 13%, no host tier, O_DIRECT reads); decode of GEN tokens after a 16-token prompt.
Limits measured in the same run: memory read bandwidth (256 MiB float32 sum, once per round) and
the disk's O_DIRECT read speed (the engine's DiskReader, 16 threads, 48 whole experts of this
checkpoint, once per round).

Lines (after the hardware line): `layout:` (bytes per layer and outside the layers), `round:` per
engine and round (with that round's read probe and, for expertcache's decode, its bytes per token x
the probe as the round's limit and the share of it reached), `summary:` per test and cpu-math (medians of the rounds, ratio of the medians,
median and range of the per-round ratios, the physical limit beside each figure).
Not part of CI: it needs the llama.cpp build of bench/peers/llama_cpp_bench.py and ~5-13 GB of disk.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

# config.json of openai/gpt-oss-20b and Qwen/Qwen3-30B-A3B (the fields the engines and the converter read)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 201088,
    "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MODELS = {"gpt-oss-20b": GPT_OSS_20B, "qwen3-30b-a3b": QWEN3_30B_A3B}
FORMATS = {
    "gpt-oss-20b": {"mxfp4": "MXFP4"},
    "qwen3-30b-a3b": {"bf16": "bf16", "int4": "Q4_0"},
}  # ours -> llama.cpp's
MXFP4_SCALE = 120  # e8m0 exponent of the random blocks: 2^-7 x e2m1 (|w| <= 6/128, rms ~0.023)


def model_config(model: str, layers: int, **overrides) -> dict:
    """The real config.json with `layers` layers (`overrides`: other fields, for toy sizes in tests)."""
    cfg = {**json.loads(json.dumps(MODELS[model])), **overrides}
    if not 1 <= layers <= cfg["num_hidden_layers"]:
        raise SystemExit(f"--layers {layers}: {model} has 1..{cfg['num_hidden_layers']} layers")
    cfg["num_hidden_layers"] = layers
    if model == "gpt-oss-20b":
        cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    else:
        cfg["max_window_layers"] = layers
    return cfg


def layer_tensors(model: str, cfg: dict, i: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer i's tensors in the shipped layout (shape legend: H hidden, E experts, I expert intermediate)."""
    H, E = cfg["hidden_size"], cfg.get("num_local_experts", cfg.get("num_experts"))
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    p = f"model.layers.{i}"
    t = {
        f"{p}.input_layernorm.weight": (1 + rnd(H, std=0.1).float()).bfloat16(),
        f"{p}.post_attention_layernorm.weight": (1 + rnd(H, std=0.1).float()).bfloat16(),
    }
    for n, o, inp in (("q", q, H), ("k", kv, H), ("v", kv, H), ("o", H, q)):
        t[f"{p}.self_attn.{n}_proj.weight"] = rnd(o, inp, std=inp**-0.5)
        if cfg["attention_bias"]:
            t[f"{p}.self_attn.{n}_proj.bias"] = rnd(o, std=0.02)
    if model == "gpt-oss-20b":
        I = cfg["intermediate_size"]
        t[f"{p}.self_attn.sinks"] = rnd(cfg["num_attention_heads"])
        t[f"{p}.mlp.router.weight"] = rnd(E, H, std=2 * H**-0.5)
        t[f"{p}.mlp.router.bias"] = rnd(E, std=0.1)
        t[f"{p}.mlp.experts.gate_up_proj_bias"] = rnd(E, 2 * I, std=0.02)
        t[f"{p}.mlp.experts.down_proj_bias"] = rnd(E, H, std=0.02)
        for name, out, inp in (
            ("gate_up_proj", 2 * I, H),
            ("down_proj", H, I),
        ):  # [E, out, in/32, 16], [E, out, in/32]
            t[f"{p}.mlp.experts.{name}_blocks"] = torch.randint(
                0, 256, (E, out, inp // 32, 16), generator=g, dtype=torch.uint8
            )
            t[f"{p}.mlp.experts.{name}_scales"] = torch.randint(
                MXFP4_SCALE - 1, MXFP4_SCALE + 2, (E, out, inp // 32), generator=g, dtype=torch.uint8
            )
    else:
        I, D = cfg["moe_intermediate_size"], cfg["head_dim"]
        t[f"{p}.self_attn.q_norm.weight"] = (1 + rnd(D, std=0.1).float()).bfloat16()
        t[f"{p}.self_attn.k_norm.weight"] = (1 + rnd(D, std=0.1).float()).bfloat16()
        t[f"{p}.mlp.gate.weight"] = rnd(E, H, std=2 * H**-0.5)
        for e in range(E):
            t[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rnd(I, H, std=H**-0.5)
            t[f"{p}.mlp.experts.{e}.up_proj.weight"] = rnd(I, H, std=H**-0.5)
            t[f"{p}.mlp.experts.{e}.down_proj.weight"] = rnd(
                H, I, std=I**-0.5 / cfg["num_hidden_layers"] ** 0.5
            )
    return t


def write_checkpoint(model: str, out: Path, layers: int, tokenizer: Path, seed: int = 0, **overrides) -> Path:
    """Write the random checkpoint unless `out` already holds it (same manifest); `overrides`:
    config fields replacing the real ones (toy sizes for tests)."""
    from safetensors.torch import save_file

    manifest = {"model": model, "layers": layers, "seed": seed, "version": 1, **overrides}
    if (out / "manifest.json").exists() and json.loads((out / "manifest.json").read_text()) == manifest:
        return out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cfg = model_config(model, layers, **overrides)
    g = torch.Generator().manual_seed(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    weight_map = {}
    shards = [
        {
            "model.embed_tokens.weight": (torch.randn(V, H, generator=g)).bfloat16(),
            "lm_head.weight": (torch.randn(V, H, generator=g) * H**-0.5).bfloat16(),
            "model.norm.weight": (1 + 0.1 * torch.randn(H, generator=g)).bfloat16(),
        }
    ]
    for i in range(-1, layers):
        tensors = shards.pop() if i < 0 else layer_tensors(model, cfg, i, g)
        name = f"model-{i + 2:05d}-of-{layers + 1:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer / f, out / f)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".safetensors")


def layout(ckpt: Path) -> dict:
    """Bytes per layer (experts, of them top-k per token, the rest) and outside the layers."""
    from safetensors import safe_open

    per_layer: dict[int, dict] = {}
    outside = 0
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                sl = h.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                n *= {"U8": 1, "BF16": 2, "F32": 4, "I32": 4, "F16": 2, "I8": 1}[sl.get_dtype()]
                if k.startswith("model.layers."):
                    L = int(k.split(".")[2])
                    kind = "experts" if ".experts." in k else "dense"
                    per_layer.setdefault(L, {"experts": 0, "dense": 0})[kind] += n
                else:
                    outside += n
    return {"layers": per_layer, "outside": outside}


def converter(cache: Path) -> Path:
    return cache / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"


def gguf_for(
    ckpt: Path, out: Path, cache: Path, bindir: Path, peer: str, output_type: str | None = None
) -> Path:
    """llama.cpp's GGUF of `ckpt` (its own converter; Q4_0 through its llama-quantize, its output matrix in
    `output_type` when given, else llama-quantize's choice), made once."""
    from llama_cpp_bench import sh

    if out.exists():
        return out
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    src = out.with_suffix(".src.gguf") if peer == "Q4_0" else out
    if not src.exists():
        outtype = [] if peer == "MXFP4" else ["--outtype", "bf16"]
        sh(
            [sys.executable, str(converter(cache)), str(ckpt), *outtype, "--outfile", str(src) + ".tmp"],
            env=env,
        )
        os.replace(str(src) + ".tmp", src)
    if peer == "Q4_0":
        out_type = ["--output-tensor-type", output_type] if output_type else []
        sh([str(bindir / "llama-quantize"), *out_type, str(src), str(out) + ".tmp", "Q4_0", "2"])
        os.replace(str(out) + ".tmp", out)
        src.unlink()
    return out


def disk_speed(ckpt: Path, threads: int = 16, experts: int = 48) -> tuple[float, bool]:
    """MB/s of whole experts read from `ckpt` with the engine's DiskReader (O_DIRECT when available)."""
    from disk_read import read_experts

    from expertcache.experts.layout import ExpertSource
    from expertcache.loader.safetensors_index import TensorIndex
    from expertcache.models.registry import read_config
    from expertcache.quant.checkpoint import method_from_config

    family, cfg, hf = read_config(ckpt)
    source = ExpertSource(TensorIndex(ckpt), cfg, family.names, method_from_config(hf))
    pairs = [(layer, e) for layer in source.layers for e in range(cfg.num_experts)]
    chosen = random.Random(time.time_ns()).sample(pairs, min(experts, len(pairs)))
    return read_experts(source, chosen, threads)


class MemoryCgroup:
    """A child memory cgroup (v1 or v2) of this process's own, `mib` MiB; `prefix` runs a command in it.
    Needs root; raises OSError where cgroups cannot be created."""

    def __init__(self, name: str, mib: int):
        line = next((x for x in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in x), None)
        if line is not None:
            self.path = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/") / name
            limit_file = "memory.limit_in_bytes"
        else:
            own = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
            self.path, limit_file = Path("/sys/fs/cgroup") / own[3:].lstrip("/") / name, "memory.max"
        self.path.mkdir(exist_ok=True)
        (self.path / limit_file).write_text(str(mib << 20))
        self.mib = mib
        self.prefix = ("sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh")

    def close(self) -> None:
        if (self.path / "memory.force_empty").exists():
            try:
                (self.path / "memory.force_empty").write_text("0")
            except OSError:
                pass
        try:
            self.path.rmdir()
        except OSError as e:
            print(f"note: could not remove {self.path}: {e}", file=sys.stderr)


def cgroup_bytes(lay: dict, share: float, full_layers: int) -> int:
    """The memory limit: `share` of the full model's size, scaled to the layers written. With fewer
    layers the embeddings and lm_head (outside the layers) weigh more; the limit keeps them and
    gives each written layer the memory a layer has when the full model runs in `share` of its size:
    outside + (share x full - outside) x written layer bytes / full layer bytes."""
    per_layer = sum(x["experts"] + x["dense"] for x in lay["layers"].values())
    full_layers_bytes = per_layer / len(lay["layers"]) * full_layers
    full = lay["outside"] + full_layers_bytes
    if share * full <= lay["outside"]:
        raise SystemExit(
            f"--cgroup-share {share}: below the {lay['outside'] / 1e9:.2f} GB outside the layers"
        )
    return int(lay["outside"] + (share * full - lay["outside"]) * per_layer / full_layers_bytes)


def drop_page_cache() -> None:
    subprocess.run(["sh", "-c", "sync; echo 1 > /proc/sys/vm/drop_caches"], check=False)


def rows_by_test(rows: list[dict]) -> dict[str, float]:
    out = {}
    for r in rows:
        key = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        out[key] = r["avg_ts"]
    return out


def summarize(tag: str, res: dict, limits: dict, extra: str = "") -> None:
    """res: engine -> [per round {test: tok/s}]; limits: test -> (tok/s, how) for expertcache's figures."""
    llama = res["llama.cpp"]
    for engine, runs in res.items():
        if engine == "llama.cpp":
            continue
        for test in runs[0]:
            if any(test not in r for r in llama):
                continue
            lm, em = statistics.median(r[test] for r in llama), statistics.median(r[test] for r in runs)
            ratios = sorted(e[test] / l[test] for l, e in zip(llama, runs))
            lim = limits.get(test)
            lim_s = (
                f" limit_tok_s={lim[0]:.2f} ({lim[1]}) expertcache_share_of_limit={em / lim[0]:.0%} "
                f"llama_share_of_limit={lm / lim[0]:.0%}"
                if lim
                else " limit=n/a"
            )
            print(
                f"summary: {tag} engine={engine} test={test} rounds={len(runs)} llama_tok_s={lm:.2f} "
                f"expertcache_tok_s={em:.2f} ratio={em / lm:.2f} round_ratio_median={statistics.median(ratios):.2f} "
                f"round_ratio_range={ratios[0]:.2f}-{ratios[-1]:.2f}{lim_s}{extra}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt-oss-20b")
    ap.add_argument(
        "--format", default=None, help="gpt-oss-20b: mxfp4; qwen3-30b-a3b: bf16 or int4 (default: the first)"
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="layers written (default: the model's full depth)"
    )
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache" / "expertcache-realscale")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "expertcache-peers",
        help="the llama.cpp build of bench/peers/llama_cpp_bench.py",
    )
    ap.add_argument(
        "--tokenizer",
        type=Path,
        default=HERE.parent / "tests" / "fixtures" / "qwen3-tokenizer",
        help="a tokenizer.json + tokenizer_config.json for the converter (default: the Qwen3 tokenizer "
        "the tests carry)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--cpu-math", nargs="+", default=["exact", "fast"], choices=["exact", "fast"])
    ap.add_argument("--parts", nargs="+", default=["resident", "cgroup"], choices=["resident", "cgroup"])
    ap.add_argument(
        "--cgroup-share",
        type=float,
        default=0.45,
        help="memory limit: this share of the full model's size, scaled to the layers written",
    )
    ap.add_argument("--cgroup-gen", type=int, default=8, help="tokens decoded per round in the memory cgroup")
    ap.add_argument(
        "--lm-head",
        default=None,
        help="expertcache's lm_head format (LLM(lm_head=...), e.g. int8: "
        "llama-quantize quantizes the output matrix too); default: as stored",
    )
    ap.add_argument(
        "--dense",
        default=None,
        help="expertcache's dense projections' format (LLM(dense=...), e.g. "
        "int4: a Q4_0 GGUF holds its attention in 4 bits); default: as stored",
    )
    ap.add_argument(
        "--llama-output",
        default=None,
        help="the Q4_0 GGUF's output matrix type (llama-quantize --output-tensor-type, e.g. q8_0: the "
        "bytes of --lm-head int8); default: llama-quantize's choice (Q6_K)",
    )
    ap.add_argument(
        "--llama-extra",
        type=shlex.split,
        default=[],
        help="further llama-bench flags in one quoted string, e.g. --llama-extra '--repack 0'",
    )
    ap.add_argument(
        "--fresh-workers",
        action="store_true",
        help="start and close the expertcache processes every round (default: only where the checkpoint "
        "and the GGUF do not fit in RAM together)",
    )
    ap.add_argument(
        "--ram-reserve",
        type=float,
        default=4.0,
        help="GiB of RAM left to everything else when judging whether both engines' weights fit",
    )
    ap.add_argument(
        "--write-only", action="store_true", help="write the checkpoint and print its layout line"
    )
    ap.add_argument(
        "--keep", action="store_true", help="keep the checkpoints and GGUFs (default: delete at the end)"
    )
    args = ap.parse_args()
    fmt = args.format or next(iter(FORMATS[args.model]))
    if fmt not in FORMATS[args.model]:
        raise SystemExit(f"--format {fmt}: {args.model} comes as {', '.join(FORMATS[args.model])}")
    peer = FORMATS[args.model][fmt]
    if args.layers is None:
        args.layers = MODELS[args.model]["num_hidden_layers"]
    torch.set_num_threads(args.threads)
    from common import hardware_line

    print(hardware_line(), flush=True)
    t0 = time.perf_counter()
    base = write_checkpoint(
        args.model, args.dir / f"{args.model}-{args.layers}L", args.layers, args.tokenizer
    )
    ckpt = base
    if fmt == "int4":
        from expertcache.quantize.rewrite import quantize_checkpoint

        ckpt = args.dir / f"{args.model}-{args.layers}L-int4"
        if not (ckpt / "config.json").exists():
            quantize_checkpoint(base, ckpt, "int4")
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(base / f, ckpt / f)
    lay = layout(ckpt)
    one = lay["layers"][0]
    cfg = MODELS[args.model]
    E = cfg.get("num_local_experts", cfg.get("num_experts"))
    k = cfg["num_experts_per_tok"]
    print(
        f"layout: model={args.model} format={fmt} layers={args.layers}/{cfg['num_hidden_layers']} "
        f"checkpoint_GB={dir_bytes(ckpt) / 1e9:.2f} per_layer_experts_GB={one['experts'] / 1e9:.3f} "
        f"per_layer_dense_GB={one['dense'] / 1e9:.4f} "
        f"per_layer_read_per_token_GB={(one['experts'] * k / E + one['dense']) / 1e9:.4f} "
        f"outside_layers_GB={lay['outside'] / 1e9:.3f} (embeddings + lm_head + norm) "
        f"written_in_s={time.perf_counter() - t0:.0f}",
        flush=True,
    )
    if args.write_only:
        return
    from llama_cpp_bench import build_llama_cpp

    bindir = build_llama_cpp(args.cache)
    ver = subprocess.run(
        [str(bindir / "llama-bench"), "--version"], check=False, capture_output=True, text=True
    )
    print(
        f"llama.cpp: {(ver.stdout + ver.stderr).strip().splitlines()[-1]} extra_flags={args.llama_extra or 'none'}",
        flush=True,
    )
    t0 = time.perf_counter()
    if args.llama_output and peer != "Q4_0":
        raise SystemExit(f"--llama-output: only for the Q4_0 GGUF (this run's is {peer})")
    name = f"{args.model}-{args.layers}L-{peer}" + (f"-out-{args.llama_output}" if args.llama_output else "")
    gguf = gguf_for(base, args.dir / f"{name}.gguf", args.cache, bindir, peer, args.llama_output)
    print(
        f"gguf: {gguf.name} GB={gguf.stat().st_size / 1e9:.2f} made_in_s={time.perf_counter() - t0:.0f}",
        flush=True,
    )
    tag = (
        f"model={args.model} layers={args.layers} format={fmt} llama_format={peer} threads={args.threads} "
        f"lm_head={args.lm_head or 'stored'} dense={args.dense or 'stored'}"
        + (f" llama_output={args.llama_output}" if args.llama_output else "")
    )
    pp = ",".join(map(str, args.prompts))
    try:
        if "resident" in args.parts:
            resident_part(args, tag, ckpt, gguf, bindir, pp)
        if "cgroup" in args.parts:
            cgroup_part(args, tag, ckpt, gguf, bindir)
    finally:
        if not args.keep:
            for p in (base, ckpt):
                shutil.rmtree(p, ignore_errors=True)
            gguf.unlink(missing_ok=True)


def mem_total() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal:"))
    return int(line.split()[1]) << 10


def resident_part(args, tag: str, ckpt: Path, gguf: Path, bindir: Path, pp: str) -> None:
    from kernel_bench import read_bandwidth
    from llama_cpp_bench import Worker, llama_bench_rows

    extra = {k: v for k, v in (("lm_head", args.lm_head), ("dense", args.dense)) if v}
    need, have = dir_bytes(ckpt) + gguf.stat().st_size, mem_total() - int(args.ram_reserve * 2**30)
    fresh = args.fresh_workers or need > have
    print(
        f"resident: weights_GB={need / 1e9:.2f} (checkpoint + GGUF) ram_GB={have / 1e9:.2f} (MemTotal less "
        f"--ram-reserve) workers={'started every round' if fresh else 'long-lived'}",
        flush=True,
    )

    def start(m: str) -> Worker:
        return Worker(
            ckpt,
            max(args.prompts),
            args.gen,
            args.threads,
            {"cpu_math": m, **extra},
            warm=tuple(args.prompts),
        )

    workers = {} if fresh else {m: start(m) for m in args.cpu_math}
    res = {"llama.cpp": [], **{m: [] for m in args.cpu_math}}
    bws, bpt = [], None
    try:
        for r in range(args.rounds):
            bws.append(read_bandwidth())
            for engine, runs in res.items():
                t1 = time.perf_counter()
                if engine == "llama.cpp":
                    got = rows_by_test(
                        llama_bench_rows(bindir, gguf, pp, args.gen, args.threads, tuple(args.llama_extra))
                    )
                else:
                    w = workers[engine] if not fresh else start(engine)
                    bpt = w.info["bytes_per_token"] / 1e9
                    t2 = time.perf_counter()
                    got = {}
                    for i, n in enumerate(args.prompts):  # decode after the first prompt
                        m = w.measure(n, args.gen if i == 0 else 1)
                        got[f"pp{n}"] = m["pp"]
                        if i == 0:
                            got[f"tg{args.gen}"] = m["tg"]
                    if fresh:
                        w.close()
                    t1 = t2
                runs.append(got)
                share = ""
                if engine != "llama.cpp":
                    lim = bws[-1] / bpt
                    share = (
                        f" round_limit_tok_s={lim:.2f} ({bpt:.3f} GB/token x {bws[-1]:.1f} GB/s) "
                        f"share_of_round_limit={got[f'tg{args.gen}'] / lim:.0%}"
                    )
                print(
                    f"round: {tag} part=resident round={r} engine={engine} "
                    + " ".join(f"{t}_tok_s={v:.2f}" for t, v in sorted(got.items()))
                    + f" read_GBps={bws[-1]:.1f}{share} wall_s={time.perf_counter() - t1:.0f}",
                    flush=True,
                )
    finally:
        for w in workers.values():
            w.close()
    tg = f"tg{args.gen}"
    shares = sorted(e[tg] * bpt / b for e, b in zip(res[args.cpu_math[0]], bws))
    bw = statistics.median(bws)
    limits = {tg: (bw / bpt, f"{bpt:.3f} GB per token x read {bw:.1f} GB/s")}
    summarize(
        tag + " part=resident",
        res,
        limits,
        f" {args.cpu_math[0]}_share_of_round_limit_median={statistics.median(shares):.0%} "
        f"({shares[0]:.0%}-{shares[-1]:.0%})",
    )


def cgroup_part(args, tag: str, ckpt: Path, gguf: Path, bindir: Path) -> None:
    from llama_cpp_bench import Worker, llama_bench_rows

    limit = cgroup_bytes(layout(ckpt), args.cgroup_share, MODELS[args.model]["num_hidden_layers"])
    mib_ec = limit >> 20
    mib_ll = int(limit * gguf.stat().st_size / dir_bytes(ckpt)) >> 20  # the same share of llama.cpp's file
    try:
        cg_ec = MemoryCgroup(f"realscale-ec-{os.getpid()}", mib_ec)
        try:
            cg_ll = MemoryCgroup(f"realscale-ll-{os.getpid()}", mib_ll)
        except OSError:
            cg_ec.close()
            raise
    except OSError as e:
        print(f"cgroup: skipped, a memory cgroup cannot be created here ({e})", flush=True)
        return
    tag += f" part=cgroup share={args.cgroup_share} expertcache_limit_MiB={mib_ec} llama_limit_MiB={mib_ll}"
    test = f"tg{args.cgroup_gen}"
    res = {"llama.cpp": [], "fast": []}
    disks = []
    worker = None
    try:
        drop_page_cache()
        # auto budgets: the expert slots take the RAM the cgroup leaves after the engine's other terms
        opts = {"cpu_math": "fast", "low_memory": True, "max_num_batched_tokens": 512}
        worker = Worker(ckpt, 16, args.cgroup_gen, args.threads, opts, prefix=cg_ec.prefix)
        before = worker.measure()["disk_bytes"]
        disk_per_token = []
        for r in range(args.rounds):
            disks.append(disk_speed(ckpt)[0])
            for engine, runs in res.items():
                t1 = time.perf_counter()
                if engine == "llama.cpp":
                    drop_page_cache()
                    try:
                        got = {
                            test: rows_by_test(
                                llama_bench_rows(
                                    bindir,
                                    gguf,
                                    "0",
                                    args.cgroup_gen,
                                    args.threads,
                                    tuple(args.llama_extra),
                                    cg_ll.prefix,
                                )
                            )[test]
                        }
                    except subprocess.CalledProcessError as e:
                        print(
                            f"round: {tag} round={r} engine=llama.cpp failed: exit {e.returncode} "
                            f"(-9 / 137: killed by the memory limit)",
                            flush=True,
                        )
                        return
                else:
                    m = worker.measure()
                    got = {test: m["tg"]}
                    disk_per_token.append((m["disk_bytes"] - before) / (args.cgroup_gen + 1))
                    before = m["disk_bytes"]
                runs.append(got)
                print(
                    f"round: {tag} round={r} engine={engine} {test}_tok_s={got[test]:.3f} disk_MBps={disks[-1]:.0f} "
                    + (f"disk_GB_per_token={disk_per_token[-1] / 1e9:.3f} " if engine != "llama.cpp" else "")
                    + f"wall_s={time.perf_counter() - t1:.0f}",
                    flush=True,
                )
        d, dpt = statistics.median(disks), statistics.median(disk_per_token) / 1e9
        limits = {
            test: (d / 1e3 / dpt, f"{dpt:.3f} GB read from disk per token x disk {d:.0f} MB/s O_DIRECT")
        }
        summarize(tag, res, limits)
    except RuntimeError as e:  # the worker died (the memory limit)
        print(f"cgroup: expertcache failed: {e} (-9: killed by the memory limit)", flush=True)
    finally:
        if worker is not None:
            try:
                worker.close()
            except (OSError, ValueError):
                pass
        cg_ec.close()
        cg_ll.close()


if __name__ == "__main__":
    main()
