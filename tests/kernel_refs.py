"""float64 references for the CPU kernel tests, written from the formats' and the kernels' definitions
(csrc/fast_kernels.h, csrc/nibble_kernels.h), never from the kernels or the packing code under test:

- how each CPU math sees the activations (an `ActRounding`, named after the kernels' suffixes):
  F32ACT (exact math: float32 as is), BF16ACT (fast bf16: nearest-even bf16), Q8ACT32 / Q8ACT64 (fast
  4-bit / int8: int8 codes per block of 32 / 64 along K, scale = max|x| / 127 in float32, round half to
  even; a non-finite block gives NaN);
- the 4-bit dequantizers: MXFP4 (e2m1 codes, e8m0 block scales, 255 = NaN) and int4 (codes, float
  scales, integer zero points per group);
- the MoE sum per (token, slot) pair: SiLU (split gate / up) or GPT-OSS's clamped SwiGLU with biases.

Shape legend: T tokens, K features, N weight rows, S expert slots, A slots per token (-1: skipped),
H hidden, I intermediate features of an expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _q8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (int8 codes, their block's scale) as float64 [T, K]; blocks of `block` along K."""
    T, K = x.shape
    Kp = -(-K // block) * block
    xb = F.pad(x.float(), (0, Kp - K)).view(T, Kp // block, block)
    s = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s > 0, torch.round(xb / s), torch.zeros_like(xb))  # torch.round: half to even
    return q.double().view(T, Kp)[:, :K], s.double().expand(T, Kp // block, block).reshape(T, Kp)[:, :K]


@dataclass(frozen=True)
class ActRounding:
    """How a kernel sees its activations: `rnd(x)` x [T, K] -> float64 [T, K]; `rnd.step(h)` h float64
    [K] -> float64 [K], one rounding step per element (what rounding h from float32 instead of float64
    may change; 0 where the kernel does not round)."""

    name: str
    round: Callable[[torch.Tensor], torch.Tensor]
    step: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.round(x)


F32ACT = ActRounding("f32act", lambda x: x.double(), torch.zeros_like)
BF16ACT = ActRounding("bf16act", lambda x: x.float().bfloat16().double(), lambda h: h.abs() * 2**-7)
Q8ACT32 = ActRounding("q8act32", lambda x: torch.mul(*_q8(x, 32)), lambda h: _q8(h[None], 32)[1][0])
Q8ACT64 = ActRounding("q8act64", lambda x: torch.mul(*_q8(x, 64)), lambda h: _q8(h[None], 64)[1][0])


def mxfp4_weight(codes: torch.Tensor, scales: torch.Tensor, K: int) -> torch.Tensor:
    """codes uint8 [N, K / 2] (low nibble first), e8m0 uint8 [N, ceil(K / 32)] -> float64 [N, K]."""
    c = torch.stack([codes & 0xF, codes >> 4], -1).reshape(codes.shape[0], -1)[:, :K].long()
    e = scales.double()
    s = torch.where(scales == 255, torch.nan, torch.where(scales == 0, 2.0**-127, 2.0 ** (e - 127)))
    return E2M1[c] * s.repeat_interleave(32, 1)[:, :K]


def int4_weight(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, K: int, group: int
) -> torch.Tensor:
    """codes uint8 [N, K / 2] (low nibble first), scale float32 [N, ng], zero uint8 [N, ng] (ng groups
    of `group` along K) -> float64 [N, K]."""
    c = torch.stack([codes & 0xF, codes >> 4], -1).reshape(codes.shape[0], -1)[:, :K].double()
    z = zero.double().repeat_interleave(group, 1)[:, :K]
    return (c - z) * scale.double().repeat_interleave(group, 1)[:, :K]


def moe_reference(
    x,
    slots,
    weights,
    gate,
    up,
    down,
    rnd: ActRounding = F32ACT,
    act: str = "silu",
    biases=(None, None, None),
    limit: float = 7.0,
    alpha: float = 1.702,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], slots [T, A] (-1: skipped), weights [T, A], gate / up float64 [S, I, H], down float64
    [S, H, I], biases (gate [S, I], up [S, I], down [S, H]) or Nones -> (out, slack) float64 [T, H]:
    out[t] = sum_a weights[t, a] * (down_s act(gate_s x_t + bg_s, up_s x_t + bu_s) + bd_s), x and h seen
    through `rnd`; act "silu": silu(g) u, "clamped_swiglu": g <= limit, |u| <= limit, (u + 1) g sigmoid(alpha g)
    (GPT-OSS: limit 7, alpha 1.702).
    slack bounds what rounding h from float32 instead may change (one step of `rnd` per element of h,
    through |down|); zero for F32ACT."""
    bg, bu, bd = (None if b is None else b.double() for b in biases)
    xr = rnd(x)
    out = torch.zeros(x.shape, dtype=torch.float64)
    slack = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(slots.shape[0]):
        for j in range(slots.shape[1]):
            s = int(slots[t, j])
            if s < 0:
                continue
            g, u = gate[s] @ xr[t], up[s] @ xr[t]
            if bg is not None:
                g, u = g + bg[s], u + bu[s]
            if act == "silu":
                h = F.silu(g) * u
            elif act == "clamped_swiglu":
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
                h = (u + 1) * g * torch.sigmoid(alpha * g)
            else:
                raise ValueError(f"moe_reference: act must be silu or clamped_swiglu, got {act!r}")
            y = down[s] @ rnd(h[None])[0]
            out[t] += weights[t, j].double() * (y if bd is None else y + bd[s])
            slack[t] += weights[t, j].double().abs() * (down[s].abs() @ rnd.step(h))
    return out, slack


def assert_moe_close(out: torch.Tensor, ref: torch.Tensor, slack: torch.Tensor, label: str) -> None:
    """Every output within slack + 1e-5 max|ref| of the reference, and at least 90% within 1e-5 max|ref|
    (float32 sums only: a rounding edge of h moves a few at most)."""
    err = (out.double() - ref).abs()
    tol = 1e-5 * ref.abs().max()
    assert (err <= slack + tol).all(), f"{label}: max error {err.max():.3g}"
    assert (err <= tol).float().mean() >= 0.9, label
