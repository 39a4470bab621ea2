"""Fused MoE over the device slot pool in Triton: one launch for gate_up + activation, one for down.

Shape legend:
    T tokens, H hidden, I moe intermediate, K top_k, S slots, P = T*K routed pairs, BM pairs per block
    x [T, H]   slots [T, K] slot of each routed pair (-1 = not in this pool)   weights [T, K]
    pool parts (experts/layout.py, quant/method.py), one slot per leading index:
        plain    gate_up [S, 2I, H], down [S, H, I]  ([S, H, 2I], [S, I, H] when ffn.transposed)
        quantized  "<gate|up|down>.<suffix>" [S, out, ...] (or "gate_up.<suffix>" when ffn.fused_quant)
        biases   gate_up_bias [S, 2I], down_bias [S, H]
    inter [P, I] (the dot dtype)   out_pairs [P, H] float32

Each projection is read through a `Proj`: codes [S, out, in] (or packed bytes), addressed by strides, so
views select gate and up rows (halves or interleaved) and transposed weights without a copy. A weight
tile is dequantised in registers to float32 (fp8 bytes and e2m1 nibbles through a table built once per
device, int8 / int4 codes with zero points, times a scale indexed by (row // S_BN, col // S_BK): per
tensor, per channel, per fp8 block, per group, or e8m0 per 32), cast to the dot dtype (bf16/fp16 as x,
else float32 at IEEE precision) and multiplied with tl.dot into a float32 accumulator. Slot bases are
64-bit (`_slot_base`), so pools past 2^31 elements are addressed correctly.

Alignment (`align_by_slot`) is a handful of device ops and no host read: pairs are sorted by slot, each
slot's run padded to a multiple of BM, and the grid is the bound min(P, S) * (BM - 1) + P pairs' blocks
known from the shapes alone; blocks past the end read slot -1 and exit. Pairs whose slot is -1 get no
block: their rows of out_pairs stay 0 and the caller adds their partial sums (CPU compute, staged waves).
The routing weight and the down bias are applied in the down kernel; the sum over K is a plain reduction
(deterministic, no atomics). Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (CI).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: the CUDA install's extra
    triton = None

FLOAT, FP8, INT8, INT4, MXFP4 = range(5)  # FMT: how a weight tile is decoded
SILU, CLAMPED_SWIGLU = 0, 1  # ACT
DOT_FP32, DOT_BF16, DOT_FP16 = 0, 1, 2
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Launch configurations by shape (a starting table: not tuned on a GPU yet). "decode": few pairs per
# slot, so a short BM wastes the fewest padded rows; "prefill": many pairs per slot.
CONFIGS = {
    "decode": dict(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2),
    "prefill": dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3),
}
DECODE_PAIRS_PER_SLOT = 16  # at most this many pairs per slot on average: the decode configuration


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """The kernels were built for the Triton interpreter (TRITON_INTERPRET=1 when this module was imported):
    they then run on CPU tensors."""
    return triton is not None and type(_down_kernel).__name__ == "InterpretedFunction"


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run on `device`, or None."""
    if triton is None:
        return "triton is not installed (pip install 'expertcache[cuda]')"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if interpreted():
            return None
        return ("on device='cpu' the Triton kernels run only under the interpreter: start with TRITON_INTERPRET=1 "
                "(slow; for tests) or use moe_kernel='auto' / 'torch'")
    return f"no Triton kernels for device {device.type!r}"


