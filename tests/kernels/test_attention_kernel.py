"""The CPU attention kernel (kernels/attention.py, csrc/attention.cpp) against a float64 reference,
and the whole model with it against the torch path.

- the kernel: per-head q/k RMSNorm, partial rotary, the new k/v written at slot_mapping (fp32 cache:
  exactly; bf16: rounded to nearest even), attention through the block table (blocks out of order,
  padded rows, several sequences of different lengths), decode and multi-token batches (a sequence's
  new tokens see each other), GQA ratios 1, 4 and 6, a sliding window, sinks, head_dim 64, 20 and
  12 (not a multiple of the vector width), q/k/v as strided views into one qkv row; against a
  float64 loop over each query's visible key positions;
- bad input: a clear error naming the parameter; the wrapper declines (None, nothing written) where
  it does not apply;
- the whole model: logits and decode logprobs with the kernel equal the torch path (1e-4 relative),
  for Qwen3-MoE (head q/k norm, fused qkv), Qwen2-MoE (qkv biases), GPT-OSS (sinks, sliding window);
  q/k/v fused into one weight at load.
"""

from __future__ import annotations

import math

import gpt_oss_checkpoints as G
import pytest
import torch

from expertcache import LLM, SamplingParams
from expertcache.kernels import attention as KA
from expertcache.kernels import build
from expertcache.layers.attention import AttnBatch

needs_cpp = pytest.mark.skipif(build.extension() is None, reason="C++ kernels not available")

EPS = 1e-6


def _tables(rng: torch.Generator, lengths: list[int], bs: int, num_blocks: int) -> torch.Tensor:
    """[B, nb] block tables: distinct blocks in a shuffled order, rows padded with 0."""
    need = [math.ceil(n / bs) for n in lengths]
    perm = torch.randperm(num_blocks - 1, generator=rng) + 1  # block 0 is only ever padding
    tables = torch.zeros(len(lengths), max(need), dtype=torch.int64)
    at = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[at : at + n]
        at += n
    return tables


