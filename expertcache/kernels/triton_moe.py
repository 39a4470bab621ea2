"""Fused MoE over the device slot pool in Triton: one launch for gate_up + activation, one for down.

Shape legend:
    T tokens, H hidden, I moe intermediate, K top_k, S slots, P = T*K routed pairs, BM pairs per block
    x [T, H]   slots [T, K] slot of each routed pair (-1 = not in this pool)   weights [T, K]
    pool parts (experts/layout.py, quant/method.py), one slot per leading index:
        plain    gate_up [S, 2I, H], down [S, H, I]  ([S, H, 2I], [S, I, H] when ffn.transposed)
        quantized  "<gate|up|down>.<suffix>" [S, out, ...] (or "gate_up.<suffix>" when ffn.fused_quant)
        biases   gate_up_bias [S, 2I], down_bias [S, H]
    inter [P, I] (the dot dtype)   out_pairs [P, H] float32

Each projection is read through a `Proj` (triton_pool.py): codes [S, out, in] (or packed bytes), addressed
by strides, so views select gate and up rows (halves or interleaved) and transposed weights without a
copy. The kernels (triton_moe_jit.py) dequantise a weight tile in registers to float32 (fp8 bytes and e2m1 nibbles through a table built once per
device, int8 / int4 codes with zero points, times a scale indexed by (row // S_BN, col // S_BK): per
tensor, per channel, per fp8 block, per group, or e8m0 per 32), cast to the dot dtype (bf16/fp16 as x,
else float32 at IEEE precision) and multiplied with tl.dot into a float32 accumulator. Slot bases are
64-bit (`triton_moe_jit.slot_base`), so pools past 2^31 elements are addressed correctly.

Alignment (`align_by_slot`) is a handful of device ops and no host read: pairs are sorted by slot, each
slot's run padded to a multiple of BM, and the grid is the bound min(P, S) * (BM - 1) + P pairs' blocks
known from the shapes alone; blocks past the end read slot -1 and exit. Pairs whose slot is -1 get no
block: their rows of out_pairs stay 0 and the caller adds their partial sums (CPU compute, staged waves).
The routing weight and the down bias are applied in the down kernel; the sum over K is a plain reduction
(deterministic, no atomics). Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (CI).
"""

from __future__ import annotations

import contextlib

import torch

from .triton_moe_jit import (CLAMPED_SWIGLU, DOT_BF16, DOT_FP16, DOT_FP32, E2M1_VALUES, FP8, MXFP4, SILU,
                              down_kernel, gate_up_kernel, triton)
from .triton_pool import Proj, biases, projections, supported

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
    return triton is not None and type(down_kernel).__name__ == "InterpretedFunction"


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
    dummy = lut  # stands for the pointers a constexpr branch never reads
    bias = biases(pool, ffn)
    has_bias = bias is not None
    if has_bias:
        gbias, ubias, db = bias
        gb_s, db_s = (gbias.stride(0), gbias.stride(1)), (db.stride(0), db.stride(1))
    else:
        gbias = ubias = db = dummy
        gb_s = db_s = (0, 0)

    def parts(p: Proj):
        return p.w, p.scale if p.scale is not None else dummy, p.zero if p.zero is not None else dummy

    inter = torch.empty((P, I), dtype=x.dtype if dot != DOT_FP32 else torch.float32, device=dev)
    out_pairs = torch.zeros((P, H), dtype=torch.float32, device=dev)
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():  # Triton launches there
        grid = (bslot.numel(), triton.cdiv(I, BN))
        gate_up_kernel[grid](xc, *parts(g), *parts(u), gbias, ubias, lut, inter, sorted_ids, bslot,
                              H, I, K, P, xc.stride(0), *g.w_strides, *g.s_strides, *g.s_block, *gb_s, alpha, limit,
                              FMT=fmt, ACT=act, HAS_BIAS=has_bias, DOT=dot, BM=BM, BN=BN, BK=BK, **launch)
        grid = (bslot.numel(), triton.cdiv(H, BN))
        down_kernel[grid](inter, *parts(d), db, lut, rw, out_pairs, sorted_ids, bslot, H, I, P,
                           *d.w_strides, *d.s_strides, *d.s_block, *db_s,
                           FMT=fmt, HAS_BIAS=has_bias, DOT=dot, BM=BM, BN=BN, BK=BK, **launch)
    out += out_pairs.view(T, K, H).sum(1).to(out.dtype)
    return out


__all__ = ["available", "interpreted", "unavailable_reason", "supported", "align_by_slot", "num_blocks_bound",
           "fused_moe", "projections", "pick_config", "CONFIGS"]
