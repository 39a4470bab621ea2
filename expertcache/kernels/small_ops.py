"""Fused small ops of a decode step (csrc/small_ops.cpp): each returns None when it does not apply
(no C++ extension, a CUDA tensor, another dtype, a strided view), and the caller computes with torch.

Shape legend:
    T tokens, H hidden, R logits rows, V vocabulary, E experts, K top_k
    rms_norm      x [..., H] float32, w [H] float32 -> y like x
    add_rms_norm  h, d [..., H] -> (h + d, rms_norm(h + d))
    row_stats     logits [R, V] -> (max [R], argmax [R] int64, logsumexp [R], finite [R] bool)
    softmax_topk  logits [T, E] -> (ids [T, K] int64, weights [T, K]), or None (also when a near-tie
                  or a non-finite logit could make torch's choice differ: torch decides those)
"""

from __future__ import annotations

import torch

from .build import extension


def _ok(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    ext = extension()
    if ext is None or not (_ok(x) and _ok(w)) or w.dim() != 1 or x.dim() == 0 or x.shape[-1] != w.shape[0]:
        return None
    return ext.rms_norm(x.view(-1, x.shape[-1]), w, eps).view(x.shape)


def add_rms_norm(h: torch.Tensor, d: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    ext = extension()
    if (ext is None or not (_ok(h) and _ok(d) and _ok(w)) or h.shape != d.shape or w.dim() != 1 or h.dim() == 0
            or h.shape[-1] != w.shape[0]):
        return None
    s, y = ext.add_rms_norm(h.view(-1, h.shape[-1]), d.view(-1, h.shape[-1]), w, eps)
    return s.view(h.shape), y.view(h.shape)


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    ext = extension()
    if ext is None or not _ok(logits) or logits.dim() != 2 or logits.shape[1] == 0:
        return None
    return ext.row_stats(logits)


def softmax_topk(logits: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    ext = extension()
    if ext is None or not _ok(logits) or logits.dim() != 2 or not 1 <= k <= logits.shape[1]:
        return None
    ids, w, exact = ext.softmax_topk(logits, k, renorm)
    return (ids, w) if exact else None
