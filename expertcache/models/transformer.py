"""The decoder shared by every family: embed -> [attention, MLP or MoE] x L -> norm -> lm_head.

The model is assembled from dense weights already read onto the compute device (embeddings,
attention, norms, routers, shared experts, dense MLPs, lm_head: build/fill.py DenseWeights; an
untied embedding under low memory on the CPU has its rows read per step, a GGUF one in a block type is
held as its file's blocks and its rows decoded per step, models/embedding.py).
Routed experts are not held here: each MoE layer calls the ExpertProvider, which owns where they live.

Before layer l's experts run, the router of the next MoE layer is applied to the
current residual stream (normed with that layer's post-attention norm): the
prediction is handed to `experts.prefetch` so transfers overlap this layer's work.

The token mixer is chosen per layer: softmax attention over the paged KV cache (kv holds one
(k, v) pair per attention layer, in layer order) or, in hybrid models, a Gated DeltaNet layer
over the per-sequence state cache (`states`, layers/gated_deltanet.py).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..experts.provider import ExpertProvider
from ..layers.attention import Attention, AttnBatch
from ..layers.basic import QuantizedWeight, add_rms_norm, linear, rms_norm, swiglu
from ..layers.block import AttnBlock, AttnStack
from ..layers.gated_deltanet import StateBatch
from ..layers.mla import MLAttention
from ..layers.moe import route
from ..loader.rows import RowReader
from ..spec.model_config import ModelConfig
from .embedding import BlockTable, Table

# Bytes of per-layer outputs a forward keeps for `finite_after` (decode steps: T x H x 4 x L, e.g.
# 8 x 4096 x 4 x 94 = 12 MiB); a bigger forward checks its logits rows after every layer instead.
KEEP_LAYER_OUTPUTS = 16 << 20


class MoETransformer:
    """Assembled from weights already read (build/fill.py DenseWeights): it reads nothing itself."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights,
        experts: ExpertProvider,
        device: torch.device,
        dtype: torch.dtype,
        cpu_math: str = "exact",
    ):
        self.cfg, self.experts, self.device, self.dtype = cfg, experts, device, dtype
        self.cpu_math = cpu_math  # kernels.CPU_MATHS: how the CPU kernels compute in every forward
        # per forward with logits_rows: `finite_after` [num_layers, B] bool, row b's hidden state finite
        # after layer l (read only when a sequence's logits are not finite, to name the layer where it
        # started): derived on first read from the layers' outputs kept by the forward
        self._finite_after: torch.Tensor | None = None
        self._layer_outputs: tuple[list[torch.Tensor], torch.Tensor] | None = None  # ([L] x [T, H], rows)
        self.record_routing = False
        # route_override(layer, ids, weights) -> (ids, weights): replaces the router's choice
        # (benchmarks drive routing from a synthetic trace); None = the model's own router. If it
        # has .lookahead(layer, ids) -> ids, that replaces the next-layer prediction too.
        self.route_override = None
        self.routing: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self.embed: Table | BlockTable | RowReader = weights.embed  # rows(input_ids [T]) -> [T, H]
        self.rotary, self.norm, self.lm_head = weights.rotary, weights.norm, weights.lm_head
        self.dense_quantized: list[QuantizedWeight] = (
            weights.dense_quantized
        )  # what `dense` quantized at load
        self.kv_index = {layer: n for n, layer in enumerate(cfg.attention_layer_ids)}
        self.layers = [self._mixer(i, dict(layer)) for i, layer in enumerate(weights.layers)]
        moe = cfg.moe_layer_ids
        self.next_moe = {a: b for a, b in zip(moe, moe[1:])}
        # a MoE layer's attention half in one C++ call where every piece runs on the kernels anyway
        # (layers/block.py; bit-identical to the Python path). fused_blocks = False: the Python path.
        self.blocks = [AttnBlock.build(cfg, layer, device, dtype) for layer in self.layers]
        self.fused_blocks = True
        # and the MoE call inside the block where the experts are resident (slot = expert id), the
        # layer has no shared expert and the router does not scale its weights
        self._block_moe = [
            experts.kernel_moe_args(i, cfg.hidden_size)
            if b is not None and "shared" not in layer and cfg.router.scaling == 1.0
            else None
            for i, (b, layer) in enumerate(zip(self.blocks, self.layers))
        ]
        # and, where every layer has a block, the whole stack of them in one call a step
        self.stack = AttnStack.build(self.blocks, self._block_moe)

    def _mixer(self, i: int, layer: dict) -> dict:
        """A layer's token mixer made from its weights: softmax attention or MLA ("attn"); a Gated
        DeltaNet layer comes made ("linear")."""
        if "mha" in layer:
            layer["attn"] = Attention(self.cfg, i, layer.pop("mha"), self.rotary)
        elif "mla" in layer:
            layer["attn"] = MLAttention(self.cfg, i, layer.pop("mla"), self.rotary)
        return layer

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        batch: AttnBatch,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        logits_rows: torch.Tensor | None = None,
        states: StateBatch | None = None,
    ) -> torch.Tensor:
        """input_ids [T] -> logits [len(logits_rows) or T, V] in float32. kv: one (k, v) cache pair per
        attention layer; states: the sequences' linear-attention states (hybrid models only)."""
        with kernels.cpu_threads(self.device), kernels.cpu_math(self.cpu_math):
            return self._forward(input_ids, batch, kv, logits_rows, states)

    @property
    def finite_after(self) -> torch.Tensor | None:
        """[num_layers, B] bool for the last forward with logits_rows: row b finite after layer l."""
        if self._finite_after is None and self._layer_outputs is not None:
            hs, rows = self._layer_outputs
            self._finite_after = torch.stack([torch.isfinite(h[rows]).all(-1) for h in hs]) if hs else None
            self._layer_outputs = None
        return self._finite_after

    def _forward(self, input_ids, batch, kv, logits_rows, states):
        eps = self.cfg.rms_norm_eps
        h = self.embed.rows(input_ids).to(self.dtype)  # [T, H]
        self.routing = {}
        self._finite_after = self._layer_outputs = None
        # every layer's output h (a new tensor each layer) is kept while they are few bytes, and only
        # checked if the logits turn out non-finite; a bigger step checks its B rows after each layer
        keep = h.numel() * h.element_size() * len(self.layers) <= KEEP_LAYER_OUTPUTS
        outs: list[torch.Tensor] = []

        def done(h):  # h: a layer's output
            if logits_rows is not None:
                outs.append(h if keep else torch.isfinite(h[logits_rows]).all(-1))

        self.experts.begin_step()
        try:
            mlp = None  # the previous layer's MLP / MoE output, added into h by the next norm
            blocks = self.blocks if self.fused_blocks else ()
            # the MoE inside the block only when nothing needs the routing in Python this step
            with_moe = self.route_override is None and not self.record_routing
            moes = self._block_moe if with_moe else [None] * len(blocks)
            stacked = (
                self.stack is not None and self.fused_blocks and self._run_stack(h, batch, kv, with_moe, done)
            )
            if stacked:
                h, mlp = stacked
            for i, layer in enumerate(() if stacked else self.layers):
                fused = (
                    blocks[i](h, mlp, batch, *kv[self.kv_index[i]], moes[i]) if blocks and blocks[i] else None
                )
                if fused is not None:
                    s, h, x, routed, out = fused
                    if mlp is not None:
                        done(s)
                    mlp = out if out is not None else self._moe(i, layer, h, x, routed)
                    continue
                if mlp is None:
                    x = rms_norm(h, layer["input_ln"], eps)
                else:
                    h, x = add_rms_norm(h, mlp, layer["input_ln"], eps)
                    done(h)
                if "linear" in layer:
                    mix = layer["linear"](x, batch.seq_of_token, batch.row_of_token, batch.max_q, states)
                else:
                    mix = layer["attn"](x, batch, *kv[self.kv_index[i]])
                h, x = add_rms_norm(h, mix, layer["post_ln"], eps)
                mlp = self._moe(i, layer, h, x) if "router" in layer else swiglu(x, *layer["mlp"])
            if mlp is not None:
                h = h + mlp
                done(h)
        finally:
            self.experts.end_step()
        if logits_rows is not None:
            if keep:
                self._layer_outputs = (outs, logits_rows)
            else:
                self._finite_after = torch.stack(outs) if outs else None
            h = h.index_select(0, logits_rows)  # (h[rows] runs torch's much longer indexing path)
        return linear(rms_norm(h, self.norm, eps), self.lm_head).float()

    def _run_stack(self, h: torch.Tensor, batch: AttnBatch, kv: list, with_moe: bool, done) -> tuple | None:
        """Every layer through the stack of blocks (layers/block.py AttnStack), a layer whose MoE needs
        Python run here between two calls -> (h, mlp) after the last layer, or None: the attention
        kernel does not take this step (nothing has run)."""
        kv = [kv[self.kv_index[i]] for i in range(len(self.layers))]
        if not self.stack.takes(batch, kv):
            return None
        mlp, start = None, 0
        while start < len(self.layers):
            stop, sums, _, h, x, routed, out = self.stack(h, mlp, batch, kv, start, with_moe)
            for s in sums:
                done(s)
            mlp = out if out is not None else self._moe(stop, self.layers[stop], h, x, routed)
            start = stop + 1
        return h, mlp

    def _route(self, layer: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return route(
            x,
            layer["router"],
            cfg.top_k,
            cfg.norm_topk_prob,
            cfg.router,
            layer.get("correction"),
            layer.get("router_bias"),
        )

    def _moe(
        self, i: int, layer: dict, h: torch.Tensor, x: torch.Tensor, routed: tuple | None = None
    ) -> torch.Tensor:
        ids, w = self._route(layer, x) if routed is None else routed
        if self.route_override is not None:
            ids, w = self.route_override(i, ids, w)
        ahead = None
        nxt = self.next_moe.get(i)
        if nxt is not None and (self.experts.wants_prefetch or self.record_routing):
            nl = self.layers[nxt]
            ahead, _ = self._route(nl, rms_norm(h, nl["post_ln"], self.cfg.rms_norm_eps))
            if hasattr(self.route_override, "lookahead"):
                ahead = self.route_override.lookahead(nxt, ahead)
            if self.experts.wants_prefetch:
                self.experts.prefetch(nxt, ahead)
        if self.record_routing:
            self.routing[i] = (ids, w, ahead)
        out = self.experts.forward(i, x, ids, w)
        if "shared" in layer:
            s = swiglu(x, *layer["shared"])
            if "shared_gate" in layer:
                s = torch.sigmoid(linear(x, layer["shared_gate"])) * s
            out = out + s
        return out
