"""Quant methods: how ONE expert's weight matrices are stored and computed.

A method turns float32 weights into stored tensors (`pack`), says how many
bytes they take (`nbytes`, weights + scales + zero points, so cache budgets
count real bytes), and turns them back (`dequantize`, `linear`). Methods are
chosen by name: `make_quant_method("int4", group_size=128)`.

Naming: an expert projection P is e.g. `gate_proj` / `up_proj` / `down_proj`
(or Mixtral `w1` / `w2` / `w3`). `pack` takes `{"P.weight": fp32 [out, in]}`;
keys ending in `.bias` are passed through unchanged, any other key is an error.
`dequantize` / `linear` take `name` = "P" (or "P.weight").

Stored layout per format (legend: out, in = weight dims; G = group size;
Bo x Bi = fp8 block; ceil division written c(a/b)):

  bf16 / fp16 / fp32
      P.weight        bfloat16 / float16 / float32   [out, in]
  fp8            (block-scaled, DeepSeek-V3 / Qwen3-FP8; block_size default 128)
      P.weight        float8_e4m3fn  [out, in]
      P.weight_scale  float32        [c(out/Bo), c(in/Bi)]   multiplier; a checkpoint's
                                                              `P.weight_scale_inv` is read as this
  fp8-channel    (compressed-tensors, strategy "channel")
      P.weight        float8_e4m3fn  [out, in]
      P.weight_scale  float32        [out, 1]
  fp8-tensor     (compressed-tensors, strategy "tensor")
      P.weight        float8_e4m3fn  [out, in]
      P.weight_scale  float32        [1]        ([] is accepted on read)
  int8           (symmetric; group_size default 128, ragged last group allowed)
      P.weight        int8           [out, in]
      P.weight_scale  float32        [out, c(in/G)]
  int4           (asymmetric, integer zero points; group_size default 128; in even)
      P.weight        uint8          [out, in/2]   two codes per byte, low nibble first
      P.weight_scale  float32        [out, c(in/G)]
      P.weight_zero   uint8          [out, c(in/G)]
  mxfp4          (OCP MX, GPT-OSS layout; in % 32 == 0)
      P.weight_blocks uint8          [out, in/32, 16]
      P.weight_scales uint8          [out, in/32]   e8m0

The concrete formats live in `methods.py` (imported by the package, so the
registry is always filled). Invariants: `nbytes(shape) == sum of the packed tensors' bytes`; `layout`
lists exactly the tensors `pack` produces; `dequantize` validates presence,
dtype and shape of every tensor it reads and raises ValueError naming it.
Scales read from checkpoints may be any float dtype (computed in float32);
fp8 weights may also arrive as their raw uint8 bytes.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping, NamedTuple

import torch

Shape = tuple[int, int]


class TensorSpec(NamedTuple):
    """Shape and dtype of one stored tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


QUANT_METHODS: dict[str, type["QuantMethod"]] = {}


def register(name: str) -> Callable[[type["QuantMethod"]], type["QuantMethod"]]:
    def deco(cls: type["QuantMethod"]) -> type["QuantMethod"]:
        cls.name = name
        QUANT_METHODS[name] = cls
        return cls

    return deco


def make_quant_method(name: str, **params: Any) -> "QuantMethod":
    """Build the method registered as `name` with its parameters
    (`block_size` for fp8, `group_size` for int8/int4; others take none)."""
    if name not in QUANT_METHODS:
        raise ValueError(f"unknown quant format {name!r}; choose one of {sorted(QUANT_METHODS)}")
    cls = QUANT_METHODS[name]
    unknown = set(params) - set(cls.params)
    if unknown:
        accepted = ", ".join(cls.params) or "none"
        raise ValueError(
            f"quant format {name!r} does not take {sorted(unknown)}; accepted parameters: {accepted}"
        )
    return cls(**params)


