"""Small layers: RMSNorm, rotary embedding, the dense SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.model_config import ModelConfig, rope_inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rotary:
    """cos/sin for arbitrary positions: q/k [T, heads, D] rotated in the half-split convention."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        inv, self.scale = rope_inv_freq(cfg)
        self.inv_freq = inv.to(device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        freqs = positions[:, None].float() * self.inv_freq  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scale).to(q.dtype)[:, None, :]
        sin = (emb.sin() * self.scale).to(q.dtype)[:, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
