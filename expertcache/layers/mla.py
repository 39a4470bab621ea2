"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) over a paged latent KV cache.

Shape legend:
    T new tokens (flattened)   B sequences   Q max new tokens of one sequence   L padded context
    h heads   N qk_nope_head_dim   P qk_rope_head_dim   V v_head_dim   R kv_lora_rank
    cache [num_blocks, block_size, R + P] per layer: the normed latent c (R) and the roped shared key (P)

    q      = q_proj(x) or q_b_proj(norm(q_a_proj(x)))          [T, h, N + P]  (q_nope | q_pe)
    c, kpe = kv_a_proj_with_mqa(x) -> norm(c) [T, R], kpe [T, P]  (kpe shared by all heads)
    kv_b_proj [h * (N + V), R] expands c into k_nope [h, N] and v [h, V]

Two exact ways to attend (same math, different cost):
    naive     expand every context token's c through kv_b_proj, then attention over N+P / V dims;
    absorbed  fold kv_b_proj's key half into the query (q_nope @ W_uk -> [h, R]) and its value half
              into the output, attending straight over the cached latent (R + P keys, R values).
`path="auto"` picks the one with fewer multiply-adds for the batch: absorbed for decode (it never
expands the context), naive for long prefills (its attention dims are smaller).
Rotary dims stored as interleaved pairs are permuted to half-split at load (deinterleave_rows).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..spec.model_config import ModelConfig
from .attention import AttnBatch, pad_queries, visible
from .basic import Rotary, deinterleave_rows, linear, rms_norm

PATHS = ("auto", "naive", "absorbed")
# q_a_layernorm / kv_a_layernorm: the reference builds them with the default eps, not rms_norm_eps
LATENT_NORM_EPS = 1e-6


