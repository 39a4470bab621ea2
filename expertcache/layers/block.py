"""A MoE layer's attention half as one C++ call on the CPU (kernels.attn_block, csrc/decode_block.cpp):
the residual add and input norm, the fused qkv projection, attention, the output projection, the
residual add and post-attention norm, the router's projection and its softmax top-k.

It calls the kernels the layer's Python path calls, in the same order, so its results are that path's
bit for bit. What it saves is the Python between the kernels: at batch 1 a layer makes ~7 such calls,
and each Python round trip runs on caches the weights have just streamed through.

It is used where every piece would run on the C++ kernels anyway:
- float32 compute on the CPU;
- a standard attention (no output gate, no full-width q/k norm, no clip) with a fused qkv, or q, k and v
  apart (a GGUF file's in different types: three projections, their outputs joined);
- projections the kernels read (bf16/fp16 dense weights, or `--dense int8`);
- the softmax router, without a bias or fp32 logits (a float32 router weight, as GGUF files store it,
  is read by the kernels on both paths: layers/basic.py `router_spec`).
Per step it also needs the attention kernel to take the batch (at most MAX_Q new tokens a sequence), and
not a prefill step that may go to the bf16 matmul (kernels.prefill_step: fast math, many tokens).
Anywhere else, the layer runs its Python path.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import attention as attention_kernel
from ..spec.model_config import ModelConfig
from .attention import Attention, AttnBatch
from .basic import kernel_spec, router_spec
from .moe import finish_route, route_logits


def _projection(w, b: torch.Tensor | None) -> tuple | None:
    """kernels.projection of a weight the Python path computes with a kernel, else None."""
    spec = kernel_spec(w, torch.float32)
    return None if spec is None else kernels.projection(spec, b)


class AttnBlock:
    """One layer's block; build() says whether the layer has one."""

    def __init__(self, cfg: ModelConfig, attn: Attention, layer: dict, qkv: tuple, o: tuple, router: tuple):
        self.cfg, self.attn, self.layer = cfg, attn, layer
        self.qkv, self.o, self.router = qkv, o, router

    @classmethod
    def build(
        cls, cfg: ModelConfig, layer: dict, device: torch.device, dtype: torch.dtype
    ) -> AttnBlock | None:
        attn = layer.get("attn")
        if (
            torch.device(device).type != "cpu"
            or dtype != torch.float32
            or kernels.backend() != "cpp"
            or not isinstance(attn, Attention)
            or not attn.plain
            or "router" not in layer
            or cfg.router.kind != "softmax"
            or cfg.router.float32_logits
            or "router_bias" in layer
        ):
            return None
        w = attn.w
        names = ("qkv_proj",) if attn.fused else ("q_proj", "k_proj", "v_proj")
        qkv = [_projection(w[f"{n}.weight"], w.get(f"{n}.bias")) for n in names]
        o = _projection(w["o_proj.weight"], w.get("o_proj.bias"))
        router = router_spec(layer["router"], torch.float32)
        if None in (*qkv, o, router):
            return None
        return cls(cfg, attn, layer, qkv[0] if attn.fused else qkv, o, kernels.projection(router))

    def __call__(
        self,
        h: torch.Tensor,
        mlp: torch.Tensor | None,
        batch: AttnBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        moe: tuple | None = None,
    ) -> tuple | None:
        """h [T, H] the residual stream, mlp the previous layer's MLP / MoE output (None: nothing to add)
        -> (s, h2, x2, (ids, weights), out): s = h + mlp (the previous layer's output), h2 the stream
        after attention, x2 its post-attention norm, the router's choice; out: with `moe` (the
        resident experts' kernel arguments, ExpertProvider.kernel_moe_args; the router must not scale),
        the layer's MoE output once the fused top-k answered, else None; or None (not for this step)."""
        if not attention_kernel.takes(batch, k_cache) or kernels.prefill_step(h.shape[0]):
            return None  # a prefill step under fast math: its projections may go to the bf16 matmul (linear)
        cfg, layer = self.cfg, self.layer
        s, h2, x2, logits, ids, w, out = kernels.attn_block(
            h,
            mlp,
            layer["input_ln"],
            layer["post_ln"],
            cfg.rms_norm_eps,
            self.qkv,
            self.o,
            self.router,
            self.attn.kernel_args(batch, k_cache, v_cache),
            cfg.top_k,
            cfg.norm_topk_prob,
            moe,
        )
        return s, h2, x2, self.routed(logits, ids, w, x2.dtype), out

    def routed(
        self, logits: torch.Tensor, ids: torch.Tensor | None, w: torch.Tensor | None, dtype: torch.dtype
    ):
        """The router's (ids, weights) from the block's results; ids None (the fused top-k declined, a
        near-tie): the router's torch code decides from the logits."""
        cfg = self.cfg
        if ids is None:
            return route_logits(logits, cfg.top_k, cfg.norm_topk_prob, cfg.router, None, dtype)
        return finish_route(ids, w, cfg.router, dtype)

    def stack_args(self, moe: tuple | None) -> tuple:
        """The layer's entry of kernels.attn_stack's `layers` (moe: as __call__'s)."""
        cfg, layer = self.cfg, self.layer
        qn, kn, window, scale, sinks = self.attn.kernel_layer_args()
        return (
            layer["input_ln"],
            layer["post_ln"],
            self.qkv,
            self.o,
            self.router,
            qn,
            kn,
            window,
            scale,
            sinks,
            cfg.top_k,
            cfg.norm_topk_prob,
            moe,
        )


class AttnStack:
    """Every layer's block in one call a step (kernels.attn_stack): built where every layer has a
    block. A call runs layers from `start` on, each with its MoE inside, and returns at the first layer
    whose MoE needs Python (no kernel arguments for it, with_moe false, or a declined top-k) or after
    the last; the caller runs that layer's MoE and calls again from the next. Bit-identical to the
    blocks called one by one (the same C++ calls in the same order)."""

    def __init__(self, blocks: list[AttnBlock], moes: list[tuple | None]):
        self.blocks = blocks
        self.layers = [b.stack_args(m) for b, m in zip(blocks, moes)]

    @classmethod
    def build(cls, blocks: list[AttnBlock | None], moes: list[tuple | None]) -> AttnStack | None:
        return cls(blocks, moes) if blocks and all(b is not None for b in blocks) else None

    def takes(self, batch: AttnBatch, kv: list) -> bool:
        """The attention kernel takes this step (every layer's cache has the first one's dtype)."""
        return attention_kernel.takes(batch, kv[0][0]) and not kernels.prefill_step(batch.positions.shape[0])

    def __call__(
        self,
        h: torch.Tensor,
        mlp: torch.Tensor | None,
        batch: AttnBatch,
        kv: list,
        start: int,
        with_moe: bool,
    ) -> tuple:
        """kv: every layer's (k_cache, v_cache), for a step the stack takes -> (stop, sums, s, h2, x2,
        routed, out) of layer `stop` (routed: None when out is given; sums: the residual sums s of the
        layers run after an mlp)."""
        first = self.blocks[0]
        stop, sums, s, h2, x2, logits, ids, w, out = kernels.attn_stack(
            h,
            mlp,
            self.layers,
            kv,
            first.attn.kernel_step_args(batch),
            first.cfg.rms_norm_eps,
            start,
            with_moe,
        )
        routed = None if out is not None else self.blocks[stop].routed(logits, ids, w, x2.dtype)
        return stop, sums, s, h2, x2, routed, out
