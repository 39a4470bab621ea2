"""Small layers: linear (with per-use conversion), RMSNorm (alone or fused with the residual add before it),
rotary embedding, the dense SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import hostmem, kernels
from ..kernels import small_ops
from ..quant import make_quant_method
from ..spec.model_config import ModelConfig, rope_inv_freq

CONVERT_ROWS = 4096  # rows of a stored-dtype weight converted at a time (bounded scratch memory)
DEQUANT_BYTES = 64 << 20  # float32 scratch of a quantized weight dequantized on the torch path (CUDA)


# formats a dense weight can be quantized to at load (`--lm-head`, `--dense`): QuantMethod name -> parameters
LOAD_FORMATS = {"int8": dict(group_size=128), "int4": dict(group_size=128)}


def load_quant_method(name: str, what: str = "lm_head"):
    """The QuantMethod of load-time format `name` for `what` (lm_head, or the dense projections)."""
    if name not in LOAD_FORMATS:
        raise ValueError(
            f"{what}: unknown format {name!r}; choose one of {sorted(LOAD_FORMATS)} (or omit it)"
        )
    return make_quant_method(name, **LOAD_FORMATS[name])


class QuantizedWeight:
    """A dense weight [out, in] quantized at load (e.g. `--lm-head int8`), or held in the blocks its GGUF
    file stores (`stored`): the QuantMethod's stored tensors, computed from by the CPU kernels (or
    dequantized per use on the torch path)."""

    def __init__(self, w: torch.Tensor, method, rows: int = 16384):
        chunks = [method.pack({"w.weight": w[i : i + rows].float()}) for i in range(0, w.shape[0], rows)]
        # row-wise formats: exact
        self._hold(method, {k: hostmem.cat([c[k] for c in chunks]) for k in chunks[0]}, tuple(w.shape))

    @classmethod
    def stored(cls, method, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> QuantizedWeight:
        """A weight [out, in] already in `method`'s stored layout, `parts` {"w.<suffix>": tensor} (e.g. a
        GGUF matrix's blocks as in the file, "w.weight" uint8 [out, row bytes]): held as given."""
        q = cls.__new__(cls)
        q._hold(method, parts, tuple(shape))
        return q

    def _hold(self, method, parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> None:
        self.method, self.shape, self.dtype, self.parts = method, shape, torch.int8, parts
        self.nbytes = sum(t.numel() * t.element_size() for t in self.parts.values())
        assert all(t.shape[0] == self.shape[0] for t in self.parts.values()), "linear slices the parts by row"
        self.spec = kernels.quant_weight_spec(
            method, self.parts, "w", self.shape
        )  # once: the parts never change

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype: the CPU kernels, else dequantized a block of rows at a
        time into one reused float32 buffer [rows, in] (DEQUANT_BYTES at most; never the whole matrix)."""
        y = kernels.quant_linear(x, self.spec)
        if y is not None:
            return y
        out_rows, in_dim = self.shape
        rows = dequant_rows(in_dim)
        xf = x.float()
        if out_rows <= rows:
            return self.method.linear(xf, self.parts, "w").to(x.dtype)
        out = torch.empty(*x.shape[:-1], out_rows, dtype=x.dtype, device=x.device)
        buf = torch.empty(rows, in_dim, dtype=torch.float32, device=x.device)
        for i in range(0, out_rows, rows):
            n = min(rows, out_rows - i)
            block = {k: t[i : i + n] for k, t in self.parts.items()}  # row-wise formats: rows i..i+n
            out[..., i : i + n] = self.method.linear(xf, block, "w", buf=buf[:n])
        return out


def dequant_rows(in_dim: int) -> int:
    """Rows of a load-time quantized weight dequantized at a time: its float32 block within DEQUANT_BYTES."""
    return max(1, DEQUANT_BYTES // (4 * in_dim))


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + b. A weight kept in a narrower stored dtype (bf16/fp16 dense weights on the CPU) is
    read by the C++ kernels as stored, or else converted to x's dtype a block of rows at a time: the
    result equals converting it whole, without the copy."""
    if isinstance(w, QuantizedWeight):
        y = w.linear(x)
        return y if b is None else y + b.to(y.dtype)
    if w.dtype == x.dtype:
        return F.linear(x, w, b)
    y = kernels.dense_linear(x, w)
    if y is not None:
        return y if b is None else y + b.to(y.dtype)
    if w.shape[0] <= CONVERT_ROWS:
        return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))
    out = torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype, device=x.device)
    for i in range(0, w.shape[0], CONVERT_ROWS):
        out[..., i : i + CONVERT_ROWS] = F.linear(x, w[i : i + CONVERT_ROWS].to(x.dtype))
    return out if b is None else out + b.to(x.dtype)