def proj_name(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def is_float_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class QuantMethod:
    """Base class. Subclasses define `_layout`, `_quantize`, `_shape_of`, `_dequant`."""

    name: ClassVar[str] = "?"
    params: ClassVar[tuple[str, ...]] = ()
    primary: ClassVar[str] = "weight"  # stored suffix that determines [out, in]
    primary_ndim: ClassVar[int] = 2
    aliases: ClassVar[dict[str, str]] = {}  # stored suffix -> alternative checkpoint suffix

    # ---- per-format hooks -------------------------------------------------
    def _layout(self, shape: Shape) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _shape_of(self, primary: torch.Tensor) -> Shape:
        return tuple(primary.shape)  # type: ignore[return-value]

    def _dequant(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _accepts(self, suffix: str, spec: TensorSpec, t: torch.Tensor, shape: Shape) -> bool:
        """Whether stored tensor `t` matches `spec` for a weight of `shape` (subclasses may widen)."""
        if tuple(t.shape) != spec.shape:
            return False
        if is_float_dtype(spec.dtype) and suffix != "weight":
            return is_float_dtype(t.dtype)
        return t.dtype == spec.dtype

    def _shape_hint(self, shape: Shape) -> str:
        return ""

    def shape_hint(self, shape: Shape) -> str:
        """What in the checkpoint's config sets the stored shapes of a weight of `shape` ("" if nothing)."""
        return self._shape_hint(shape)

    # ---- public API -------------------------------------------------------
    def layout(self, name: str, shape: Shape) -> dict[str, TensorSpec]:
        """Stored tensors `{"P.suffix": TensorSpec}` for projection `name` of weight `shape` [out, in]."""
        p = proj_name(name)
        return {f"{p}.{k}": v for k, v in self._layout(self._check_shape(shape)).items()}

    def nbytes(self, shape: Shape) -> int:
        """Stored bytes (values + scales + zero points) of one weight of `shape` [out, in]."""
        return sum(s.nbytes for s in self._layout(self._check_shape(shape)).values())

    def pack(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`{"P.weight": float [out, in], "P.bias"?: ...}` -> stored tensors (see module legend)."""
        stored: dict[str, torch.Tensor] = {}
        for key, w in weights.items():
            if key.endswith(".bias"):
                stored[key] = w
                continue
            if not key.endswith(".weight"):
                raise ValueError(
                    f"cannot pack {key!r}: expected keys 'P.weight' (or 'P.bias' passed through)"
                )
            if w.dim() != 2 or not w.is_floating_point():
                raise ValueError(
                    f"{key}: expected a 2-D float weight [out, in], got {w.dtype} {list(w.shape)}"
                )
            self._check_shape(tuple(w.shape), key)
            if not bool(torch.isfinite(w).all()):
                raise ValueError(
                    f"{key}: weight has NaN or inf values; refusing to quantize it to {self.name}"
                )
            p = proj_name(key)
            for suffix, t in self._quantize(w.detach().to(torch.float32)).items():
                stored[f"{p}.{suffix}"] = t.contiguous()
        return stored

    def dequantize(
        self, stored: Mapping[str, torch.Tensor], name: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Stored tensors of projection `name` -> float32 [out, in].

        With `out` (contiguous float32 [out, in], e.g. a reusable buffer) the
        result is written there and `out` is returned.
        """
        parts, shape = self._gather(stored, proj_name(name))
        if out is None:
            device = parts[self.primary].device
            out = torch.empty(shape, dtype=torch.float32, device=device)
        elif tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(
                f"out buffer for {proj_name(name)} must be contiguous float32 {list(shape)}, "
                f"got {out.dtype} {list(out.shape)}{'' if out.is_contiguous() else ' (non-contiguous)'}"
            )
        return self._dequant(parts, out)

    def linear(
        self, x: torch.Tensor, stored: Mapping[str, torch.Tensor], name: str, buf: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x float32 [T, in] -> x @ W^T float32 [T, out] (dequantize into `buf`, then matmul)."""
        w = self.dequantize(stored, name, out=buf)
        if x.shape[-1] != w.shape[1]:
            raise ValueError(
                f"{proj_name(name)}: input has {x.shape[-1]} features, weight expects {w.shape[1]}"
            )
        return torch.nn.functional.linear(x.to(torch.float32), w)

    # ---- validation -------------------------------------------------------
    def _check_shape(self, shape: tuple[int, ...], key: str = "weight") -> Shape:
        if len(shape) != 2 or min(shape) < 1:
            raise ValueError(f"{key}: expected a 2-D weight shape [out, in], got {list(shape)}")
        return (int(shape[0]), int(shape[1]))

    def _lookup(self, stored: Mapping[str, torch.Tensor], p: str, suffix: str) -> torch.Tensor:
        key = f"{p}.{suffix}"
        if key in stored:
            return stored[key]
        alias = self.aliases.get(suffix)
        if alias and f"{p}.{alias}" in stored:
            return stored[f"{p}.{alias}"]
        have = sorted(k for k in stored if k.startswith(f"{p}."))
        wanted = f"{key}" + (f" (or {p}.{alias})" if alias else "")
        raise ValueError(
            f"missing {wanted} for quant format {self.name!r}; stored tensors for {p}: {have or 'none'}"
        )

    def _gather(self, stored: Mapping[str, torch.Tensor], p: str) -> tuple[dict[str, torch.Tensor], Shape]:
        primary = self._lookup(stored, p, self.primary)
        shape = self._shape_of_checked(primary, p)
        parts = {}
        for suffix, spec in self._layout(shape).items():
            t = primary if suffix == self.primary else self._lookup(stored, p, suffix)
            if not self._accepts(suffix, spec, t, shape):
                hint = self._shape_hint(shape)
                raise ValueError(
                    f"{p}.{suffix} is {t.dtype} {list(t.shape)} but quant format {self.name!r} expects "
                    f"{spec.dtype} {list(spec.shape)} for a weight of shape {list(shape)}{hint}"
                )
            parts[suffix] = t
        return parts, shape

    def _shape_of_checked(self, primary: torch.Tensor, p: str) -> Shape:
        if primary.dim() != self.primary_ndim:
            raise ValueError(
                f"{p}.{self.primary} must be {self.primary_ndim}-D for quant format {self.name!r}, "
                f"got {primary.dtype} {list(primary.shape)}"
            )
        return self._shape_of(primary)
