"""The Triton jit functions of the fused MoE (host side: triton_moe.py; the pool's parts: triton_pool.py).

Shape legend (as triton_moe.py): BM rows x BN outputs per program, BK inputs per step; P routed pairs,
R rows (the call's own pairs: those with a slot), NR rows allocated (R, or P when R is not known on the
host), H hidden, I moe intermediate. Rows are the call's pairs in slot order: `sorted` [blocks * BM]
holds row ids in runs of one slot (padding NR), `pair_of_row` [NR] each row's pair (token = pair // K).
`gate_up_kernel`: inter[row, n] = act(x[tok] W_gate[n]^T + bg, x[tok] W_up[n]^T + bu); `down_kernel`:
out_rows[row, n] = w_pair * (inter[row] W_down[n]^T + bd); `reduce_kernel`: out[t] += sum over k in
order of out_rows[row_of_pair[t * K + k]] (-1: not this call's), deterministic, no atomics. A program
whose block reads slot -1 (past the padded runs) exits. Constexpr FMT picks the tile decoder (`_tile`),
ACT the activation, DOT the dot's input dtype. Pair and token counts are not specialised on
(`do_not_specialize`): a new batch size compiles nothing.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: the CUDA install's extra
    triton = None

FLOAT, FP8, INT8, INT4, MXFP4 = range(5)  # FMT: how a weight tile is decoded
SILU, CLAMPED_SWIGLU = 0, 1  # ACT
DOT_FP32, DOT_BF16, DOT_FP16 = 0, 1, 2
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


if triton is not None:

    @triton.jit
    def slot_base(slot, stride):
        """Element offset of a slot: 64-bit, since a layer's pool part can pass 2^31 elements."""
        return slot.to(tl.int64) * stride

    @triton.jit
    def _tile_offsets(offs_n, offs_k, sbase, w_n, w_k, s_n, s_k, S_BN, S_BK, FMT: tl.constexpr):
        """Where a weight tile [BK, BN] lies in its slot: element offsets by output n and by input k
        (int4/mxfp4: of the byte holding code k, two to a byte), and each weight's scale index."""
        sidx = sbase + (offs_n[None, :] // S_BN) * s_n + (offs_k[:, None] // S_BK) * s_k
        wn = offs_n[None, :] * w_n
        if FMT >= 3:
            wk = (offs_k[:, None] // 2) * w_k
        else:
            wk = offs_k[:, None] * w_k
        return wn, wk, sidx

    @triton.jit
    def _tile(w_ptr, s_ptr, z_ptr, lut_ptr, wbase, wn, wk, sidx, offs_k, m, FMT: tl.constexpr):
        """Dequantised weight tile W[n, k] as float32 [BK, BN] (transposed for the dot): codes at
        wbase + wn + wk (`_tile_offsets`), scales (int4: and zero points) at sidx; m masks the tile."""
        if FMT == 0:
            w = tl.load(w_ptr + wbase + wn + wk, mask=m, other=0.0)
            return w.to(tl.float32)
        if FMT == 1:  # fp8 e4m3fn bytes through the 256-entry table
            byte = tl.load(w_ptr + wbase + wn + wk, mask=m, other=0)
            scale = tl.load(s_ptr + sidx, mask=m, other=0.0).to(tl.float32)
            return tl.load(lut_ptr + byte.to(tl.int32), mask=m, other=0.0) * scale
        if FMT == 2:  # int8 codes
            code = tl.load(w_ptr + wbase + wn + wk, mask=m, other=0)
            scale = tl.load(s_ptr + sidx, mask=m, other=0.0).to(tl.float32)
            return code.to(tl.float32) * scale
        # int4 / mxfp4: byte k // 2 of row n, low nibble first
        byte = tl.load(w_ptr + wbase + wn + wk, mask=m, other=0)
        code = (byte.to(tl.int32) >> ((offs_k[:, None] % 2) * 4)) & 0xF
        if FMT == 3:  # asymmetric int4: (code - zero) * scale
            scale = tl.load(s_ptr + sidx, mask=m, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + sidx, mask=m, other=0).to(tl.float32)
            return (code.to(tl.float32) - zero) * scale
        e = tl.load(s_ptr + sidx, mask=m, other=127).to(tl.float32)  # mxfp4: e2m1 times 2^(e8m0 - 127)
        return tl.load(lut_ptr + code, mask=m, other=0.0) * tl.exp2(e - 127.0)

    @triton.jit
    def _to_dot(t, DOT: tl.constexpr):
        # one return: compiled Triton refuses returns of different types, even in constexpr branches
        if DOT == 1:
            r = t.to(tl.bfloat16)
        elif DOT == 2:
            r = t.to(tl.float16)
        else:
            r = t.to(tl.float32)
        return r

    @triton.jit
    def _dot(a, b, acc, DOT: tl.constexpr):
        if DOT == 0:
            return acc + tl.dot(a, b, input_precision="ieee")
        return acc + tl.dot(a, b)

    @triton.jit
    def _activation(g, u, alpha, limit, ACT: tl.constexpr):
        """SiLU(g) * u; ACT 1 (GPT-OSS's clamped SwiGLU): (up + 1) * g * sigmoid(alpha * g), g <= limit,
        up in [-limit, limit]."""
        if ACT == 1:
            gc = tl.minimum(g, limit)
            uc = tl.maximum(tl.minimum(u, limit), -limit)
            h = (uc + 1.0) * (gc * tl.sigmoid(gc * alpha))
        else:
            h = g * tl.sigmoid(g) * u
        return h

    # The kernels' parameters in groups, one line each (triton_moe.launches passes them in this order):
    # tensors; the call's rows by slot (triton_moe.Alignment); sizes; the pool's layout (triton_moe._layout:
    # slot/row/column strides of codes, then of scales, the scale block, the bias strides); constexprs.
    @triton.jit(do_not_specialize=["NR"])
    def gate_up_kernel(
        x_ptr, gw_ptr, gs_ptr, gz_ptr, uw_ptr, us_ptr, uz_ptr, gb_ptr, ub_ptr, lut_ptr, inter_ptr,
        sorted_ptr, bslot_ptr, pair_ptr,
        H, I, TOPK, NR, sx_t,
        w_s, w_n, w_k, s_s, s_n, s_k, S_BN, S_BK, b_s, b_n,
        alpha, limit,  # clamped SwiGLU (ACT 1)
        FMT: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        b, nb = tl.program_id(0), tl.program_id(1)
        slot = tl.load(bslot_ptr + b)
        if slot >= 0:
            rows = tl.load(sorted_ptr + b * BM + tl.arange(0, BM))  # int64 row ids, NR = padding
            valid = rows < NR
            tok = tl.load(pair_ptr + rows, mask=valid, other=0) // TOPK
            offs_n = nb * BN + tl.arange(0, BN)
            nmask = offs_n < I
            wbase, sbase = slot_base(slot, w_s), slot_base(slot, s_s)
            acc_g = tl.zeros((BM, BN), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, H, BK):
                offs_k = k0 + tl.arange(0, BK)
                kmask = offs_k < H
                a = tl.load(
                    x_ptr + tok[:, None] * sx_t + offs_k[None, :],
                    mask=valid[:, None] & kmask[None, :],
                    other=0.0,
                )
                a = _to_dot(a, DOT)
                m = kmask[:, None] & nmask[None, :]
                wn, wk, sidx = _tile_offsets(offs_n, offs_k, sbase, w_n, w_k, s_n, s_k, S_BN, S_BK, FMT)
                wg = _tile(gw_ptr, gs_ptr, gz_ptr, lut_ptr, wbase, wn, wk, sidx, offs_k, m, FMT)
                wu = _tile(uw_ptr, us_ptr, uz_ptr, lut_ptr, wbase, wn, wk, sidx, offs_k, m, FMT)
                acc_g = _dot(a, _to_dot(wg, DOT), acc_g, DOT)
                acc_u = _dot(a, _to_dot(wu, DOT), acc_u, DOT)
            if HAS_BIAS:
                bbase = slot_base(slot, b_s)
                acc_g += tl.load(gb_ptr + bbase + offs_n * b_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
                acc_u += tl.load(ub_ptr + bbase + offs_n * b_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
            h = _activation(acc_g, acc_u, alpha, limit, ACT)
            tl.store(
                inter_ptr + rows[:, None] * I + offs_n[None, :],
                _to_dot(h, DOT),
                mask=valid[:, None] & nmask[None, :],
            )

    @triton.jit(do_not_specialize=["NR"])
    def down_kernel(
        inter_ptr, dw_ptr, ds_ptr, dz_ptr, db_ptr, lut_ptr, rw_ptr, out_ptr,
        sorted_ptr, bslot_ptr, pair_ptr,
        H, I, NR,
        w_s, w_n, w_k, s_s, s_n, s_k, S_BN, S_BK, b_s, b_n,
        FMT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        b, nb = tl.program_id(0), tl.program_id(1)
        slot = tl.load(bslot_ptr + b)
        if slot >= 0:
            rows = tl.load(sorted_ptr + b * BM + tl.arange(0, BM))
            valid = rows < NR
            pair = tl.load(pair_ptr + rows, mask=valid, other=0)
            offs_n = nb * BN + tl.arange(0, BN)
            nmask = offs_n < H
            wbase, sbase = slot_base(slot, w_s), slot_base(slot, s_s)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, I, BK):
                offs_k = k0 + tl.arange(0, BK)
                kmask = offs_k < I
                a = tl.load(
                    inter_ptr + rows[:, None] * I + offs_k[None, :],
                    mask=valid[:, None] & kmask[None, :],
                    other=0.0,
                )
                m = kmask[:, None] & nmask[None, :]
                wn, wk, sidx = _tile_offsets(offs_n, offs_k, sbase, w_n, w_k, s_n, s_k, S_BN, S_BK, FMT)
                wd = _tile(dw_ptr, ds_ptr, dz_ptr, lut_ptr, wbase, wn, wk, sidx, offs_k, m, FMT)
                acc = _dot(a, _to_dot(wd, DOT), acc, DOT)
            if HAS_BIAS:
                acc += tl.load(db_ptr + slot_base(slot, b_s) + offs_n * b_n, mask=nmask, other=0.0).to(
                    tl.float32
                )[None, :]
            acc *= tl.load(rw_ptr + pair, mask=valid, other=0.0)[:, None]  # the routing weight
            tl.store(out_ptr + rows[:, None] * H + offs_n[None, :], acc, mask=valid[:, None] & nmask[None, :])

    @triton.jit(do_not_specialize=["T"])
    def reduce_kernel(
        rows_ptr, row_of_pair_ptr, out_ptr, T, H, TOPK, so_t, BT: tl.constexpr, BH: tl.constexpr
    ):
        tb, hb = tl.program_id(0), tl.program_id(1)
        tok = tb * BT + tl.arange(0, BT)
        tmask = tok < T
        offs_h = hb * BH + tl.arange(0, BH)
        hmask = offs_h < H
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for k in range(TOPK):  # in order: the same sum every run
            r = tl.load(row_of_pair_ptr + tok.to(tl.int64) * TOPK + k, mask=tmask, other=-1)
            m = (r >= 0)[:, None] & hmask[None, :]
            acc += tl.load(rows_ptr + r[:, None] * H + offs_h[None, :], mask=m, other=0.0)
        o = out_ptr + tok[:, None].to(tl.int64) * so_t + offs_h[None, :]
        m = tmask[:, None] & hmask[None, :]
        prev = tl.load(o, mask=m, other=0.0).to(tl.float32)
        tl.store(o, (prev + acc).to(out_ptr.dtype.element_ty), mask=m)
else:
    slot_base = gate_up_kernel = down_kernel = reduce_kernel = None