def kernel_spec(w: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> tuple | None:
    """The C++ kernel spec linear(x, w) computes with for x of `dtype` on the CPU (with the kernels in
    use), or None where linear takes a torch path: the same dispatch as linear's."""
    if isinstance(w, QuantizedWeight):
        return w.spec
    return None if w.dtype == dtype else kernels.dense_spec(w)


def _float32_router(w, dtype: torch.dtype) -> bool:
    """A float32 router weight for float32 x: linear leaves it to torch, the router functions to the kernels."""
    return isinstance(w, torch.Tensor) and w.dtype == dtype == torch.float32


def router_spec(w: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> tuple | None:
    """The kernel spec router_linear(x, w) computes with for x of `dtype` on the CPU, or None (torch):
    kernel_spec's, and a float32 weight (every GGUF file's router) for float32 x too, which linear leaves
    to torch's matmul (one thread inside a forward: the router's GEMV then costs as much as an expert)."""
    return kernels.dense_spec(w) if _float32_router(w, dtype) else kernel_spec(w, dtype)


def router_linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight, b: torch.Tensor | None = None):
    """x @ w.T + b for a router's projection: linear, except for the float32 weights router_spec sends
    to the kernels."""
    y = kernels.dense_linear(x, w) if _float32_router(w, x.dtype) else None
    if y is None:
        return linear(x, w, b)
    return y if b is None else y + b


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] normalised over its last dim, times weight [H] (the C++ kernel on CPU float32)."""
    y = small_ops.rms_norm(x, weight, eps)
    if y is not None:
        return y
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (s, rms_norm(s)) with s = h + d [..., H], a new tensor."""
    fused = small_ops.add_rms_norm(h, d, weight, eps)
    if fused is not None:
        return fused
    s = h + d
    return s, rms_norm(s, weight, eps)


class Rotary:
    """cos/sin for arbitrary positions: q/k [T, heads, D] rotated in the half-split convention (on the CPU in
    float32 gathered from a table of positions 0..n-1, the same values).
    Partial rotary: only the first R = cfg.rope_dim dims of each head rotate, the rest pass."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        inv, self.scale = rope_inv_freq(cfg)
        self.inv_freq = inv.to(device)
        self.dim = 2 * inv.numel()
        # cos/sin of the last positions tensor: every layer of one forward passes the same tensor
        # object, so they are computed once per forward, not once per layer
        self._last: tuple | None = None
        # float32 cos/sin [n, R] of positions 0..n-1 (n grown by doubling up to TABLE_POSITIONS): a
        # step's rows are gathered from them (2 ops, not ~10 run cold after the weights streamed)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    TABLE_POSITIONS = 16384  # at most 16384 x R x 8 bytes (8 MiB at R = 128); later positions are computed

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.tables(positions, q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, R] (contiguous, the rotary scale folded in) for positions [T]."""
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        # on the CPU only: reading the largest position back from a device would wait for it
        top = int(positions.max()) + 1 if positions.is_cpu and positions.numel() else self.TABLE_POSITIONS + 1
        if dtype == torch.float32 and top <= self.TABLE_POSITIONS:
            if self._table is None or self._table[0].shape[0] < top:
                n = min(self.TABLE_POSITIONS, max(1024, 1 << (top - 1).bit_length()))
                self._table = self._compute(torch.arange(n, device=self.inv_freq.device), dtype)
            cos, sin = (t.index_select(0, positions)[:, None, :] for t in self._table)
        else:
            cos, sin = (t[:, None, :] for t in self._compute(positions, dtype))
        self._last = (positions, dtype, cos, sin)  # holds `positions`: its id is not reused
        return cos, sin

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == self.dim:
            return x * cos + rotate_half(x) * sin
        r, rest = x[..., : self.dim], x[..., self.dim :]
        return torch.cat((r * cos + rotate_half(r) * sin, rest), dim=-1)


def deinterleave_rows(w: torch.Tensor, group: int, start: int, dim: int) -> torch.Tensor:
    """Rows of a projection whose output is groups of `group` values, rows start..start+dim of each
    group in interleaved rotary pairs (x0, x1), (x2, x3) ... reordered to half-split (x0, x2, ..., x1, x3, ...).
    Rotating the reordered vector half-split equals rotating the original pairwise (same dot products)."""
    perm = torch.arange(w.shape[0]).view(-1, group)
    seg = perm[:, start : start + dim]
    perm[:, start : start + dim] = torch.cat((seg[:, 0::2], seg[:, 1::2]), dim=1)
    return w[perm.reshape(-1)]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)
