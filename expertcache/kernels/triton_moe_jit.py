"""The Triton jit functions of the fused MoE (host side: triton_moe.py; the pool's parts: triton_pool.py).

Shape legend (as triton_moe.py): BM rows x BN outputs per program, BK inputs per step; P routed pairs,
R rows (the call's own pairs: those with a slot), NR rows allocated (R, or P when R is not known on the
host), H hidden, I moe intermediate. Rows are the call's pairs in slot order: `sorted` [blocks * BM]
holds row ids in runs of one slot (padding NR), `pair_of_row` [NR] each row's pair (token = pair // K).
`gate_up_kernel`: inter[row, n] = act(x[tok] W_gate[n]^T + bg, x[tok] W_up[n]^T + bu); `down_kernel`:
out_rows[row, n] = w_pair * (inter[row] W_down[n]^T + bd); `reduce_kernel`: out[t] += sum over k in
order of out_rows[row_of_pair[t * K + k]] (-1: not this call's), deterministic, no atomics. A program
whose block reads slot -1 (past the padded runs) exits. Constexpr FMT picks the tile decoder (`_tile`;
the gate_up and down launches each have their own), ACT the activation, DOT the dot's input dtype.
GGUF weights (FMT 5-13) are read in the slot's bytes as the file stores them: row n of a projection is
its blocks (quant/ggml_blocks.py has the layouts), and a tile's element (k, n) decodes from block k // QK
of row n, place k % QK (`_gguf_tile`, one helper per type), so any BK reads any type. Pair and token
counts are not specialised on (`do_not_specialize`): a new batch size compiles nothing.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: the CUDA install's extra
    triton = None

FLOAT, FP8, INT8, INT4, MXFP4 = range(5)  # FMT: how a weight tile is decoded
Q8_0, Q4_0, Q5_0, IQ4_NL, GGUF_MXFP4, Q4_K, Q5_K, Q6_K, IQ4_XS = range(5, 14)  # GGUF blocks in place
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
        (int4/mxfp4: of the byte holding code k, two to a byte; GGUF: column k itself, the decoder finds
        its block), and each weight's scale index."""
        sidx = sbase + (offs_n[None, :] // S_BN) * s_n + (offs_k[:, None] // S_BK) * s_k
        wn = offs_n[None, :] * w_n
        if FMT >= 5:
            wk = offs_k[:, None]
        elif FMT >= 3:
            wk = (offs_k[:, None] // 2) * w_k
        else:
            wk = offs_k[:, None] * w_k
        return wn, wk, sidx

    # GGUF blocks, read where they lie (layouts: quant/ggml_blocks.py). Each helper takes `row` [1, BN] (the
    # byte pointer of each output row's first block), `k` [BK, 1] (the input column) and the mask, and
    # returns the float32 values [BK, BN] the reference decoder gives (its products in its order).
    @triton.jit
    def _byte(p, m):
        return tl.load(p, mask=m, other=0).to(tl.int32)

    @triton.jit
    def _f16(p, m):
        """The little-endian fp16 at byte p (two byte loads: no alignment assumed)."""
        bits = _byte(p, m) | (_byte(p + 1, m) << 8)
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _nibble(qs, j, m):
        """Code j (0..31) of the 16 bytes of 4-bit codes at qs, Q4_0's order: byte j % 16, low nibble
        for j < 16."""
        return (_byte(qs + j % 16, m) >> ((j // 16) * 4)) & 0xF

    @triton.jit
    def _q8_0(row, k, m):
        """Q8_0, 34 bytes: d f16 | q int8[32]; x = d * q."""
        b = row + (k // 32) * 34
        q = tl.load(b + 2 + k % 32, mask=m, other=0).to(tl.int8, bitcast=True)
        return _f16(b, m) * q.to(tl.float32)

    @triton.jit
    def _q4_0(row, k, m):
        """Q4_0, 18 bytes: d f16 | qs[16]; x = d * (nibble - 8)."""
        b = row + (k // 32) * 18
        return _f16(b, m) * (_nibble(b + 2, k % 32, m) - 8).to(tl.float32)

    @triton.jit
    def _q5_0(row, k, m):
        """Q5_0, 22 bytes: d f16 | qh u32 | qs[16]; x = d * (nibble + 16 * bit j of qh - 16)."""
        b = row + (k // 32) * 22
        j = k % 32
        high = (_byte(b + 2 + j // 8, m) >> (j % 8)) & 1
        return _f16(b, m) * ((_nibble(b + 6, j, m) | (high << 4)) - 16).to(tl.float32)

    @triton.jit
    def _iq4_nl(row, k, m, lut_ptr):
        """IQ4_NL, 18 bytes: d f16 | qs[16]; x = d * KV_IQ4[nibble] (the table at lut_ptr)."""
        b = row + (k // 32) * 18
        return _f16(b, m) * tl.load(lut_ptr + _nibble(b + 2, k % 32, m), mask=m, other=0.0)

    @triton.jit
    def _mxfp4_gguf(row, k, m, lut_ptr):
        """GGUF MXFP4, 17 bytes: e e8m0 | qs[16] (Q4_0's order); x = KV_MXFP4[nibble] * 2^(e - 128), the
        power of two built from its bits as the reference does (subnormal below e = 2)."""
        b = row + (k // 32) * 17
        e = _byte(b, m)
        scale = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        return tl.load(lut_ptr + _nibble(b + 1, k % 32, m), mask=m, other=0.0) * scale

    @triton.jit
    def _k_sub(b, sub, q, m):
        """Q4_K / Q5_K: code q of sub-block sub (0..7) of the block at b -> d * sc * q - dmin * mn, with the
        6-bit sc and mn packed in scales[12] at b + 4: sub < 4 in the low 6 bits of bytes sub (sc) and
        sub + 4 (mn); sub >= 4 in the nibbles of byte sub + 4, their top 2 bits those of bytes sub - 4
        (sc) and sub (mn)."""
        i = sub % 4
        s0, s1, s2 = _byte(b + 4 + i, m), _byte(b + 8 + i, m), _byte(b + 12 + i, m)
        low = sub < 4
        sc = tl.where(low, s0 & 63, (s2 & 0xF) | ((s0 >> 6) << 4)).to(tl.float32)
        mn = tl.where(low, s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)).to(tl.float32)
        return (_f16(b, m) * sc) * q.to(tl.float32) - _f16(b + 2, m) * mn

    @triton.jit
    def _q4_k(row, k, m):
        """Q4_K, 144 bytes: d f16 | dmin f16 | scales[12] | qs[128]; 8 sub-blocks of 32 (`_k_sub`); 32-byte
        chunk c of qs holds sub-block 2c in its low nibbles, 2c + 1 in its high ones."""
        b = row + (k // 256) * 144
        j = k % 256
        sub = j // 32
        q = (_byte(b + 16 + (j // 64) * 32 + j % 32, m) >> ((sub % 2) * 4)) & 0xF
        return _k_sub(b, sub, q, m)

    @triton.jit
    def _q5_k(row, k, m):
        """Q5_K, 176 bytes: d | dmin | scales[12] | qh[32] | qs[128]; Q4_K's codes plus bit sub of qh[j % 32]
        as the fifth."""
        b = row + (k // 256) * 176
        j = k % 256
        sub = j // 32
        q = (_byte(b + 48 + (j // 64) * 32 + j % 32, m) >> ((sub % 2) * 4)) & 0xF
        high = (_byte(b + 16 + j % 32, m) >> sub) & 1
        return _k_sub(b, sub, q | (high << 4), m)

    @triton.jit
    def _q6_k(row, k, m):
        """Q6_K, 210 bytes: ql[128] | qh[64] | scales int8[16] | d f16; x = d * scales[j // 16] * (q - 32).
        Element j = 128 h + 32 c + l (c 0..3): low 4 bits of q in ql[64 h + 32 (c % 2) + l] (low nibble
        for c < 2), top 2 in bits 2c of qh[32 h + l]."""
        b = row + (k // 256) * 210
        j = k % 256
        h, c, l = j // 128, (j // 32) % 4, j % 32
        low = (_byte(b + 64 * h + 32 * (c % 2) + l, m) >> ((c // 2) * 4)) & 0xF
        high = (_byte(b + 128 + 32 * h + l, m) >> (2 * c)) & 3
        sc = tl.load(b + 192 + j // 16, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return (_f16(b + 208, m) * sc) * ((low | (high << 4)) - 32).to(tl.float32)

    @triton.jit
    def _iq4_xs(row, k, m, lut_ptr):
        """IQ4_XS, 136 bytes: d f16 | scales_h u16 | scales_l[4] | qs[128]; 8 sub-blocks of 32, a 6-bit
        scale each (low 4 bits: nibble sub % 2 of scales_l[sub // 2]; top 2: bits 2 sub of scales_h);
        x = d * (scale - 32) * KV_IQ4[nibble], sub-block sub's codes in the 16 bytes at 8 + 16 sub
        (Q4_0's order)."""
        b = row + (k // 256) * 136
        j = k % 256
        sub = j // 32
        lo = (_byte(b + 4 + sub // 2, m) >> ((sub % 2) * 4)) & 0xF
        hi = (_byte(b + 2 + sub // 4, m) >> ((sub % 4) * 2)) & 3
        dl = _f16(b, m) * ((lo | (hi << 4)) - 32).to(tl.float32)
        return dl * tl.load(lut_ptr + _nibble(b + 8 + 16 * sub, j % 32, m), mask=m, other=0.0)

    @triton.jit
    def _gguf_tile(row, k, m, lut_ptr, FMT: tl.constexpr):
        """The GGUF tile decoder of FMT (5-13, Q8_0 .. IQ4_XS)."""
        if FMT == 5:
            return _q8_0(row, k, m)
        if FMT == 6:
            return _q4_0(row, k, m)
        if FMT == 7:
            return _q5_0(row, k, m)
        if FMT == 8:
            return _iq4_nl(row, k, m, lut_ptr)
        if FMT == 9:
            return _mxfp4_gguf(row, k, m, lut_ptr)
        if FMT == 10:
            return _q4_k(row, k, m)
        if FMT == 11:
            return _q5_k(row, k, m)
        if FMT == 12:
            return _q6_k(row, k, m)
        return _iq4_xs(row, k, m, lut_ptr)

    @triton.jit
    def _tile(w_ptr, s_ptr, z_ptr, lut_ptr, wbase, wn, wk, sidx, offs_k, m, FMT: tl.constexpr):
        """Dequantised weight tile W[n, k] as float32 [BK, BN] (transposed for the dot): codes at
        wbase + wn + wk (`_tile_offsets`), scales (int4: and zero points) at sidx; m masks the tile.
        GGUF: the row's blocks from wbase + wn, column wk."""
        if FMT >= 5:
            return _gguf_tile(w_ptr + wbase + wn, wk, m, lut_ptr, FMT)
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
