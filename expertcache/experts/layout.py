"""Where each routed expert lives in the checkpoint, and the parts one expert is made of.

Shapes (I = moe intermediate size, H = hidden size):
    gate_up  [2I, H]   rows 0..I-1 = gate_proj (Mixtral w1), rows I..2I-1 = up_proj (w3)
    down     [H, I]    down_proj (Mixtral w2)

Quantized experts (a QuantMethod from expertcache.quant) are kept as stored: one part per
stored tensor, named "<gate|up|down>.<suffix>" (e.g. "gate.weight", "gate.weight_scale"),
and every tier holds those bytes; compute dequantizes (see compute.expert_ffn). A shipped
integer layout (GPTQ, AWQ, compressed-tensors pack-quantized) that repacks exactly into the
project's int4/int8 layout is repacked per expert as it is read (`StoredRanges`: the reader reads
the shipped bytes, `convert` writes the tier's parts), so the tiers and the kernels see int4/int8
and the disk keeps the one shipped copy; `stored_parts` / `stored_nbytes` are the shipped tensors.

Both checkpoint layouts reduce to at most three contiguous byte ranges per expert:
  hub:   layers.{l}.mlp.experts.{j}.gate_proj.weight / up_proj / down_proj (one tensor each)
  fused: layers.{l}.mlp.experts.gate_up_proj [E, 2I, H] and .down_proj [E, H, I] (slice j);
         GPT-OSS stores them [E, H, 2I] / [E, I, H] (parts keep that orientation) with
         gate_up_proj_bias [E, 2I] / down_proj_bias [E, H] (parts "gate_up_bias", "down_bias"),
         and quantized as gate_up_proj_blocks [E, 2I, H/32, 16] / _scales (parts "gate_up.weight_blocks" ...)
`ExpertSource.ranges(layer, expert)` returns, per part, the (file, offset, nbytes) list in
slot order; the tiers read exactly those bytes and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import kernels
from ..errors import CheckpointError, ConfigError
from ..loader.checks import SKIP_HINT, nonfinite_parts
from ..loader.safetensors_index import TensorIndex
from ..quant.checkpoint import index_quantized_dense
from ..quant.shipped import ShippedInt
from ..spec.model_config import ModelConfig
from ..spec.weights import WeightNames
from .compute import ExpertFFN


@dataclass(frozen=True)
class Part:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class LayerParts(tuple):
    """The parts of each MoE layer's experts, [i] = the i-th MoE layer's tuple of Part, where layers
    differ in layout (a GGUF file whose expert types differ between layers: quant/ggml.py GGMLLayers).
    Where every layer shares one layout an ExpertSource's `parts` is that plain tuple of Part instead.
    The one place that decides it is ExpertSource._quantized; the tiers follow the parts (pool.SlotPool
    groups the layers of one layout)."""


def parts_at(parts, i: int) -> tuple:
    """The parts of MoE layer index i: `parts[i]` of a LayerParts, else `parts` (one layout)."""
    return parts[i] if isinstance(parts, LayerParts) else parts


def parts_nbytes(parts) -> int:
    """Bytes of one expert: its parts' bytes; over a LayerParts the mean over the layers rounded up (so
    layers x slots x this >= the slots' bytes, by less than one byte per layer and slot)."""
    if isinstance(parts, LayerParts):
        return -(-sum(sum(p.nbytes for p in ps) for ps in parts) // len(parts))
    return sum(p.nbytes for p in parts)


def parts_key(parts) -> tuple:
    """What identifies a layout (names, dtypes, shapes), per layer for a LayerParts."""
    if isinstance(parts, LayerParts):
        return tuple(parts_key(ps) for ps in parts)
    return tuple((p.name, p.dtype, tuple(p.shape)) for p in parts)


Range = tuple[Path, int, int]  # file, absolute offset, nbytes

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fits(shape: tuple[int, ...], dtype: torch.dtype, spec) -> bool:
    """A checkpoint tensor can stand for a stored part: same shape (a scalar may be [] or [1]);
    scales any float dtype; fp8 values as float8 or raw uint8; other codes exactly their dtype."""
    if tuple(shape) != tuple(spec.shape) and not (math.prod(shape) == 1 == math.prod(spec.shape)):
        return False
    if spec.dtype in FLOAT8:
        return dtype in (spec.dtype, torch.uint8)
    if spec.dtype.is_floating_point:
        return dtype.is_floating_point and dtype not in FLOAT8
    return dtype == spec.dtype


def _slice(t, j: int, n: int) -> Range:
    """Byte range of entry j of a tensor whose first dimension has n entries."""
    return (t.file, t.offset + j * t.nbytes // n, t.nbytes // n)


def _entry(t, j: int, n: int) -> list[Range]:
    """Byte ranges of entry j of a stacked tensor: one slice, or the pieces an index serves it in
    (`t.expert_ranges(j)`: a GGUF file's gate and up stacks as one gate_up, gguf/index.py)."""
    pieces = getattr(t, "expert_ranges", None)
    return pieces(j) if pieces is not None else [_slice(t, j, n)]


def _one_dtype(layer: int, dtypes: set, example: str, dtype: torch.dtype | None) -> torch.dtype:
    """The one floating-point dtype of `layer`'s unquantized experts (`example`: a tensor for errors),
    the same as the earlier layers' `dtype` where there is one."""
    if not all(d.is_floating_point for d in dtypes):
        raise CheckpointError(
            f"{example} (and the other routed experts) stored as "
            f"{', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))}: expert "
            "weights must be floating point unless config.json names a quantized layout"
        )
    if dtypes & set(FLOAT8):
        raise ConfigError(
            f"{example} (and the other routed experts) stored as "
            f"{', '.join(sorted(str(d).replace('torch.', '') for d in dtypes))} but config.json "
            "has no quantization_config saying how to scale them"
        )
    if len(dtypes) != 1 or (dtype is not None and dtypes != {dtype}):
        raise CheckpointError(f"layer {layer}: routed experts mix dtypes {sorted(map(str, dtypes))}")
    return dtypes.pop()


class StoredRanges(dict):
    """One expert's byte ranges {stored part: [Range]} when the tiers hold another layout: the reader
    (loader.disk.DiskReader.read_parts) reads them into `scratch()`, then `convert(raw, dst)` writes
    the tier's parts."""

    __slots__ = ("source", "key")

    def __init__(self, ranges: dict, source: "ExpertSource", key: tuple[int, int]):
        super().__init__(ranges)
        self.source, self.key = source, key

    def scratch(self) -> dict[str, torch.Tensor]:
        parts = self.source.layer_parts(self.key[0], stored=True)
        return {p.name: torch.empty(p.shape, dtype=p.dtype) for p in parts}

    def convert(self, raw: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> None:
        self.source.convert(*self.key, raw, dst)


class ExpertSource:
    """Byte ranges of every routed expert of a checkpoint (from the headers alone)."""

    def __init__(self, index: TensorIndex, cfg: ModelConfig, names: WeightNames, method=None):
        self.index, self.cfg, self.method = index, cfg, method
        self.layers = cfg.moe_layer_ids
        self._li = {layer: i for i, layer in enumerate(self.layers)}
        self._ranges: dict[tuple[int, int], dict[str, list[Range]]] = {}
        self._names: dict[tuple[int, int], str] = {}  # the checkpoint's name of each expert (errors)
        # the per-expert finite check at an expert's first read into any tier (see check_read)
        self.check_finite = True
        self.nonfinite: dict[tuple[int, int], list[str]] = {}  # (layer, expert) -> tensors with NaN/inf
        self._checked: set[tuple[int, int]] = set()
        self.bias_parts: tuple[Part, ...] = ()
        self.stored_method = method  # the checkpoint's layout (self.method: the tiers', after a repack)
        if method is not None:
            self._quantized(names)
        else:
            self._plain(names)

    def _plain(self, names: WeightNames) -> None:
        """Parts = gate_up and down (and the biases), in the one floating-point dtype of the checkpoint."""
        H, I = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        tr = names.fused_transposed  # such a family has only the fused layout
        gu_shape, dn_shape = ((H, 2 * I), (I, H)) if tr else ((2 * I, H), (H, I))
        dtype = None
        for layer in self.layers:
            prefix = self.moe_prefix(layer, names)
            if f"{prefix}.experts.gate_up_proj" in self.index or tr:
                dtypes, example = self._fused_ranges(layer, prefix, gu_shape, dn_shape)
            else:
                dtypes, example = self._hub_ranges(layer, prefix, names)
            dtype = _one_dtype(layer, dtypes, example, dtype)
        self.dtype = dtype or torch.float32
        self.parts = (
            Part("gate_up", gu_shape, self.dtype),
            Part("down", dn_shape, self.dtype),
        ) + self.bias_parts
        self.expert_nbytes = sum(p.nbytes for p in self.parts)
        self.stored_parts, self.stored_nbytes = self.parts, self.expert_nbytes
        self.ffn = self._ffn(names, transposed=tr, fused_quant=False)

    def _fused_ranges(self, layer: int, prefix: str, gu_shape: tuple, dn_shape: tuple) -> tuple[set, str]:
        """`layer`'s experts from experts.gate_up_proj [E, *gu_shape] and .down_proj [E, *dn_shape] (slice
        j), with their biases -> (the dtypes stored, a tensor name for errors)."""
        E = self.cfg.num_experts
        gu = self.index.info(f"{prefix}.experts.gate_up_proj", (E, *gu_shape))
        dn = self.index.info(f"{prefix}.experts.down_proj", (E, *dn_shape))
        for j in range(E):
            self._ranges[layer, j] = {"gate_up": _entry(gu, j, E), "down": _entry(dn, j, E)}
            self._names[layer, j] = f"{prefix}.experts.{{gate_up_proj,down_proj}}[{j}]"
        self._biases(layer, prefix)
        return {gu.dtype, dn.dtype}, gu.name

    def _hub_ranges(self, layer: int, prefix: str, names: WeightNames) -> tuple[set, str]:
        """`layer`'s experts from one tensor per expert and projection (experts.{j}.gate_proj.weight ...)
        -> (the dtypes stored, a tensor name for errors)."""
        cfg = self.cfg
        H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        if cfg.expert_bias:
            raise CheckpointError(
                f"{self.index.model_dir}: missing tensor {prefix}.experts.gate_up_proj (experts with "
                "biases are read from the fused layout only)"
            )
        g, u, d = names.expert_projs
        dtypes = set()
        for j in range(E):
            base = f"{prefix}.experts.{j}"
            gi = self.index.info(f"{base}.{g}.weight", (I, H))
            ui = self.index.info(f"{base}.{u}.weight", (I, H))
            di = self.index.info(f"{base}.{d}.weight", (H, I))
            self._ranges[layer, j] = {
                "gate_up": [(gi.file, gi.offset, gi.nbytes), (ui.file, ui.offset, ui.nbytes)],
                "down": [(di.file, di.offset, di.nbytes)],
            }
            dtypes |= {gi.dtype, ui.dtype, di.dtype}
            self._names[layer, j] = f"{base}.{{{g},{u},{d}}}.weight"
        return dtypes, gi.name

    def _ffn(self, names: WeightNames, transposed: bool, fused_quant: bool) -> ExpertFFN:
        cfg = self.cfg
        return ExpertFFN(
            act=cfg.expert_act,
            interleaved=names.gate_up_interleaved,
            transposed=transposed,
            fused_quant=fused_quant,
            alpha=cfg.swiglu_alpha,
            limit=cfg.swiglu_limit,
        )

    def _biases(self, layer: int, prefix: str) -> None:
        """Expert biases (cfg.expert_bias): experts.gate_up_proj_bias [E, 2I], experts.down_proj_bias [E, H]."""
        if not self.cfg.expert_bias:
            return
        cfg = self.cfg
        E, parts = cfg.num_experts, []
        for part, proj, n in (
            ("gate_up_bias", "gate_up_proj", 2 * cfg.moe_intermediate_size),
            ("down_bias", "down_proj", cfg.hidden_size),
        ):
            t = self.index.info(f"{prefix}.experts.{proj}_bias", (E, n))
            parts.append(Part(part, (n,), t.dtype))
            for j in range(E):
                self._ranges[layer, j][part] = _entry(t, j, E)
        if self.bias_parts and tuple(parts) != self.bias_parts:
            raise CheckpointError(
                f"layer {layer}: expert bias dtypes {[str(p.dtype) for p in parts]} differ "
                "from the other layers'"
            )
        self.bias_parts = tuple(parts)

    def _quantized(self, names: WeightNames) -> None:
        """Parts = the method's stored tensors for gate, up and down, read as the checkpoint has them."""
        cfg = self.cfg
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I), "gate_up": (2 * I, H)}
        m = self._expert_method(names)
        used: set[str] = set()  # the experts' tensors (the rest of a shipped layout is dense)
        fused_any = False
        per_layer: list[tuple[Part, ...]] = []
        for layer in self.layers:
            parts, fused = self._quantized_layer(layer, names, shapes, used)
            fused_any |= fused
            per_layer.append(parts)
        if fused_any and any(p.name.split(".")[0] in ("gate", "up") for ps in per_layer for p in ps):
            raise CheckpointError(
                f"{self.index.model_dir}: layers mix the fused and per-expert quantized layouts"
            )
        per_layer = [ps + self.bias_parts for ps in per_layer]
        one = all(ps == per_layer[0] for ps in per_layer)
        self.parts = per_layer[0] if one else LayerParts(per_layer)
        self.stored_parts = self.parts
        self.stored_nbytes = parts_nbytes(self.parts)
        if isinstance(m, ShippedInt):
            self._shipped(names, m, shapes)
        self.dtype = parts_at(self.parts, 0)[0].dtype
        if hasattr(m, "tier_layout"):
            self._tier_types(per_layer, shapes)
        index_quantized_dense(self.index, m, used)
        self.expert_nbytes = parts_nbytes(self.parts)
        self.ffn = self._ffn(names, transposed=False, fused_quant=fused_any)

    def _expert_method(self, names: WeightNames):
        """The routed experts' method; for a shipped integer layout the one the config's rules give the
        first expert's module (then also self.method and self.stored_method)."""
        m = self.method
        if isinstance(m, ShippedInt):  # the config's rules say which parameters the experts have
            module = f"{self.moe_prefix(self.layers[0], names)}.experts.0.{names.expert_projs[0]}"
            m = self.method = self.stored_method = m.method_for(module)
            if m is None:
                raise ConfigError(
                    f"config.json: quantization_config leaves routed expert module {module} "
                    "unquantized; unquantized experts in a quantized checkpoint are not supported"
                )
        return m

    def _quantized_layer(
        self, layer: int, names: WeightNames, shapes: dict, used: set[str]
    ) -> tuple[tuple[Part, ...], bool]:
        """`layer`'s experts' ranges and names recorded, the tensors read added to `used` -> (the layer's
        parts, one dtype per part across its experts; whether it has the fused layout)."""
        m, E = self.method, self.cfg.num_experts
        parts: dict[str, Part] = {}
        prefix = self.moe_prefix(layer, names)
        primary = m.primary.removeprefix("weight")
        fused = names.gate_up_interleaved or f"{prefix}.experts.gate_up_proj{primary}" in self.index
        lm = self._layer_method(layer)
        projs = (
            (("gate_up", "gate_up_proj"), ("down", "down_proj"))
            if fused
            else tuple(zip(("gate", "up", "down"), names.expert_projs))
        )
        for j in range(E):
            ranges = {}
            for canon, proj in projs:
                for key, spec in lm.layout(canon, shapes[canon]).items():
                    name, t, shape, rng = self._quantized_tensor(lm, prefix, proj, key, j, fused)
                    if not _fits(shape, t.dtype, spec):
                        raise CheckpointError(
                            f"{t.file.name}: tensor {name} is {t.dtype} {list(t.shape)}, but {m.name} experts "
                            f"need {spec.dtype} {list(spec.shape)}{' per expert' if fused else ''}"
                            f"{m.shape_hint(shapes[canon])}"
                        )
                    used.add(name)
                    part = Part(key, spec.shape, t.dtype)
                    if parts.setdefault(key, part) != part:
                        raise CheckpointError(
                            f"tensor {name}: {t.dtype} differs from other experts' {parts[key].dtype}"
                        )
                    ranges[key] = rng
            self._ranges[layer, j] = ranges
            self._names[layer, j] = (
                f"{prefix}.experts.{{gate_up_proj,down_proj}}[{j}]"
                if fused
                else f"{prefix}.experts.{j}.{{{','.join(names.expert_projs)}}}"
            )
        if fused:
            self._biases(layer, prefix)
        elif self.cfg.expert_bias:
            raise CheckpointError(
                f"{self.index.model_dir}: missing tensor {prefix}.experts.gate_up_proj{primary} "
                "(experts with biases are read from the fused layout only)"
            )
        return tuple(parts.values()), fused

    def _quantized_tensor(self, lm, prefix: str, proj: str, key: str, j: int, fused: bool):
        """Expert j's stored tensor of part `key` ("<canon>.<suffix>") of projection `proj`, under the
        method's alias where the file uses it -> (name, info, expert j's shape, expert j's ranges)."""
        suffix = key.split(".", 1)[1]
        if not fused:
            name = f"{prefix}.experts.{j}.{proj}.{suffix}"
            if name not in self.index and suffix in lm.aliases:
                name = f"{prefix}.experts.{j}.{proj}.{lm.aliases[suffix]}"
            t = self.index.info(name)
            return name, t, t.shape, [(t.file, t.offset, t.nbytes)]
        # experts.{proj}{suffix without "weight"} [E, ...], slice j
        E = self.cfg.num_experts
        name = f"{prefix}.experts.{proj}{suffix.removeprefix('weight')}"
        if name not in self.index and suffix in lm.aliases:
            name = f"{prefix}.experts.{proj}{lm.aliases[suffix].removeprefix('weight')}"
        t = self.index.info(name)
        shape, rng = t.shape[1:], _entry(t, j, E)
        if t.shape[0] != E:
            raise CheckpointError(
                f"{t.file.name}: tensor {name} has {t.shape[0]} experts, config.json says {E}"
            )
        return name, t, shape, rng

    def _tier_types(self, per_layer: list[tuple[Part, ...]], shapes: dict) -> None:
        """Experts of a type no kernel reads (GGUF's Q2_K, Q3_K, IQ2/IQ3, Q4_1 ...): the tiers hold the
        format `method.tier_layout` names (converted per read, `convert`); the disk keeps the file's bytes."""
        m, tiers = self.method, []
        for ps in per_layer:
            tier = []
            for p in ps:  # a weight "P.<type>" in its tier type; a bias part as it is
                specs = (
                    {p.name: p}
                    if p in self.bias_parts
                    else m.tier_layout(p.name, shapes[p.name.split(".")[0]])
                )
                tier += [Part(k, tuple(v.shape), v.dtype) for k, v in specs.items()]
            tiers.append(tuple(tier))
        if tiers == per_layer:
            return
        self.parts = tiers[0] if all(t == tiers[0] for t in tiers) else LayerParts(tiers)
        self._shapes = shapes
        for key, ranges in self._ranges.items():
            if tiers[self._li[key[0]]] != per_layer[self._li[key[0]]]:
                self._ranges[key] = StoredRanges(ranges, self, key)

    def _layer_method(self, layer: int):
        """The method whose layout gives `layer`'s parts: the source's, or for experts whose types differ
        between layers (`for_layer`: GGUF's GGMLLayers) the one of this layer's types (the index's
        `expert_types`)."""
        m = self.method
        if not hasattr(m, "for_layer"):
            return m
        types = {c: t for (la, c), t in getattr(self.index, "expert_types", {}).items() if la == layer}
        if not types:
            raise CheckpointError(f"{self.index.model_dir}: no routed-expert types for layer {layer}")
        return m.for_layer(types)

    def layer_parts(self, layer: int, stored: bool = False) -> tuple[Part, ...]:
        """The parts of `layer`'s experts as the tiers hold them (`stored`: as the checkpoint has them)."""
        return parts_at(self.stored_parts if stored else self.parts, self._li[layer])

    def _shipped(self, names: WeightNames, m: ShippedInt, shapes: dict) -> None:
        """A shipped integer layout: every routed expert module under the default parameters (the config's
        exclusions and per-module overrides must leave them alone), then the repack into the project
        layout where it is exact (the tiers' parts become that layout's)."""
        g, u, d = names.expert_projs
        for layer in self.layers:
            base = f"{self.moe_prefix(layer, names)}.experts"
            for j in range(self.cfg.num_experts):
                for proj in (g, u, d):
                    if m.method_for(f"{base}.{j}.{proj}") is not m:
                        raise ConfigError(
                            f"config.json: quantization_config gives routed expert module "
                            f"{base}.{j}.{proj} other parameters than {base}.0.{g} (an exclusion or "
                            "per-module override); routed experts must share one layout"
                        )
        # act-order in the config: the first expert's g_idx says whether the groups are contiguous anyway
        # (GPTQ's static groups); every later read checks its own
        first = f"{self.moe_prefix(self.layers[0], names)}.experts.0"
        in_order = (
            None
            if m.exact_groups
            else all(
                torch.equal(
                    self.index.load(f"{first}.{proj}.g_idx").long(),
                    torch.arange(shapes[canon][1]) // m.group_size(shapes[canon][1]),
                )
                for canon, proj in zip(("gate", "up", "down"), (g, u, d))
            )
        )
        tier = m.tier(max(self.cfg.hidden_size, self.cfg.moe_intermediate_size), in_order)
        if tier is None:
            return
        self.method = tier
        self._projs = dict(zip(("gate", "up", "down"), (g, u, d)))
        self.parts = tuple(
            Part(key, spec.shape, spec.dtype)
            for canon in ("gate", "up", "down")
            for key, spec in tier.layout(canon, shapes[canon]).items()
        )
        for key, ranges in self._ranges.items():
            self._ranges[key] = StoredRanges(ranges, self, key)

    def convert(
        self, layer: int, expert: int, raw: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]
    ) -> None:
        """Expert (layer, expert)'s shipped tensors `raw` -> its tier parts, written into `dst` (exact)."""
        if hasattr(self.method, "to_tier"):  # GGUF experts of a type no kernel reads (_tier_types)
            for key, t in raw.items():
                shape = self._shapes.get(key.split(".", 1)[0])  # None: a bias part, copied as it is
                for k, v in (self.method.to_tier(key, t, shape) if shape else {key: t}).items():
                    dst[k].copy_(v)
            return
        for canon, proj in self._projs.items():
            try:
                parts = self.stored_method.repack(raw, canon, self.method)
            except ValueError as e:
                prefix = self._names[layer, expert].split("{", 1)[0]
                raise CheckpointError(
                    f"{self.index.model_dir}: tensor {prefix}{proj}{str(e)[len(canon) :]}"
                ) from None
            for suffix, t in parts.items():
                dst[f"{canon}.{suffix}"].copy_(t)

    def compute_parts(self, dtype: torch.dtype, device: torch.device | str | None = None) -> tuple[Part, ...]:
        """Parts as the fastest tier holds them: quantized as stored; plain weights as stored where the
        CPU kernels read them (`kernels.reads_stored`: CPU, float32 compute), else in the compute dtype."""
        if self.method is not None or (device is not None and kernels.reads_stored(device, dtype)):
            return self.parts
        return tuple(Part(p.name, p.shape, dtype) for p in self.parts)

    def moe_prefix(self, layer: int, names: WeightNames) -> str:
        for p in names.moe_prefixes:
            prefix = f"model.layers.{layer}.{p}"
            if f"{prefix}.{names.router}.weight" in self.index:
                return prefix
        raise CheckpointError(
            f"{self.index.model_dir}: missing tensor model.layers.{layer}.{names.moe_prefixes[0]}.{names.router}.weight "
            "(router of a sparse layer)"
        )

    def expert_name(self, layer: int, expert: int) -> str:
        return self._names[layer, expert]

    def check_read(self, layer: int, expert: int, parts: dict[str, torch.Tensor]) -> list[str]:
        """The finite check of an expert just read into a tier, once per expert (later reads of the
        same bytes are skipped): -> its parts holding NaN/inf (also kept in `nonfinite`), [] if clean
        or unchecked. Any thread."""
        key = (layer, expert)
        if not self.check_finite or key in self._checked:
            return []
        self._checked.add(key)
        bad = nonfinite_parts(parts)
        if bad:
            self.nonfinite[key] = bad
        return bad

    def nonfinite_error(self, layer: int, expert: int) -> CheckpointError:
        return CheckpointError(
            f"{self.expert_name(layer, expert)}: expert {expert} of layer {layer} holds non-finite "
            f"values (NaN or inf) in {', '.join(self.nonfinite[layer, expert])}; {SKIP_HINT}"
        )

    def ranges(self, layer: int, expert: int) -> dict[str, list[Range]]:
        return self._ranges[layer, expert]

    def read(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """Read one expert with buffered preads (the tiers' parts, CPU). The disk tier has the fast path."""
        out = {}
        for part in self.layer_parts(layer, stored=True):
            buf = bytearray(part.nbytes)
            pos = 0
            for path, off, n in self.ranges(layer, expert)[part.name]:
                with open(path, "rb", buffering=0) as f:
                    f.seek(off)
                    f.readinto(memoryview(buf)[pos : pos + n])
                pos += n
            out[part.name] = torch.frombuffer(buf, dtype=torch.uint8).view(part.dtype).view(part.shape)
        if self.stored_parts is self.parts:
            return out
        dst = {p.name: torch.empty(p.shape, dtype=p.dtype) for p in self.layer_parts(layer)}
        self.convert(layer, expert, out, dst)
        return dst

    @property
    def total_nbytes(self) -> int:
        """Every routed expert's bytes on disk (the shipped tensors)."""
        if isinstance(self.stored_parts, LayerParts):
            return sum(parts_nbytes(ps) for ps in self.stored_parts) * self.cfg.num_experts
        return self.stored_nbytes * len(self.layers) * self.cfg.num_experts
