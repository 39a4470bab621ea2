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

from ..kernels.attention import attend
from ..spec.model_config import ModelConfig
from .basic import Rotary, linear, rms_norm


class AttnBatch(NamedTuple):
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padding = 0)
    seq_of_token: torch.Tensor  # [T] int64, sequence index b
    row_of_token: torch.Tensor  # [T] int64, index j of the token within its sequence's new tokens
    max_q: int
    query_pos: torch.Tensor  # [B, Q] positions of each sequence's new tokens (padding 0)
    # per sequence (first new position, new tokens) on the host, tokens flattened sequence after sequence;
    # None: read from query_pos / seq_of_token once per batch (a device -> host read on a GPU)
    spans: tuple[tuple[int, int], ...] | None = None


class Attention:
    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor], rotary: Rotary):
        self.cfg, self.w, self.rotary = cfg, w, rotary
        self.h, self.g, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window[layer]
        self.scale = self.d**-0.5
        self.sinks = w.get("sinks")
        self.q_rows = (2 if cfg.attn_output_gate else 1) * self.h * self.d
        head_norm = cfg.qk_norm == "head"
        self._kernel_norms = (w["q_norm.weight"], w["k_norm.weight"]) if head_norm else (None, None)
        self.fused = "qkv_proj.weight" in w
        # nothing between the q/k/v projections and the kernel; plain_qkv: fused, so the kernel takes it whole
        self.plain = not cfg.attn_output_gate and cfg.qk_norm != "full" and cfg.clip_qkv is None
        self.plain_qkv = self.fused and self.plain

    def __call__(
        self, x: torch.Tensor, batch: AttnBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
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
        return attend(
            q,
            k,
            v,
            k_cache,
            v_cache,
            batch,
            self.scale,
            self.window,
            self.sinks,
            qn,
            kn,
            self.cfg.rms_norm_eps,
            cos,
            sin,
        )

    def _torch(self, q, k, v, batch: AttnBatch, k_cache, v_cache) -> torch.Tensor:
        """The same in torch ops: -> [T, h, D]."""
        cfg, w, T = self.cfg, self.w, q.shape[0]
        q, k, v = q.view(T, self.h, self.d), k.view(T, self.g, self.d), v.view(T, self.g, self.d)
        if cfg.qk_norm == "head":
            q = rms_norm(q, w["q_norm.weight"], cfg.rms_norm_eps)
            k = rms_norm(k, w["k_norm.weight"], cfg.rms_norm_eps)
        q, k = self.rotary(q, k, batch.positions)

        k_cache.view(-1, self.g, self.d)[batch.slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(-1, self.g, self.d)[batch.slot_mapping] = v.to(v_cache.dtype)
        o, off = [], 0
        for b, (start, n) in enumerate(host_spans(batch)):
            o.append(self._sequence(q[off : off + n], b, start, n, batch, k_cache, v_cache))
            off += n
        return torch.cat(o) if len(o) > 1 else o[0]

    def _sequence(self, q, b: int, start: int, n: int, batch: AttnBatch, k_cache, v_cache) -> torch.Tensor:
        """One sequence's n new queries q [n, h, D] at positions start.. over its own keys, sliced to what
        they can see (the window's start on; through the block table, no padded gather) -> [n, h, D]:
        without a window band or sinks `_unmasked` (no mask tensor), else `_masked`."""
        L = start + n
        lo = max(0, start - self.window + 1) if self.window else 0  # the first key any query sees
        keys, vals = self._context(b, lo, L, batch, k_cache, v_cache, q.dtype)
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, h, n, D]
        if self.sinks is None and (not self.window or n == 1 or L <= self.window):  # no band to mask
            return self._unmasked(qs, keys, vals)
        return self._masked(qs, keys, vals, start, lo)

    def _context(self, b: int, lo: int, L: int, batch: AttnBatch, k_cache, v_cache, dtype):
        """Sequence b's keys and values at positions lo..L-1, read through its block table and cast to
        dtype -> ([1, g, L - lo, D], [1, g, L - lo, D])."""
        bs = k_cache.shape[1]
        blocks = batch.block_tables[b, lo // bs : -(-L // bs)]
        cut = slice(lo - lo // bs * bs, L - lo // bs * bs)

        def ctx(cache):  # [1, g, Lk, D]
            return cache[blocks].view(-1, self.g, self.d)[cut].transpose(0, 1).unsqueeze(0).to(dtype)

        return ctx(k_cache), ctx(v_cache)

    def _unmasked(self, qs, keys, vals) -> torch.Tensor:
        """qs [1, h, n, D] over keys/vals [1, g, Lk, D] that every query may see up to its own position
        -> [n, h, D]. No mask (one query), SDPA's causal flag (a prompt's first chunk) or its lower-right
        CausalBias (a chunk after cached tokens), never a mask tensor, with the grouped KV heads as
        stored (enable_gqa): flash attention takes it on a GPU."""
        n, Lk = qs.shape[2], keys.shape[2]
        # one query sees every key; n == Lk: SDPA's (top-left) causal flag is the lower-right one
        mask = None
        if n > 1 and n != Lk:  # imported here: the module pulls in torch._dynamo (and triton) at import
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(n, Lk)
        o = F.scaled_dot_product_attention(
            qs,
            keys,
            vals,
            attn_mask=mask,
            is_causal=n > 1 and n == Lk,
            scale=self.scale,
            enable_gqa=self.g != self.h,
        )
        return o[0].transpose(0, 1)

    def _masked(self, qs, keys, vals, start: int, lo: int) -> torch.Tensor:
        """qs [1, h, n, D] at positions start.. over keys/vals [1, g, Lk, D] at lo.. under a window band
        or sinks -> [n, h, D]. A boolean (sinks: additive) mask in the compute dtype, K/V expanded per
        query head in that dtype (the memory-efficient backend takes masks but not grouped heads),
        queries in chunks whose mask stays within ATTN_MASK_BYTES: never the float32 math backend's
        [B, h, Q, L] scores."""
        n, Lk = qs.shape[2], keys.shape[2]
        L = lo + Lk
        if self.g != self.h:
            keys, vals = (t.repeat_interleave(self.h // self.g, dim=1) for t in (keys, vals))
        if self.sinks is not None:
            keys, vals = F.pad(keys, (0, 0, 0, 1)), F.pad(vals, (0, 0, 0, 1))
        heads = self.h if self.sinks is not None else 1
        step = max(1, ATTN_MASK_BYTES // max(1, heads * (Lk + 1) * qs.element_size()))
        kpos = torch.arange(lo, L, device=qs.device)
        out = []
        for a in range(0, n, step):
            qpos = torch.arange(start + a, start + min(n, a + step), device=qs.device)[:, None]
            mask = kpos <= qpos
            if self.window:
                mask &= kpos > qpos - self.window
            if self.sinks is not None:
                bias = torch.zeros(1, self.h, qpos.shape[0], Lk + 1, dtype=qs.dtype, device=qs.device)
                bias[..., :Lk].masked_fill_(~mask, float("-inf"))
                bias[..., Lk] = self.sinks.to(qs.dtype)[None, :, None]
                mask = bias
            out.append(
                F.scaled_dot_product_attention(
                    qs[:, :, a : a + qpos.shape[0]], keys, vals, attn_mask=mask, scale=self.scale
                )
            )
        return torch.cat(out, 2)[0].transpose(0, 1)


ATTN_MASK_BYTES = 64 << 20  # the masked path's mask per SDPA call (queries taken in chunks to stay under it)
_SPANS: dict = {}  # id(query_pos) -> spans: the last batch's, read once for all its layers


def host_spans(batch: AttnBatch) -> tuple[tuple[int, int], ...]:
    """Each sequence's (first new position, new tokens): batch.spans, else read from the batch's tensors
    once per batch (the tokens must be flattened sequence after sequence, as engine/runner.py builds them)."""
    if batch.spans is not None:
        return batch.spans
    key = id(batch.query_pos)
    got = _SPANS.get(key)
    if got is None or got[0] is not batch.query_pos:
        seq = batch.seq_of_token.tolist()
        if seq != sorted(seq):
            raise ValueError("AttnBatch.seq_of_token: tokens must come sequence after sequence")
        counts = torch.bincount(batch.seq_of_token.cpu(), minlength=batch.block_tables.shape[0]).tolist()
        first = batch.query_pos[:, 0].tolist()
        _SPANS.clear()
        _SPANS[key] = got = (batch.query_pos, tuple(zip(first, counts)))
    return got[1]


def workspace_bytes(cfg: ModelConfig, tokens: int, context: int, dtype: torch.dtype) -> int:
    """Worst-case device bytes of one layer's torch attention (the SDPA path) for `tokens` new tokens of one
    sequence at `context` positions (the longest chunk at max_model_len): the sequence's K and V gathered
    and cast, expanded per query head and padded with the sink column where the masked path runs, the
    mask or bias within ATTN_MASK_BYTES, and the output; flash attention's own buffers (float32 row
    statistics) are counted as [h, tokens] float32 twice."""
    e, h, g, d = dtype.itemsize, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    keys = 2 * context * g * d * e
    masked = any(cfg.sliding_window) or cfg.attn_sinks
    expanded = 2 * (context + 1) * h * d * e if masked else 0
    mask = min(ATTN_MASK_BYTES + tokens * (context + 1), h * tokens * (context + 1) * e) if masked else 0
    return keys + expanded + mask + 2 * tokens * h * d * e + 2 * h * tokens * 4


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