def load_mla(
    cfg: ModelConfig, prefix: str, load: Callable[[str, tuple], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The attention weights of one layer; `load(name, shape)` reads (and converts) a tensor."""
    m, H, h = cfg.mla, cfg.hidden_size, cfg.num_heads
    N, P, V, R = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    p = f"{prefix}.self_attn"
    w: dict[str, torch.Tensor] = {}
    if m.q_lora_rank is None:
        w["q_proj.weight"] = load(f"{p}.q_proj.weight", (h * (N + P), H))
    else:
        w["q_a_proj.weight"] = load(f"{p}.q_a_proj.weight", (m.q_lora_rank, H))
        w["q_a_layernorm.weight"] = load(f"{p}.q_a_layernorm.weight", (m.q_lora_rank,))
        w["q_b_proj.weight"] = load(f"{p}.q_b_proj.weight", (h * (N + P), m.q_lora_rank))
        if cfg.qkv_bias:
            w["q_a_proj.bias"] = load(f"{p}.q_a_proj.bias", (m.q_lora_rank,))
    w["kv_a_proj_with_mqa.weight"] = load(f"{p}.kv_a_proj_with_mqa.weight", (R + P, H))
    if cfg.qkv_bias:
        w["kv_a_proj_with_mqa.bias"] = load(f"{p}.kv_a_proj_with_mqa.bias", (R + P,))
    w["kv_a_layernorm.weight"] = load(f"{p}.kv_a_layernorm.weight", (R,))
    w["kv_b_proj.weight"] = load(f"{p}.kv_b_proj.weight", (h * (N + V), R))
    w["o_proj.weight"] = load(f"{p}.o_proj.weight", (H, h * V))
    if cfg.o_bias:
        w["o_proj.bias"] = load(f"{p}.o_proj.bias", (H,))
    if cfg.rope_interleave:
        q = "q_proj.weight" if m.q_lora_rank is None else "q_b_proj.weight"
        w[q] = deinterleave_rows(w[q], N + P, N, P)
        for k in ("kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias"):
            if k in w:
                w[k] = deinterleave_rows(w[k], R + P, R, P)
    return w


class MLAttention:
    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor], rotary: Rotary):
        m = cfg.mla
        self.cfg, self.w, self.rotary = cfg, w, rotary
        self.h, self.N, self.P = cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim
        self.V, self.R = m.v_head_dim, m.kv_lora_rank
        self.scale = cfg.attn_scale or (self.N + self.P) ** -0.5
        self.window = cfg.sliding_window[layer]
        self.path = "auto"  # one of PATHS; "naive" / "absorbed" force a path (tests, benchmarks)
        kv_b = w["kv_b_proj.weight"].view(self.h, self.N + self.V, self.R)
        self.w_uk, self.w_uv = kv_b[:, : self.N], kv_b[:, self.N :]  # [h, N, R], [h, V, R]

    def choose(self, T: int, B: int, Q: int, L: int) -> str:
        """naive or absorbed: the one with fewer multiply-adds for this batch shape."""
        if self.path != "auto":
            return self.path
        h, N, P, V, R = self.h, self.N, self.P, self.V, self.R
        naive = B * L * R * h * (N + V) + B * Q * L * h * (N + P + V)
        absorbed = T * h * R * (N + V) + B * Q * L * h * (2 * R + P)
        return "absorbed" if absorbed < naive else "naive"

    def __call__(self, x: torch.Tensor, batch: AttnBatch, cache: torch.Tensor) -> torch.Tensor:
        w, T = self.w, x.shape[0]
        h, N, P, V, R = self.h, self.N, self.P, self.V, self.R
        if "q_proj.weight" in w:
            q = linear(x, w["q_proj.weight"])
        else:
            qa = linear(x, w["q_a_proj.weight"], w.get("q_a_proj.bias"))
            q = linear(rms_norm(qa, w["q_a_layernorm.weight"], LATENT_NORM_EPS), w["q_b_proj.weight"])
        q = q.view(T, h, N + P)
        ckv = linear(x, w["kv_a_proj_with_mqa.weight"], w.get("kv_a_proj_with_mqa.bias"))
        c = rms_norm(ckv[:, :R], w["kv_a_layernorm.weight"], LATENT_NORM_EPS)
        q_pe, k_pe = self.rotary(q[..., N:], ckv[:, None, R:], batch.positions)
        cache.view(-1, R + P)[batch.slot_mapping] = torch.cat((c, k_pe[:, 0]), dim=-1).to(cache.dtype)

        B, nb = batch.block_tables.shape
        L = nb * cache.shape[1]
        lat = cache[batch.block_tables].view(B, L, R + P).to(q.dtype)
        mask = visible(batch, L, self.window)[:, None]  # [B, 1, Q, L]
        if self.choose(T, B, batch.max_q, L) == "naive":
            kv = linear(lat[..., :R], w["kv_b_proj.weight"]).view(B, L, h, N + V)
            keys = torch.cat((kv[..., :N], lat[:, :, None, R:].expand(B, L, h, P)), dim=-1)
            query = pad_queries(batch, torch.cat((q[..., :N], q_pe), dim=-1))
            o = F.scaled_dot_product_attention(
                query.transpose(1, 2),
                keys.transpose(1, 2),
                kv[..., N:].transpose(1, 2),
                attn_mask=mask,
                scale=self.scale,
            )
            o = o.transpose(1, 2)[batch.seq_of_token, batch.row_of_token]  # [T, h, V]
        else:
            w_uk, w_uv = self.w_uk.to(q.dtype), self.w_uv.to(q.dtype)
            q_lat = torch.einsum("thn,hnr->thr", q[..., :N], w_uk)
            query = pad_queries(batch, torch.cat((q_lat, q_pe), dim=-1)).transpose(1, 2)  # [B, h, Q, R + P]
            kv = lat[:, None]  # [B, 1, L, R + P]: one latent head shared by all h query heads
            o = F.scaled_dot_product_attention(
                query, kv, kv[..., :R], attn_mask=mask, scale=self.scale, enable_gqa=True
            )  # [B, h, Q, R]
            o = o.transpose(1, 2)[batch.seq_of_token, batch.row_of_token]  # [T, h, R]
            o = torch.einsum("thr,hvr->thv", o, w_uv)
        return linear(o.reshape(T, h * V), w["o_proj.weight"], w.get("o_proj.bias"))
