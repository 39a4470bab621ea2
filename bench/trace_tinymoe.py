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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[2] / "shared/models/tinymoe-py16"))
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--offset", type=int, default=0, help="first held-out id to use")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    cfg = model.config
    ids = torch.load(Path(args.model) / "heldout_ids.pt").flatten()
    need = args.seqs * args.tokens
    ids = ids[args.offset:]
    if ids.numel() < need:
        raise SystemExit(f"heldout_ids.pt has {ids.numel()} ids, need {need}")
    layers = model.model.layers
    nl, k = len(layers), cfg.num_experts_per_tok
    captured: dict[int, tuple] = {}
    inputs: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda mod, inp, out, i=i: captured.__setitem__(i, (out[2].detach(), out[1].detach()))))
        hooks.append(layer.register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: inputs.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).detach()),
            with_kwargs=True))

    experts = np.empty((need, nl, k), np.int32)
    weights = np.empty((need, nl, k), np.float32)
    look = np.full((need, nl, k), -1, np.int32)
    with torch.no_grad():
        for s in range(args.seqs):
            chunk = ids[s * args.tokens:(s + 1) * args.tokens].long()[None]
            captured.clear()
            inputs.clear()
            model(input_ids=chunk, use_cache=False)
            rows = slice(s * args.tokens, (s + 1) * args.tokens)
            for i in range(nl):
                idx, sc = captured[i]
                experts[rows, i] = idx.reshape(args.tokens, k).numpy()
                weights[rows, i] = sc.reshape(args.tokens, k).float().numpy()
            # lookahead: run layer l's gate on layer l's post-attention norm of its input
            for i in range(1, nl):
                h = layers[i].post_attention_layernorm(inputs[i].reshape(-1, cfg.hidden_size))
                _, _, pred = layers[i].mlp.gate.__class__.forward(layers[i].mlp.gate, h)
                look[rows, i] = pred.reshape(args.tokens, k).numpy()
    for h in hooks:
        h.remove()
    n = need
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2  # bf16 as stored
    trace = RoutingTrace(
        experts=experts, num_experts=cfg.num_experts, weights=weights, lookahead=look,
        seq=np.repeat(np.arange(args.seqs), args.tokens), token=np.tile(np.arange(args.tokens), args.seqs),
        phase=np.ones(n, np.int8), step=np.arange(n), model=Path(args.model).name,
        layer_ids=list(range(nl)), expert_bytes=expert_bytes)
    trace.save(args.out)
    print(f"saved {args.out}: {n} rows x {nl} layers x top-{k}, {cfg.num_experts} experts")


if __name__ == "__main__":
    main()
