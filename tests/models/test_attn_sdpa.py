"""layers/attention.py's torch path (the one CUDA runs): per sequence over its own keys through the block
table, SDPA's lower-right causal bias with the grouped KV heads as stored where no window or sink needs a
mask (what flash attention takes), else a compute-dtype mask over the visible keys only. Against a
float64 brute-force reference written from the definition (softmax over the visible keys, the sink's
logit in the denominator), and against the path it replaced (a padded gather of every sequence, a
boolean mask, SDPA's math backend); plus the SDPA calls it makes and its workspace bound."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias

from expertcache.layers import attention as A
from expertcache.layers.attention import Attention, AttnBatch

H, G, D, BS = 4, 2, 16, 4
SPANS = ((0, 5), (7, 1), (3, 4), (9, 3))  # a prompt, a decode step, two chunks after cached tokens


class NoRotary:
    """Rotary is applied before the part under test, the same in every path: left out."""

    def __call__(self, q, k, positions):
        return q, k


def make(window=None, sinks=False, heads=H, kv=G, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=D,
        sliding_window=(window,),
        attn_output_gate=False,
        qk_norm=None,
        clip_qkv=None,
        rms_norm_eps=1e-6,
        attn_sinks=sinks,
    )
    w = {"sinks": torch.randn(heads, generator=g)} if sinks else {}
    attn = Attention(cfg, 0, w, NoRotary())
    B = len(SPANS)
    nblocks = [-(-(s + n) // BS) for s, n in SPANS]
    perm = torch.randperm(sum(nblocks), generator=g) + 1  # block 0: the padding block
    tables, at = [], 0
    for nb in nblocks:
        tables.append(perm[at : at + nb].tolist() + [0] * (max(nblocks) - nb))
        at += nb
    k_cache = torch.randn(sum(nblocks) + 1, BS, kv, D, generator=g).to(dtype)
    v_cache = torch.randn(sum(nblocks) + 1, BS, kv, D, generator=g).to(dtype)
    pos, slots, seq_of, row_of, qpos = [], [], [], [], []
    Q = max(n for _, n in SPANS)
    for b, (s, n) in enumerate(SPANS):
        p = list(range(s, s + n))
        pos += p
        slots += [tables[b][i // BS] * BS + i % BS for i in p]
        seq_of += [b] * n
        row_of += range(n)
        qpos.append(p + [0] * (Q - n))
    t = torch.tensor
    batch = AttnBatch(t(pos), t(slots), t(tables), t(seq_of), t(row_of), Q, t(qpos))
    T = len(pos)
    q = torch.randn(T, heads * D, generator=g).to(dtype)
    k = torch.randn(T, kv * D, generator=g).to(dtype)
    v = torch.randn(T, kv * D, generator=g).to(dtype)
    assert B == batch.block_tables.shape[0]
    return attn, batch, q, k, v, k_cache, v_cache


def brute_force(attn, batch, q, k, v, k_cache, v_cache):
    """float64, query by query: keys kp <= qp (and > qp - window) of its own sequence, the new ones
    written first; softmax with the sink logit joining the denominator."""
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    kc.view(-1, attn.g, D)[batch.slot_mapping] = k.double().view(-1, attn.g, D)
    vc.view(-1, attn.g, D)[batch.slot_mapping] = v.double().view(-1, attn.g, D)
    out = torch.zeros(q.shape[0], attn.h, D, dtype=torch.float64)
    qd = q.double().view(-1, attn.h, D)
    for t in range(q.shape[0]):
        b, qp = int(batch.seq_of_token[t]), int(batch.positions[t])
        keys = [kp for kp in range(qp + 1) if not attn.window or kp > qp - attn.window]
        flat = [int(batch.block_tables[b, kp // BS]) * BS + kp % BS for kp in keys]
        for h in range(attn.h):
            kv = h // (attn.h // attn.g)
            s = torch.stack([kc.view(-1, attn.g, D)[f, kv] @ qd[t, h] for f in flat]) * attn.scale
            logits = torch.cat([s, attn.sinks[h : h + 1].double()]) if attn.sinks is not None else s
            p = torch.softmax(logits, 0)[: len(keys)]
            out[t, h] = sum(p[i] * vc.view(-1, attn.g, D)[f, kv] for i, f in enumerate(flat))
    return out


def replaced_path(attn, batch, q, k, v, k_cache, v_cache):
    """The torch path before: every sequence's padded context gathered, a boolean [B, 1, Q, L] mask (an
    additive [B, h, Q, L + 1] one with sinks), SDPA with enable_gqa (the math backend on a GPU)."""
    kc, vc = k_cache.clone(), v_cache.clone()
    T = q.shape[0]
    q, k, v = q.view(T, attn.h, D), k.view(T, attn.g, D), v.view(T, attn.g, D)
    kc.view(-1, attn.g, D)[batch.slot_mapping] = k
    vc.view(-1, attn.g, D)[batch.slot_mapping] = v
    B, nb = batch.block_tables.shape
    keys = kc[batch.block_tables].view(B, nb * BS, attn.g, D).transpose(1, 2)
    vals = vc[batch.block_tables].view(B, nb * BS, attn.g, D).transpose(1, 2)
    mask = A.visible(batch, nb * BS, attn.window)[:, None]
    if attn.sinks is not None:
        keys, vals = F.pad(keys, (0, 0, 0, 1)), F.pad(vals, (0, 0, 0, 1))
        L = mask.shape[-1]
        bias = torch.zeros(B, attn.h, mask.shape[2], L + 1, dtype=q.dtype)
        bias[..., :L].masked_fill_(~mask, float("-inf"))
        bias[..., L] = attn.sinks.to(q.dtype)[None, :, None]
        mask = bias
    o = F.scaled_dot_product_attention(
        A.pad_queries(batch, q).transpose(1, 2),
        keys,
        vals,
        attn_mask=mask,
        scale=attn.scale,
        enable_gqa=attn.g != attn.h,
    )
    return o.transpose(1, 2)[batch.seq_of_token, batch.row_of_token]


CASES = {
    "gqa": {},
    "window": dict(window=3),
    "sinks": dict(sinks=True),
    "window+sinks": dict(window=3, sinks=True),
    "mha": dict(kv=H),
    "long-window": dict(window=64),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_path_against_brute_force_and_the_replaced_path(case, dtype):
    attn, batch, q, k, v, kc, vc = make(dtype=dtype, **CASES[case])
    ref = brute_force(attn, batch, q, k, v, kc, vc)
    old = replaced_path(attn, batch, q, k, v, kc, vc)
    got = attn._torch(q, k, v, batch, kc, vc)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == old.shape == (q.shape[0], attn.h, D) and got.dtype == dtype
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(got.double(), old.double(), atol=tol, rtol=tol)


def test_spans_given_or_read_and_query_chunks_give_the_same(monkeypatch):
    attn, batch, q, k, v, kc, vc = make(window=3, sinks=True)
    read = attn._torch(q, k, v, batch, kc.clone(), vc.clone())
    given = attn._torch(q, k, v, batch._replace(spans=SPANS), kc.clone(), vc.clone())
    monkeypatch.setattr(A, "ATTN_MASK_BYTES", 1)  # one query per SDPA call
    chunked = attn._torch(q, k, v, batch, kc.clone(), vc.clone())
    assert torch.equal(read, given) and torch.equal(read, chunked)
    assert A.host_spans(batch) == SPANS


def test_without_window_or_sinks_sdpa_gets_no_mask_tensor(monkeypatch):
    """The fused backends' case: per sequence no mask tensor (none for one query, the causal flag for a
    prompt's first chunk, a lower-right CausalBias after cached tokens), the grouped KV heads as stored
    (enable_gqa), and keys of that sequence only (its context length)."""
    attn, batch, q, k, v, kc, vc = make()
    calls, real = [], F.scaled_dot_product_attention

    def spy(qs, keys, vals, attn_mask=None, **kw):
        kind = type(attn_mask).__name__ if attn_mask is not None else None
        calls.append(
            (qs.shape[2], keys.shape[1], keys.shape[2], kind, kw.get("is_causal"), kw.get("enable_gqa"))
        )
        if isinstance(attn_mask, CausalBias):  # dispatches itself (SDPA's own check is by identity)
            monkeypatch.setattr(F, "scaled_dot_product_attention", real)  # its CPU fallback calls SDPA again
            try:
                return CausalBias._dispatch(qs, keys, vals, attn_mask, **kw)
            finally:
                monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
        return real(qs, keys, vals, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    got = attn._torch(q, k, v, batch, kc, vc)
    monkeypatch.undo()
    torch.testing.assert_close(got, replaced_path(attn, batch, q, k, v, kc, vc), atol=2e-2, rtol=2e-2)
    want = {
        (0, 5): (None, True),
        (7, 1): (None, False),
        (3, 4): ("CausalBias", False),
        (9, 3): ("CausalBias", False),
    }
    assert calls == [(n, G, s + n, *want[s, n], True) for s, n in SPANS]


def test_the_masked_path_expands_heads_in_the_compute_dtype(monkeypatch):
    attn, batch, q, k, v, kc, vc = make(window=3)
    seen, real = [], F.scaled_dot_product_attention

    def spy(qs, keys, vals, attn_mask=None, **kw):
        kind = "causal" if attn_mask is None or isinstance(attn_mask, CausalBias) else attn_mask.dtype
        seen.append((keys.dtype, keys.shape[1], kind, keys.shape[2]))
        if isinstance(attn_mask, CausalBias):  # dispatches itself (SDPA's own check is by identity)
            monkeypatch.setattr(F, "scaled_dot_product_attention", real)  # its CPU fallback calls SDPA again
            try:
                return CausalBias._dispatch(qs, keys, vals, attn_mask, **kw)
            finally:
                monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
        return real(qs, keys, vals, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    attn._torch(q, k, v, batch, kc, vc)
    monkeypatch.undo()
    # decode (n = 1) needs no band mask; the others: bf16 keys, every query head, a bool mask, and only
    # the keys the window can reach (n + window - 1 at most)
    assert len(seen) == len(SPANS), seen
    for (dt, heads, mdt, lk), (s, n) in zip(seen, SPANS):
        assert dt == torch.bfloat16 and lk <= n + 3 - 1
        assert (heads, mdt) == ((G, "causal") if n == 1 else (H, torch.bool))


def test_workspace_bytes_bounds_the_temporaries():
    cfg = SimpleNamespace(
        num_heads=32, num_kv_heads=4, head_dim=128, sliding_window=(None,), attn_sinks=False
    )
    plain = A.workspace_bytes(cfg, 2048, 32768, torch.bfloat16)
    assert plain < 2 << 30  # the fp32 math backend's scores alone: 32 x 2048 x 32768 x 4 B = 8 GiB
    assert plain >= 2 * 32768 * 4 * 128 * 2  # the sequence's K and V
    masked = A.workspace_bytes(
        SimpleNamespace(**{**vars(cfg), "attn_sinks": True}), 2048, 32768, torch.bfloat16
    )
    assert masked > plain and masked < plain + 2 * 32769 * 32 * 128 * 2 + A.ATTN_MASK_BYTES + 2048 * 32769 + 1
    assert math.isfinite(masked)