if triton is not None:

    @triton.jit
    def _slot_base(slot, stride):
        """Element offset of a slot: 64-bit, since a layer's pool part can pass 2^31 elements."""
        return slot.to(tl.int64) * stride

    @triton.jit
    def _tile(w_ptr, s_ptr, z_ptr, lut_ptr, wbase, sbase, offs_n, offs_k, nmask, kmask,
              w_n, w_k, s_n, s_k, S_BN, S_BK, FMT: tl.constexpr):
        """Dequantised weight tile W[n, k] as float32 [BK, BN] (transposed for the dot)."""
        m = kmask[:, None] & nmask[None, :]
        if FMT == 0:
            w = tl.load(w_ptr + wbase + offs_n[None, :] * w_n + offs_k[:, None] * w_k, mask=m, other=0.0)
            return w.to(tl.float32)
        sidx = sbase + (offs_n[None, :] // S_BN) * s_n + (offs_k[:, None] // S_BK) * s_k
        if FMT == 1:  # fp8 e4m3fn bytes through the 256-entry table
            byte = tl.load(w_ptr + wbase + offs_n[None, :] * w_n + offs_k[:, None] * w_k, mask=m, other=0)
            scale = tl.load(s_ptr + sidx, mask=m, other=0.0).to(tl.float32)
            return tl.load(lut_ptr + byte.to(tl.int32), mask=m, other=0.0) * scale
        if FMT == 2:  # int8 codes
            code = tl.load(w_ptr + wbase + offs_n[None, :] * w_n + offs_k[:, None] * w_k, mask=m, other=0)
            scale = tl.load(s_ptr + sidx, mask=m, other=0.0).to(tl.float32)
            return code.to(tl.float32) * scale
        # int4 / mxfp4: byte k // 2 of row n, low nibble first
        byte = tl.load(w_ptr + wbase + offs_n[None, :] * w_n + (offs_k[:, None] // 2) * w_k, mask=m, other=0)
        code = (byte.to(tl.int32) >> ((offs_k[:, None] % 2) * 4)) & 0xF
        if FMT == 3:  # asymmetric int4: (code - zero) * scale
            scale = tl.load(s_ptr + sidx, mask=m, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + sidx, mask=m, other=0).to(tl.float32)
            return (code.to(tl.float32) - zero) * scale
        e = tl.load(s_ptr + sidx, mask=m, other=127).to(tl.float32)  # mxfp4: e2m1 times 2^(e8m0 - 127)
        return tl.load(lut_ptr + code, mask=m, other=0.0) * tl.exp2(e - 127.0)

    @triton.jit
    def _to_dot(t, DOT: tl.constexpr):
        if DOT == 1:
            return t.to(tl.bfloat16)
        if DOT == 2:
            return t.to(tl.float16)
        return t.to(tl.float32)

    @triton.jit
    def _dot(a, b, acc, DOT: tl.constexpr):
        if DOT == 0:
            return acc + tl.dot(a, b, input_precision="ieee")
        return acc + tl.dot(a, b)

    @triton.jit
    def _gate_up_kernel(x_ptr, gw_ptr, gs_ptr, gz_ptr, uw_ptr, us_ptr, uz_ptr, gb_ptr, ub_ptr, lut_ptr,
                        inter_ptr, sorted_ptr, bslot_ptr,
                        H, I, TOPK, P, sx_t, w_s, w_n, w_k, s_s, s_n, s_k, S_BN, S_BK, b_s, b_n, alpha, limit,
                        FMT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        b, nb = tl.program_id(0), tl.program_id(1)
        slot = tl.load(bslot_ptr + b)
        if slot >= 0:
            rows = tl.load(sorted_ptr + b * BM + tl.arange(0, BM))  # int64 pair ids, P = padding
            valid = rows < P
            tok = rows // TOPK
            offs_n = nb * BN + tl.arange(0, BN)
            nmask = offs_n < I
            wbase, sbase = _slot_base(slot, w_s), _slot_base(slot, s_s)
            acc_g = tl.zeros((BM, BN), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, H, BK):
                offs_k = k0 + tl.arange(0, BK)
                kmask = offs_k < H
                a = tl.load(x_ptr + tok[:, None] * sx_t + offs_k[None, :], mask=valid[:, None] & kmask[None, :],
                            other=0.0)
                a = _to_dot(a, DOT)
                wg = _tile(gw_ptr, gs_ptr, gz_ptr, lut_ptr, wbase, sbase, offs_n, offs_k, nmask, kmask,
                           w_n, w_k, s_n, s_k, S_BN, S_BK, FMT)
                wu = _tile(uw_ptr, us_ptr, uz_ptr, lut_ptr, wbase, sbase, offs_n, offs_k, nmask, kmask,
                           w_n, w_k, s_n, s_k, S_BN, S_BK, FMT)
                acc_g = _dot(a, _to_dot(wg, DOT), acc_g, DOT)
                acc_u = _dot(a, _to_dot(wu, DOT), acc_u, DOT)
            if HAS_BIAS:
                bbase = _slot_base(slot, b_s)
                acc_g += tl.load(gb_ptr + bbase + offs_n * b_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
                acc_u += tl.load(ub_ptr + bbase + offs_n * b_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
            if ACT == 1:  # GPT-OSS: (up + 1) * g * sigmoid(alpha * g), g <= limit, up in [-limit, limit]
                g = tl.minimum(acc_g, limit)
                u = tl.maximum(tl.minimum(acc_u, limit), -limit)
                h = (u + 1.0) * (g * tl.sigmoid(g * alpha))
            else:
                h = acc_g * tl.sigmoid(acc_g) * acc_u
            tl.store(inter_ptr + rows[:, None] * I + offs_n[None, :], _to_dot(h, DOT),
                     mask=valid[:, None] & nmask[None, :])

    @triton.jit
    def _down_kernel(inter_ptr, dw_ptr, ds_ptr, dz_ptr, db_ptr, lut_ptr, rw_ptr, out_ptr, sorted_ptr, bslot_ptr,
                     H, I, P, w_s, w_n, w_k, s_s, s_n, s_k, S_BN, S_BK, b_s, b_n,
                     FMT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        b, nb = tl.program_id(0), tl.program_id(1)
        slot = tl.load(bslot_ptr + b)
        if slot >= 0:
            rows = tl.load(sorted_ptr + b * BM + tl.arange(0, BM))
            valid = rows < P
            offs_n = nb * BN + tl.arange(0, BN)
            nmask = offs_n < H
            wbase, sbase = _slot_base(slot, w_s), _slot_base(slot, s_s)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, I, BK):
                offs_k = k0 + tl.arange(0, BK)
                kmask = offs_k < I
                a = tl.load(inter_ptr + rows[:, None] * I + offs_k[None, :], mask=valid[:, None] & kmask[None, :],
                            other=0.0)
                wd = _tile(dw_ptr, ds_ptr, dz_ptr, lut_ptr, wbase, sbase, offs_n, offs_k, nmask, kmask,
                           w_n, w_k, s_n, s_k, S_BN, S_BK, FMT)
                acc = _dot(a, _to_dot(wd, DOT), acc, DOT)
            if HAS_BIAS:
                acc += tl.load(db_ptr + _slot_base(slot, b_s) + offs_n * b_n, mask=nmask,
                               other=0.0).to(tl.float32)[None, :]
            acc *= tl.load(rw_ptr + rows, mask=valid, other=0.0)[:, None]  # the routing weight
            tl.store(out_ptr + rows[:, None] * H + offs_n[None, :], acc, mask=valid[:, None] & nmask[None, :])


def num_blocks_bound(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Blocks of BM pairs that the padded runs can need, from the shapes alone: every non-empty slot
    (at most min(P, S)) pads at most BM - 1 rows; one more block holds the skipped pairs' sentinel."""
    return (num_pairs + min(num_pairs, num_slots) * (block_m - 1)) // block_m + 1


def align_by_slot(slots: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [P] (-1 = skip) -> (sorted pair ids [blocks * BM] padded with P, slot of each block [blocks],
    -1 past the end). Device ops only, no host read: pairs of slot s occupy a run starting at a multiple
    of BM; a slot's run starts where searchsorted finds it in the sorted keys (no bincount)."""
    P, dev = slots.numel(), slots.device
    key = torch.where(slots < 0, num_slots, slots).long()  # skipped pairs sort last, into a bucket with no blocks
    sk, order = torch.sort(key, stable=True)
    start = torch.searchsorted(sk, torch.arange(num_slots + 1, device=dev))  # [S + 1] run starts
    counts = start[1:] - start[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    num_blocks = num_blocks_bound(P, num_slots, block_m)
    ok = sk < num_slots
    s = sk.clamp(max=num_slots - 1)
    pos = torch.where(ok, ends[s] - padded[s] + torch.arange(P, device=dev) - start[s], num_blocks * block_m - 1)
    sorted_ids = torch.full((num_blocks * block_m,), P, dtype=torch.int64, device=dev)
    sorted_ids.scatter_(0, pos, torch.where(ok, order, P))
    first = torch.arange(num_blocks, device=dev) * block_m
    bslot = torch.searchsorted(ends, first, right=True)
    return sorted_ids, torch.where(bslot < num_slots, bslot, -1).to(torch.int32)


_TABLES: dict = {}


def _table(fmt: int, device) -> torch.Tensor:
    """Decode table in device memory, built once per (format, device): e4m3fn bytes or e2m1 codes -> float32."""
    key = (fmt, str(device))
    if key not in _TABLES:
        if fmt == FP8:
            t = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        elif fmt == MXFP4:
            t = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        else:
            t = torch.zeros(1)
        _TABLES[key] = t.to(device)
    return _TABLES[key]


class Proj(NamedTuple):
    """One projection's stored tensors in the kernels' terms: codes w [S, ...] with element strides to
    (slot, out row, in column or packed byte); scale (and int4 zero) indexed by (row // s_bn, col // s_bk)."""

    w: torch.Tensor
    w_strides: tuple[int, int, int]
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    s_strides: tuple[int, int, int] = (0, 0, 0)
    s_block: tuple[int, int] = (1, 1)


# quant format name -> (FMT, code suffix, scale suffix, zero suffix)
QUANT_FORMATS = {
    "bf16": (FLOAT, "weight", None, None), "fp16": (FLOAT, "weight", None, None),
    "fp32": (FLOAT, "weight", None, None),
    "fp8": (FP8, "weight", "weight_scale", None), "fp8-channel": (FP8, "weight", "weight_scale", None),
    "fp8-tensor": (FP8, "weight", "weight_scale", None), "int8": (INT8, "weight", "weight_scale", None),
    "int4": (INT4, "weight", "weight_scale", "weight_zero"), "mxfp4": (MXFP4, "weight_blocks", "weight_scales", None),
}


def supported(method) -> str | None:
    """Why the kernels cannot compute experts stored by `method` (a QuantMethod or None), or None."""
    if method is not None and method.name not in QUANT_FORMATS:
        return f"no Triton MoE kernel for the {method.name!r} expert format (have: {', '.join(QUANT_FORMATS)})"
    return None


def _scale_block(method) -> tuple[int, int]:
    name = method.name
    if name == "fp8":
        return tuple(method.block)
    if name in ("int8", "int4"):
        return 1, method.group
    return (1, 32) if name == "mxfp4" else (1, 1)


def _strides(t: torch.Tensor, out_dim: int = 1, in_dim: int = 2) -> tuple[int, int, int]:
    """(slot, out, in) element strides; a missing or size-1 dimension reads stride 0 (broadcast)."""
    def at(d):
        return t.stride(d) if t.dim() > d and t.shape[d] > 1 else 0
    return t.stride(0), at(out_dim), at(in_dim)


def _rows(t: torch.Tensor, which: int, interleaved: bool, dim: int = 1) -> torch.Tensor:
    """Gate (which 0) or up (1) rows of a fused gate_up tensor along `dim`: halves or alternate rows (a view)."""
    n = t.shape[dim]
    rows = slice(which, None, 2) if interleaved else slice(which * n // 2, (which + 1) * n // 2)
    return t[(slice(None),) * dim + (rows,)]


def _quant_proj(pool, prefix: str, method, which: int | None, interleaved: bool) -> Proj:
    fmt, code, scale_sfx, zero_sfx = QUANT_FORMATS[method.name]
    w = pool[f"{prefix}.{code}"]
    if w.dtype == torch.float8_e4m3fn:
        w = w.view(torch.uint8)
    if fmt == MXFP4:  # [S, out, in/32, 16] -> bytes along the row
        if w.stride(2) != 16 * w.stride(3):
            raise ValueError(f"{prefix}.{code}: mxfp4 blocks must be contiguous within a row for the Triton kernel")
        w = w.as_strided(w.shape[:2] + (w.shape[2] * 16,), (w.stride(0), w.stride(1), w.stride(3)))
    scale = pool.get(f"{prefix}.{scale_sfx}") if scale_sfx else None
    zero = pool.get(f"{prefix}.{zero_sfx}") if zero_sfx else None
    if scale is not None and scale.dim() == 1:
        scale = scale.unsqueeze(1)  # per-tensor [S] -> [S, 1]
    block = _scale_block(method)
    if which is not None:  # a fused gate_up part: this projection's rows
        if block[0] > 1 and (interleaved or (w.shape[1] // 2) % block[0]):
            raise ValueError(f"{prefix}.{code}: block-scaled gate_up rows cannot be split into gate and up for the "
                             f"Triton kernel (block rows {block[0]})")
        w = _rows(w, which, interleaved)
        if scale is not None and scale.dim() > 2 and scale.shape[1] > 1:
            scale = _rows(scale, which, interleaved)
        if zero is not None:
            zero = _rows(zero, which, interleaved)
    if scale is not None and zero is not None and _strides(zero) != _strides(scale):
        raise ValueError(f"{prefix}.{zero_sfx}: zero points must be laid out like {prefix}.{scale_sfx}")
    return Proj(w, _strides(w), scale, zero, _strides(scale) if scale is not None else (0, 0, 0), block)


def projections(pool: dict[str, torch.Tensor], method, ffn) -> tuple[int, int, Proj, Proj, Proj]:
    """A pool -> (FMT, I, gate, up, down) in the kernels' terms (views, no copies)."""
    fmt, g, u, d = _projections(pool, method, ffn)
    if (g.w_strides, g.s_strides) != (u.w_strides, u.s_strides):
        raise ValueError("gate and up expert weights are laid out differently in the slot pool; the Triton kernel "
                         "reads both with one set of strides")
    transposed = method is None and ffn is not None and ffn.transposed
    return fmt, g.w.shape[2 if transposed else 1], g, u, d


def _projections(pool, method, ffn) -> tuple[int, Proj, Proj, Proj]:
    interleaved = bool(ffn is not None and ffn.interleaved)
    if method is None:
        gu, dn = pool["gate_up"], pool["down"]
        transposed = bool(ffn is not None and ffn.transposed)
        o, i = (2, 1) if transposed else (1, 2)  # the out and in dimensions
        g, u = (_rows(gu, which, interleaved, dim=o) for which in (0, 1))
        return FLOAT, Proj(g, _strides(g, o, i)), Proj(u, _strides(u, o, i)), Proj(dn, _strides(dn, o, i))
    why = supported(method)
    if why:
        raise ValueError(why)
    fmt = QUANT_FORMATS[method.name][0]
    if ffn is not None and ffn.fused_quant:
        g, u = (_quant_proj(pool, "gate_up", method, which, interleaved) for which in (0, 1))
    else:
        g, u = (_quant_proj(pool, p, method, None, False) for p in ("gate", "up"))
    return fmt, g, u, _quant_proj(pool, "down", method, None, False)


def pick_config(num_pairs: int, num_slots: int) -> dict:
    """The CONFIGS entry for a call: decode while the pairs per slot stay few."""
    return CONFIGS["decode" if num_pairs <= DECODE_PAIRS_PER_SLOT * num_slots else "prefill"]


def _check_block(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"fused_moe {name}: a power of two >= 16 (tl.dot's smallest tile), got {value!r}")
    return value


def _dot_kind(dtype: torch.dtype) -> int:
    """tl.dot's input dtype: x's when bf16/fp16 (tensor cores), else float32 at IEEE precision. The
    interpreter multiplies bf16 operands as raw integers (Triton 3.9), so there it is always float32."""
    if interpreted():
        return DOT_FP32
    return {torch.bfloat16: DOT_BF16, torch.float16: DOT_FP16}.get(dtype, DOT_FP32)


def fused_moe(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, pool: dict[str, torch.Tensor],
              method=None, ffn=None, out: torch.Tensor | None = None, block_m: int | None = None,
              block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """out += sum_k weights[t,k] * FFN_{slots[t,k]}(x[t]) over the pairs with a slot (-1: skipped, the caller
    computes them elsewhere); -> out [T, H] in x.dtype (a new zeroed one when None). `ffn` is an
    experts.compute.ExpertFFN (None: SwiGLU, gate rows first, [out, in], no biases); `method` the pool's
    QuantMethod (None: plain float parts). Block sizes default to CONFIGS by shape; given ones must be
    powers of two >= 16."""
    if triton is None:
        raise RuntimeError(unavailable_reason(x.device))
    T, H = x.shape
    K = slots.shape[1]
    fmt, I, g, u, d = projections(pool, method, ffn)
    S, P = g.w.shape[0], T * K
    cfg = dict(pick_config(P, S))
    for name, given in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if given is not None:
            cfg[name] = _check_block(name, given)
    BM, BN, BK = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    launch = {} if interpreted() else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if out is None:
        out = torch.zeros_like(x)
    if P == 0:
        return out
    dev = x.device
    sorted_ids, bslot = align_by_slot(slots.reshape(-1).to(dev, torch.int64, non_blocking=True), S, BM)
    lut = _table(fmt, dev)
    dot = _dot_kind(x.dtype)
    xc = x.contiguous()
    act = CLAMPED_SWIGLU if ffn is not None and ffn.act == "clamped_swiglu" else SILU
    alpha = float(ffn.alpha) if ffn is not None else 1.0
    limit = float(ffn.limit) if ffn is not None else float("inf")
    gb = pool.get("gate_up_bias")
    has_bias = gb is not None
    dummy = lut
    if has_bias:
        interleaved = bool(ffn is not None and ffn.interleaved)
        gbias, ubias = _rows(gb, 0, interleaved), _rows(gb, 1, interleaved)
        db = pool["down_bias"]
        gb_s, db_s = (gbias.stride(0), gbias.stride(1)), (db.stride(0), db.stride(1))
    else:
        gbias = ubias = db = dummy
        gb_s = db_s = (0, 0)

    def parts(p: Proj):
        return p.w, p.scale if p.scale is not None else dummy, p.zero if p.zero is not None else dummy

    inter = torch.empty((P, I), dtype=x.dtype if dot != DOT_FP32 else torch.float32, device=dev)
    grid = (bslot.numel(), triton.cdiv(I, BN))
    _gate_up_kernel[grid](xc, *parts(g), *parts(u), gbias, ubias, lut, inter, sorted_ids, bslot,
                          H, I, K, P, xc.stride(0), *g.w_strides, *g.s_strides, *g.s_block, *gb_s, alpha, limit,
                          FMT=fmt, ACT=act, HAS_BIAS=has_bias, DOT=dot, BM=BM, BN=BN, BK=BK, **launch)
    out_pairs = torch.zeros((P, H), dtype=torch.float32, device=dev)
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    grid = (bslot.numel(), triton.cdiv(H, BN))
    _down_kernel[grid](inter, *parts(d), db, lut, rw, out_pairs, sorted_ids, bslot, H, I, P,
                       *d.w_strides, *d.s_strides, *d.s_block, *db_s,
                       FMT=fmt, HAS_BIAS=has_bias, DOT=dot, BM=BM, BN=BN, BK=BK, **launch)
    out += out_pairs.view(T, K, H).sum(1).to(out.dtype)
    return out


__all__ = ["available", "interpreted", "unavailable_reason", "supported", "align_by_slot", "num_blocks_bound",
           "fused_moe", "projections", "pick_config", "CONFIGS"]
