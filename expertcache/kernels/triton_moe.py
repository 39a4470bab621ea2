"""Fused MoE over the device slot pool in Triton: one launch for gate_up + SwiGLU, one for down.

Shape legend:
    T tokens, H hidden, I moe intermediate, K top_k, E logical experts, S slots, P = T*K routed pairs
    x [T, H]   ids [T, K] logical experts   weights [T, K]   slot_of [E] int (-1 = not resident)
    float pools: gate_up [S, 2I, H] (gate rows then up rows), down [S, H, I]
    fp8 pools:   {gate,up,down}.weight float8_e4m3fn [S, out, in] + .weight_scale float32 [S, out, 1]
    mxfp4 pools: {gate,up,down}.weight_blocks uint8 [S, out, in/32, 16] + .weight_scales uint8 [S, out, in/32]
    inter [P, I]   out_pairs [P, H]   BM pairs per block

Pairs are sorted by slot on the device and padded per slot to a multiple of BM (no host sync:
the grid is sized by the bound P + S*(BM-1) blocks; blocks past the end read slot -1 and exit).
Each program computes a [BM, BN] tile of one slot's output, dequantising weights in registers
(fp8 bytes through a 256-entry table and a scale per output channel, mxfp4 e2m1 nibbles through a
16-entry table times 2^(e8m0-127); the tables are built once per device),
accumulating in float32. Pairs whose expert is not resident (slot -1) get no block: their rows of
out_pairs stay 0 and the caller adds their partial sums (CPU compute, staged waves). The final
sum over K is a plain reduction (deterministic, no atomics). Runs on CUDA, and on CPU tensors
under TRITON_INTERPRET=1 (how CI tests it).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: the CUDA install's extra
    triton = None

FLOAT, FP8, MXFP4 = 0, 1, 2
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _load_w(w_ptr, s_ptr, lut_ptr, slot, offs_n, offs_k, nmask, kmask,
                sw_s, sw_n, ss_s, ss_n, MODE: tl.constexpr):
        """Weight tile W[slot, n, k] as float32 [BK, BN] (transposed for the dot)."""
        m = kmask[:, None] & nmask[None, :]
        if MODE == 1:  # fp8 e4m3fn bytes through a 256-entry table (the per-channel scale comes after the dot)
            byte = tl.load(w_ptr + slot * sw_s + offs_n[None, :] * sw_n + offs_k[:, None], mask=m, other=0)
            return tl.load(lut_ptr + byte.to(tl.int32), mask=m, other=0.0)
        if MODE == 2:  # mxfp4: byte k // 2 of row n, low nibble first; scale per 32 inputs
            byte = tl.load(w_ptr + slot * sw_s + offs_n[None, :] * sw_n + offs_k[:, None] // 2, mask=m, other=0)
            code = (byte.to(tl.int32) >> ((offs_k[:, None] % 2) * 4)) & 0xF
            val = tl.load(lut_ptr + code, mask=m, other=0.0)
            e = tl.load(s_ptr + slot * ss_s + offs_n[None, :] * ss_n + offs_k[:, None] // 32, mask=m, other=127)
            return val * tl.exp2(e.to(tl.float32) - 127.0)
        w = tl.load(w_ptr + slot * sw_s + offs_n[None, :] * sw_n + offs_k[:, None], mask=m, other=0.0)
        return w.to(tl.float32)

    @triton.jit
    def _gate_up_kernel(x_ptr, g_ptr, u_ptr, gs_ptr, us_ptr, lut_ptr, inter_ptr, sorted_ptr, bslot_ptr,
                        H, I, TOPK, P, sx_t, sw_s, sw_n, ss_s, ss_n,
                        MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        b, nb = tl.program_id(0), tl.program_id(1)
        slot = tl.load(bslot_ptr + b)
        if slot >= 0:
            rows = tl.load(sorted_ptr + b * BM + tl.arange(0, BM))
            valid = rows < P
            tok = rows // TOPK
            offs_n = nb * BN + tl.arange(0, BN)
            nmask = offs_n < I
            acc_g = tl.zeros((BM, BN), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, H, BK):
                offs_k = k0 + tl.arange(0, BK)
                kmask = offs_k < H
                a = tl.load(x_ptr + tok[:, None] * sx_t + offs_k[None, :], mask=valid[:, None] & kmask[None, :],
                            other=0.0).to(tl.float32)
                wg = _load_w(g_ptr, gs_ptr, lut_ptr, slot, offs_n, offs_k, nmask, kmask, sw_s, sw_n, ss_s, ss_n, MODE)
                wu = _load_w(u_ptr, us_ptr, lut_ptr, slot, offs_n, offs_k, nmask, kmask, sw_s, sw_n, ss_s, ss_n, MODE)
                acc_g += tl.dot(a, wg, input_precision="ieee")
                acc_u += tl.dot(a, wu, input_precision="ieee")
            if MODE == 1:  # fp8: one scale per output channel
                acc_g *= tl.load(gs_ptr + slot * ss_s + offs_n * ss_n, mask=nmask, other=0.0)[None, :]
                acc_u *= tl.load(us_ptr + slot * ss_s + offs_n * ss_n, mask=nmask, other=0.0)[None, :]
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            tl.store(inter_ptr + rows[:, None] * I + offs_n[None, :], h, mask=valid[:, None] & nmask[None, :])

    @triton.jit
    def _down_kernel(inter_ptr, d_ptr, ds_ptr, lut_ptr, w_ptr, out_ptr, sorted_ptr, bslot_ptr,
                     H, I, P, sw_s, sw_n, ss_s, ss_n,
                     MODE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        b, nb = tl.program_id(0), tl.program_id(1)
        slot = tl.load(bslot_ptr + b)
        if slot >= 0:
            rows = tl.load(sorted_ptr + b * BM + tl.arange(0, BM))
            valid = rows < P
            offs_n = nb * BN + tl.arange(0, BN)
            nmask = offs_n < H
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, I, BK):
                offs_k = k0 + tl.arange(0, BK)
                kmask = offs_k < I
                a = tl.load(inter_ptr + rows[:, None] * I + offs_k[None, :], mask=valid[:, None] & kmask[None, :],
                            other=0.0)
                wd = _load_w(d_ptr, ds_ptr, lut_ptr, slot, offs_n, offs_k, nmask, kmask, sw_s, sw_n, ss_s, ss_n, MODE)
                acc += tl.dot(a, wd, input_precision="ieee")
            if MODE == 1:
                acc *= tl.load(ds_ptr + slot * ss_s + offs_n * ss_n, mask=nmask, other=0.0)[None, :]
            acc *= tl.load(w_ptr + rows, mask=valid, other=0.0)[:, None]
            tl.store(out_ptr + rows[:, None] * H + offs_n[None, :], acc, mask=valid[:, None] & nmask[None, :])


def align_by_slot(slots: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [P] (-1 = skip) -> (sorted pair ids [bound] padded with P, slot of each block [bound / BM]).

    Every step is a device op (no .item()): pairs of slot s occupy a run starting at a multiple of BM."""
    P, dev = slots.numel(), slots.device
    key = torch.where(slots < 0, num_slots, slots).long()  # skipped pairs sort last, into a bucket with no blocks
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_slots + 1)[:num_slots]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    num_blocks = (P + num_slots * (block_m - 1)) // block_m + 1
    sorted_ids = torch.full((num_blocks * block_m,), P, dtype=torch.int64, device=dev)
    sk = key[order]
    ok = sk < num_slots
    s = sk.clamp(max=num_slots - 1)
    rank = torch.arange(P, device=dev) - start[s]
    pos = torch.where(ok, pad_start[s] + rank, num_blocks * block_m - 1)
    sorted_ids.scatter_(0, pos, torch.where(ok, order, P))
    ends = torch.cumsum(padded, 0)
    first = torch.arange(num_blocks, device=dev) * block_m
    bslot = torch.searchsorted(ends, first, right=True)
    bslot = torch.where(bslot < num_slots, bslot, -1).to(torch.int32)
    return sorted_ids, bslot


