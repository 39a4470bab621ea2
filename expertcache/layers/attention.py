"""Attention over a paged KV cache for a flattened batch of sequences.

Shape legend:
    T new tokens (all sequences, flattened)   B sequences   Q max new tokens of one sequence
    L = max blocks per sequence * block_size (padded context)   h heads, g kv heads, D head_dim
    k_cache / v_cache [num_blocks, block_size, g, D] (one pair per layer)

New keys/values are written at `slot_mapping` (flat index block * block_size + offset)
before the gather, so a sequence sees its own new tokens. Masking: key position kp is
visible to a query at position qp iff kp <= qp and kp > qp - window (sliding window).
With attn_output_gate, q_proj yields [query, gate] per head and the output is scaled by sigmoid(gate).

Attention sinks (GPT-OSS, `w["sinks"]` [h]): a learned logit per head joins each softmax
denominator without a value, softmax([q.k * scale..., sink_h]) dropping the sink's column. It is
computed as one more key (zeros) with a zero value whose additive mask entry is sink_h.

Two paths after the projections (one fused qkv weight when the load made one, models/transformer.py
`fuse_qkv`): on the CPU in float32 the C++ kernel (kernels/attention.py: head q/k norm, rotary, the
cache write and attention through the block table in one call; it splits a plain fused qkv itself);
elsewhere, or where it declines, torch: the same steps as tensor ops and SDPA over the gathered,
padded context.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..spec.model_config import ModelConfig
from ..kernels.attention import attend
from .basic import Rotary, linear, rms_norm


class AttnBatch(NamedTuple):
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padding = 0)
    seq_of_token: torch.Tensor  # [T] int64, sequence index b
    row_of_token: torch.Tensor  # [T] int64, index j of the token within its sequence's new tokens
    max_q: int
    query_pos: torch.Tensor  # [B, Q] positions of each sequence's new tokens (padding 0)


class Attention:
    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor], rotary: Rotary):
        self.cfg, self.w, self.rotary = cfg, w, rotary
        self.h, self.g, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window[layer]
        self.scale = self.d ** -0.5
        self.sinks = w.get("sinks")
        self.q_rows = (2 if cfg.attn_output_gate else 1) * self.h * self.d
        head_norm = cfg.qk_norm == "head"
        self._kernel_norms = (w["q_norm.weight"], w["k_norm.weight"]) if head_norm else (None, None)
        self.fused = "qkv_proj.weight" in w
        # a fused qkv the kernel can take whole: nothing between the projection and the kernel
        self.plain_qkv = self.fused and not cfg.attn_output_gate and cfg.qk_norm != "full" and cfg.clip_qkv is None

    def __call__(self, x: torch.Tensor, batch: AttnBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        w, T = self.w, x.shape[0]
        qkv = linear(x, w["qkv_proj.weight"], w.get("qkv_proj.bias")) if self.fused else None
        o = self._kernel(qkv, None, None, batch, k_cache, v_cache) if self.plain_qkv else None  # [T, h * D]
        if o is None:
            q, gate, k, v = self._project(x, qkv)
            o = self._kernel(q, k, v, batch, k_cache, v_cache)
            if o is None:
                o = self._torch(q, k, v, batch, k_cache, v_cache).reshape(T, self.h * self.d)
            if gate is not None:
                o = o * torch.sigmoid(gate)
        return linear(o, w["o_proj.weight"], w.get("o_proj.bias"))

    def kernel_args(self, batch: AttnBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        """The attention kernel's arguments besides q/k/v and eps, as kernels.attn_block takes them:
        (q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_of_token,
        positions, window, scale, sinks)."""
        cos, sin, *tables = self.kernel_step_args(batch)
        qn, kn, window, scale, sinks = self.kernel_layer_args()
        return (qn, kn, cos, sin, k_cache, v_cache, *tables, window, scale, sinks)

    def kernel_layer_args(self) -> tuple:
        """The layer's own part of kernel_args: (q_norm, k_norm, window, scale, sinks)."""
        return (*self._kernel_norms, self.window or 0, self.scale, self.sinks)

    def kernel_step_args(self, batch: AttnBatch) -> tuple:
        """The step's part of kernel_args, the same for every layer: (cos, sin, slot_mapping,
        block_tables, seq_of_token, positions)."""
        cos, sin = self.rotary.tables(batch.positions, torch.float32)
        return cos, sin, batch.slot_mapping, batch.block_tables, batch.seq_of_token, batch.positions

    def _project(self, x: torch.Tensor, qkv: torch.Tensor | None):
        """x [T, H] (and its fused qkv projection, when the load fused the weights) -> q [T, h * D] (with
        attn_output_gate: [T, h, D], a strided view), gate [T, h * D] (attn_output_gate, else None), k and
        v [T, g * D]: the projections, full q/k norm, clip_qkv."""
        cfg, w, T, qr, kd = self.cfg, self.w, x.shape[0], self.q_rows, self.g * self.d
        if qkv is not None:
            q, k, v = qkv.split((qr, kd, kd), dim=1)
        else:
            q = linear(x, w["q_proj.weight"], w.get("q_proj.bias"))
            k = linear(x, w["k_proj.weight"], w.get("k_proj.bias"))
            v = linear(x, w["v_proj.weight"], w.get("v_proj.bias"))
        gate = None
        if cfg.attn_output_gate:  # per head [query (D), gate (D)]
            q, gate = q.view(T, self.h, 2 * self.d).chunk(2, dim=-1)
            gate = gate.reshape(T, self.h * self.d)
        if cfg.qk_norm == "full":
            q = rms_norm(q.reshape(T, self.h * self.d), w["q_norm.weight"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm.weight"], cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        return q, gate, k, v

    def _kernel(self, q, k, v, batch: AttnBatch, k_cache, v_cache) -> torch.Tensor | None:
        """The CPU kernel (head norm, rotary, cache write, attention in one call), or None: not handled.
        k = v = None: q is the fused qkv."""
        if not q.is_cpu or q.dtype != torch.float32:
            return None
        cos, sin = self.rotary.tables(batch.positions, q.dtype)
        qn, kn = self._kernel_norms
        return attend(q, k, v, k_cache, v_cache, batch, self.scale, self.window, self.sinks, qn, kn,
                      self.cfg.rms_norm_eps, cos, sin)

    def _torch(self, q, k, v, batch: AttnBatch, k_cache, v_cache) -> torch.Tensor:
        """The same in torch ops: -> [T, h, D]."""
        cfg, w, T = self.cfg, self.w, q.shape[0]
        q, k, v = q.view(T, self.h, self.d), k.view(T, self.g, self.d), v.view(T, self.g, self.d)
        if cfg.qk_norm == "head":
            q = rms_norm(q, w["q_norm.weight"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm.weight"], cfg.rms_norm_eps)
        q, k = self.rotary(q, k, batch.positions)

        bs = k_cache.shape[1]
        k_cache.view(-1, self.g, self.d)[batch.slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(-1, self.g, self.d)[batch.slot_mapping] = v.to(v_cache.dtype)
        B, nb = batch.block_tables.shape
        keys = k_cache[batch.block_tables].view(B, nb * bs, self.g, self.d).transpose(1, 2).to(q.dtype)
        vals = v_cache[batch.block_tables].view(B, nb * bs, self.g, self.d).transpose(1, 2).to(q.dtype)

        mask = visible(batch, nb * bs, self.window)[:, None]  # [B, 1, Q, L]
        if self.sinks is not None:
            keys, vals, mask = self._sink_column(keys, vals, mask, q.dtype)
        o = F.scaled_dot_product_attention(
            pad_queries(batch, q).transpose(1, 2), keys, vals, attn_mask=mask, scale=self.scale,
            enable_gqa=self.g != self.h
        )  # [B, h, Q, D]
        return o.transpose(1, 2)[batch.seq_of_token, batch.row_of_token]

    def _sink_column(self, keys, vals, mask, dtype):
        """keys/vals [B, g, L, D] -> [B, g, L+1, D] (a zero key and value last); the boolean mask
        [B, 1, Q, L] -> an additive one [B, h, Q, L+1] whose last column is each head's sink logit."""
        keys, vals = F.pad(keys, (0, 0, 0, 1)), F.pad(vals, (0, 0, 0, 1))
        B, _, Q, L = mask.shape
        bias = torch.zeros(B, self.h, Q, L + 1, dtype=dtype, device=mask.device)
        bias[..., :L].masked_fill_(~mask, float("-inf"))
        bias[..., L] = self.sinks.to(dtype)[None, :, None]
        return keys, vals, bias


def pad_queries(batch: AttnBatch, q: torch.Tensor) -> torch.Tensor:
    """[T, ...] new tokens -> [B, Q, ...] per sequence (padding rows zero)."""
    qp = q.new_zeros(batch.block_tables.shape[0], batch.max_q, *q.shape[1:])
    qp[batch.seq_of_token, batch.row_of_token] = q
    return qp


def visible(batch: AttnBatch, length: int, window: int | None = None) -> torch.Tensor:
    """[B, Q, length] bool: key position kp visible to the query at qp (kp <= qp, within the window)."""
    kpos = torch.arange(length, device=batch.query_pos.device)[None, None, :]
    qpos = batch.query_pos[:, :, None]  # [B, Q, 1]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    return mask
