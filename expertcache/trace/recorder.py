"""RoutingRecorder: the engine's routing, step by step, as a RoutingTrace (`--record-routing FILE`).

The engine calls `record(step, work, routing)` after each forward: `work` is the scheduled
[(sequence, new tokens)], `routing` maps each MoE layer to (ids [T, K], weights [T, K],
lookahead [T, K] | None), where lookahead is the *next* MoE layer's router applied to this
layer's residual stream. Rows follow the batch's flattened token order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .format import PHASES, RoutingTrace


class RoutingRecorder:
    def __init__(self, llm):
        self.layers = llm.cfg.moe_layer_ids
        self.num_experts = llm.cfg.num_experts
        self.expert_bytes = llm.source.expert_nbytes
        self.model = str(llm.model_dir)
        self.rows: dict[str, list] = {
            k: [] for k in ("experts", "weights", "lookahead", "seq", "token", "phase", "step")
        }

    def record(self, step: int, work, routing: dict) -> None:
        seq, token, phase = [], [], []
        for s, n in work:
            start = s.num_computed
            seq += [s.seq_id] * n
            token += range(start, start + n)
            phase += [PHASES["prefill"] if start + i < s.prompt_len else PHASES["decode"] for i in range(n)]
        T = len(seq)
        ex = np.stack([routing[layer][0].cpu().numpy() for layer in self.layers], axis=1)
        wt = np.stack([routing[layer][1].float().cpu().numpy() for layer in self.layers], axis=1)
        la = np.full_like(ex, -1)
        for li, layer in enumerate(self.layers[:-1]):
            ahead = routing[layer][2]
            if ahead is not None:
                la[:, li + 1] = ahead.cpu().numpy()
        for k, v in (
            ("experts", ex),
            ("weights", wt),
            ("lookahead", la),
            ("seq", seq),
            ("token", token),
            ("phase", phase),
            ("step", [step] * T),
        ):
            self.rows[k].append(np.asarray(v))

    def trace(self) -> RoutingTrace:
        if not self.rows["experts"]:
            raise ValueError("no routing was recorded (nothing was generated)")
        cat = {k: np.concatenate(v) for k, v in self.rows.items()}
        return RoutingTrace(
            num_experts=self.num_experts,
            model=self.model,
            layer_ids=list(self.layers),
            expert_bytes=self.expert_bytes,
            **cat,
        )

    def save(self, path: str | Path) -> None:
        self.trace().save(path)
