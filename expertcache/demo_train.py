"""Train the shipped demo model: a tiny Qwen3-MoE on the project's own docs and source.

    nice -n 10 python -m expertcache.demo_train --out expertcache/demo_model --steps 600

(the shipped model's run: seed 0, one thread; deterministic for a seed and thread count, 20-40
minutes of one CPU thread). The log prints, every `--probe-every` steps, the held-out loss and a
routing probe: the share of a token's experts the previous token also used (chance = K/E) and the
expert-load entropy (1 = even). The load-balancing loss weight matters most for routing: at 0.01 it
keeps the load even and the routing no more local than a random model's (reuse ~0.22 with K/E =
0.125); at 0.001 experts specialise and a token reuses 40-50% of its predecessor's experts, with
the load skewed about as much as in other small trained MoEs (entropy 0.75-0.83); with no balancing loss
(router z-loss only) routing clumps onto few experts (entropy ~0.63) and perplexity suffers.

The corpus is the repository's Markdown and Python files (README, docs/, expertcache/,
bench/, tests/) plus chat-formatted question/answer pairs made from their docstrings, so the
model writes text that looks like this project's code and docs and answers "What does X do?"
in its chat template. Every 16th file (in sorted order) is held out; its text goes to
`heldout.txt` in the output directory, where tests measure perplexity.

The model is trained here in plain torch with stacked expert weights (tokens sorted by expert,
one matmul per active expert on its rows: exact work, no capacity padding), then written in the
Hugging Face layout under hub names, with the tokenizer (byte-level BPE trained on the same
corpus by `demo.train_tokenizer`) and a manifest (`expertcache_demo.json`: parameters, corpus
hash, training summary, size/sha256 of every file) that `demo.check_demo_model` verifies.

Shapes: B batch, T sequence, H hidden, E experts, K top-k, I expert width,
N = B*T tokens.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import math
import pathlib
import random
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from . import demo
from .loader.writer import write_safetensors

SIZES: dict[str, Any] = {
    "num_layers": 6,
    "num_experts": 32,
    "top_k": 4,
    "hidden": 192,
    "moe_intermediate": 128,
    "intermediate": 512,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "vocab": 2048,
    "max_position": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
}
DEFAULT_STEPS = 600  # the shipped model's run (with the defaults below)
HOLDOUT_EVERY = 16
SYSTEM = "You are the expertcache demo model."
# ChatML with the training's system prompt as the default, so a chat without one looks like training
CHAT_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}{%- endif %}" + demo.CHAT_TEMPLATE
)
_GLOBS = ("README.md", "docs/**/*.md", "expertcache/**/*.py", "bench/**/*.py", "tests/**/*.py")


# ----------------------------------------------------------------------------- corpus


def corpus_files(root: pathlib.Path) -> list[pathlib.Path]:
    files = {f for g in _GLOBS for f in root.glob(g) if f.is_file() and "demo_model" not in f.parts}
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def _chat(question: str, answer: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        f"<|im_start|>assistant\n{answer}<|im_end|>\n"
    )


def chat_pairs(rel: str, text: str) -> list[str]:
    """Question/answer samples from a Python file's docstrings (module, classes, functions)."""
    if not rel.endswith(".py"):
        return []
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    mod = ast.get_docstring(tree)
    if mod:
        out.append(_chat(f"What is {rel} for?", mod.split("\n\n")[0].strip()))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and not node.name.startswith("test_"):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                out.append(_chat(f"What does the {kind} `{node.name}` do?", doc.split("\n\n")[0].strip()))
    return out


def build_corpus(root: pathlib.Path) -> tuple[list[str], list[str], dict[str, Any]]:
    """(training documents, held-out documents, description for the manifest)."""
    train, held, names = [], [], []
    h = hashlib.sha256()
    files = corpus_files(root)
    if len(files) < 2:
        raise ValueError(
            f"demo_train: {root} has {len(files)} corpus files ({', '.join(_GLOBS)}); need at least 2"
        )
    # every HOLDOUT_EVERY-th file, or the last one of a small corpus
    held_idx = {i for i in range(len(files)) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1} or {len(files) - 1}
    for i, f in enumerate(files):
        rel = f.relative_to(root).as_posix()
        text = f.read_text(encoding="utf-8", errors="replace")
        h.update(rel.encode() + b"\0" + text.encode() + b"\0")
        names.append(rel)
        docs = [text] + chat_pairs(rel, text)
        (held if i in held_idx else train).extend(docs)
    info = {
        "files": len(names),
        "held_out_files": [names[i] for i in sorted(held_idx)],
        "sha256": h.hexdigest(),
        "train_chars": sum(map(len, train)),
        "held_out_chars": sum(map(len, held)),
    }
    return train, held, info


