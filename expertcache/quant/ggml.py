"""GGUF's block formats as QuantMethods: a weight kept in the bytes llama.cpp wrote.

Stored layout per projection P (out, in = weight dims; QK = elements per block, BB = bytes per block;
in % QK == 0):
    P.weight   uint8  [out, (in // QK) * BB]   row o = the blocks of row o exactly as in the file

    name          QK   BB   (block layout: quant/ggml_blocks.py)
    gguf-q4_0     32   18
    gguf-q5_0     32   22
    gguf-q8_0     32   34
    gguf-iq4_nl   32   18
    gguf-mxfp4    32   17
    gguf-q4_k    256  144
    gguf-q5_k    256  176
    gguf-q6_k    256  210
    gguf-iq4_xs  256  136

Routed experts whose types differ between layers (llama-quantize's Q4_K_M: ffn_down_exps Q6_K in some
layers, Q4_K in others; UD files) are method "gguf-layers" (`GGMLLayers`): a part is keyed by its type,
    P.<type>   uint8  [out, (in // QK) * BB]   e.g. "down.q6_k": the same bytes, the key naming the format
so a layer's pool says how to read it and one method computes every layer (`block_method`);
`GGMLLayers.for_layer(types)` is the method whose `layout` gives one layer's parts. Experts of a type no
kernel reads (Q2_K, Q3_K, Q4_1, Q5_1, IQ2/IQ3/IQ1, TQ) are gguf-layers too; their tiers hold another
format (`tier_type`, `to_tier`): Q3_K repacked to Q6_K blocks of the same values, the others
dequantized to F32 ("P.f32" float32 [out, in], exact).

A GGUF tensor [in, out] (ggml dims) is already this layout, and each expert of a stacked
`blk.N.ffn_*_exps` [in, out, E] is one contiguous [out, row bytes] range of it, so every tier holds an
expert in exactly its file bytes. `dequantize` decodes in vectorised torch (float32, the reference's
values); `linear` dequantizes then multiplies (the C++ kernels read these bytes directly); `pack`
quantizes where the encoder is simple (Q8_0, Q4_0: ggml's reference rounding), else refuses.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .ggml_blocks import BY_NAME, DECODERS, METHODS, method_name, q3_k_as_q6_k
from .method import QUANT_METHODS, QuantMethod, Shape, TensorSpec, proj_name, register
from .methods import FP32


class GGMLBlocks(QuantMethod):
    """Base: one ggml block type (`type_name`) stored row by row as raw bytes."""

    type_name: ClassVar[str]

    @property
    def qk(self) -> int:
        return BY_NAME[self.type_name].block

    @property
    def block_bytes(self) -> int:
        return BY_NAME[self.type_name].block_bytes

    def _check_shape(self, shape: tuple[int, ...], key: str = "weight") -> Shape:
        out, in_ = super()._check_shape(shape, key)
        if in_ % self.qk:
            raise ValueError(
                f"{key}: {self.name} needs an input dim that is a multiple of {self.qk}, got {list(shape)}"
            )
        return out, in_

    def _layout(self, shape: Shape) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec((shape[0], shape[1] // self.qk * self.block_bytes), torch.uint8)}

    def _shape_of(self, primary: torch.Tensor) -> Shape:
        if primary.shape[1] % self.block_bytes:
            raise ValueError(
                f"{self.name}: stored rows of {primary.shape[1]} bytes are not whole "
                f"{self.block_bytes}-byte blocks"
            )
        return (primary.shape[0], primary.shape[1] // self.block_bytes * self.qk)

    def _dequant(self, parts: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        blocks = parts["weight"].contiguous().view(-1, self.block_bytes)
        return out.copy_(DECODERS[self.type_name](blocks).view(out.shape))

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        raise ValueError(
            f"{self.name}: no quantiser here (weights in this format are read from GGUF files); "
            "pack supports gguf-q8_0 and gguf-q4_0"
        )


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C roundf: halves away from zero (torch.round rounds them to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(-1, 32)


def _with_d(d: torch.Tensor, qs: torch.Tensor, rows: int) -> torch.Tensor:
    """d float32 [N, 1] (stored as f16) + qs uint8 [N, B] -> uint8 [rows, N / rows * (2 + B)]."""
    return torch.cat((d.to(torch.float16).view(torch.uint8), qs), dim=1).reshape(rows, -1)


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """float [out, in] -> Q8_0 rows (ggml's reference: d = amax / 127, q = roundf(x / d))."""
    x = _blocks(w.float())
    d = x.abs().amax(dim=1, keepdim=True) / 127
    q = torch.where(d == 0, torch.zeros_like(x), _roundf(x / torch.where(d == 0, 1, d)))
    return _with_d(d, q.to(torch.int8).view(torch.uint8), w.shape[0])


def quantize_q4_0(w: torch.Tensor) -> torch.Tensor:
    """float [out, in] -> Q4_0 rows (ggml's reference: d = the signed amax / -8, q = trunc(x / d + 8.5))."""
    x = _blocks(w.float())
    peak = torch.gather(x, 1, x.abs().argmax(dim=1, keepdim=True))
    d = peak / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, 1, d))
    q = torch.trunc(x * inv + 8.5).clamp(0, 15).to(torch.uint8)
    return _with_d(d, q[:, :16] | (q[:, 16:] << 4), w.shape[0])


