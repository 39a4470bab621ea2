"""Router of one MoE layer: scores, top-k, optional renormalisation.

    x [T, H] -> ids [T, K] int64, weights [T, K] (x's dtype)
order "softmax_topk": softmax over all experts, then top-k (optionally renormalised);
order "topk_softmax" (GPT-OSS): top-k of the logits, then softmax over those k.
The router may have a bias. Softmax and top-k run in float32, as the reference implementations do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .basic import linear

def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk_prob: bool,
          bias: torch.Tensor | None = None, order: str = "softmax_topk"):
    logits = linear(x, router_w, bias).float()
    if order == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return ids, F.softmax(top, dim=-1).to(x.dtype)
    probs = F.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(x.dtype)
