"""GGUF checkpoints (llama.cpp's format) as the engine's checkpoints.

`read_config(path)` -> (arch, the config.json dict rebuilt from the metadata, with the routed experts'
quant method as a quantization_config), `open_index(path, expert_projs)` -> GGUFIndex: what
models/registry.py returns for a .gguf model argument, so build.py and plan read a GGUF file through
the same Family, ExpertSource and model code as a safetensors directory. Headers are read once per
file (cached by path, size and mtime).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from ..quant.ggml import mixed_method
from ..quant.ggml_blocks import METHODS
from .families import ARCHES, Arch, hf_config
from .index import GGUFIndex
from .reader import GGUFFile, is_gguf, read_gguf

__all__ = ["ARCHES", "GGUFIndex", "is_gguf", "open_index", "read_config", "read_header"]

_CACHE: dict[tuple, GGUFFile] = {}


def read_header(path: str | Path) -> GGUFFile:
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CACHE:
        _CACHE.clear()  # one model at a time: the tokenizer arrays are large
        _CACHE[key] = read_gguf(path)
    return _CACHE[key]


def expert_types(gf: GGUFFile) -> dict[tuple[int, str], str]:
    """(layer, gate|up|down) -> ggml type name of the routed-expert weight stacks."""
    from .names import expert_piece, expert_stack

    out: dict[tuple[int, str], str] = {}
    for t in gf.tensors.values():
        s, p = expert_stack(t.name), expert_piece(t.name)
        if s is not None and s[2] == "weight":
            out[s[0], s[1]] = t.type.name
        elif p is not None and out.setdefault((p[0], p[1]), t.type.name) != t.type.name:
            raise CheckpointError(
                f"{gf.path}: tensor {t.name} is {t.type.name}, the layer's other "
                f"ffn_{p[1]} experts {out[p[0], p[1]]}; one layer's experts share one type"
            )
    return out


def _quantization(path: Path, gf: GGUFFile) -> dict | None:
    """The experts' QuantMethod as a quantization_config (None: float experts, or none): one block type
    per projection in every layer -> that type's method (or gguf-mixed per projection); types that
    differ between layers (llama-quantize's Q4_K_M: ffn_down_exps Q6_K in some layers, Q4_K in others)
    or a type no kernel reads (converted at load: quant/ggml.py tier_type) -> gguf-layers, each layer's
    parts keyed by their type (quant/ggml.py)."""
    types = expert_types(gf)
    if not types:
        return None
    per_proj: dict[str, set[str]] = {}
    for (_, proj), t in types.items():
        per_proj.setdefault(proj, set()).add(t)
    stacks = set(per_proj)
    if "gate_up" in stacks:
        stacks |= {"gate", "up"}
        stacks.discard("gate_up")
    if stacks != {"gate", "up", "down"}:
        raise CheckpointError(
            f"{path}: routed experts have stacks {sorted(per_proj)}; expected blk.N.ffn_gate_exps, "
            "ffn_up_exps and ffn_down_exps"
        )
    floats = {"F32", "F16", "BF16"}
    every = set().union(*per_proj.values())
    if every <= floats:  # plain experts (ExpertSource refuses layers of different float dtypes)
        return None
    if every & floats:
        raise CheckpointError(
            f"{path}: routed experts mix float and block types ({', '.join(sorted(every))}); "
            "expected one float type or block types only"
        )
    if any(len(ts) > 1 for ts in per_proj.values()) or not every <= set(METHODS):  # per layer, or converted
        return {"quant_method": "expertcache", "experts": "gguf-layers"}
    one = {p: next(iter(ts)) for p, ts in per_proj.items()}
    if "gate_up" in one:  # blk.N.ffn_gate_up_exps in every layer
        one.update(gate=one["gate_up"], up=one.pop("gate_up"))
    return {"quant_method": "expertcache", "experts": mixed_method(one)}


def read_config(path: str | Path) -> tuple[Arch, dict]:
    path = Path(path)
    gf = read_header(path)
    emb = gf.tensors.get("token_embd.weight")
    if emb is None:
        raise CheckpointError(f"{path}: missing tensor token_embd.weight")
    arch, hf = hf_config(path, gf.metadata, gf.tensors, emb.dims[-1])
    q = _quantization(path, gf)
    if q is not None:
        hf["quantization_config"] = q
    return arch, hf


def open_index(path: str | Path, expert_projs: tuple[str, str, str]) -> GGUFIndex:
    gf = read_header(path)
    return GGUFIndex(gf, ARCHES[gf.metadata["general.architecture"]], expert_projs)
