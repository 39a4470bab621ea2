"""The built-in demo models: the shipped trained one, and a deterministic random-weight one.

`demo_model_dir()` is the model `expertcache demo` (and every command given no model) runs: a tiny
Qwen3-MoE trained by `expertcache/demo_train.py` on this project's own docs and source, shipped in
`expertcache/demo_model/` and checked against its manifest on every use. `describe()` says in one
line what it is and what to expect from it.

`random_demo_dir()` builds (once, cached) a randomly initialised checkpoint of the same format:
untrained, for tests, benchmarks and the comparison with a trained router (`demo --random`).

Layout of both checkpoint directories:

    config.json                         Qwen3MoeForCausalLM config, written as a plain dict
    generation_config.json              eos_token_id = [<|endoftext|>, <|im_end|>]
    tokenizer.json                      byte-level BPE trained here (`train_tokenizer`)
    tokenizer_config.json               eos/pad tokens and a ChatML chat_template
    model*.safetensors                  bf16 weights under hub names (random: split by layer ranges)
    model.safetensors.index.json        random model: {"metadata": {"total_size"}, "weight_map"}
    heldout.txt                         trained model: text of files it was not trained on
    expertcache_demo.json               manifest: build parameters (+ training summary) + size/sha256 of every file

Invariants (random model):
- Same seed and sizes => byte-identical files. Every tensor has its own generator seeded
  from (seed, tensor name), so values do not depend on generation order or sharding.
- The cache directory is created by renaming a finished temp directory, so a reader
  never sees a half-written model; the manifest is written last, inside the temp dir.
- On reuse, sizes of all files are checked, plus the sha256 of the small files and of
  every safetensors header (cheap). `check_demo_model(path, deep=True)` hashes everything.
- Routed experts are the bulk of the bytes (>= 80% at default sizes), like real MoEs.
- transformers is not imported here (tests use it as the oracle).

Routing is made deliberately non-uniform: each router is low rank and every token
embedding shares a common direction, so a few experts per layer are hot and
consecutive tokens tend to reuse experts, which is what an expert cache feeds on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

from .demo_corpus import CORPUS  # the tokenizer's training text
from .loader.writer import write_safetensors

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
DEMO_NAME = f"demo-qwen3moe-v{FORMAT_VERSION}"
MANIFEST = "expertcache_demo.json"

DEFAULT_SIZES: dict[str, Any] = {
    "num_layers": 8,
    "num_experts": 32,
    "top_k": 4,
    "hidden": 256,
    "moe_intermediate": 256,
    "intermediate": 512,  # dense MLP width; unused because every layer is sparse
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    # BPE training target; config vocab_size = max(tokenizer size, vocab). CORPUS supports
    # ~2080 tokens, so a larger vocab adds embedding/lm_head rows no token maps to.
    "vocab": 2048,
    "max_position": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "num_shards": 3,
    "router_rank": 4,
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_INIT_STD = 0.02  # q/k/v, expert gate/up, lm_head
_OUT_STD = 0.01  # o_proj and expert down_proj: smaller, so layers nudge the residual stream
_EMB_STD = 0.07  # embeddings: large enough that the current token still steers deep routers
# The routing shape these give the random-weight model (measured): docs/demo.md, "The random-weight
# model".
_EMB_COMMON = 0.3  # weight of the direction shared by all embeddings, relative to _EMB_STD
_ROUTER_POP = 0.05  # spread of per-expert popularity along that direction
_ROUTER_NOISE = 0.3  # full-rank part of the router, relative to the low-rank part


# ----------------------------------------------------------------------------- paths


from .paths import cache_root, check_private, private_dir  # noqa: E402  (cache_root re-exported: the demo's cache lives under it)

SHIPPED_DIR = pathlib.Path(__file__).with_name("demo_model")


def demo_model_dir(progress: bool = True) -> pathlib.Path:
    """The shipped trained demo model, after checking sizes and headers against its manifest."""
    from .errors import CheckpointError

    problem = check_demo_model(SHIPPED_DIR)
    if problem is not None:
        raise CheckpointError(
            f"the demo model shipped in {SHIPPED_DIR} is damaged ({problem}); reinstall "
            f"expertcache (or `git checkout -- expertcache/demo_model`), or retrain it with "
            f"`python -m expertcache.demo_train --out {SHIPPED_DIR} --minutes 45`"
        )
    return SHIPPED_DIR


def describe(path: str | os.PathLike) -> str | None:
    """One line on a trained demo model (from its manifest): what it is and what to expect; None if untrained."""
    try:
        m = json.loads((pathlib.Path(path) / MANIFEST).read_text(encoding="utf-8"))
        p, t = m["params"], m["training"]
    except (OSError, ValueError, KeyError):
        return None
    routing = ""
    if "held_out_reuse" in t:
        routing = (
            f"; its routers reuse {t['held_out_reuse']:.0%} of the previous token's experts "
            f"where chance is {p['top_k'] / p['num_experts']:.1%}"
        )
    return (
        f"a tiny Qwen3-MoE ({p['num_layers']} layers x {p['num_experts']} experts, top-{p['top_k']}, "
        f"{t['parameters_m']} M parameters) trained for {t['steps']} steps ({t['tokens_seen'] / 1e6:.1f} M "
        f"tokens, {t['minutes']:.0f} min on one thread of a shared CPU) on this project's own docs and source; expect "
        f"code- and doc-like fragments in the project's words, not facts or reliable answers "
        f"(held-out perplexity {t['held_out_ppl']}){routing}"
    )


def random_demo_dir(rebuild: bool = False, progress: bool = True) -> pathlib.Path:
    """Return the path of the random-weight demo checkpoint, building it if missing or damaged."""
    root = private_dir(cache_root())  # ours and not writable by others, as the kernel cache
    final = root / DEMO_NAME
    with _Lock(root / f"{DEMO_NAME}.lock"):
        if final.exists():  # the directory and every file in it ours, not writable by group or others
            check_private(final)
            for f in final.iterdir():
                check_private(f, "file")
        for stale in root.glob(f".{DEMO_NAME}.*"):  # left by a killed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        if not rebuild:
            problem = check_demo_model(final, expected_params=_params(0, {}))
            if problem is None:
                return final
            if final.exists():
                log.warning("demo model at %s is damaged (%s); rebuilding it", final, problem)
                if progress:
                    print(f"expertcache: demo model damaged ({problem}); rebuilding", file=sys.stderr)
        if progress:
            print(f"expertcache: creating the demo model in {final} (once)", file=sys.stderr, flush=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}.tmp-", dir=root))
        try:
            build_demo_model(tmp, seed=0, progress=progress)
            if final.exists():  # move the old copy aside first: rename cannot replace a non-empty dir
                trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}.old-", dir=root))
                os.replace(final, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            for f in tmp.iterdir():  # whatever the umask: the checks above refuse group-writable files
                f.chmod(0o644)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


class _Lock:
    """An advisory file lock (POSIX), so two processes do not build the demo at once."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.fd: int | None = None

    def __enter__(self) -> "_Lock":
        try:
            import fcntl
        except ImportError:  # Windows: no lock; the atomic rename still protects readers
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the flock
            self.fd = None