_ENCODERS = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0}


def _method(type_name: str) -> type[GGMLBlocks]:
    attrs: dict = {"type_name": type_name, "__doc__": f"ggml {type_name} blocks, as stored in GGUF."}
    if type_name in _ENCODERS:
        enc = _ENCODERS[type_name]
        attrs["_quantize"] = lambda self, w: {"weight": enc(w)}
    cls = type(f"GGUF_{type_name}", (GGMLBlocks,), attrs)
    return register(method_name(type_name))(cls)


GGUF_METHODS: dict[str, type[GGMLBlocks]] = {t: _method(t) for t in METHODS}


class GGMLMixed(QuantMethod):
    """Routed experts whose projections differ in block type (e.g. gate/up Q4_K, down Q6_K): each
    projection P is stored and computed by `projections[P]` (a GGMLBlocks method), its layout unchanged.
    Registered per combination as "gguf-mixed:<gate>,<up>,<down>" (`mixed_method`); a kernel spec for it
    takes `projections[proj]`'s."""

    projections: ClassVar[dict[str, GGMLBlocks]]

    def sub(self, name: str) -> GGMLBlocks:
        p = name.split(".", 1)[0]
        if p not in self.projections:
            raise ValueError(f"{self.name}: no projection {p!r} (have {sorted(self.projections)})")
        return self.projections[p]

    def layout(self, name: str, shape: Shape) -> dict[str, TensorSpec]:
        return self.sub(name).layout(name, shape)

    def nbytes(self, shape: Shape) -> int:
        raise ValueError(f"{self.name}: bytes depend on the projection; use layout(name, shape)")

    def pack(self, weights):
        raise ValueError(f"{self.name}: no quantiser here (weights in this format are read from GGUF files)")

    def dequantize(self, stored, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.sub(name).dequantize(stored, name, out)

    def linear(self, x, stored, name: str, buf: torch.Tensor | None = None) -> torch.Tensor:
        return self.sub(name).linear(x, stored, name, buf)


def mixed_method(types: dict[str, str]) -> str:
    """The registered name of the method for experts of ggml types {gate|up|down: type} (registered on
    first use); a single type is its plain method."""
    if len(set(types.values())) == 1:
        return method_name(next(iter(types.values())))
    name = "gguf-mixed:" + ",".join(types[p].lower() for p in ("gate", "up", "down"))
    if name not in QUANT_METHODS:
        subs = {p: GGUF_METHODS[t]() for p, t in types.items()}
        if types["gate"] == types["up"]:  # a gate_up part (experts.gate_up_proj) in the gate's type
            subs["gate_up"] = subs["gate"]
        register(name)(type("GGUF_mixed", (GGMLMixed,), {"projections": subs}))
    return name


def _keyed(type_name: str) -> QuantMethod:
    """The method of `type_name` with its stored tensor keyed "P.<type lower>" (GGMLLayers' parts): a
    block type's (one without a QuantMethod: its layout and decoder only), or F32's (a dequantized
    expert: plain float32 [out, in])."""
    if type_name == "F32":
        base = FP32
    else:
        base = GGUF_METHODS.get(type_name) or type(
            f"GGUF_{type_name}",
            (GGMLBlocks,),
            {
                "type_name": type_name,
                "_dequant": lambda self, parts, out: out.copy_(
                    decode(self.type_name, parts["weight"].contiguous().view(-1, self.block_bytes)).view(
                        out.shape
                    )
                ),
            },
        )
    key = type_name.lower()
    cls = type(
        f"GGUF_{type_name}_keyed",
        (base,),
        {
            "primary": key,
            "aliases": {key: "weight"},  # the index serves the tensor as P.weight
            "_layout": lambda self, shape: {key: base._layout(self, shape)["weight"]},
            "_dequant": lambda self, parts, out: base._dequant(self, {"weight": parts[key]}, out),
        },
    )
    return cls()


def _block_types() -> list[str]:
    return [t.name for t in BY_NAME.values() if t.block > 1]


KEYED: dict[str, QuantMethod] = {t.lower(): _keyed(t) for t in [*_block_types(), "F32"]}
# routed experts of a type no kernel reads: a kernel type whose blocks hold the same values, and the
# repack into it (exact); any other such type is dequantized to F32
REPACKS = {"Q3_K": ("Q6_K", q3_k_as_q6_k)}
# the block types without a decoder here that the `gguf` package decodes (`decode` goes through it)
GGUF_DECODED = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "NVFP4")


