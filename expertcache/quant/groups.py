"""Group-wise helpers along the last (input) dimension, ragged last group allowed.

For a matrix [rows, n] and group size G there are ceil(n / G) groups; group g
covers columns [g*G, min((g+1)*G, n)). Per-group tensors are [rows, ceil(n/G)].
"""

from __future__ import annotations

import torch


def num_groups(n: int, group: int) -> int:
    """ceil(n / group)."""
    return -(-n // group)


def grouped_view(w: torch.Tensor, group: int) -> torch.Tensor:
    """[rows, n] -> [rows, ceil(n/G), G], zero-padding the ragged last group.

    Zero padding never changes amax, min(., 0) or max(., 0) of a group, which
    is all the encoders here reduce over. Copies only when n % G != 0.
    """
    rows, n = w.shape
    pad = num_groups(n, group) * group - n
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(rows, -1, group)


def expand_groups(per_group: torch.Tensor, group: int, n: int) -> torch.Tensor:
    """[rows, ceil(n/G)] -> [rows, n], each group value repeated over its columns."""
    return per_group.repeat_interleave(group, dim=1)[:, :n]


def apply_groups_(
    out: torch.Tensor, scale: torch.Tensor, group: int, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """In place: out[:, cols of g] = (out - zero[:, g]) * scale[:, g].

    `out` is float32 [rows, n] with unit stride on the last dim; `scale` (and
    `zero`) are [rows, ceil(n/G)]. Works through views, without an [rows, n]
    temporary: the full groups as [rows, n//G, G], then the ragged tail.
    """
    rows, n = out.shape
    full = n // group
    s = scale.to(torch.float32)
    z = None if zero is None else zero.to(torch.float32)
    if full:
        body = out[:, : full * group].unflatten(1, (full, group))
        if z is not None:
            body.sub_(z[:, :full, None])
        body.mul_(s[:, :full, None])
    if full * group < n:
        tail = out[:, full * group :]
        if z is not None:
            tail.sub_(z[:, full:])
        tail.mul_(s[:, full:])
    return out