def encode(tok, docs: list[str]) -> torch.Tensor:
    """Documents -> one id stream, each document followed by <|endoftext|> (id 0)."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- model


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class TinyMoE(torch.nn.Module):
    """Qwen3-MoE math (q/k norm, rotary, GQA, softmax top-k router renormalised, SwiGLU experts)."""

    def __init__(self, p: dict[str, Any], vocab_size: int, seed: int) -> None:
        super().__init__()
        self.p = p
        L, E, H, I, D = p["num_layers"], p["num_experts"], p["hidden"], p["moe_intermediate"], p["head_dim"]
        nh, nkv = p["num_heads"], p["num_kv_heads"]
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int, std: float = 0.02) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(shape, generator=g) * std)

        out_std = 0.02 / math.sqrt(2 * L)
        self.embed = w(vocab_size, H)
        self.lm_head = w(vocab_size, H)
        self.norm = torch.nn.Parameter(torch.ones(H))
        self.layers = torch.nn.ModuleList()
        for _ in range(L):
            m = torch.nn.Module()
            m.ln1, m.ln2 = torch.nn.Parameter(torch.ones(H)), torch.nn.Parameter(torch.ones(H))
            m.q_norm, m.k_norm = torch.nn.Parameter(torch.ones(D)), torch.nn.Parameter(torch.ones(D))
            m.q, m.k, m.v = w(nh * D, H), w(nkv * D, H), w(nkv * D, H)
            m.o = w(H, nh * D, std=out_std)
            m.router = w(E, H)
            m.gate, m.up, m.down = w(E, I, H), w(E, I, H), w(E, H, I, std=out_std)
            self.layers.append(m)
        inv = 1.0 / (p["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        self.register_buffer("inv_freq", inv, persistent=False)

    def moe(
        self, m: torch.nn.Module, h: torch.Tensor, routes: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [N, H] -> (out [N, H], load-balancing loss, router z-loss); top-k ids [N, K] appended to `routes`."""
        E, K = self.p["num_experts"], self.p["top_k"]
        logits = (h @ m.router.T).float()  # [N, E]
        z = torch.logsumexp(logits, -1).pow(2).mean()
        probs = F.softmax(logits, dim=-1)  # [N, E]
        top_w, top_i = probs.topk(K, dim=-1)  # [N, K]
        if routes is not None:
            routes.append(top_i)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        flat = top_i.reshape(-1)  # [N*K]
        counts = torch.bincount(flat, minlength=E)
        aux = E * ((counts.float() / flat.numel()) * probs.mean(0)).sum()
        order = torch.argsort(flat, stable=True)
        tok = order // K
        xs = h[tok]  # [N*K, H], grouped by expert
        ends = torch.cumsum(counts, 0).tolist()
        parts, start = [], 0
        for e, end in enumerate(ends):  # exact work per expert (no capacity padding)
            if end > start:
                xe = xs[start:end]
                parts.append((F.silu(xe @ m.gate[e].T) * (xe @ m.up[e].T)) @ m.down[e].T)
            start = end
        y = torch.cat(parts).float() * top_w.reshape(-1)[order, None]
        return h.new_zeros(h.shape).index_add(0, tok, y.to(h.dtype)), aux, z

    def forward(
        self, ids: torch.Tensor, routes: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [B, T] -> (logits [B, T, V], mean load-balancing loss, mean router z-loss); with `routes`
        a list, each layer's top-k expert ids [B*T, K] are appended to it."""
        p = self.p
        B, T = ids.shape
        nh, nkv, D, eps = p["num_heads"], p["num_kv_heads"], p["head_dim"], p["rms_norm_eps"]
        freqs = torch.outer(torch.arange(T, dtype=torch.float32), self.inv_freq)
        cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()  # [T, D]
        x = self.embed[ids]
        aux = x.new_zeros(())
        zl = x.new_zeros(())
        for m in self.layers:
            h = _rms(x, m.ln1, eps)
            q = _rms((h @ m.q.T).view(B, T, nh, D), m.q_norm, eps).transpose(1, 2)
            k = _rms((h @ m.k.T).view(B, T, nkv, D), m.k_norm, eps).transpose(1, 2)
            v = (h @ m.v.T).view(B, T, nkv, D).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(B, T, nh * D) @ m.o.T
            out, la, lz = self.moe(m, _rms(x, m.ln2, eps).view(B * T, -1), routes)
            x = x + out.view(B, T, -1)
            aux, zl = aux + la, zl + lz
        L = len(self.layers)
        return _rms(x, self.norm, eps) @ self.lm_head.T, aux / L, zl / L

    def hub_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters under Qwen3-MoE hub names, bf16."""
        t = {
            "model.embed_tokens.weight": self.embed,
            "lm_head.weight": self.lm_head,
            "model.norm.weight": self.norm,
        }
        for i, m in enumerate(self.layers):
            pre = f"model.layers.{i}."
            t.update(
                {
                    pre + "input_layernorm.weight": m.ln1,
                    pre + "post_attention_layernorm.weight": m.ln2,
                    pre + "self_attn.q_norm.weight": m.q_norm,
                    pre + "self_attn.k_norm.weight": m.k_norm,
                    pre + "self_attn.q_proj.weight": m.q,
                    pre + "self_attn.k_proj.weight": m.k,
                    pre + "self_attn.v_proj.weight": m.v,
                    pre + "self_attn.o_proj.weight": m.o,
                    pre + "mlp.gate.weight": m.router,
                }
            )
            for j in range(self.p["num_experts"]):
                for proj, wt in (("gate", m.gate), ("up", m.up), ("down", m.down)):
                    t[pre + f"mlp.experts.{j}.{proj}_proj.weight"] = wt[j]
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sorted(t.items())}


# ----------------------------------------------------------------------------- training


def held_out_eval(model: TinyMoE, ids: torch.Tensor, seq: int, max_windows: int = 32) -> dict[str, float]:
    """Loss on held-out windows of `seq` tokens, and the routing probe on them: `reuse` = mean share of a
    token's top-k experts that the previous token of its window also used (chance = K/E), `entropy` =
    expert-load entropy over log(E), per layer then averaged (1 = perfectly even load)."""
    n = min(max_windows, (len(ids) - 1) // seq)
    x = ids[: n * seq].view(n, seq)
    y = ids[1 : n * seq + 1].view(n, seq)
    routes: list[torch.Tensor] = []
    with torch.no_grad():
        logits, _, _ = model(x, routes)
    E, K = model.p["num_experts"], model.p["top_k"]
    r = torch.stack(routes).view(len(routes), n, seq, K)  # [L, n, T, K]
    shared = (r[:, :, 1:, :, None] == r[:, :, :-1, None, :]).any(-1).sum(-1)  # [L, n, T-1]
    load = torch.stack([torch.bincount(t.reshape(-1), minlength=E) for t in routes]).float()  # [L, E]
    q = load / load.sum(1, keepdim=True)
    ent = -(q * q.clamp_min(1e-12).log()).sum(1) / math.log(E)
    return {
        "loss": float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))),
        "reuse": float(shared.float().mean() / K),
        "entropy": float(ent.mean()),
    }


def write_checkpoint(
    out: pathlib.Path,
    model: TinyMoE,
    tok,
    p: dict[str, Any],
    vocab_size: int,
    held_text: str,
    info: dict[str, Any],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file():
            f.unlink()
    tok.save(str(out / "tokenizer.json"))
    demo.write_json(
        out / "tokenizer_config.json", {**demo.tokenizer_config(tok, p), "chat_template": CHAT_TEMPLATE}
    )
    cfg = demo.config_json(p, vocab_size, [0, 2])
    cfg["router_aux_loss_coef"] = info["aux_coef"]
    demo.write_json(out / "config.json", cfg)
    demo.write_json(
        out / "generation_config.json",
        {
            "bos_token_id": None,
            "eos_token_id": [0, 2],
            "pad_token_id": 0,
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
        },
    )
    write_safetensors(model.hub_tensors(), out / "model.safetensors", metadata={"format": "pt"})
    (out / "heldout.txt").write_text(held_text, encoding="utf-8")
    write_manifest(out, p, info)


def write_manifest(out: pathlib.Path, p: dict[str, Any], info: dict[str, Any]) -> None:
    """The manifest (parameters, training summary, size/sha256 of every other file); files made 0644."""
    files = {
        f.name: demo.file_entry(f) for f in sorted(out.iterdir()) if f.is_file() and f.name != demo.MANIFEST
    }
    demo.write_json(
        out / demo.MANIFEST,
        {
            "format": "expertcache-demo",
            "version": demo.FORMAT_VERSION,
            "params": p,
            "training": info,
            "files": files,
        },
    )
    for f in out.iterdir():
        f.chmod(0o644)


def _corpus(root: pathlib.Path, p: dict, held_chars: int):
    """The corpus of `root` and a tokenizer trained on it -> (tokenizer, vocab size, training ids, held-out
    text, its ids, the corpus's info)."""
    train_docs, held_docs, info = build_corpus(root)
    tok = demo.train_tokenizer(int(p["vocab"]), train_docs)
    vocab_size = max(tok.get_vocab_size(), int(p["vocab"]))
    held_text = "\n".join(held_docs)[:held_chars]
    return tok, vocab_size, encode(tok, train_docs), held_text, encode(tok, [held_text]), info


def _corpus_line(info: dict, data, held, model) -> str:
    return (
        f"corpus: {info['files']} files, {len(data)} training tokens, {len(held)} held-out tokens; "
        f"{sum(q.numel() for q in model.parameters()) / 1e6:.1f} M parameters; threads {torch.get_num_threads()}"
    )


def _set_lr(opt, lr: float, step: int, warmup: int, frac: float) -> None:
    """Linear warm-up, then a cosine from lr down to 0.1 lr over the run (`frac` of it done)."""
    scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
    for g in opt.param_groups:
        g["lr"] = lr * scale * g["lr_mult"]


def _optimizer(model, lr: float, router_lr_mult: float) -> torch.optim.AdamW:
    """AdamW over three groups: matrices (decayed), the routers (decayed, their own lr multiple), vectors
    (not decayed); each group's `lr_mult` scales the schedule's lr."""
    routers = {id(m.router) for m in model.layers}
    groups = [
        ([q for q in model.parameters() if q.dim() >= 2 and id(q) not in routers], 0.1, 1.0),
        ([m.router for m in model.layers], 0.1, router_lr_mult),
        ([q for q in model.parameters() if q.dim() < 2], 0.0, 1.0),
    ]
    return torch.optim.AdamW(
        [{"params": g, "weight_decay": wd, "lr_mult": mult} for g, wd, mult in groups],
        lr=lr,
        betas=(0.9, 0.95),
    )


def _update(model, opt, data, starts: list[int], seq: int, aux_coef: float, z_coef: float):
    """One optimizer step on the windows at `starts` -> (loss, aux, z)."""
    x = torch.stack([data[s : s + seq] for s in starts])
    y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
    logits, aux, z = model(x)  # fp32 (on CPUs without bf16 matmul units it is the faster one)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    (loss + aux_coef * aux + z_coef * z).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss, aux, z


def train(
    root: pathlib.Path,
    out: pathlib.Path,
    *,
    minutes: float | None,
    steps: int | None,
    batch: int = 16,
    seq: int = 256,
    lr: float = 3e-3,
    aux_coef: float = 0.001,
    z_coef: float = 0.0,
    router_lr_mult: float = 1.0,
    seed: int = 0,
    sizes: dict[str, Any] | None = None,
    held_chars: int = 40_000,
    probe_every: int = 0,
    log=print,
) -> dict[str, Any]:
    """Train until `steps` or `minutes` run out (exactly one is given), write the checkpoint to `out`.

    With `steps`, the run is deterministic for a seed and thread count. `aux_coef` weighs the
    load-balancing loss, `z_coef` the router z-loss (mean squared logsumexp of router logits);
    `router_lr_mult` scales the routers' learning rate. Every `probe_every` steps (0: never) the log
    gets the held-out loss and routing probe (see `held_out_eval`)."""
    if (minutes is None) == (steps is None):
        raise ValueError("train: give exactly one of minutes= and steps=")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    p = {**SIZES, **(sizes or {}), "seed": seed}
    tok, vocab_size, data, held_text, held, info = _corpus(root, p, held_chars)
    model = TinyMoE(p, vocab_size, seed)
    opt = _optimizer(model, lr, router_lr_mult)
    log(_corpus_line(info, data, held, model))
    t0 = time.perf_counter()
    budget = None if minutes is None else minutes * 60
    warmup = 50 if steps is None else max(1, steps // 10)
    step = 0
    while True:
        elapsed = time.perf_counter() - t0
        frac = step / steps if steps is not None else elapsed / budget
        if frac >= 1:
            break
        _set_lr(opt, lr, step, warmup, frac)
        starts = [rng.randrange(len(data) - seq - 1) for _ in range(batch)]
        loss, aux, z = _update(model, opt, data, starts, seq, aux_coef, z_coef)
        if step % 10 == 0:
            log(f"step {step} t={elapsed:.0f}s loss={loss.item():.3f} aux={aux.item():.3f} z={z.item():.2f}")
        if probe_every and step % probe_every == 0:
            _probe(model, held, seq, step, p, log)
        step += 1
    hyper = dict(batch=batch, seq=seq, lr=lr, aux_coef=aux_coef, z_coef=z_coef, router_lr_mult=router_lr_mult)
    info.update(_summary(model, held_out_eval(model, held, seq), step, t0, hyper))
    log(
        f"held-out loss {info['held_out_loss']:.3f} ppl {info['held_out_ppl']:.2f} reuse "
        f"{info['held_out_reuse']:.3f} load entropy {info['held_out_load_entropy']:.3f} "
        f"after {step} steps ({info['tokens_seen']} tokens, {info['minutes']} min)"
    )
    write_checkpoint(out, model, tok, p, vocab_size, held_text, info)
    return info


def _probe(model, held, seq: int, step: int, p: dict, log) -> None:
    ev = held_out_eval(model, held, seq, max_windows=8)
    log(
        f"probe step {step} held_loss={ev['loss']:.3f} reuse={ev['reuse']:.3f} "
        f"chance={p['top_k'] / p['num_experts']:.3f} load_entropy={ev['entropy']:.3f}"
    )


def _summary(model, ev: dict, step: int, t0: float, hyper: dict) -> dict:
    """The run's figures for the manifest: size, steps, tokens, the hyperparameters, held-out results."""
    hl = ev["loss"]
    return {
        "parameters_m": round(sum(q.numel() for q in model.parameters()) / 1e6, 1),
        "steps": step,
        "tokens_seen": step * hyper["batch"] * hyper["seq"],
        **hyper,
        "threads": torch.get_num_threads(),
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        "held_out_loss": round(hl, 3),
        "held_out_ppl": round(math.exp(hl), 2),
        "held_out_reuse": round(ev["reuse"], 3),
        "held_out_load_entropy": round(ev["entropy"], 3),
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m expertcache.demo_train", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", required=True, help="output directory (its files are replaced)")
    ap.add_argument(
        "--root",
        default=str(pathlib.Path(__file__).resolve().parents[1]),
        help="repository root whose docs and source are the corpus",
    )
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help=f"optimizer steps (default {DEFAULT_STEPS}, as shipped)")
    budget.add_argument("--minutes", type=float, help="a wall-clock budget instead (not reproducible)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (the run is deterministic for a seed and thread count)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--aux-coef", type=float, default=0.001, help="load-balancing loss weight")
    ap.add_argument("--z-coef", type=float, default=0.0, help="router z-loss weight")
    ap.add_argument("--router-lr-mult", type=float, default=1.0, help="routers' learning rate / the others'")
    ap.add_argument("--hidden", type=int, default=SIZES["hidden"])
    ap.add_argument("--moe-intermediate", type=int, default=SIZES["moe_intermediate"])
    ap.add_argument(
        "--probe-every", type=int, default=50, help="log held-out loss and routing every N steps (0: never)"
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.minutes is None and args.steps is None:
        args.steps = DEFAULT_STEPS
    for flag, v in (
        ("--steps", args.steps),
        ("--minutes", args.minutes),
        ("--threads", args.threads),
        ("--batch", args.batch),
        ("--seq", args.seq),
    ):
        if v is not None and v <= 0:
            ap.error(f"{flag} must be positive, got {v}")
    torch.set_num_threads(args.threads)
    train(
        pathlib.Path(args.root),
        pathlib.Path(args.out),
        minutes=args.minutes,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        lr=args.lr,
        aux_coef=args.aux_coef,
        z_coef=args.z_coef,
        router_lr_mult=args.router_lr_mult,
        seed=args.seed,
        sizes={"hidden": args.hidden, "moe_intermediate": args.moe_intermediate},
        probe_every=args.probe_every,
        log=lambda s: print(s, flush=True),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
