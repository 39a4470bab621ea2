"""A MoE layer's attention half as one C++ call on the CPU (kernels.attn_block, csrc/decode_block.cpp):
the residual add and input norm, the fused qkv projection, attention, the output projection, the
residual add and post-attention norm, the router's projection and its softmax top-k.

It calls the kernels the layer's Python path calls, in the same order, so its results are that path's
bit for bit. What it saves is the Python between the kernels: at batch 1 a layer makes ~7 such calls,
and each Python round trip runs on caches the weights have just streamed through.

It is used where every piece would run on the C++ kernels anyway:
- float32 compute on the CPU;
- a standard attention with a plain fused qkv (no output gate, no full-width q/k norm, no clip);
- projections the kernels read (bf16/fp16 dense weights, or `--dense int8`);
- the softmax router, without a bias or fp32 logits.
Per step it also needs the attention kernel to take the batch (at most MAX_Q new tokens a sequence).
Anywhere else, the layer runs its Python path.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels import attention as attention_kernel
from ..spec.model_config import ModelConfig
from .attention import AttnBatch, Attention
from .basic import kernel_spec
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
    def build(cls, cfg: ModelConfig, layer: dict, device: torch.device, dtype: torch.dtype) -> AttnBlock | None:
        attn = layer.get("attn")
        if (torch.device(device).type != "cpu" or dtype != torch.float32 or kernels.backend() != "cpp"
                or not isinstance(attn, Attention) or not attn.plain_qkv or "router" not in layer
                or cfg.router.kind != "softmax" or cfg.router.float32_logits or "router_bias" in layer):
            return None
        w = attn.w
        qkv = _projection(w["qkv_proj.weight"], w.get("qkv_proj.bias"))
        o = _projection(w["o_proj.weight"], w.get("o_proj.bias"))
        router = _projection(layer["router"], None)
        return None if None in (qkv, o, router) else cls(cfg, attn, layer, qkv, o, router)

    def __call__(self, h: torch.Tensor, mlp: torch.Tensor | None, batch: AttnBatch, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, moe: tuple | None = None) -> tuple | None:
        """h [T, H] the residual stream, mlp the previous layer's MLP / MoE output (None: nothing to add)
        -> (s, h2, x2, (ids, weights), out): s = h + mlp (the previous layer's output), h2 the stream
        after attention, x2 its post-attention norm, the router's choice; out: with `moe` (the
        resident experts' kernel arguments, ExpertProvider.kernel_moe_args; the router must not scale),
        the layer's MoE output once the fused top-k answered, else None; or None (not for this step)."""
        if not attention_kernel.takes(batch, k_cache):
            return None
        cfg, layer = self.cfg, self.layer
        s, h2, x2, logits, ids, w, out = kernels.attn_block(
            h, mlp, layer["input_ln"], layer["post_ln"], cfg.rms_norm_eps, self.qkv, self.o, self.router,
            self.attn.kernel_args(batch, k_cache, v_cache), cfg.top_k, cfg.norm_topk_prob, moe)
        if ids is None:  # the fused top-k declined (a near-tie): the router's torch code decides
            return s, h2, x2, route_logits(logits, cfg.top_k, cfg.norm_topk_prob, cfg.router, None, x2.dtype), None
        return s, h2, x2, finish_route(ids, w, cfg.router, x2.dtype), out
