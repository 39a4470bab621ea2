"""Routers of MoE layers, in a registry by name (ModelConfig.router.kind).

    x [T, H] -> ids [T, K] int64, weights [T, K] (x's dtype)
Scores, group selection and top-k run in float32 (the logits too where the reference computes them so).
E experts in G groups of E/G (n_group); a group-limited router keeps the topk_group best groups
and picks the top-k experts among them.

    softmax               softmax over experts, top-k (Qwen, Mixtral, OLMoE; DeepSeek-V2 `greedy`)
    topk_softmax          top-k of the logits, softmax over those k (GPT-OSS)
    group_limited_greedy  softmax, groups ranked by their best expert (DeepSeek-V2)
    noaux_tc              sigmoid scores; the choice uses scores + e_score_correction_bias, groups
                          ranked by the sum of their two best; weights are the plain scores (DeepSeek-V3, GLM-4.5)
The router linear may have a bias (GPT-OSS). Every router then renormalises the chosen weights
when norm_topk_prob and multiplies them by routed_scaling_factor (RouterSpec.scaling).
On the CPU the softmax router's post-linear work (softmax, top-k, renormalisation) is one C++ call
(kernels/small_ops.py), which hands a call back to the torch code above when a near-tie could make
its choice differ from torch's.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels import small_ops
from ..spec.model_config import RouterSpec
from .basic import linear, router_linear

# kind -> fn(logits fp32 [T, E], correction [E] | None, top_k, spec, renorm) -> (ids [T, K], weights fp32
# [T, K], divided by their sum when renorm: each router renormalises, so that a fused kernel can)
ROUTERS: dict[str, Callable] = {}


def register(name: str):
    def deco(fn):
        ROUTERS[name] = fn
        return fn

    return deco


def _group_mask(choice: torch.Tensor, group_scores: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """[T, E] bool: experts in the topk_group best groups (group_scores [T, G])."""
    T, E = choice.shape
    best = torch.topk(group_scores, spec.topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep[:, :, None].expand(T, spec.n_group, E // spec.n_group).reshape(T, E)


def _normed(w: torch.Tensor, renorm: bool, eps: float = 0.0) -> torch.Tensor:
    return w / (w.sum(dim=-1, keepdim=True) + eps) if renorm else w


@register("softmax")
def _softmax(logits, correction, top_k, spec, renorm):
    # C++ on CPU float32, renormalised in the same pass; it declines near-ties, so the choice is torch's
    fused = small_ops.softmax_topk(logits, top_k, renorm)
    if fused is not None:
        return fused
    w, ids = torch.topk(F.softmax(logits, dim=-1), top_k, dim=-1)
    return ids, _normed(w, renorm)


@register("topk_softmax")
def _topk_softmax(logits, correction, top_k, spec, renorm):
    top, ids = torch.topk(logits, top_k, dim=-1)
    return ids, _normed(F.softmax(top, dim=-1), renorm)


@register("group_limited_greedy")
def _group_limited(logits, correction, top_k, spec, renorm):
    probs = F.softmax(logits, dim=-1)
    groups = probs.view(probs.shape[0], spec.n_group, -1).amax(dim=-1)
    probs = probs.masked_fill(~_group_mask(probs, groups, spec), 0.0)
    w, ids = torch.topk(probs, top_k, dim=-1)
    return ids, _normed(w, renorm)


@register("noaux_tc")
def _noaux_tc(logits, correction, top_k, spec, renorm):
    scores = logits.sigmoid()
    choice = scores if correction is None else scores + correction
    groups = choice.view(choice.shape[0], spec.n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
    choice = choice.masked_fill(~_group_mask(choice, groups, spec), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    return ids, _normed(scores.gather(1, ids), renorm, 1e-20)


def router_logits(
    x: torch.Tensor, router_w: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None
):
    """x [T, H] -> the router's logits [T, E] in float32."""
    if spec.float32_logits:
        return linear(x.float(), router_w.float(), None if bias is None else bias.float())
    return router_linear(x, router_w, bias).float()


def finish_route(ids: torch.Tensor, w: torch.Tensor, spec: RouterSpec, dtype: torch.dtype):
    """A router's (ids, weights) -> the weights scaled by routed_scaling_factor, in dtype."""
    if spec.scaling != 1.0:
        w = w * spec.scaling
    return ids, (w if w.dtype == dtype else w.to(dtype))


def route_logits(
    logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    spec: RouterSpec,
    correction: torch.Tensor | None,
    dtype: torch.dtype,
):
    """The experts and weights (in dtype) of each token from its router logits [T, E] float32."""
    ids, w = ROUTERS[spec.kind](
        logits, None if correction is None else correction.float(), top_k, spec, norm_topk_prob
    )
    return finish_route(ids, w, spec, dtype)


def route(
    x: torch.Tensor,
    router_w: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    spec: RouterSpec | None = None,
    correction: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """The experts and weights of each token (spec None = softmax, no scaling)."""
    spec = spec or RouterSpec()
    return route_logits(
        router_logits(x, router_w, spec, bias), top_k, norm_topk_prob, spec, correction, x.dtype
    )
