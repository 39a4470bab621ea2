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
    """The experts' QuantMethod as a quantization_config (None: float experts, or none)."""
    types = expert_types(gf)
    if not types:
        return None
    per_proj: dict[str, set[str]] = {}
    for (_, proj), t in types.items():
        per_proj.setdefault(proj, set()).add(t)
    mixed = {p: sorted(ts) for p, ts in per_proj.items() if len(ts) > 1}
    if mixed:
        p, ts = next(iter(mixed.items()))
        layers = {t: sorted(la for (la, q), tt in types.items() if q == p and tt == t) for t in ts}
        raise CheckpointError(
            f"{path}: routed experts blk.N.ffn_{p}_exps differ in type across layers "
            f"({'; '.join(f'{t} in layers {ls[:6]}' + ('...' if len(ls) > 6 else '') for t, ls in layers.items())}); "
            "every layer's experts of one projection must share one type (the expert slots "
            "hold one layout per projection)"
        )
    one = {p: next(iter(ts)) for p, ts in per_proj.items()}
    if "gate_up" in one and not ({"gate", "up"} & set(one)):  # blk.N.ffn_gate_up_exps
        one.update(gate=one["gate_up"], up=one.pop("gate_up"))
    if set(one) != {"gate", "up", "down"}:
        raise CheckpointError(
            f"{path}: routed experts have stacks {sorted(one)}; expected blk.N.ffn_gate_exps, "
            "ffn_up_exps and ffn_down_exps"
        )
    floats = {"F32", "F16", "BF16"}
    if set(one.values()) <= floats:
        return None
    if set(one.values()) & floats:
        raise CheckpointError(f"{path}: routed experts mix float and block types {one}")
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