_TABLES: dict = {}


def _table(mode: int, device) -> torch.Tensor:
    """Decode table in device memory, built once per (format, device): e4m3fn bytes or e2m1 codes -> float32."""
    key = (mode, str(device))
    if key not in _TABLES:
        if mode == FP8:
            t = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        else:
            t = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        _TABLES[key] = t.to(device)
    return _TABLES[key]


def pool_mode(pool: dict[str, torch.Tensor]) -> int:
    if "gate_up" in pool:
        return FLOAT
    if "gate.weight_blocks" in pool:
        return MXFP4
    if "gate.weight" in pool and pool["gate.weight"].dtype == torch.float8_e4m3fn:
        scale = pool.get("gate.weight_scale")
        if scale is None or scale.dim() != 3 or scale.shape[-1] != 1:
            raise ValueError("triton fused MoE: fp8 pools need per-channel scales [S, out, 1] "
                             "(block-scaled fp8 is computed by the unfused path)")
        return FP8
    raise ValueError(f"triton fused MoE: no kernel for a pool with parts {sorted(pool)}")


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, slot_of: torch.Tensor,
              pool: dict[str, torch.Tensor], block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """sum_k weights[t,k] * FFN_{ids[t,k]}(x[t]) over the pairs whose expert has a slot; -> [T, H] in x.dtype.
    Pairs with slot_of[ids] == -1 contribute 0 (the caller computes them elsewhere and adds them)."""
    if triton is None:
        raise RuntimeError("the fused MoE kernel needs triton (pip install 'expertcache[cuda]')")
    T, H = x.shape
    K = ids.shape[1]
    mode = pool_mode(pool)
    if mode == FLOAT:
        gate_up, down = pool["gate_up"], pool["down"]
        S, I = gate_up.shape[0], gate_up.shape[1] // 2
        g, u, d = gate_up, gate_up[:, I:], down
        gs = us = dsc = torch.empty(1, device=x.device)
        sw, ss, sd, ssd = (gate_up.stride(0), gate_up.stride(1)), (0, 0), (down.stride(0), down.stride(1)), (0, 0)
    else:
        suffix = "weight_blocks" if mode == MXFP4 else "weight"
        sname = "weight_scales" if mode == MXFP4 else "weight_scale"
        g, u, d = (pool[f"{p}.{suffix}"] for p in ("gate", "up", "down"))
        if mode == FP8:
            g, u, d = (t.view(torch.uint8) for t in (g, u, d))
        gs, us, dsc = (pool[f"{p}.{sname}"] for p in ("gate", "up", "down"))
        S, I = g.shape[0], g.shape[1]
        sw, sd = (g.stride(0), g.stride(1)), (d.stride(0), d.stride(1))
        ss, ssd = (gs.stride(0), gs.stride(1)), (dsc.stride(0), dsc.stride(1))
    P = T * K
    slots = slot_of[ids.reshape(-1)].to(torch.int64)
    sorted_ids, bslot = align_by_slot(slots, S, block_m)
    lut = _table(mode, x.device)
    xc = x.contiguous()
    inter = torch.empty((P, I), dtype=torch.float32, device=x.device)
    grid = (bslot.numel(), triton.cdiv(I, block_n))
    _gate_up_kernel[grid](xc, g, u, gs, us, lut, inter, sorted_ids, bslot, H, I, K, P, xc.stride(0),
                          sw[0], sw[1], ss[0], ss[1], MODE=mode, BM=block_m, BN=block_n, BK=block_k)
    out_pairs = torch.zeros((P, H), dtype=torch.float32, device=x.device)
    w = weights.reshape(-1).to(torch.float32).contiguous()
    grid = (bslot.numel(), triton.cdiv(H, block_n))
    _down_kernel[grid](inter, d, dsc, lut, w, out_pairs, sorted_ids, bslot, H, I, P,
                       sd[0], sd[1], ssd[0], ssd[1], MODE=mode, BM=block_m, BN=block_n, BK=block_k)
    return out_pairs.view(T, K, H).sum(1).to(x.dtype)
