"""Fused MoE over the device slot pool in Triton: one launch for gate_up + activation, one for down, one
for the sum over K.

Shape legend:
    T tokens, H hidden, I moe intermediate, K top_k, S slots, P = T*K routed pairs, BM rows per block,
    R the call's own pairs (those with a slot), NR rows allocated (R with a host alignment, else P)
    x [T, H]   slots [T, K] slot of each routed pair (-1 = not in this pool)   weights [T, K]
    pool parts (experts/layout.py, quant/method.py), one slot per leading index:
        plain    gate_up [S, 2I, H], down [S, H, I]  ([S, H, 2I], [S, I, H] when ffn.transposed)
        quantized  "<gate|up|down>.<suffix>" [S, out, ...] (or "gate_up.<suffix>" when ffn.fused_quant)
        biases   gate_up_bias [S, 2I], down_bias [S, H]
    inter [NR, I] (the dot dtype)   out_rows [NR, H] float32

Each projection is read through a `Proj` (triton_pool.py): codes [S, out, in] (or packed bytes), addressed
by strides, so views select gate and up rows (halves or interleaved) and transposed weights without a
copy. The kernels (triton_moe_jit.py) dequantise a weight tile in registers to float32 (fp8 bytes and e2m1
nibbles through a table built once per
device, int8 / int4 codes with zero points, times a scale indexed by (row // S_BN, col // S_BK): per
tensor, per channel, per fp8 block, per group, or e8m0 per 32; GGUF blocks decoded where they lie in the
slot's bytes, gate_up and down each with its own decoder), cast to the dot dtype (bf16/fp16 as x,
else float32 at IEEE precision) and multiplied with tl.dot into a float32 accumulator. Slot bases are
64-bit (`triton_moe_jit.slot_base`), so pools past 2^31 elements are addressed correctly.

Alignment: the call's pairs with a slot become rows in slot order, each slot's run padded to a multiple
of BM (`Alignment`). Either made on the host (`host_alignment`: numpy from the slot table a scheduled step
already has, exact grid, R rows; sent in one copy by `alignment_to`), so the call spends no device launch
on it, or on the device (`align_by_slot`: a sort and a handful of index ops, no host read; the grid is
the bound min(P, S) * (BM - 1) + P rows' blocks known from the shapes alone, blocks past the end read
slot -1 and exit; P rows). Pairs whose slot is -1 get no row: the caller adds their partial sums (CPU
compute, staged waves). The routing weight and the down bias are applied in the down kernel; the sum
over K is its own kernel, in order (deterministic, no atomics), added into `out` in float32.
`workspace_bytes` gives a call's temporaries for the device plan; `warm_up` compiles a pool's kernels
before the first request. Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (CI).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import numpy as np
import torch

from ..quant.ggml_blocks import KV_IQ4, KV_MXFP4
from .triton_moe_jit import (
    CLAMPED_SWIGLU,
    DOT_BF16,
    DOT_FP16,
    DOT_FP32,
    E2M1_VALUES,
    FP8,
    GGUF_MXFP4,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
    SILU,
    down_kernel,
    gate_up_kernel,
    reduce_kernel,
    triton,
)
from .triton_pool import Proj, biases, projections, supported

# Launch configurations by shape (a starting table: not tuned on a GPU yet). "decode": few pairs per
# slot, so a short BM wastes the fewest padded rows; "prefill": many pairs per slot.
CONFIGS = {
    "decode": dict(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2),
    "prefill": dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3),
}
DECODE_PAIRS_PER_SLOT = 16  # at most this many pairs per slot on average: the decode configuration
# Devices with at most 99 KiB of shared memory per block (sm_86, sm_89, sm_120): the prefill tiles with two
# stages (three need up to 112 KiB: the ahead-of-time compile, triton_aot.py, measures each target)
SMALL_SHARED_BYTES = 101376
SMALL_SHARED = {"prefill": dict(CONFIGS["prefill"], num_stages=2)}
REDUCE_BLOCK_T, REDUCE_BLOCK_H = 16, 128  # the sum over K: tokens x hidden per program
ALIGN_INTS = 16  # a sent alignment's arrays start every 16 int64s (128 bytes)


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
        return (
            "on device='cpu' the Triton kernels run only under the interpreter: start with TRITON_INTERPRET=1 "
            "(slow; for tests) or use moe_kernel='auto' / 'torch'"
        )
    return f"no Triton kernels for device {device.type!r}"


def num_blocks_bound(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Blocks of BM rows that the padded runs can need, from the shapes alone: every non-empty slot
    (at most min(P, S)) pads at most BM - 1 rows; one more block holds the skipped pairs' sentinel."""
    return (num_pairs + min(num_pairs, num_slots) * (block_m - 1)) // block_m + 1