# ----------------------------------------------------------------------------- checking


def _sha256_file(path: pathlib.Path, limit: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        remaining = limit
        while remaining is None or remaining > 0:
            chunk = f.read(1 << 20 if remaining is None else min(1 << 20, remaining))
            if not chunk:
                break
            h.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
    return h.hexdigest()


def _safetensors_header_len(path: pathlib.Path) -> int:
    """Bytes of the 8-byte length prefix plus the JSON header."""
    with open(path, "rb") as f:
        prefix = f.read(8)
    if len(prefix) != 8:
        raise ValueError(f"{path.name}: shorter than a safetensors header")
    return 8 + int.from_bytes(prefix, "little")


def file_entry(path: pathlib.Path) -> dict[str, Any]:
    entry: dict[str, Any] = {"size": path.stat().st_size, "sha256": _sha256_file(path)}
    if path.suffix == ".safetensors":
        n = _safetensors_header_len(path)
        entry["header_bytes"] = n
        entry["header_sha256"] = _sha256_file(path, n)
    return entry


def check_demo_model(
    path: str | os.PathLike, *, deep: bool = False, expected_params: dict | None = None
) -> str | None:
    """Return None if the checkpoint at `path` matches its manifest, else the first problem.

    The default check reads sizes, small files and safetensors headers only; deep=True
    hashes every byte. expected_params, if given, must equal the manifest's build parameters.
    """
    path = pathlib.Path(path)
    mpath = path / MANIFEST
    if not path.is_dir():
        return f"{path} does not exist"
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is missing or unreadable ({e.__class__.__name__}: {e})"
    if manifest.get("version") != FORMAT_VERSION:
        return f"{MANIFEST}: format version {manifest.get('version')!r}, expected {FORMAT_VERSION}"
    if expected_params is not None and manifest.get("params") != expected_params:
        return f"{MANIFEST}: built with other parameters than this version of expertcache"
    for name, want in sorted(files.items()):
        f = path / name
        try:
            size = f.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want["size"]:
            return f"{name} has {size} bytes, manifest says {want['size']}"
    for name, want in sorted(files.items()):
        f = path / name
        if deep or "header_sha256" not in want:
            if _sha256_file(f) != want["sha256"]:
                return f"{name}: sha256 differs from the manifest"
        elif _sha256_file(f, want["header_bytes"]) != want["header_sha256"]:
            return f"{name}: safetensors header differs from the manifest"
    return None


# ----------------------------------------------------------------------------- building


def _params(seed: int, overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(DEFAULT_SIZES))
    if unknown:
        raise TypeError(
            f"build_demo_model: unknown size override(s) {unknown}; known: {sorted(DEFAULT_SIZES)}"
        )
    p = {**DEFAULT_SIZES, **overrides, "seed": seed}
    for key in (
        "num_layers",
        "num_experts",
        "top_k",
        "hidden",
        "moe_intermediate",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "vocab",
        "num_shards",
        "router_rank",
    ):
        if int(p[key]) < 1:
            raise ValueError(f"build_demo_model: {key}={p[key]} must be >= 1")
    if p["top_k"] > p["num_experts"]:
        raise ValueError(f"build_demo_model: top_k={p['top_k']} exceeds num_experts={p['num_experts']}")
    if p["num_heads"] % p["num_kv_heads"]:
        raise ValueError(
            f"build_demo_model: num_heads={p['num_heads']} is not a multiple of "
            f"num_kv_heads={p['num_kv_heads']}"
        )
    if p["head_dim"] % 2:
        raise ValueError(f"build_demo_model: head_dim={p['head_dim']} must be even (rotary embedding)")
    return p


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"expertcache-demo/{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _randn(seed: int, name: str, *shape: int, std: float = _INIT_STD) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(seed, name)) * std


def _uniform(
    seed: int, name: str, *shape: int, std: float = _INIT_STD, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Uniform with the given std (like nn.Linear's default init); ~3x faster than randn."""
    a = std * 3**0.5
    return torch.empty(shape, dtype=dtype).uniform_(-a, a, generator=_generator(seed, name))


def train_tokenizer(vocab_size: int, texts=None):
    """A deterministic byte-level BPE (tokenizers.Tokenizer) trained on `texts` (default: CORPUS's paragraphs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.strip().split("\n\n") if texts is None else texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} got id {tok.token_to_id(t)}, expected {i}"
    return tok


def config_json(p: dict[str, Any], vocab_size: int, eos_ids: list[int]) -> dict[str, Any]:
    # Keys and values as transformers 5 writes Qwen3MoeConfig, plus the hub-era keys
    # (`num_experts`, `rope_theta`) that older readers and our own loader expect.
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "decoder_sparse_step": 1,
        "dtype": "bfloat16",
        "eos_token_id": eos_ids[0],
        "head_dim": p["head_dim"],
        "hidden_act": "silu",
        "hidden_size": p["hidden"],
        "initializer_range": _INIT_STD,
        "intermediate_size": p["intermediate"],
        "max_position_embeddings": p["max_position"],
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": p["moe_intermediate"],
        "norm_topk_prob": True,
        "num_attention_heads": p["num_heads"],
        "num_experts": p["num_experts"],
        "num_experts_per_tok": p["top_k"],
        "num_hidden_layers": p["num_layers"],
        "num_key_value_heads": p["num_kv_heads"],
        "num_local_experts": p["num_experts"],
        "output_router_logits": False,
        "pad_token_id": 0,
        "rms_norm_eps": p["rms_norm_eps"],
        "rope_parameters": {"rope_theta": float(p["rope_theta"]), "rope_type": "default"},
        "rope_theta": float(p["rope_theta"]),
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def _layer_tensors(p: dict[str, Any], i: int, common: torch.Tensor) -> dict[str, torch.Tensor]:
    s, H, E, I, D = p["seed"], p["hidden"], p["num_experts"], p["moe_intermediate"], p["head_dim"]
    pre = f"model.layers.{i}."
    t: dict[str, torch.Tensor] = {
        pre + "input_layernorm.weight": torch.ones(H),
        pre + "post_attention_layernorm.weight": torch.ones(H),
        pre + "self_attn.q_norm.weight": torch.ones(D),
        pre + "self_attn.k_norm.weight": torch.ones(D),
    }
    for proj, rows, cols in (
        ("q", p["num_heads"] * D, H),
        ("k", p["num_kv_heads"] * D, H),
        ("v", p["num_kv_heads"] * D, H),
        ("o", H, p["num_heads"] * D),
    ):
        name = pre + f"self_attn.{proj}_proj.weight"
        t[name] = _uniform(s, name, rows, cols, std=_OUT_STD if proj == "o" else _INIT_STD)
    # Router: low rank (a few directions of the hidden state decide the choice, so nearby
    # states pick the same experts) plus a per-expert popularity along the direction shared
    # by all embeddings (so some experts are hot). Logits have std ~1 on unit-RMS inputs.
    name = pre + "mlp.gate.weight"
    r = p["router_rank"]
    low = _randn(s, name + "/a", E, r, std=1.0) @ _randn(s, name + "/b", r, H, std=1.0) / (r * H) ** 0.5
    popularity = _randn(s, name + "/pop", E, 1, std=_ROUTER_POP)
    noise = _randn(s, name + "/noise", E, H, std=_ROUTER_NOISE / H**0.5)
    t[name] = low + popularity * common / H**0.5 + noise
    for j in range(E):
        for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            name = pre + f"mlp.experts.{j}.{proj}_proj.weight"
            t[name] = _uniform(s, name, *shape, std=_OUT_STD if proj == "down" else _INIT_STD)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in t.items()}


def build_demo_model(
    out_dir: str | os.PathLike, *, seed: int = 0, progress: bool = False, **size_overrides: Any
) -> pathlib.Path:
    """Write the checkpoint into out_dir (used by demo_model_dir, and by tests/benchmarks for bigger models).

    size_overrides are keys of DEFAULT_SIZES, e.g. num_layers=16, num_experts=64, hidden=512,
    moe_intermediate=512, num_heads=8, num_kv_heads=4, num_shards=4 gives 1.6 GB of experts
    (about 30 s on 2 cores). out_dir may exist but must not already hold a checkpoint.
    """
    t0 = time.perf_counter()
    p = _params(seed, size_overrides)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").exists() or (out / MANIFEST).exists():
        raise FileExistsError(f"build_demo_model: {out} already holds a checkpoint; pass an empty directory")

    def say(msg: str) -> None:
        if progress:
            print(f"expertcache: {msg}", file=sys.stderr, flush=True)

    say(f"building a demo checkpoint ({p['num_layers']} layers x {p['num_experts']} experts) ...")
    vocab_size = _write_tokenizer_and_configs(out, p)
    _write_weights(out, p, seed, vocab_size, say)
    files = {f.name: file_entry(f) for f in sorted(out.iterdir()) if f.is_file() and f.name != MANIFEST}
    write_json(
        out / MANIFEST, {"format": "expertcache-demo", "version": FORMAT_VERSION, "params": p, "files": files}
    )
    say(f"demo model ready in {time.perf_counter() - t0:.1f} s")
    return out


def _write_tokenizer_and_configs(out: pathlib.Path, p: dict[str, Any]) -> int:
    """tokenizer.json, tokenizer_config.json, config.json and generation_config.json -> the vocab size."""
    tok = train_tokenizer(int(p["vocab"]))
    vocab_size = max(tok.get_vocab_size(), int(p["vocab"]))
    eos_ids = [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")]
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", tokenizer_config(tok, p))
    write_json(out / "config.json", config_json(p, vocab_size, eos_ids))
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": None,
            "eos_token_id": eos_ids,
            "pad_token_id": 0,
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
        },
    )
    return vocab_size


def _write_weights(out: pathlib.Path, p: dict[str, Any], seed: int, vocab_size: int, say) -> None:
    """The weights in num_shards safetensors files (layers split evenly; the embedding in the first, the
    final norm and lm_head in the last) and, when there are several, their index."""
    H, L, n = p["hidden"], p["num_layers"], p["num_shards"]
    n = min(n, L)
    common = torch.randn(H, generator=_generator(seed, "common-direction"))  # unit RMS
    shard_of_layer = [i * n // L for i in range(L)]
    weight_map: dict[str, str] = {}
    total = 0
    for k in range(n):
        fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        if k == 0:
            # Token embeddings share one direction on top of their own noise.
            emb = _uniform(
                seed, "model.embed_tokens.weight", vocab_size, H, std=_EMB_STD, dtype=torch.float32
            )
            emb += _EMB_COMMON * _EMB_STD * common
            tensors["model.embed_tokens.weight"] = emb.to(torch.bfloat16)
        for i in range(L):
            if shard_of_layer[i] == k:
                tensors.update(_layer_tensors(p, i, common))
        if k == n - 1:
            tensors["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
            tensors["lm_head.weight"] = _uniform(seed, "lm_head.weight", vocab_size, H)
        write_safetensors(tensors, out / fname, metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        weight_map.update({name: fname for name in tensors})
        say(f"  wrote {fname} ({(out / fname).stat().st_size / 2**20:.1f} MiB)")
        del tensors
    if n > 1:
        write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        )


def tokenizer_config(tok, p: dict[str, Any]) -> dict[str, Any]:
    return {
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": p["max_position"],
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_json(path: pathlib.Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")
