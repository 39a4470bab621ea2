"""Writers of GPTQ, AWQ and compressed-tensors pack-quantized checkpoints, from the formats' documentation
(AutoGPTQ / GPTQModel, AutoAWQ's GEMM packer, compressed-tensors' pack_to_int32), independent of the
engine's readers: quantize a float weight group-wise, pack the integer codes into int32 words, and
keep the dequantized weight the stored codes stand for (the reference).

Legend: N out, K in, b bits, p = 32 // b codes per word, G group size, ng groups.
    codes  int64 [N, K] unsigned codes    zero int64 [N, ng]    scale [N, ng] (the stored float dtype)
    group  int64 [K]    group of every input column (act-order: not contiguous)
    reference w[n, k] = (codes[n, k] - zero[n, group[k]]) * float(scale[n, group[k]])
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import checkpoints
import torch
from safetensors.torch import save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: position i of a word holds column order[i]


def quantize(w: torch.Tensor, bits: int, group: torch.Tensor, sym: bool, scale_dtype=torch.float16):
    """w fp32 [N, K] -> (codes, zero, scale, reference) for the column groups `group` [K]."""
    N, K = w.shape
    ng = int(group.max()) + 1
    qmax, mid = (1 << bits) - 1, 1 << (bits - 1)
    zero = torch.zeros(N, ng, dtype=torch.int64)
    scale = torch.zeros(N, ng)
    for g in range(ng):
        cols = w[:, group == g]
        if sym:
            s = cols.abs().amax(dim=1) / (mid - 1)
            z = torch.full((N,), mid)
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            s = (hi - lo) / qmax
            z = torch.round(-lo / s).clamp(1, qmax).long()  # >= 1: GPTQ v1 stores zero - 1 unsigned
        scale[:, g], zero[:, g] = s, z
    scale = scale.clamp(min=1e-4).to(scale_dtype)
    s = scale.float()[:, group]
    codes = (torch.round(w / s) + zero[:, group]).clamp(0, qmax).long()
    reference = (codes - zero[:, group]).float() * s
    return codes, zero, scale, reference


def words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [..., m * p] -> int32 words [..., m], code i of a word at bits [i*b, (i+1)*b)."""
    p = 32 // bits
    c = codes.reshape(*codes.shape[:-1], -1, p).long()
    x = sum(c[..., i] << (bits * i) for i in range(p))
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def contiguous_groups(K: int, G: int) -> torch.Tensor:
    return torch.arange(K) // (K if G == -1 else G)


def act_order_groups(K: int, G: int, seed: int) -> torch.Tensor:
    """GPTQ desc_act: columns quantized in a permuted order, group i // G of the i-th one."""
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(seed))
    g = torch.empty(K, dtype=torch.int64)
    g[perm] = torch.arange(K) // G
    return g


# ---- one linear in each layout: (stored tensors {suffix: tensor}, reference weight) ----------------------


def gptq(w, bits=4, group_size=128, sym=False, desc_act=False, v2=False, seed=0):
    N, K = w.shape
    G = K if group_size == -1 else group_size
    group = act_order_groups(K, G, seed) if desc_act else contiguous_groups(K, G)
    codes, zero, scale, ref = quantize(w, bits, group, sym)
    stored_zero = zero if v2 else zero - 1
    return {
        "qweight": words(codes, bits).T.contiguous(),  # [K/p, N]: packed along the input dim
        "qzeros": words(stored_zero.T.contiguous(), bits),  # [ng, N/p]
        "scales": scale.T.contiguous(),  # [ng, N] fp16
        "g_idx": group.to(torch.int32),
    }, ref


def awq(w, group_size=128):
    N, K = w.shape
    codes, zero, scale, ref = quantize(w, 4, contiguous_groups(K, group_size), sym=False)

    def interleaved(c):  # [rows, N] -> words [rows, N/8], each word's 8 columns in AWQ's order
        return words(c.reshape(c.shape[0], -1, 8)[..., AWQ_PACK_ORDER].reshape(c.shape[0], -1), 4)

    return {
        "qweight": interleaved(codes.T.contiguous()),
        "qzeros": interleaved(zero.T.contiguous()),
        "scales": scale.T.contiguous(),
    }, ref


def pack_quantized(w, bits=4, group_size=128, symmetric=True):
    """compressed-tensors: signed values + 2^(b-1) packed along the input dim (zero points along the output)."""
    N, K = w.shape
    codes, zero, scale, ref = quantize(w, bits, contiguous_groups(K, group_size), symmetric, torch.bfloat16)
    out = {"weight_packed": words(codes, bits), "weight_scale": scale}
    if not symmetric:
        out["weight_zero_point"] = words(zero.T.contiguous(), bits).T.contiguous()  # [N/p, ng]
    out["weight_shape"] = torch.tensor([N, K], dtype=torch.int64)
    return out, ref


PACKERS = {"gptq": gptq, "awq": awq, "compressed-tensors": pack_quantized}

EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj$")
ATTN = re.compile(r"\.self_attn\.[qkvo]_proj$")


def write(
    base: Path, dst: Path, fmt: str, qconfig: dict, params: dict, targets=(EXPERT, ATTN), params_for=None
) -> tuple[Path, Path]:
    """Checkpoint `base` with every module matching `targets` packed by PACKERS[fmt](w, **params) (or
    params_for(module) -> params / None to leave it), -> (quantized dir, its dequantized fp32 twin)."""
    tensors = checkpoints.read_tensors(base)
    quant, twin = {}, {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        p = params if params_for is None else params_for(module)
        if name.endswith(".weight") and p is not None and any(r.search(module) for r in targets):
            stored, ref = PACKERS[fmt](t.float(), **p)
            quant.update({f"{module}.{k}": v for k, v in stored.items()})
            twin[name] = ref
        else:
            quant[name] = t
            twin[name] = t.float()
    hf = json.loads((base / "config.json").read_text())
    out = []
    for d, ts, conf in (
        (dst, quant, {**hf, "quantization_config": qconfig}),
        (dst.with_name(dst.name + "-twin"), twin, {**hf, "dtype": "float32"}),
    ):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        save_file(
            {k: v.contiguous() for k, v in ts.items()},
            str(d / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (d / "config.json").write_text(json.dumps(conf, indent=2))
        for f in base.iterdir():
            if (
                f.is_file()
                and f.suffix != ".safetensors"
                and f.name not in ("config.json", "model.safetensors.index.json")
            ):
                shutil.copy(f, d / f.name)
        out.append(d)
    return out[0], out[1]
