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


# rms_norm, add_rms_norm and softmax_topk make their checks in C++ (a decode step makes ~50 such calls)
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    ext = extension()
    return None if ext is None else ext.rms_norm(x, w, eps)


def add_rms_norm(
    h: torch.Tensor, d: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    ext = extension()
    return None if ext is None else ext.add_rms_norm(h, d, w, eps)


def row_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    ext = extension()
    if ext is None or not _ok(logits) or logits.dim() != 2 or logits.shape[1] == 0:
        return None
    return ext.row_stats(logits)


def softmax_topk(logits: torch.Tensor, k: int, renorm: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    ext = extension()
    return None if ext is None else ext.softmax_topk(logits, k, renorm)
