"""Router of one MoE layer: softmax over experts, top-k, optional renormalisation.

    x [T, H] -> ids [T, K] int64, weights [T, K] (x's dtype)
Softmax and top-k run in float32, as the reference implementations do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .basic import linear


def route(x: torch.Tensor, router_w: torch.Tensor, top_k: int, norm_topk_prob: bool):
    probs = F.softmax(linear(x, router_w).float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(x.dtype)