def _batch(rng, ctx: list[int], new: list[int], bs: int, num_blocks: int):
    """Sequences b with ctx[b] tokens before new[b] new ones -> AttnBatch (positions ctx..ctx+new-1)."""
    tables = _tables(rng, [c + n for c, n in zip(ctx, new)], bs, num_blocks)
    pos, slots, seq_of, row_of = [], [], [], []
    qpos = torch.zeros(len(ctx), max(new), dtype=torch.int64)
    for b, (c, n) in enumerate(zip(ctx, new)):
        p = list(range(c, c + n))
        pos += p
        slots += [int(tables[b, i // bs]) * bs + i % bs for i in p]
        seq_of += [b] * n
        row_of += range(n)
        qpos[b, :n] = torch.tensor(p)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return AttnBatch(t(pos), t(slots), tables, t(seq_of), t(row_of), max(new), qpos)


def _rope(positions: torch.Tensor, R: int, dtype=torch.float64):
    inv = 10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    ang = positions.double()[:, None] * inv
    ang = torch.cat((ang, ang), dim=-1)
    return (ang.cos() * 0.9).to(dtype), (ang.sin() * 0.9).to(dtype)  # a rotary scale != 1


def _prep64(x, w, cos, sin, R):
    """float64 per-head RMSNorm (w may be None) then rotary on the first R dims: x [T, n, D]."""
    x = x.double()
    if w is not None:
        x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w.double()
    if R:
        half = R // 2
        y = x.clone()
        c, s = cos[:, None, :], sin[:, None, :]
        a, b = x[..., :half], x[..., half:R]
        y[..., :half] = a * c[..., :half] - b * s[..., :half]
        y[..., half:R] = b * c[..., half:] + a * s[..., half:]
        x = y
    return x


def _reference(q, k_cache, v_cache, batch, scale, window, sinks):
    """float64 loop: each new token over its sequence's visible key positions, read via the table."""
    T, h, D = q.shape
    g, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros(T, h, D, dtype=torch.float64)
    for t in range(T):
        b, qp = int(batch.seq_of_token[t]), int(batch.positions[t])
        kps = [kp for kp in range(qp + 1) if not window or kp > qp - window]
        keys = torch.stack(
            [k_cache[batch.block_tables[b, kp // bs], kp % bs] for kp in kps]
        ).double()  # [n, g, D]
        vals = torch.stack([v_cache[batch.block_tables[b, kp // bs], kp % bs] for kp in kps]).double()
        for hd in range(h):
            j = hd // (h // g)
            s = [float(q[t, hd].double() @ keys[i, j]) * scale for i in range(len(kps))]
            logits = s + ([float(sinks[hd])] if sinks is not None else [])
            m = max(logits)
            e = [math.exp(x - m) for x in logits]
            z = sum(e)
            for i in range(len(kps)):
                out[t, hd] += e[i] / z * vals[i, j]
    return out


CASES = {  # name: (h, g, D, R, window, sinks, norms, ctx, new)
    "decode-gqa4": (8, 2, 64, 64, None, False, True, [0, 16, 39], [1, 1, 1]),
    "decode-mha-d20": (4, 4, 20, 12, None, False, False, [5, 33], [1, 1]),
    "prefill-gqa4-window-sinks": (8, 2, 64, 32, 5, True, True, [0, 11, 3], [7, 13, 1]),
    "prefill-gqa6-d12": (6, 1, 12, 12, None, True, False, [2, 0], [9, 4]),
    "decode-long-window": (4, 2, 64, 64, 24, False, True, [70, 3], [1, 1]),
}


@needs_cpp
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bs", [16, 5])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_against_float64(case, bs, cache_dtype):
    h, g, D, R, window, with_sinks, norms, ctx, new = CASES[case]
    rng = torch.Generator().manual_seed(hash((case, bs)) % 1000)
    num_blocks = sum(math.ceil((c + n) / bs) for c, n in zip(ctx, new)) + 3
    batch = _batch(rng, ctx, new, bs, num_blocks)
    T = int(batch.positions.numel())
    qkv = torch.randn(T, (h + 2 * g) * D + 3, generator=rng)  # one projection row per token (+ 3 unused)
    q = qkv[:, : h * D].view(T, h, D)
    k = qkv[:, h * D : (h + g) * D].view(T, g, D)
    v = qkv[:, (h + g) * D : (h + 2 * g) * D].view(T, g, D)
    qn = torch.rand(D, generator=rng) + 0.5 if norms else None
    kn = torch.rand(D, generator=rng) + 0.5 if norms else None
    sinks = torch.randn(h, generator=rng) * 2 if with_sinks else None
    cos, sin = _rope(batch.positions, R)
    k_cache = torch.randn(num_blocks, bs, g, D, generator=rng).to(cache_dtype)  # the context's keys: random
    v_cache = torch.randn(num_blocks, bs, g, D, generator=rng).to(cache_dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    scale = D**-0.5

    out = KA.attend(
        q,
        k,
        v,
        k_cache,
        v_cache,
        batch,
        scale,
        window,
        sinks,
        qn,
        kn,
        EPS,
        cos.float()[:, None, :],
        sin.float()[:, None, :],
    )
    assert out.shape == (T, h * D) and out.dtype == torch.float32
    out = out.view(T, h, D)
    # q/k/v as [T, heads * D] column slices (the layer's form): the same result
    k_cache2, v_cache2 = before_k.clone(), before_v.clone()
    flat = KA.attend(
        q.reshape(T, h * D),
        k.reshape(T, g * D),
        v.reshape(T, g * D),
        k_cache2,
        v_cache2,
        batch,
        scale,
        window,
        sinks,
        qn,
        kn,
        EPS,
        cos.float()[:, None, :],
        sin.float()[:, None, :],
    )
    assert torch.equal(flat.view(T, h, D), out)
    assert torch.equal(k_cache2, k_cache) and torch.equal(v_cache2, v_cache)

    # the cache: new rows at slot_mapping, every other row untouched
    k64, q64 = _prep64(k, kn, cos, sin, R), _prep64(q, qn, cos, sin, R)
    flat_k, flat_v = k_cache.view(-1, g, D), v_cache.view(-1, g, D)
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[batch.slot_mapping] = True
    assert torch.equal(flat_k[~written], before_k.view(-1, g, D)[~written])
    assert torch.equal(flat_v[~written], before_v.view(-1, g, D)[~written])
    got_k = flat_k[batch.slot_mapping].double()
    if cache_dtype == torch.float32:
        assert (got_k - k64).abs().max() <= 1e-5 * k64.abs().max()
        assert torch.equal(flat_v[batch.slot_mapping], v)
    else:  # rounded to nearest: within half a bf16 step (2^-8 relative) of the float64 value
        assert ((got_k - k64).abs() <= k64.abs() * 2.0**-8 + 1e-6).all()
        assert torch.equal(flat_v[batch.slot_mapping], v.bfloat16())

    # attention over what the cache now holds (its bf16 rounding checked above)
    ref = _reference(q64, k_cache, v_cache, batch, scale, window, sinks)
    assert (out.double() - ref).abs().max() <= 2e-5 * ref.abs().max()


@needs_cpp
def test_threads_give_the_same_result():
    """1 and 2 kernel threads: bit-identical (each unit is computed by one thread alone)."""
    rng = torch.Generator().manual_seed(3)
    batch = _batch(rng, [40, 7, 0], [1, 9, 12], 16, 12)
    T = batch.positions.numel()
    q, k, v = (
        torch.randn(T, 8, 64, generator=rng),
        torch.randn(T, 2, 64, generator=rng),
        torch.randn(T, 2, 64, generator=rng),
    )
    ext = build.extension()
    outs = []
    for n in (1, 2):
        ext.set_threads(n)
        try:
            kc, vc = torch.zeros(12, 16, 2, 64), torch.zeros(12, 16, 2, 64)
            outs.append(KA.attend(q, k, v, kc, vc, batch, 0.125))
        finally:
            ext.set_threads(0)
    assert torch.equal(outs[0], outs[1])


def _small():
    rng = torch.Generator().manual_seed(1)
    batch = _batch(rng, [3], [2], 4, 4)
    return (
        batch,
        torch.randn(2, 4, 8),
        torch.randn(2, 2, 8),
        torch.randn(2, 2, 8),
        torch.zeros(4, 4, 2, 8),
        torch.zeros(4, 4, 2, 8),
    )


@needs_cpp
@pytest.mark.parametrize(
    "field, value, match",
    [
        ("slot_mapping", torch.tensor([3, 16]), "slot_mapping\\[1\\] = 16 outside"),
        ("block_tables", torch.tensor([[1, 4]]), "block_tables holds block 4"),
        ("positions", torch.tensor([3, 8]), "positions\\[1\\] = 8 outside"),
        ("seq_of_token", torch.tensor([0, 1]), "seq_of_token\\[1\\] = 1 outside"),
    ],
)
def test_bad_input_names_the_parameter(field, value, match):
    batch, q, k, v, kc, vc = _small()
    with pytest.raises(RuntimeError, match=match):
        KA.attend(q, k, v, kc, vc, batch._replace(**{field: value}), 0.3)


@needs_cpp
def test_bad_shapes_name_the_parameter():
    batch, q, k, v, kc, vc = _small()
    with pytest.raises(RuntimeError, match="3 query heads are not a multiple of 2 kv heads"):
        KA.attend(q[:, :3], k, v, kc, vc, batch, 0.3)
    with pytest.raises(RuntimeError, match="v has shape"):
        KA.attend(q, k, v[:, :, :4], kc, vc, batch, 0.3)
    with pytest.raises(RuntimeError, match="sinks must be"):
        KA.attend(q, k, v, kc, vc, batch, 0.3, sinks=torch.zeros(3))
    with pytest.raises(RuntimeError, match="cos must be"):
        KA.attend(q, k, v, kc, vc, batch, 0.3, cos=torch.ones(2, 1, 10), sin=torch.ones(2, 1, 10))


def test_declines_where_it_does_not_apply(monkeypatch):
    """None (and nothing written) for float64 q, an fp16 cache, more than MAX_Q new tokens, no extension."""
    batch, q, k, v, kc, vc = _small()
    assert KA.attend(q.double(), k.double(), v.double(), kc.double(), vc.double(), batch, 0.3) is None
    assert KA.attend(q, k, v, kc.half(), vc.half(), batch, 0.3) is None
    monkeypatch.setattr(KA, "MAX_Q", 1)
    assert KA.attend(q, k, v, kc, vc, batch, 0.3) is None
    monkeypatch.setattr(KA, "MAX_Q", 64)
    monkeypatch.setattr(KA, "extension", lambda: None)
    assert KA.attend(q, k, v, kc, vc, batch, 0.3) is None
    assert not kc.any() and not vc.any()


# ---------------------------------------------------------------------------
# the whole model

PROMPTS = [
    [(i * 37 + 11) % 300 + 3 for i in range(40)],
    [5, 9, 33, 7],
    [(i * 13 + 2) % 290 + 3 for i in range(23)],
]
TINY = dict(
    hidden_size=64, moe_intermediate_size=32, num_experts=8, num_hidden_layers=2, num_experts_per_tok=2
)


def _run(path, **kw):
    """(prefill logits of PROMPTS[0], greedy tokens and their logprobs of a 3-sequence decode)"""
    llm = LLM(str(path), **kw)
    logits = llm.logits(PROMPTS[0])
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0))
    toks = [o.token_ids for o in outs]
    lps = torch.tensor([[lp[1] for lp in o.logprobs] for o in outs])
    return llm, logits, toks, lps


def _kernel_vs_torch(path, monkeypatch, **kw):
    calls = []
    real = KA.attend
    monkeypatch.setattr(KA, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    import expertcache.layers.attention as LA

    monkeypatch.setattr(LA, "attend", KA.attend)
    llm, fast, toks, lps = _run(path, **kw)
    assert calls, "the kernel was not called"
    with monkeypatch.context() as mp:
        mp.setattr(KA, "MAX_Q", 0)  # every batch declined: the torch path
        _, slow, toks_t, lps_t = _run(path, **kw)
    assert (fast - slow).abs().max() <= 1e-4 * slow.abs().max()
    assert toks == toks_t
    assert (lps - lps_t).abs().max() <= 1e-4 * max(1.0, lps_t.abs().max())
    return llm


@needs_cpp
@pytest.mark.parametrize(
    "family, overrides",
    [
        ("qwen3_moe", dict(num_attention_heads=8, num_key_value_heads=2)),  # head q/k norm, GQA 4
        ("qwen2_moe", {}),  # q/k/v biases
    ],
    ids=["qwen3_moe", "qwen2_moe"],
)
def test_whole_model_kernel_equals_torch_path(family, overrides, checkpoint, monkeypatch):
    path = checkpoint(family, **TINY, **overrides)
    llm = _kernel_vs_torch(path, monkeypatch)
    w = llm.model.layers[0]["attn"].w
    assert "qkv_proj.weight" in w and "q_proj.weight" not in w
    cfg = llm.cfg
    assert w["qkv_proj.weight"].shape == (
        (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
        cfg.hidden_size,
    )
    assert ("qkv_proj.bias" in w) == cfg.qkv_bias


@needs_cpp
def test_gpt_oss_sinks_and_window_kernel_equals_torch_path(tmp_path, monkeypatch):
    path = G.make_gpt_oss(tmp_path)
    _kernel_vs_torch(path, monkeypatch)
