"""Derive a real routing trace from a Qwen3-MoE checkpoint with transformers as the oracle.

    .venv/bin/python bench/trace_tinymoe.py OUT.npz [--model DIR] [--seqs 8] [--tokens 256] [--offset 0]

Runs `--seqs` contiguous chunks of `--tokens` held-out ids (heldout_ids.pt) one full
forward each and records, per MoE layer, the router's top-k (forward hook on
`layers[i].mlp.gate`, which returns (router_logits, scores, indices)).

Lookahead for layer l (l >= 1): `layers[l].mlp.gate(layers[l].post_attention_layernorm(h))`
where h is the output hidden state of layer l-1 (the input of layer l) - i.e. the
prediction available before layer l's attention runs. Row l=0 is -1.

The trace is laid out as decode: every row is its own forward step, sequences back to
back (step = row index), so replay sees one token at a time with caches carried across
sequences.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from expertcache.trace.format import RoutingTrace  # noqa: E402


def route(model, chunks: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Routing of a transformers Qwen3-MoE model on `chunks` [S, T] (one full forward each) ->
    experts, weights, lookahead, each [S, T, layers, top_k] (lookahead of layer 0 is -1)."""
    cfg, layers = model.config, model.model.layers
    nl, k = len(layers), cfg.num_experts_per_tok
    S, T = chunks.shape
    captured: dict[int, tuple] = {}
    inputs: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(
            layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out, i=i: captured.__setitem__(i, (out[2].detach(), out[1].detach()))
            )
        )
        hooks.append(
            layer.register_forward_pre_hook(
                lambda mod, args, kwargs, i=i: inputs.__setitem__(
                    i, (args[0] if args else kwargs["hidden_states"]).detach()
                ),
                with_kwargs=True,
            )
        )
    experts = np.empty((S, T, nl, k), np.int32)
    weights = np.empty((S, T, nl, k), np.float32)
    look = np.full((S, T, nl, k), -1, np.int32)
    with torch.no_grad():
        for s in range(S):
            captured.clear()
            inputs.clear()
            model(input_ids=chunks[s].long()[None], use_cache=False)
            for i in range(nl):
                idx, sc = captured[i]
                experts[s, :, i] = idx.reshape(T, k).numpy()
                weights[s, :, i] = sc.reshape(T, k).float().numpy()
            # lookahead: run layer l's gate on layer l's post-attention norm of its input
            for i in range(1, nl):
                h = layers[i].post_attention_layernorm(inputs[i].reshape(-1, cfg.hidden_size))
                _, _, pred = layers[i].mlp.gate.__class__.forward(layers[i].mlp.gate, h)
                look[s, :, i] = pred.reshape(T, k).numpy()
    for h in hooks:
        h.remove()
    return experts, weights, look


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument(
        "--model", default=str(Path(__file__).resolve().parents[2] / "shared/models/tinymoe-py16")
    )
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--offset", type=int, default=0, help="first held-out id to use")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    cfg = model.config
    ids = torch.load(Path(args.model) / "heldout_ids.pt").flatten()
    need = args.seqs * args.tokens
    ids = ids[args.offset :]
    if ids.numel() < need:
        raise SystemExit(f"heldout_ids.pt has {ids.numel()} ids, need {need}")
    nl, k = len(model.model.layers), cfg.num_experts_per_tok
    ex, wt, la = route(model, ids[:need].reshape(args.seqs, args.tokens))
    experts, weights, look = (a.reshape(need, nl, k) for a in (ex, wt, la))
    n = need
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2  # bf16 as stored
    trace = RoutingTrace(
        experts=experts,
        num_experts=cfg.num_experts,
        weights=weights,
        lookahead=look,
        seq=np.repeat(np.arange(args.seqs), args.tokens),
        token=np.tile(np.arange(args.tokens), args.seqs),
        phase=np.ones(n, np.int8),
        step=np.arange(n),
        model=Path(args.model).name,
        layer_ids=list(range(nl)),
        expert_bytes=expert_bytes,
    )
    trace.save(args.out)
    print(f"saved {args.out}: {n} rows x {nl} layers x top-{k}, {cfg.num_experts} experts")


if __name__ == "__main__":
    main()