def tier_type(type_name: str) -> str:
    """The ggml type (or F32) the tiers hold routed experts stored in `type_name` in."""
    return type_name if type_name in METHODS else REPACKS.get(type_name, ("F32",))[0]


def decode(type_name: str, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks uint8 [N, block bytes] of any block type -> float32 [N, block]: the project's decoder, else
    the `gguf` package's (IQ2/IQ3/IQ1/TQ types)."""
    if type_name in DECODERS:
        return DECODERS[type_name](blocks)
    try:
        import gguf
    except ImportError:
        raise ValueError(
            f"{type_name} blocks are decoded through the gguf package (pip install gguf)"
        ) from None
    t = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), t).astype("float32", copy=False)).reshape(
        blocks.shape[0], -1
    )


@register("gguf-layers")
class GGMLLayers(QuantMethod):
    """Routed experts whose ggml types differ between layers: each projection P of a layer is stored as
    "P.<type>" (KEYED[type]'s layout, the file's bytes), so the parts name their format and
    `block_method` reads it from them. Layouts are per layer (`for_layer`), so `layout` / `nbytes`
    without a layer are refused."""

    def block_method(self, stored, name: str) -> GGMLBlocks:
        """The block method of projection `name` in `stored` (its one "P.<type>" key)."""
        p = proj_name(name)
        for k in stored:
            head, _, suffix = k.partition(".")
            if head == p and suffix in KEYED:
                return KEYED[suffix]
        raise ValueError(
            f"{self.name}: no stored tensor {p}.<type> (have {sorted(stored)}); types: {sorted(KEYED)}"
        )

    @staticmethod
    def for_layer(types: dict[str, str]) -> GGMLMixed:
        """The method whose layout gives one layer's parts, for its types {gate|up|down|gate_up: type}."""
        subs = {p: KEYED[t.lower()] for p, t in types.items()}
        if "gate_up" not in subs and types.get("gate") == types.get("up"):
            subs["gate_up"] = subs["gate"]
        aliases = {k: "weight" for k in KEYED}
        cls = type("GGUF_layer", (GGMLMixed,), {"projections": subs, "aliases": aliases})
        cls.name = "gguf-layer:" + ",".join(f"{p}={t.lower()}" for p, t in sorted(types.items()))
        return cls()

    @staticmethod
    def tier_layout(key: str, shape: Shape) -> dict[str, TensorSpec]:
        """The tiers' part for stored part `key` ("P.<type>") of a weight of `shape` [out, in]: itself where
        a kernel reads the type, else the one it is converted to at load (`tier_type`)."""
        p, t = key.split(".", 1)
        return KEYED[tier_type(t.upper()).lower()].layout(p, shape)

    @staticmethod
    def to_tier(key: str, raw: torch.Tensor, shape: Shape) -> dict[str, torch.Tensor]:
        """Stored part `key` (uint8 [out, row bytes], the file's blocks) -> the tiers' part(s) (`tier_layout`)."""
        p, t = key.split(".", 1)
        name, target = t.upper(), tier_type(t.upper())
        if target == name:
            return {key: raw}
        blocks = raw.reshape(-1, BY_NAME[name].block_bytes)
        if name in REPACKS:
            return {f"{p}.{target.lower()}": REPACKS[name][1](blocks).reshape(shape[0], -1)}
        return {f"{p}.f32": decode(name, blocks).reshape(shape)}

    def layout(self, name: str, shape: Shape) -> dict[str, TensorSpec]:
        raise ValueError(f"{self.name}: the layout depends on the layer's types; use for_layer(types)")

    def nbytes(self, shape: Shape) -> int:
        raise ValueError(f"{self.name}: bytes depend on the layer's types; use for_layer(types)")

    def pack(self, weights):
        raise ValueError(f"{self.name}: no quantiser here (weights in this format are read from GGUF files)")

    def dequantize(self, stored, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.block_method(stored, name).dequantize(stored, name, out)

    def linear(self, x, stored, name: str, buf: torch.Tensor | None = None) -> torch.Tensor:
        return self.block_method(stored, name).linear(x, stored, name, buf)
