"""Gated DeltaNet token mixer (the linear_attention layers of Qwen3-Next / Qwen3.5-MoE).

Per token t and value head (fp32), with q, k L2-normalised and q scaled by Dk^-0.5:
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T      (the gated delta rule)
    o_t = S_t^T q_t
    g_t = -exp(A_log) * softplus(a_t + dt_bias),  beta_t = sigmoid(b_t)
q|k|v first pass a causal depthwise conv (width K) + SiLU; the output is RMSNorm(o) * SiLU(z), then
out_proj. A sequence's state between calls is its conv state (the last K-1 conv inputs) and S.

Two equal forms (within fp32 rounding): `chunked_delta_rule` for prefill (chunks of CHUNK tokens:
matrix products inside a chunk, a scan over chunks only) and `recurrent_step` for one decode token.

Shape legend:
    T new tokens (flattened batch)   B sequences   Q max new tokens of one sequence
    Hk / Hv key / value heads, Dk / Dv their head dims   C = 2 Hk Dk + Hv Dv conv channels
    conv state [slots, K-1, C] (model dtype)   recurrent state S [slots, Hv, Dk, Dv] (float32)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..spec.model_config import ModelConfig
from .basic import linear

CHUNK = 64  # tokens per chunk of the chunked form


class StateBatch(NamedTuple):
    """The sequences of a batch in the state pool (see engine/state_cache.py)."""

    slots: torch.Tensor  # [B] int64, each sequence's state slot
    lengths: torch.Tensor  # [B] int64, new tokens of each sequence
    layers: dict  # layer -> (conv state [slots, K-1, C], recurrent state [slots, Hv, Dk, Dv])
    # the same lengths on the host (None: read from `lengths` once per layer, a device -> host read on a GPU)
    host_lengths: tuple[int, ...] | None = None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(q, k, v, g, beta, state):
    """One token per sequence. q, k [B, Hv, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; state [B, Hv, Dk, Dv]
    (all fp32, q/k normalised and q scaled) -> (o [B, Hv, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    predicted = (k[..., None, :] @ state)[..., 0, :]  # S^T k  [B, Hv, Dv]
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (q[..., None, :] @ state)[..., 0, :], state


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """q, k [B, Hv, L, Dk]; v [B, Hv, L, Dv]; g, beta [B, Hv, L]; state [B, Hv, Dk, Dv] (fp32)
    -> (o [B, Hv, L, Dv], final state). Trailing padding with k = v = g = beta = 0 leaves the state as is.

    Within a chunk (WY/UT form): with Gamma_ij = exp(G_i - G_j) for j <= i (G = cumsum g),
    A = I + tril(beta_i k_i.k_j Gamma_ij, -1), u = A^-1 (beta v), w = A^-1 (beta k exp(G));
    then per chunk  v' = u - w S,  o = (q exp(G)) S + tril(q.k Gamma) v',
    S <- exp(G_last) S + (k exp(G_last - G))^T v'."""
    B, Hh, L, Dk = k.shape
    pad = -L % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (L + pad) // chunk
    q, k, v = (x.reshape(B, Hh, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(B, Hh, n, chunk), beta.reshape(B, Hh, n, chunk)
    G = g.cumsum(-1)  # [B, Hv, n, c]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(upper, float("-inf")).exp()  # Gamma [.., c, c]
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay  # diagonal beta_i |k_i|^2 is ignored (unit triangular)
    u = torch.linalg.solve_triangular(A, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(A, kb * G.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    qd = q * G.exp()[..., None]
    kd = k * (G[..., -1:] - G).exp()[..., None]
    last = G[..., -1].exp()[..., None, None]  # [B, Hv, n, 1, 1]
    out = torch.empty_like(v)
    for c in range(n):
        vn = u[:, :, c] - w[:, :, c] @ state
        out[:, :, c] = qd[:, :, c] @ state + intra[:, :, c] @ vn
        state = state * last[:, :, c] + kd[:, :, c].transpose(-1, -2) @ vn
    return out.reshape(B, Hh, n * chunk, -1)[:, :, :L], state


def load_weights(load, index, prefix: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The layer's weights, from either checkpoint layout, with one input projection `in_proj`
    whose rows are [q (Hk Dk) | k (Hk Dk) | v (Hv Dv) | z (Hv Dv) | b (Hv) | a (Hv)].
    load(name, shape) -> tensor on the compute device. Qwen3-Next's `in_proj_qkvz` holds, per key
    head, [q (Dk), k (Dk), v (r Dv), z (r Dv)] rows (r = Hv / Hk) and `in_proj_ba` [b (r), a (r)]:
    their rows are regrouped once here (exact)."""
    la, H = cfg.linear_attn, cfg.hidden_size
    Hk, Hv, Dk, Dv = la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim
    r, key_dim, value_dim = Hv // Hk, Hk * Dk, Hv * Dv
    w = {
        "conv": load(f"{prefix}.conv1d.weight", (la.conv_dim, 1, la.conv_kernel)),
        "A_log": load(f"{prefix}.A_log", (Hv,)),
        "dt_bias": load(f"{prefix}.dt_bias", (Hv,)),
        "norm": load(f"{prefix}.norm.weight", (Dv,)),
        "out_proj": load(f"{prefix}.out_proj.weight", (H, value_dim)),
    }
    if f"{prefix}.in_proj_qkvz.weight" in index:
        qkvz = load(f"{prefix}.in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, H)).view(Hk, -1, H)
        q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=1)
        ba = load(f"{prefix}.in_proj_ba.weight", (2 * Hv, H)).view(Hk, 2 * r, H)
        b, a = ba.split([r, r], dim=1)
        w["qkv"] = torch.cat([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)])
        w["z"], w["b"], w["a"] = z.reshape(-1, H), b.reshape(-1, H), a.reshape(-1, H)
    else:
        w["qkv"] = load(f"{prefix}.in_proj_qkv.weight", (la.conv_dim, H))
        w["z"] = load(f"{prefix}.in_proj_z.weight", (value_dim, H))
        w["b"] = load(f"{prefix}.in_proj_b.weight", (Hv, H))
        w["a"] = load(f"{prefix}.in_proj_a.weight", (Hv, H))
    # one input projection: rows [q | k | v | z | b | a]
    w["in_proj"] = torch.cat([w.pop("qkv"), w.pop("z"), w.pop("b"), w.pop("a")])
    return w


class GatedDeltaNet:
    def __init__(self, cfg: ModelConfig, layer: int, w: dict[str, torch.Tensor]):
        la = cfg.linear_attn
        self.layer, self.w, self.eps = layer, w, cfg.rms_norm_eps
        self.hk, self.hv, self.dk, self.dv, self.kw = (
            la.num_k_heads,
            la.num_v_heads,
            la.k_head_dim,
            la.v_head_dim,
            la.conv_kernel,
        )
        self.neg_A = -w["A_log"].float().exp()  # [Hv]
        self.conv_w = w["conv"][:, 0].t().contiguous()  # [K, C]

    def __call__(
        self,
        x: torch.Tensor,
        seq_of_token: torch.Tensor,
        row_of_token: torch.Tensor,
        max_q: int,
        states: StateBatch,
    ) -> torch.Tensor:
        """x [T, H] (tokens of sequence b contiguous, in order) -> [T, H]; updates the states in place."""
        w, T = self.w, x.shape[0]
        conv_pool, rec_pool = states.layers[self.layer]
        slots = states.slots
        kd, vd = self.hk * self.dk, self.hv * self.dv
        qkv, z, b, a = linear(x, w["in_proj"]).split([2 * kd + vd, vd, self.hv, self.hv], dim=-1)
        qkv = self._conv(qkv, seq_of_token, row_of_token, max_q, slots, states.lengths, conv_pool)
        q, k, v = qkv.split([kd, kd, vd], dim=-1)
        r = self.hv // self.hk
        q = l2norm(q.reshape(T, self.hk, self.dk).float()).repeat_interleave(r, dim=1) * self.dk**-0.5
        k = l2norm(k.reshape(T, self.hk, self.dk).float()).repeat_interleave(r, dim=1)
        v = v.reshape(T, self.hv, self.dv).float()
        beta = torch.sigmoid(b).float()
        g = self.neg_A * F.softplus(a.float() + w["dt_bias"])

        o = torch.empty(T, self.hv, self.dv, dtype=torch.float32, device=x.device)
        single, multi, tok1, tokn, bi, ji = _split(states, x.device)
        if single is not None:  # decodes: one recurrent step each
            s = slots[single]
            o[tok1], rec_pool[s] = recurrent_step(q[tok1], k[tok1], v[tok1], g[tok1], beta[tok1], rec_pool[s])
        if multi is not None:  # prefill chunks: padded to [B', Q] and chunked

            def pad(t):  # [tok, Hv, ...] -> [B', Hv, Q, ...]
                out = t.new_zeros(len(multi), max_q, *t.shape[1:])
                out[bi, ji] = t[tokn]
                return out.transpose(1, 2)

            s = slots[multi]
            out, rec_pool[s] = chunked_delta_rule(pad(q), pad(k), pad(v), pad(g), pad(beta), rec_pool[s])
            o[tokn] = out.transpose(1, 2)[bi, ji]

        # gated RMSNorm per value head, then the output projection
        o = o.to(x.dtype)
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        z = z.reshape(T, self.hv, self.dv)
        o = (w["norm"] * of.to(x.dtype)) * F.silu(z.float())
        return linear(o.to(x.dtype).reshape(T, -1), w["out_proj"])

    def _conv(self, qkv, seq_of_token, row_of_token, max_q, slots, lengths, conv_pool):
        """Causal depthwise conv + SiLU over each sequence's new tokens, continuing from its conv state
        (the K-1 inputs before them); the state becomes the last K-1 inputs."""
        B, C, K = len(slots), qkv.shape[-1], self.kw
        buf = qkv.new_zeros(B, K - 1 + max_q, C)
        buf[:, : K - 1] = conv_pool[slots].to(qkv.dtype)
        buf[seq_of_token, K - 1 + row_of_token] = qkv
        keep = lengths[:, None] + torch.arange(K - 1, device=qkv.device)  # [B, K-1]: the last K-1 inputs
        conv_pool[slots] = buf.gather(1, keep[..., None].expand(-1, -1, C)).to(conv_pool.dtype)
        buf = buf.to(self.conv_w.dtype)
        out = buf[:, :max_q] * self.conv_w[0]  # depthwise: out[t, c] = sum_j w[c, j] x[t - K + 1 + j, c]
        for j in range(1, K):
            out += buf[:, j : j + max_q] * self.conv_w[j]
        return F.silu(out[seq_of_token, row_of_token]).to(qkv.dtype)


def _split(states: StateBatch, device: torch.device) -> tuple:
    """The batch's decodes and prefill chunks from the host lengths (tokens flattened sequence after
    sequence), as index tensors made in one host -> device copy: (single [B1] sequences of one new token,
    multi [B'] the others, tok1 [B1] their tokens, tokn their tokens, b and j: each of those tokens'
    index in multi and row in its sequence); a part that is empty is None."""
    lengths = states.host_lengths
    if lengths is None:
        lengths = tuple(states.lengths.tolist())
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += n
    single = [i for i, n in enumerate(lengths) if n == 1]
    multi = [i for i, n in enumerate(lengths) if n != 1]  # (a sequence of 0 new tokens pads as before)
    tokn = [starts[i] + r for i in multi for r in range(lengths[i])]
    b = [m for m, i in enumerate(multi) for _ in range(lengths[i])]
    j = [r for i in multi for r in range(lengths[i])]
    parts = [single, multi, [starts[i] for i in single], tokn, b, j]
    flat = torch.tensor([v for p in parts for v in p], dtype=torch.int64).to(device, non_blocking=True)
    out, at = [], 0
    for p, of in zip(parts, (single, multi, single, multi, multi, multi)):
        out.append(flat[at : at + len(p)] if of else None)
        at += len(p)
    return tuple(out)
