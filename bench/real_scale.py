"""expertcache and llama.cpp side by side at the shapes and formats people download: random-weight
checkpoints with the exact shapes and shipped layouts of gpt-oss-20b (MXFP4 experts) and
Qwen3-30B-A3B (bf16; int4), at the model's full depth (fewer layers with --layers, for quick runs),
converted with llama.cpp's own converter, llama-bench and expertcache run alternately in one run, 2 threads.

    python bench/real_scale.py --model gpt-oss-20b [--layers 24] [--rounds 3] [--threads 2]
        [--prompts 128 512] [--gen 32] [--cpu-math auto exact fast] [--parts resident cgroup]
        [--ours-from safetensors gguf] [--cgroup-share 0.45] [--dir ~/.cache/expertcache-realscale] [--keep]
    python bench/real_scale.py --model qwen3-30b-a3b --format bf16|int4 --layers 4 ...
    python bench/real_scale.py --model qwen3-30b-a3b --format int4 --dense int4 --lm-head int8 --llama-output q8_0 ...
        (the output matrix in the same bytes on both sides)
    python bench/real_scale.py --model qwen3-30b-a3b --format q4_k_m --ours-from gguf --layers 4 ...
        (llama-quantize's Q4_K_M file, read by both engines)
    python bench/real_scale.py --model gpt-oss-20b --layers 1 --write-only [--gguf] --dir D
        (the checkpoint alone; with --gguf its GGUF too)

Checkpoints (under --dir, reused while their manifest matches): config.json with the real model's
fields (num_hidden_layers set to --layers), one safetensors shard per layer plus one for the
embeddings/lm_head, weights random with a fixed seed. gpt-oss-20b: experts as shipped,
`gate_up_proj_blocks` [32, 5760, 90, 16] / `_scales` [32, 5760, 90] (e2m1 codes and e8m0 scales drawn
at random) and down_proj's, expert biases, attention (with biases and sinks) and router in bf16.
Qwen3-30B-A3B: every tensor bf16, per-expert `mlp.experts.E.{gate,up,down}_proj.weight`; int4
through `expertcache quantize --experts int4` (ours) and llama-quantize Q4_0 (llama.cpp's).
Both carry the Qwen3 tokenizer (--tokenizer): the converter identifies a tokenizer by its
pre-tokenizer, the prompts are token ids, and the tokenizer changes no timing.

What expertcache reads (--ours-from, one or both, each its own engine in every round): `safetensors`
(the default) the checkpoint above (int4: `expertcache quantize`'s rewrite of it); `gguf` the very GGUF
file llama-bench reads (`LLM("x.gguf")`, expertcache/gguf/): the same bytes on both sides. Format
q4_k_m (Qwen3-30B-A3B) exists only as llama-quantize's Q4_K_M file, so it runs with `--ours-from gguf`.
--cpu-math auto is what `LLM(...)` does without the keyword (fast where the CPU has AVX-512 BF16/VNNI,
else exact; $EXPERTCACHE_CPU_MATH overrides); the lines name the math it resolved to.

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
engine (`engine=llama.cpp`, or `engine=MATH:SOURCE`, e.g. `auto:gguf`) and round (with that round's
read probe and, for expertcache's decode, its bytes per token x the probe as the round's limit, the
share of it reached and the CPU math it ran), `summary:` per test and expertcache engine (medians of
the rounds, ratio of the medians, median and range of the per-round ratios, the physical limit beside
each figure).
Not part of CI: it needs the llama.cpp build of bench/peers/llama_cpp_bench.py and ~5-28 GB of disk
(the full gpt-oss-20b: 13.8 GB checkpoint + 13.8 GB GGUF).
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
    "qwen3-30b-a3b": {"bf16": "bf16", "int4": "Q4_0", "q4_k_m": "Q4_K_M"},
}  # ours -> llama.cpp's
QUANTIZED = ("Q4_0", "Q4_K_M")  # llama.cpp's formats made by llama-quantize from the converter's bf16 file
GGUF_ONLY = ("q4_k_m",)  # formats only a GGUF holds: expertcache reads them with --ours-from gguf
SOURCES = ("safetensors", "gguf")  # what expertcache reads (--ours-from)
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


def layer_tensors(
    model: str, cfg: dict, i: int, g: torch.Generator, experts: bool = True
) -> dict[str, torch.Tensor]:
    """Layer i's tensors in the shipped layout (shape legend: H hidden, E experts, I expert intermediate);
    experts=False: Qwen3's without its routed experts (bench/depth_writer.py draws them as blocks)."""
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
        for e in range(E if experts else 0):
            t[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rnd(I, H, std=H**-0.5)
            t[f"{p}.mlp.experts.{e}.up_proj.weight"] = rnd(I, H, std=H**-0.5)
            t[f"{p}.mlp.experts.{e}.down_proj.weight"] = rnd(
                H, I, std=I**-0.5 / cfg["num_hidden_layers"] ** 0.5
            )
    return t


def outer_tensors(cfg: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The tensors outside the layers, drawn first (so a checkpoint of any depth shares them)."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    return {
        "model.embed_tokens.weight": (torch.randn(V, H, generator=g)).bfloat16(),
        "lm_head.weight": (torch.randn(V, H, generator=g) * H**-0.5).bfloat16(),
        "model.norm.weight": (1 + 0.1 * torch.randn(H, generator=g)).bfloat16(),
    }


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
    weight_map = {}
    shards = [outer_tensors(cfg, g)]
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
    """Bytes per layer (experts, of them top-k per token, the rest) and outside the layers, of a checkpoint
    directory or a GGUF file."""
    from safetensors import safe_open

    per_layer: dict[int, dict] = {}
    outside = 0
    if ckpt.suffix == ".gguf":
        from expertcache.gguf.reader import read_gguf

        for t in read_gguf(ckpt).tensors.values():
            if t.name.startswith("blk."):
                kind = "experts" if "_exps." in t.name else "dense"
                per_layer.setdefault(int(t.name.split(".")[1]), {"experts": 0, "dense": 0})[kind] += t.nbytes
            else:
                outside += t.nbytes
        return {"layers": per_layer, "outside": outside}
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
    """llama.cpp's GGUF of `ckpt` (its own converter; Q4_0 and Q4_K_M through its llama-quantize, the
    output matrix in `output_type` when given, else llama-quantize's choice), made once."""
    from llama_cpp_bench import sh

    if out.exists():
        return out
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    src = out.with_suffix(".src.gguf") if peer in QUANTIZED else out
    if not src.exists():
        outtype = [] if peer == "MXFP4" else ["--outtype", "bf16"]
        sh(
            [sys.executable, str(converter(cache)), str(ckpt), *outtype, "--outfile", str(src) + ".tmp"],
            env=env,
        )
        os.replace(str(src) + ".tmp", src)
    if peer in QUANTIZED:
        out_type = ["--output-tensor-type", output_type] if output_type else []
        sh([str(bindir / "llama-quantize"), *out_type, str(src), str(out) + ".tmp", peer, "2"])
        os.replace(str(out) + ".tmp", out)
        src.unlink()
    return out


def disk_speed(ckpt: Path, threads: int = 16, experts: int = 48) -> tuple[float, bool]:
    """MB/s of whole experts read from `ckpt` (a checkpoint directory or a .gguf file) with the engine's
    DiskReader (O_DIRECT when available)."""
    from disk_read import read_experts

    from expertcache.experts.layout import ExpertSource
    from expertcache.models.registry import open_index, read_config
    from expertcache.quant.checkpoint import method_from_config

    family, cfg, hf = read_config(ckpt)
    source = ExpertSource(open_index(ckpt, family), cfg, family.names, method_from_config(hf))
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt-oss-20b")
    ap.add_argument(
        "--format",
        default=None,
        help="gpt-oss-20b: mxfp4; qwen3-30b-a3b: bf16, int4 or q4_k_m (GGUF only) (default: the first)",
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
    ap.add_argument(
        "--cpu-math",
        nargs="+",
        default=["auto"],
        choices=["auto", "exact", "fast"],
        help="expertcache's CPU maths, one process each (auto: LLM's default, resolved on this CPU)",
    )
    ap.add_argument(
        "--ours-from",
        nargs="+",
        default=["safetensors"],
        choices=SOURCES,
        help="what expertcache reads: the safetensors checkpoint, and/or the very GGUF file llama.cpp "
        "reads (each its own engine in every round)",
    )
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
        "--llm",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="further LLM(...) keywords for expertcache, e.g. device_memory=100%% kv_cache_memory=512MiB "
        "(every expert in RAM where the auto budget, half of MemAvailable, holds fewer)",
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
    ap.add_argument("--gguf", action="store_true", help="with --write-only: make llama.cpp's GGUF of it too")
    ap.add_argument(
        "--direct",
        action="store_true",
        help="qwen3-30b-a3b int4: write the int4 checkpoint and the Q4_0 GGUF layer by layer, without the "
        "bf16 checkpoint at full depth (~61 GB); q4_k_m: the Q4_K_M GGUF alone (bench/depth_writer.py)",
    )
    ap.add_argument(
        "--keep", action="store_true", help="keep the checkpoints and GGUFs (default: delete at the end)"
    )
    args = ap.parse_args(argv)
    args.format = args.format or next(iter(FORMATS[args.model]))
    if args.format not in FORMATS[args.model]:
        raise SystemExit(f"--format {args.format}: {args.model} comes as {', '.join(FORMATS[args.model])}")
    args.peer = FORMATS[args.model][args.format]
    if args.format in GGUF_ONLY and args.ours_from != ["gguf"]:
        raise SystemExit(
            f"--format {args.format}: only a GGUF holds it; expertcache reads it with --ours-from gguf"
        )
    if args.llama_output and args.peer not in QUANTIZED:
        raise SystemExit(f"--llama-output: only for a llama-quantize GGUF (this run's is {args.peer})")
    if args.gguf and not args.write_only:
        raise SystemExit("--gguf: only with --write-only (a run makes its GGUF anyway)")
    if args.direct and (args.model, args.format) not in (
        ("qwen3-30b-a3b", "int4"),
        ("qwen3-30b-a3b", "q4_k_m"),
    ):
        raise SystemExit("--direct: only --model qwen3-30b-a3b --format int4 or q4_k_m")
    bad = [kv for kv in args.llm if "=" not in kv]
    if bad:
        raise SystemExit(f"--llm {bad[0]}: give KEY=VALUE")
    args.llm = dict(kv.split("=", 1) for kv in args.llm)
    args.cpu_math = list(dict.fromkeys(args.cpu_math))
    args.ours_from = list(dict.fromkeys(args.ours_from))
    if args.layers is None:
        args.layers = MODELS[args.model]["num_hidden_layers"]
    return args


def engines(args: argparse.Namespace) -> list[tuple[str, str]]:
    """expertcache's engines of the run: (cpu math, source), each named `MATH:SOURCE` in the lines."""
    return [(m, src) for src in args.ours_from for m in args.cpu_math]


def main() -> None:
    args = parse_args()
    fmt, peer = args.format, args.peer
    torch.set_num_threads(args.threads)
    from common import hardware_line

    print(hardware_line(), flush=True)
    t0 = time.perf_counter()
    if args.direct:
        base, direct_gguf, bindir = direct_files(args)
    else:
        base = write_checkpoint(
            args.model, args.dir / f"{args.model}-{args.layers}L", args.layers, args.tokenizer
        )
    ckpt = base
    if fmt == "int4" and "safetensors" in args.ours_from and not args.direct:
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
        f"checkpoint={ckpt.name} checkpoint_GB={source_bytes(ckpt) / 1e9:.2f} per_layer_experts_GB={one['experts'] / 1e9:.3f} "
        f"per_layer_dense_GB={one['dense'] / 1e9:.4f} "
        f"per_layer_read_per_token_GB={(one['experts'] * k / E + one['dense']) / 1e9:.4f} "
        f"outside_layers_GB={lay['outside'] / 1e9:.3f} (embeddings + lm_head + norm) "
        f"written_in_s={time.perf_counter() - t0:.0f}",
        flush=True,
    )
    if args.write_only and not args.gguf:
        return
    from llama_cpp_bench import build_llama_cpp

    bindir = bindir if args.direct else build_llama_cpp(args.cache)
    ver = subprocess.run(
        [str(bindir / "llama-bench"), "--version"], check=False, capture_output=True, text=True
    )
    print(
        f"llama.cpp: {'; '.join((ver.stdout + ver.stderr).strip().splitlines())} "
        f"extra_flags={args.llama_extra or 'none'}",
        flush=True,
    )
    t0 = time.perf_counter()
    name = f"{args.model}-{args.layers}L-{peer}" + (f"-out-{args.llama_output}" if args.llama_output else "")
    gguf = (
        direct_gguf
        if args.direct
        else gguf_for(base, args.dir / f"{name}.gguf", args.cache, bindir, peer, args.llama_output)
    )
    print(
        f"gguf: {gguf.name} GB={gguf.stat().st_size / 1e9:.2f} made_in_s={time.perf_counter() - t0:.0f}",
        flush=True,
    )
    if args.write_only:
        return
    sources = {"safetensors": ckpt, "gguf": gguf}
    tag = (
        f"model={args.model} layers={args.layers} format={fmt} llama_format={peer} threads={args.threads} "
        f"lm_head={args.lm_head or 'stored'} dense={args.dense or 'stored'}"
        + (f" llama_output={args.llama_output}" if args.llama_output else "")
    )
    pp = ",".join(map(str, args.prompts))
    try:
        if "resident" in args.parts:
            resident_part(args, tag, sources, bindir, pp)
        if "cgroup" in args.parts:
            cgroup_part(args, tag, sources, bindir)
    finally:
        if not args.keep:
            for p in (base, ckpt):
                shutil.rmtree(p, ignore_errors=True)
            gguf.unlink(missing_ok=True)


def direct_files(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """--direct: (the int4 checkpoint, llama.cpp's Q4_0 GGUF of the same weights) or, for q4_k_m, (the Q4_K_M
    GGUF, the same), written layer by layer (bench/depth_writer.py; the GGUF's types and metadata from
    llama-quantize's file of the 1-layer checkpoint (Q4_K_M: 2 layers, so both of its attn_v / ffn_down types
    show), checked against it first), and llama.cpp's binaries."""
    import depth_writer as W
    from llama_cpp_bench import build_llama_cpp

    bindir = build_llama_cpp(args.cache)
    gg = W.gguf_module(converter(args.cache).parent)
    n = 2 if args.format == "q4_k_m" else 1
    small = write_checkpoint(args.model, args.dir / f"{args.model}-{n}L", n, args.tokenizer)
    kind = args.peer + (f"-out-{args.llama_output}" if args.llama_output else "")
    template = gguf_for(
        small, args.dir / f"{args.model}-{n}L-{kind}.gguf", args.cache, bindir, args.peer, args.llama_output
    )
    out = args.dir / f"{args.model}-{args.layers}L-{kind}-direct.gguf"
    ckpt = None if args.format == "q4_k_m" else args.dir / f"{args.model}-{args.layers}L-int4-direct"
    if not (out.exists() if ckpt is None else W.written(ckpt, args.layers)):
        W.check_against_template(gg, args.model, args.tokenizer, template, args.dir)
    ckpt, gguf = W.write_both(gg, args.model, args.layers, args.tokenizer, template, ckpt, out)
    return ckpt or gguf, gguf, bindir


def mem_total() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal:"))
    return int(line.split()[1]) << 10


def source_bytes(path: Path) -> int:
    return path.stat().st_size if path.suffix == ".gguf" else dir_bytes(path)


def resident_part(args, tag: str, sources: dict[str, Path], bindir: Path, pp: str) -> None:
    """sources: what expertcache may read (safetensors: the checkpoint directory, gguf: llama.cpp's file)."""
    from kernel_bench import read_bandwidth
    from llama_cpp_bench import Worker, llama_bench_rows

    extra = {k: v for k, v in (("lm_head", args.lm_head), ("dense", args.dense)) if v} | args.llm
    gguf = sources["gguf"]
    # llama.cpp's file in the page cache, and each source expertcache reads copied into its own memory
    need = gguf.stat().st_size + sum(source_bytes(sources[s]) for s in args.ours_from)
    have = mem_total() - int(args.ram_reserve * 2**30)
    fresh = args.fresh_workers or need > have
    print(
        f"resident: weights_GB={need / 1e9:.2f} (the GGUF + what expertcache reads: "
        f"{', '.join(args.ours_from)}) ram_GB={have / 1e9:.2f} (MemTotal less --ram-reserve) "
        f"workers={'started every round' if fresh else 'long-lived'}",
        flush=True,
    )

    def start(m: str, src: str) -> Worker:
        return Worker(
            sources[src],
            max(args.prompts),
            args.gen,
            args.threads,
            {"cpu_math": m, **extra},
            warm=tuple(args.prompts),
        )

    names = {f"{m}:{src}": (m, src) for m, src in engines(args)}
    workers = {} if fresh else {n: start(*e) for n, e in names.items()}
    res = {"llama.cpp": [], **{n: [] for n in names}}
    bws = []
    bpt: dict[str, float] = {}  # engine -> GB read per decode token
    math: dict[str, str] = {}  # engine -> the CPU math it ran (auto resolved)
    held: dict[str, str] = {}  # engine -> resident (every expert in RAM) or CACHED (the budget held fewer)
    huge: dict[str, float] = {}  # engine -> the share of its anonymous memory on 2 MiB pages
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
                    w = workers[engine] if not fresh else start(*names[engine])
                    bpt[engine] = w.info["bytes_per_token"] / 1e9
                    math[engine] = w.info.get("cpu_math", names[engine][0])
                    held[engine] = "resident" if w.info.get("experts_resident", True) else "CACHED"
                    huge[engine] = w.info.get("huge_pages", 0.0)
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
                    lim = bws[-1] / bpt[engine]
                    share = (
                        f" cpu_math={math[engine]} experts={held[engine]} huge_pages={huge[engine]:.0%}"
                        f" round_limit_tok_s={lim:.2f} ({bpt[engine]:.3f} GB/token x "
                        f"{bws[-1]:.1f} GB/s) share_of_round_limit={got[f'tg{args.gen}'] / lim:.0%}"
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
    bw = statistics.median(bws)
    for engine in (e for e, h in held.items() if h != "resident"):
        print(
            f"note: engine={engine} held fewer than every expert in RAM (the auto budget is half of "
            "MemAvailable at its start): its figures are not resident ones",
            flush=True,
        )
    for engine in names:
        shares = sorted(e[tg] * bpt[engine] / b for e, b in zip(res[engine], bws))
        limits = {tg: (bw / bpt[engine], f"{bpt[engine]:.3f} GB per token x read {bw:.1f} GB/s")}
        summarize(
            f"{tag} part=resident cpu_math={math[engine]}",
            {"llama.cpp": res["llama.cpp"], engine: res[engine]},
            limits,
            f" {tg}_share_of_round_limit_median={statistics.median(shares):.0%} "
            f"({shares[0]:.0%}-{shares[-1]:.0%})",
        )


def cgroup_part(args, tag: str, sources: dict[str, Path], bindir: Path) -> None:
    """Each engine in its own memory cgroup: expertcache (first --cpu-math, each --ours-from) --low-memory,
    llama.cpp mmap; the limit --cgroup-share of the model's size, scaled to the layers written."""
    from llama_cpp_bench import Worker, llama_bench_rows

    ckpt, gguf = sources["safetensors"], sources["gguf"]
    limit = cgroup_bytes(layout(ckpt), args.cgroup_share, MODELS[args.model]["num_hidden_layers"])
    mib = {
        "safetensors": limit >> 20,
        "gguf": int(limit * gguf.stat().st_size / source_bytes(ckpt)) >> 20,  # the same share of the file
    }
    groups: dict[str, MemoryCgroup] = {}
    try:
        for src in ("gguf", *args.ours_from):  # llama.cpp's, then expertcache's
            key = "llama.cpp" if src == "gguf" and "llama.cpp" not in groups else src
            groups[key] = MemoryCgroup(f"realscale-{key.replace('.', '')}-{os.getpid()}", mib[src])
    except OSError as e:
        for g in groups.values():
            g.close()
        print(f"cgroup: skipped, a memory cgroup cannot be created here ({e})", flush=True)
        return
    tag += f" part=cgroup share={args.cgroup_share} " + " ".join(
        f"{k}_limit_MiB={g.mib}" for k, g in groups.items()
    )
    test = f"tg{args.cgroup_gen}"
    m = args.cpu_math[0]
    names = [f"{m}:{src}" for src in args.ours_from]
    res = {"llama.cpp": [], **{n: [] for n in names}}
    disks: dict[str, list[float]] = {n: [] for n in names}
    workers: dict[str, Worker] = {}
    try:
        drop_page_cache()
        # auto budgets: the expert slots take the RAM the cgroup leaves after the engine's other terms
        opts = {"cpu_math": m, "low_memory": True, "max_num_batched_tokens": 512} | args.llm
        for n, src in zip(names, args.ours_from):
            workers[n] = Worker(
                sources[src], 16, args.cgroup_gen, args.threads, opts, prefix=groups[src].prefix
            )
        before = {n: w.measure()["disk_bytes"] for n, w in workers.items()}
        disk_per_token: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n, src in zip(names, args.ours_from):
                disks[n].append(disk_speed(sources[src])[0])
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
                                    groups["llama.cpp"].prefix,
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
                    got_m = workers[engine].measure()
                    got = {test: got_m["tg"]}
                    disk_per_token[engine].append(
                        (got_m["disk_bytes"] - before[engine]) / (args.cgroup_gen + 1)
                    )
                    before[engine] = got_m["disk_bytes"]
                runs.append(got)
                disk = disks[engine][-1] if engine != "llama.cpp" else disks[names[0]][-1]
                print(
                    f"round: {tag} round={r} engine={engine} {test}_tok_s={got[test]:.3f} disk_MBps={disk:.0f} "
                    + (
                        f"disk_GB_per_token={disk_per_token[engine][-1] / 1e9:.3f} "
                        if engine != "llama.cpp"
                        else ""
                    )
                    + f"wall_s={time.perf_counter() - t1:.0f}",
                    flush=True,
                )
        for n in names:
            d, dpt = statistics.median(disks[n]), statistics.median(disk_per_token[n]) / 1e9
            limits = (
                {test: (d / 1e3 / dpt, f"{dpt:.3f} GB read from disk per token x disk {d:.0f} MB/s O_DIRECT")}
                if dpt > 0
                else {}  # nothing read from disk: the limit held every expert, no disk limit to name
            )
            summarize(tag, {"llama.cpp": res["llama.cpp"], n: res[n]}, limits)
    except RuntimeError as e:  # a worker died (the memory limit)
        print(f"cgroup: expertcache failed: {e} (-9: killed by the memory limit)", flush=True)
    finally:
        for w in workers.values():
            try:
                w.close()
            except (OSError, ValueError):
                pass
        for g in groups.values():
            g.close()


if __name__ == "__main__":
    main()
