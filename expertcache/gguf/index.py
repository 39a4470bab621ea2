"""A GGUF file as a checkpoint index: tensors served under the Hugging Face names the families read.

`GGUFIndex` is a loader.safetensors_index.TensorIndex (the same `tensors`, `info`, `load`, `drop`,
`nbytes`, `rename`), built from a GGUF header (reader.py) and the name map (names.py):
  - a routed-expert stack blk.N.ffn_{gate,up,down}_exps [in, out, E] (ggml dims) becomes E entries
    model.layers.N.<moe>.experts.j.<proj>.weight, each one contiguous byte range of the file:
    in a block type with a QuantMethod (quant/ggml.py) uint8 [out, row bytes], the file's blocks as they
    are; in F32/F16/BF16 that dtype [out, in]. experts/layout.py's ExpertSource reads them as it reads
    a hub checkpoint's per-expert tensors, so every tier holds an expert in exactly its file bytes;
  - a dense tensor in F32/F16/BF16 is read as stored; in a block type it is listed as float32 [out, in]
    (what `load` dequantizes it to; nbytes = its stored bytes), a type without a decoder here (Q2_K,
    Q3_K, IQ2/IQ3, ...) through the `gguf` package where installed, said once per type. A matrix in a
    type the kernels read (`block_method`) is also served as its file bytes, `blocks` uint8 [out, row
    bytes]: build/fill.py holds the lm_head and standard attention / dense MLP matrices so on the CPU.
`expert_types`: per (layer, projection) the ggml type of the routed experts (the config's quant method).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..loader.safetensors_index import TensorIndex, TensorInfo
from ..quant.ggml import GGUF_DECODED, decode, tier_type
from ..quant.ggml_blocks import BY_NAME, DECODERS, FLOATS, METHODS, GGMLType, method_name
from .families import Arch
from .names import BLOCK, KV_B_SPLIT, expert_piece, expert_stack, gguf_name, hf_name
from .reader import GGUFFile, GGUFTensor


@dataclass(frozen=True)
class GGUFInfo(TensorInfo):
    """A GGUF tensor under its HF name: `type` its ggml type, `gguf_name` its name in the file."""

    type: GGMLType | None = None
    gguf_name: str = ""
    permute_heads: int = 0  # q/k rows to un-permute (llama's converter), 0: none
    undo: Callable | None = None  # the converter's other change to undo on the loaded values (Arch.undo)


class GGUFIndex(TensorIndex):
    def __init__(self, gf: GGUFFile, arch: Arch, expert_projs: tuple[str, str, str]):
        self.model_dir = gf.path
        self.gguf = gf
        self.metadata: dict[str, str] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.expert_types: dict[tuple[int, str], str] = {}
        self.left_out: list[str] = []
        self.arch = arch
        self._dequantized: dict[str, list[str]] = {}
        projs = dict(zip(("gate", "up", "down"), expert_projs))
        undo = arch.undo(gf.path, gf.metadata, arch.arch) if arch.undo else None
        stacks, kv_b = {}, {}
        for t in gf.tensors.values():
            m = BLOCK.match(t.name)
            if m and m[2] in KV_B_SPLIT:
                kv_b.setdefault(int(m[1]), {})[KV_B_SPLIT[m[2]]] = t
                continue
            stack = expert_stack(t.name)
            if stack is not None:
                stacks[stack] = t
                continue
            piece = expert_piece(t.name)
            if piece is not None:
                self._one_expert(t, arch, projs, *piece)
                continue
            name = hf_name(t.name, arch)
            if name is None:
                self.left_out.append(t.name)
                continue
            heads = 0
            if arch.permute_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
                key = f"{arch.arch}.attention.head_count" + ("_kv" if ".k_proj." in name else "")
                heads = int(gf.metadata.get(key, gf.metadata[f"{arch.arch}.attention.head_count"]))
            self.tensors[name] = self._dense(t, name, heads, undo)
        self._experts(stacks, arch, projs)
        for layer, kv in kv_b.items():
            if set(kv) != {"k", "v"}:
                raise CheckpointError(
                    f"{gf.path}: tensor blk.{layer}.attn_{'v' if 'k' in kv else 'k'}_b.weight is "
                    f"missing beside {next(iter(kv.values())).name}"
                )
            name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
            self.tensors[name] = _kv_b(name, kv["k"], kv["v"])
        self._notes()

    def _notes(self) -> None:
        """What the load leaves out or converts, one line each."""
        path = self.gguf.path
        if self.left_out:
            shown = ", ".join(self.left_out[:4]) + (
                f" and {len(self.left_out) - 4} more" if len(self.left_out) > 4 else ""
            )
            print(
                f"note: {path.name}: {len(self.left_out)} tensor(s) not read by the {self.arch.arch} model: {shown}",
                file=sys.stderr,
            )
        for line in expert_conversions(path, self.expert_types):
            print(line, file=sys.stderr)
        for type_name, names in self._dequantized.items():
            print(
                f"note: {path.name}: {len(names)} dense tensor(s) of type {type_name} ({names[0]}"
                f"{', ...' if len(names) > 1 else ''}) are dequantized at load to float32 through the gguf "
                "package (no decoder of that type here)",
                file=sys.stderr,
            )

    def _dense(self, t: GGUFTensor, name: str, heads: int, undo=None) -> GGUFInfo:
        if t.type.name in FLOATS:
            dtype = FLOATS[t.type.name]
        elif t.type.name in DECODERS:
            dtype = torch.float32
        else:
            _gguf_package(t)
            self._dequantized.setdefault(t.type.name, []).append(t.name)
            dtype = torch.float32
        shape, fn = undo(name, t.shape) if undo else (t.shape, None)
        return GGUFInfo(name, t.file, dtype, shape, t.offset, t.nbytes, t.type, t.name, heads, fn)

    def _experts(self, stacks: dict, arch: Arch, projs: dict) -> None:
        """Routed-expert stacks {(layer, gate|up|down, weight|bias): GGUFTensor} -> index entries."""
        for (layer, canon, kind), t in stacks.items():
            want = 3 if kind == "weight" else 2
            if len(t.dims) != want:
                raise CheckpointError(
                    f"{t.file}: tensor {t.name} has ggml dims {list(t.dims)}; expected "
                    f"{'[in, out, experts]' if kind == 'weight' else '[out, experts]'}"
                )
            if kind == "bias" and t.type.name not in FLOATS:
                raise CheckpointError(
                    f"{t.file}: tensor {t.name} is {t.type.name}; expert biases must be F32/F16/BF16"
                )
            if kind == "weight":
                _expert_type(t)
                self.expert_types[layer, canon] = t.type.name
        fused_layers = {layer for (layer, canon, _) in stacks if canon == "gate_up"}
        for (layer, canon, kind), t in stacks.items():
            prefix = f"model.layers.{layer}.{arch.moe_prefix}.experts"
            if arch.fused_experts or layer in fused_layers:
                # experts.gate_up_proj [E, 2I, ...] (gate rows, then up rows) + experts.down_proj
                if canon == "up":
                    continue
                parts = (t, stacks.get((layer, "up", kind))) if canon == "gate" else (t,)
                if None in parts:
                    raise CheckpointError(
                        f"{t.file}: missing tensor {t.name.replace('gate', 'up')} (beside {t.name})"
                    )
                proj = "down_proj" if canon == "down" else "gate_up_proj"
                name = f"{prefix}.{proj}" + ("_bias" if kind == "bias" else "")
                self.tensors[name] = _stack(name, parts, kind)
            elif kind == "weight":
                E, per = t.dims[-1], t.nbytes // t.dims[-1]
                shape = _expert_shape(t)
                for j in range(E):
                    name = f"{prefix}.{j}.{projs[canon]}.weight"
                    self.tensors[name] = GGUFInfo(
                        name,
                        t.file,
                        _expert_dtype(t),
                        shape,
                        t.offset + j * per,
                        per,
                        t.type,
                        f"{t.name}[{j}]",
                    )
            else:
                raise CheckpointError(
                    f"{t.file}: tensor {t.name}: expert biases are not read for the {arch.arch} architecture"
                )

    def _one_expert(self, t: GGUFTensor, arch: Arch, projs: dict, layer: int, canon: str, j: int) -> None:
        if len(t.dims) != 2:
            raise CheckpointError(
                f"{t.file}: tensor {t.name} has ggml dims {list(t.dims)}; expected [in, out]"
            )
        _expert_type(t)
        self.expert_types[layer, canon] = t.type.name
        name = f"model.layers.{layer}.{arch.moe_prefix}.experts.{j}.{projs[canon]}.weight"
        shape = (t.dims[1], t.dims[0]) if t.type.name in FLOATS else (t.dims[1], t.type.row_bytes(t.dims[0]))
        self.tensors[name] = GGUFInfo(
            name, t.file, _expert_dtype(t), shape, t.offset, t.nbytes, t.type, t.name
        )

    def info(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        t = self.tensors.get(name)
        if t is None:
            g = gguf_name(name, self.arch)
            raise CheckpointError(
                f"{self.model_dir}: missing tensor {g + ' (' + name + ')' if g else name}{_gguf_hint(name)}"
            )
        if shape is not None and tuple(shape) != t.shape:
            g = getattr(t, "gguf_name", name)
            raise CheckpointError(
                f"{t.file.name}: tensor {g} ({name}) has shape {list(t.shape)}, the config implies "
                f"{list(shape)}"
            )
        return t

    def block_type(self, name: str) -> str | None:
        """The ggml block type dense matrix `name` is stored in (served dequantized by `load`, as the
        file's bytes by `blocks`), else None (floats, MLA's split kv_b, expert entries)."""
        t = self.tensors.get(name)
        if type(t) is not GGUFInfo or t.type is None or len(t.shape) != 2 or t.type.name in FLOATS:
            return None
        return None if t.undo is not None else t.type.name  # an undone tensor is served as its values

    def block_method(self, name: str) -> str | None:
        """The QuantMethod (quant/ggml.py `gguf-*`) of dense matrix `name` where its type is one the
        kernels read as stored, else None (floats, types without a method, MLA's split kv_b)."""
        t = self.block_type(name)
        return method_name(t) if t in METHODS else None

    def blocks(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Dense matrix `name` (a `block_method` type) as the file stores it: uint8 [out, row bytes], the
        file's bytes (llama's q/k rows un-permuted: whole rows move, each row's bytes unchanged)."""
        t = self.info(name, shape)
        raw = _read(t).view(t.shape[0], -1)
        return unpermute(raw, t.permute_heads) if t.permute_heads else raw

    def load(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """One tensor as float (stored float types as stored; block types dequantized to float32)."""
        t = self.info(name, shape)
        if isinstance(t, KVB):
            return t.join()
        if not isinstance(t, GGUFInfo) or t.type is None or t.type.name in FLOATS:
            out = super().load(name, shape)
        else:
            out = dequantize(t)
        if isinstance(t, GGUFInfo) and t.permute_heads:
            out = unpermute(out, t.permute_heads)
        if isinstance(t, GGUFInfo) and t.undo is not None:
            out = t.undo(out)
        return out


@dataclass(frozen=True)
class GGUFStack(GGUFInfo):
    """Routed experts served as one stacked tensor [E, ...] whose entry j is pieces of several GGUF
    stacks (gate_up: the gate stack's entry j, then the up stack's): `expert_ranges(j)`."""

    pieces: tuple = ()

    def expert_ranges(self, j: int) -> list[tuple]:
        return [
            (p.file, p.offset + j * (p.nbytes // p.dims[-1]), p.nbytes // p.dims[-1]) for p in self.pieces
        ]


def _expert_type(t: GGUFTensor) -> None:
    """Routed experts in a float type, a block type a kernel reads, or one converted at load
    (quant/ggml.py tier_type: decoded here, or by the gguf package); else refused naming the tensor."""
    name = t.type.name
    if name in FLOATS or method_name(name) is not None or name in DECODERS:
        return
    if t.type.block == 1 or name not in GGUF_DECODED:
        raise CheckpointError(
            f"{t.file}: tensor {t.name} (routed experts) is {name}, which has no expert format here "
            "(block types are read as stored or converted at load); requantize the experts with llama-quantize"
        )
    _gguf_package(t)  # IQ2/IQ3/IQ1/TQ blocks are decoded by the gguf package


def expert_conversions(path, types: dict[tuple[int, str], str]) -> list[str]:
    """One line per expert type the tiers hold in another format (which type -> which format)."""
    by_type: dict[str, list] = {}
    for (layer, proj), name in sorted(types.items()):
        if name not in FLOATS and tier_type(name) != name:
            by_type.setdefault(name, []).append((layer, proj))
    lines = []
    for name, where in by_type.items():
        target, src = tier_type(name), BY_NAME[name]
        bits = 8 * src.block_bytes / src.block
        tbits = 32 if target == "F32" else 8 * BY_NAME[target].block_bytes / BY_NAME[target].block
        how = f"repacked to {target} (the same values)" if target != "F32" else "dequantized to F32 (exact)"
        layers = sorted({la for la, _ in where})
        lines.append(
            f"note: {Path(path).name}: routed experts in {name} ({len(where)} stack(s), layers "
            f"{layers[:6]}{'...' if len(layers) > 6 else ''}) are {how} at load, as no kernel reads "
            f"{name}: {tbits:.2f} bits a weight in memory against {bits:.2f} on disk"
        )
    return lines


def _expert_dtype(t: GGUFTensor) -> torch.dtype:
    return FLOATS.get(t.type.name, torch.uint8)


def _expert_shape(t: GGUFTensor) -> tuple[int, ...]:
    """One expert of a stack [in, out, E] (ggml dims): [out, in] in a float type, [out, row bytes] in blocks;
    one expert's bias [out, E]: [out]."""
    if len(t.dims) == 2:
        return (t.dims[0],)
    n_in, n_out = t.dims[0], t.dims[1]
    return (n_out, n_in) if t.type.name in FLOATS else (n_out, t.type.row_bytes(n_in))


def _stack(name: str, pieces: tuple, kind: str) -> GGUFStack:
    first = pieces[0]
    if any(p.type != first.type or p.dims != first.dims for p in pieces):
        raise CheckpointError(
            f"{first.file}: tensors {', '.join(p.name for p in pieces)} differ in type or shape; "
            "they are served as one stack"
        )
    E, one = first.dims[-1], _expert_shape(first)
    shape = (E, len(pieces) * one[0], *one[1:])
    return GGUFStack(
        name,
        first.file,
        _expert_dtype(first),
        shape,
        first.offset,
        sum(p.nbytes for p in pieces),
        first.type,
        "+".join(p.name for p in pieces),
        pieces=pieces,
    )


@dataclass(frozen=True)
class KVB(GGUFInfo):
    """MLA's kv_b_proj [heads x (nope + v), kv_lora] as newer converters split it: attn_k_b [heads, kv_lora,
    nope] (transposed) and attn_v_b [heads, v, kv_lora] (HF order); `join` rebuilds it, float32."""

    k_b: GGUFTensor | None = None
    v_b: GGUFTensor | None = None

    def join(self) -> torch.Tensor:
        k, v = (_as_float(t).reshape(t.shape) for t in (self.k_b, self.v_b))
        return torch.cat((k.transpose(1, 2), v), dim=1).reshape(self.shape).contiguous()


def _kv_b(name: str, k_b: GGUFTensor, v_b: GGUFTensor) -> KVB:
    if len(k_b.dims) != 3 or len(v_b.dims) != 3 or k_b.dims[2] != v_b.dims[2] or k_b.dims[1] != v_b.dims[0]:
        raise CheckpointError(
            f"{k_b.file}: tensors {k_b.name} {list(k_b.dims)} and {v_b.name} {list(v_b.dims)} "
            "(ggml dims) are not [nope, kv_lora, heads] and [kv_lora, v, heads]"
        )
    heads, kv_lora = k_b.dims[2], k_b.dims[1]
    shape = (heads * (k_b.dims[0] + v_b.dims[1]), kv_lora)
    return KVB(
        name,
        k_b.file,
        torch.float32,
        shape,
        k_b.offset,
        k_b.nbytes + v_b.nbytes,
        k_b.type,
        f"{k_b.name}+{v_b.name}",
        k_b=k_b,
        v_b=v_b,
    )


def _as_float(t: GGUFTensor) -> torch.Tensor:
    """Any GGUF tensor's values, flat, float32 (or its float dtype)."""
    info = GGUFInfo(
        t.name, t.file, FLOATS.get(t.type.name, torch.float32), t.shape, t.offset, t.nbytes, t.type, t.name
    )
    if t.type.name in FLOATS:
        raw = torch.empty(t.nbytes, dtype=torch.uint8)
        with open(t.file, "rb", buffering=0) as f:
            f.seek(t.offset)
            f.readinto(raw.numpy())
        return raw.view(FLOATS[t.type.name]).float()
    return dequantize(info).reshape(-1)


def _read(t: GGUFInfo) -> torch.Tensor:
    """A tensor's bytes in the file, uint8 [nbytes]."""
    raw = torch.empty(t.nbytes, dtype=torch.uint8)
    with open(t.file, "rb", buffering=0) as f:
        f.seek(t.offset)
        if f.readinto(raw.numpy()) != t.nbytes:
            raise CheckpointError(f"{t.file}: short read of tensor {t.gguf_name}: file truncated?")
    return raw


def dequantize(t: GGUFInfo) -> torch.Tensor:
    """A block-type tensor's bytes -> float32 in its HF shape."""
    raw = _read(t)
    if t.type.name not in DECODERS:
        _gguf_package(t)  # the types only the gguf package decodes: refused by name without it
    return decode(t.type.name, raw.view(-1, t.type.block_bytes)).reshape(t.shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter's q/k row permutation (HF's rotate-half halves -> ggml's interleaved
    pairs): rows [heads, 2, d/2] were written as [heads, d/2, 2]."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _gguf_package(t):
    try:
        import gguf
    except ImportError:
        raise CheckpointError(
            f"{t.file}: tensor {t.name if isinstance(t, GGUFTensor) else t.gguf_name} is "
            f"{t.type.name}; that type is read through the gguf package "
            "(pip install gguf), or requantize the file"
        ) from None
    return gguf


def _gguf_hint(name: str) -> str:
    return "" if ".experts." not in name else " (no routed-expert tensor blk.N.ffn_*_exps for it in the file)"