class Alignment(NamedTuple):
    """A call's pairs in slot order, as the kernels read them (int64; numpy arrays from `host_alignment`,
    device tensors once sent). rows = the pairs with a slot (R of them), in slot order (stable).
        sorted_rows  [blocks * BM] row ids in runs of one slot, each run padded to a multiple of BM
                     with `num_rows`
        block_slot   [blocks] the slot of each block (-1: a block past the runs, whose programs exit)
        pair_of_row  [num_rows] each row's pair index t * K + k (rows past R: unused)
        row_of_pair  [P] each pair's row, -1 for a pair without a slot (the caller's to compute)
    num_rows: the rows allocated (R from the host; P on the device, where R is not read back)."""

    sorted_rows: object
    block_slot: object
    pair_of_row: object
    row_of_pair: object
    block_m: int
    num_rows: int


def host_alignment(slots, num_slots: int, block_m: int | None = None) -> Alignment:
    """slots [T, K] or [P] (numpy or a CPU tensor; -1 = skip) -> the Alignment as numpy int64 arrays, with
    the exact grid (no sentinel blocks) and num_rows = R. Computed on the host from the slot table a
    scheduled step already holds, so the call spends no device launch on it; send it with
    `alignment_to` (one copy). block_m: pick_config's for the call's shape when None."""
    sl = np.asarray(slots.numpy() if isinstance(slots, torch.Tensor) else slots).reshape(-1)
    P = sl.size
    if block_m is None:
        block_m = CONFIGS[config_name(P, num_slots)]["block_m"]
    small = P <= SMALL_ALIGN
    if small:
        sl = sl.tolist()
    lo, hi = (min(sl), max(sl)) if P else (0, 0)
    if hi >= num_slots or lo < -1:
        raise ValueError(f"host_alignment slots: values in [-1, {num_slots}), got {lo}..{hi}")
    if small:
        return _small_alignment(sl, block_m)
    sl = sl.astype(np.int64, copy=False)
    pairs = np.flatnonzero(sl >= 0)
    order = np.argsort(sl[pairs], kind="stable")
    pair_of_row, sk = pairs[order], sl[pairs[order]]
    R = pairs.size
    counts = np.bincount(sk, minlength=num_slots)
    padded = -(-counts // block_m) * block_m
    ends = np.cumsum(padded)
    starts = np.cumsum(counts) - counts
    blocks = int(ends[-1]) // block_m if num_slots else 0
    sorted_rows = np.full(blocks * block_m, R, dtype=np.int64)
    sorted_rows[(ends - padded - starts)[sk] + np.arange(R)] = np.arange(R)
    block_slot = np.repeat(np.arange(num_slots, dtype=np.int64), padded // block_m)
    row_of_pair = np.full(P, -1, dtype=np.int64)
    row_of_pair[pair_of_row] = np.arange(R)
    return Alignment(sorted_rows, block_slot, pair_of_row.astype(np.int64), row_of_pair, block_m, R)


SMALL_ALIGN = 64  # pairs up to which host_alignment runs in plain Python (fewer numpy calls: decode)


def _small_alignment(sl: list[int], block_m: int) -> Alignment:
    """host_alignment for a few pairs, in Python lists: the same arrays."""
    pair_of_row = sorted((p for p in range(len(sl)) if sl[p] >= 0), key=sl.__getitem__)  # stable
    R = len(pair_of_row)
    sorted_rows, block_slot, row_of_pair = [], [], [-1] * len(sl)
    r = 0
    while r < R:
        s, start = sl[pair_of_row[r]], r
        while r < R and sl[pair_of_row[r]] == s:
            r += 1
        n = -(-(r - start) // block_m)
        sorted_rows += range(start, r)
        sorted_rows += [R] * (n * block_m - (r - start))
        block_slot += [s] * n
    for row, p in enumerate(pair_of_row):
        row_of_pair[p] = row
    i64 = np.int64
    return Alignment(
        np.array(sorted_rows, i64),
        np.array(block_slot, i64),
        np.array(pair_of_row, i64),
        np.array(row_of_pair, i64),
        block_m,
        R,
    )


def alignment_to(al: Alignment, device, pin: bool = True) -> Alignment:
    """A host Alignment on `device` in one copy: the four arrays packed into one int64 buffer (pinned when
    `pin` and the device is CUDA, so the copy is asynchronous) and viewed apart there."""
    arrays = (al.sorted_rows, al.block_slot, al.pair_of_row, al.row_of_pair)
    # each array on a 128-byte boundary of the buffer: the kernels' pointers keep the 16-byte alignment
    # Triton specialises on (as a fresh allocation has), so this compiles what align_by_slot's does
    size = [-(-a.size // ALIGN_INTS) * ALIGN_INTS for a in arrays]
    buf = np.zeros(sum(size), dtype=np.int64)  # packed in numpy: no torch op until the copy
    at = 0
    for a, n in zip(arrays, size):
        buf[at : at + a.size] = a
        at += n
    packed = torch.from_numpy(buf)
    device = torch.device(device)
    if device.type == "cuda" and pin:
        packed = packed.pin_memory()
    on = packed.to(device, non_blocking=True)
    views, at = [], 0
    for a, n in zip(arrays, size):
        views.append(on[at : at + a.size])
        at += n
    return Alignment(*views, al.block_m, al.num_rows)


def align_by_slot(slots: torch.Tensor, num_slots: int, block_m: int) -> Alignment:
    """slots [P] (-1 = skip) on the device -> the Alignment on the device, no host read: the grid is
    num_blocks_bound's (blocks past the runs read slot -1 and exit), num_rows = P. Rows are positions in
    the stably sorted keys (skipped pairs sort last, into a bucket with no blocks); a slot's run starts
    where searchsorted finds it (no bincount)."""
    P, dev = slots.numel(), slots.device
    key = torch.where(slots < 0, num_slots, slots)
    sk, order = torch.sort(key, stable=True)
    start = torch.searchsorted(sk, torch.arange(num_slots + 1, device=dev))  # [S + 1] run starts
    padded = (start.diff() + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    num_blocks = num_blocks_bound(P, num_slots, block_m)
    ok = sk < num_slots
    j = torch.arange(P, device=dev)
    shift = ends - padded - start[:-1]  # row j of slot s sits at shift[s] + j
    pos = torch.where(ok, shift[sk.clamp(max=num_slots - 1)] + j, num_blocks * block_m - 1)
    sorted_rows = torch.full((num_blocks * block_m,), P, dtype=torch.int64, device=dev)
    sorted_rows.scatter_(0, pos, torch.where(ok, j, P))
    bslot = torch.searchsorted(ends, torch.arange(0, num_blocks * block_m, block_m, device=dev), right=True)
    row_of_pair = torch.empty(P, dtype=torch.int64, device=dev).scatter_(0, order, torch.where(ok, j, -1))
    return Alignment(sorted_rows, torch.where(bslot < num_slots, bslot, -1), order, row_of_pair, block_m, P)


def workspace_bytes(
    rows: int, hidden: int, inter: int, dtype: torch.dtype, num_slots: int = 0, block_m: int | None = None
) -> int:
    """Device bytes one fused_moe call allocates besides its output: inter [rows, I] (x's dtype for a
    bf16/fp16 dot, else float32), out_rows [rows, H] float32, the routing weights (float32) and the
    device alignment's int64 temporaries (its sort, runs and bound-sized grid; a host alignment is
    smaller). rows: the call's own pairs (R, with a host alignment) or all T * K pairs (without one)."""
    dot = dtype.itemsize if dtype in (torch.bfloat16, torch.float16) else 4
    bm = block_m or max(c["block_m"] for c in CONFIGS.values())
    blocks = num_blocks_bound(rows, num_slots, bm)
    align = 8 * (7 * rows + blocks * (bm + 1) + 4 * (num_slots + 1))
    return rows * inter * dot + rows * hidden * 4 + rows * 4 + align


_TABLES: dict = {}


def _table(fmt: int, device) -> torch.Tensor:
    """Decode table in device memory, built once per (format, device): e4m3fn bytes, e2m1 codes or GGUF's
    4-bit codes (IQ4_NL / IQ4_XS: KV_IQ4; MXFP4: KV_MXFP4) -> float32."""
    key = (fmt, str(device))
    if key not in _TABLES:
        if fmt == FP8:
            t = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        elif fmt == MXFP4:
            t = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        elif fmt in (IQ4_NL, IQ4_XS, GGUF_MXFP4):
            t = torch.tensor(KV_MXFP4 if fmt == GGUF_MXFP4 else KV_IQ4, dtype=torch.float32)
        else:
            t = torch.zeros(1)
        _TABLES[key] = t.to(device)
    return _TABLES[key]


def config_name(num_pairs: int, num_slots: int) -> str:
    """decode while the pairs per slot stay few, else prefill."""
    return "decode" if num_pairs <= DECODE_PAIRS_PER_SLOT * num_slots else "prefill"


def pick_config(
    num_pairs: int, num_slots: int, shared_limit: int | None = None, fp32_dot: bool = False
) -> dict:
    """The CONFIGS entry for a call, with SMALL_SHARED's changes on a device whose shared memory per block
    (`shared_limit`, bytes; None: no limit known) is at most SMALL_SHARED_BYTES; there a float32 dot
    (`fp32_dot`) also halves block_k (fp8 weights with float32 activations needed 100-112 KiB)."""
    name = config_name(num_pairs, num_slots)
    if shared_limit is None or shared_limit > SMALL_SHARED_BYTES:
        return CONFIGS[name]
    cfg = SMALL_SHARED.get(name, CONFIGS[name])
    return dict(cfg, block_k=cfg["block_k"] // 2) if fp32_dot else cfg


_SHARED: dict = {}


def shared_limit(device: torch.device) -> int | None:
    """Shared memory per block (with opt-in) of a CUDA device, None elsewhere (the interpreter has none)."""
    if device.type != "cuda" or interpreted():
        return None
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SHARED:
        _SHARED[key] = int(torch.cuda.get_device_properties(key).shared_memory_per_block_optin)
    return _SHARED[key]


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


def fused_moe(
    x: torch.Tensor,
    slots: torch.Tensor | None,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    method=None,
    ffn=None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    alignment: Alignment | None = None,
) -> torch.Tensor:
    """out += sum_k weights[t,k] * FFN_{slots[t,k]}(x[t]) over the pairs with a slot (-1: skipped, the caller
    computes them elsewhere); -> out [T, H] in x.dtype (a new zeroed one when None). `ffn` is an
    experts.compute.ExpertFFN (None: SwiGLU, gate rows first, [out, in], no biases); `method` the pool's
    QuantMethod (None: plain float parts). Block sizes default to CONFIGS by shape; given ones must be
    powers of two >= 16. `alignment`: the pairs' slot order made on the host (host_alignment, sent with
    alignment_to; then `slots` is not read and may be None), else made here on the device (align_by_slot)."""
    if triton is None:
        raise RuntimeError(unavailable_reason(x.device))
    T = x.shape[0]
    K = weights.shape[1]
    I, g, u, d = projections(pool, method, ffn)
    S, P = g.w.shape[0], T * K
    cfg = dict(pick_config(P, S, shared_limit(x.device), _dot_kind(x.dtype) == DOT_FP32))
    for name, given in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if given is not None:
            cfg[name] = _check_block(name, given)
    if alignment is not None:
        if block_m is not None and alignment.block_m != cfg["block_m"]:
            raise ValueError(
                f"fused_moe alignment: made for block_m {alignment.block_m}, the call asks {block_m}"
            )
        cfg["block_m"] = alignment.block_m
        if alignment.row_of_pair.numel() != P:
            raise ValueError(
                f"fused_moe alignment: {alignment.row_of_pair.numel()} pairs, the call has {P} (T*K)"
            )
    if out is None:
        out = torch.zeros_like(x)
    if P == 0:
        return out
    dev = x.device
    if alignment is None:
        alignment = align_by_slot(
            slots.reshape(-1).to(dev, torch.int64, non_blocking=True), S, cfg["block_m"]
        )
    if alignment.block_slot.numel() == 0:  # a host alignment with no pair for this pool
        return out
    target = out if out.stride(-1) == 1 else out.contiguous()  # the sum's kernel writes rows of unit stride
    launch = launches(x, pool, method, ffn, weights, alignment, target, cfg, (I, g, u, d))
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():  # Triton launches there
        for kernel, grid, args, consts, opts in launch:
            kernel[grid](*args, **consts, **opts)
    if target is not out:
        out.copy_(target)
    return out


def launches(x, pool, method, ffn, weights, al: Alignment, out, cfg, proj) -> list[tuple]:
    """The call's three launches as (kernel, grid, positional args, constexprs, launch options): one
    source for fused_moe and the ahead-of-time compile (triton_aot.py) that checks every one."""
    I, g, u, d = proj
    T, H = x.shape
    K, dev, NR = weights.shape[1], x.device, al.num_rows
    BM, BN, BK = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    opts = {} if interpreted() else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    lut, dlut = _table(g.fmt, dev), _table(d.fmt, dev)  # gate_up's and down's decode tables
    dot = _dot_kind(x.dtype)
    xc = x.contiguous()
    bias = _Bias(biases(pool, ffn), dummy=lut)
    inter = torch.empty((NR, I), dtype=x.dtype if dot != DOT_FP32 else torch.float32, device=dev)
    out_rows = torch.empty((NR, H), dtype=torch.float32, device=dev)  # every row read is written first
    rw = weights.reshape(-1).to(torch.float32).contiguous()
    rows = (al.sorted_rows, al.block_slot, al.pair_of_row)
    nb = al.block_slot.numel()
    shared = dict(HAS_BIAS=bias.has, DOT=dot, BM=BM, BN=BN, BK=BK)
    act = CLAMPED_SWIGLU if ffn is not None and ffn.act == "clamped_swiglu" else SILU
    alpha = float(ffn.alpha) if ffn is not None else 1.0
    limit = float(ffn.limit) if ffn is not None else float("inf")
    # positional arguments in the kernels' signature order (triton_moe_jit.py)
    gu_weights = (*_parts(g, lut), *_parts(u, lut), bias.gate, bias.up, lut)
    gu_layout = _layout(g, bias.gate_strides)
    gate_up = (xc, *gu_weights, inter, *rows, H, I, K, NR, xc.stride(0), *gu_layout, alpha, limit)
    down_weights = (*_parts(d, dlut), bias.down, dlut, rw)
    down = (inter, *down_weights, out_rows, *rows, H, I, NR, *_layout(d, bias.down_strides))
    return [
        (gate_up_kernel, (nb, triton.cdiv(I, BN)), gate_up, dict(shared, FMT=g.fmt, ACT=act), opts),
        (down_kernel, (nb, triton.cdiv(H, BN)), down, dict(shared, FMT=d.fmt), opts),
        (
            reduce_kernel,
            (triton.cdiv(T, REDUCE_BLOCK_T), triton.cdiv(H, REDUCE_BLOCK_H)),
            (out_rows, al.row_of_pair, out, T, H, K, out.stride(0)),
            dict(BT=REDUCE_BLOCK_T, BH=REDUCE_BLOCK_H),
            {} if interpreted() else dict(num_warps=4),
        ),
    ]


class _Bias:
    """The pool's gate/up/down biases as the kernels take them: `dummy` (a pointer the HAS_BIAS=False
    branch never reads) and strides (0, 0) when the experts have none."""

    def __init__(self, bias: tuple | None, dummy: torch.Tensor):
        self.has = bias is not None
        self.gate, self.up, self.down = bias if self.has else (dummy, dummy, dummy)
        self.gate_strides = (self.gate.stride(0), self.gate.stride(1)) if self.has else (0, 0)
        self.down_strides = (self.down.stride(0), self.down.stride(1)) if self.has else (0, 0)


def _parts(p: Proj, dummy: torch.Tensor) -> tuple:
    """A projection's codes, scales and zero points; `dummy` for the parts its format has not."""
    return p.w, p.scale if p.scale is not None else dummy, p.zero if p.zero is not None else dummy


def _layout(p: Proj, bias_strides: tuple) -> tuple:
    """The kernels' layout arguments, in their order: w_s, w_n, w_k, s_s, s_n, s_k, S_BN, S_BK, b_s, b_n."""
    return (*p.w_strides, *p.s_strides, *p.s_block, *bias_strides)


def warm_up(
    pool: dict[str, torch.Tensor],
    method=None,
    ffn=None,
    dtype: torch.dtype = torch.bfloat16,
    top_k: int = 1,
    configs=("decode",),
) -> int:
    """Compile the kernels a layer of `pool` will launch (its format, variant and activation dtype) for
    each of `configs` before the first request, so no request waits for a compile: one call per config
    with every pair skipped but one (on slot 0), its output discarded. Pair counts are not
    specialised on, so any batch size reuses what this compiled. -> the number of calls made (0 when
    the kernels cannot run on the pool's device)."""
    dev = next(iter(pool.values())).device
    if unavailable_reason(dev) is not None:
        return 0
    S = projections(pool, method, ffn)[1].w.shape[0]
    H = _hidden(pool, method, ffn)
    n = 0
    for name in configs:
        c = CONFIGS[name]
        # the fewest tokens whose pairs pick this config
        T = 1 if name == "decode" else DECODE_PAIRS_PER_SLOT * S // top_k + 1
        slots = torch.full((T, top_k), -1, dtype=torch.int64)
        slots[0, 0] = 0
        al = alignment_to(host_alignment(slots, S, c["block_m"]), dev)
        x = torch.zeros(T, H, dtype=dtype, device=dev)
        w = torch.zeros(T, top_k, dtype=torch.float32, device=dev)
        fused_moe(x, None, w, pool, method, ffn, alignment=al)
        n += 1
    return n


def _hidden(pool, method, ffn) -> int:
    """H of a pool: the down projection's output rows (its input columns when transposed plain parts)."""
    d = projections(pool, method, ffn)[3].w
    transposed = method is None and ffn is not None and ffn.transposed
    return d.shape[2] if transposed else d.shape[1]


__all__ = [
    "CONFIGS",
    "Alignment",
    "align_by_slot",
    "alignment_to",
    "available",
    "fused_moe",
    "host_alignment",
    "config_name",
    "interpreted",
    "num_blocks_bound",
    "pick_config",
    "shared_limit",
    "projections",
    "supported",
    "unavailable_reason",
    "warm_up",
    "workspace_bytes",
]
