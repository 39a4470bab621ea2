"""The GGUF container, read from its header alone (no tensor byte is touched).

Layout (little-endian; GGUF v2/v3, the only versions llama.cpp writes):
    u32 magic "GGUF" | u32 version | u64 tensor count | u64 metadata count
    metadata:  string key, u32 value type, value             (strings: u64 length + UTF-8 bytes;
               arrays: u32 element type, u64 count, elements; value types: VALUE_TYPES)
    tensors:   string name, u32 n_dims, u64 dims[n_dims] (ggml order: dims[0] = the row length),
               u32 ggml type (types.py), u64 offset (from the data section's start)
    padding to `general.alignment` (default 32), then the data section.
A split set (`name-00001-of-00003.gguf`) is that layout per file; the first file holds the model's
metadata, every file its own tensors. `read_gguf(path)` -> `GGUFFile` with every tensor's absolute
byte range checked against its file's size; errors are one line naming the file and the tensor.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from ..quant.ggml_blocks import TYPES, GGMLType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type id -> (name, struct format or None for string / array)
VALUE_TYPES = {
    0: ("u8", "<B"),
    1: ("i8", "<b"),
    2: ("u16", "<H"),
    3: ("i16", "<h"),
    4: ("u32", "<I"),
    5: ("i32", "<i"),
    6: ("f32", "<f"),
    7: ("bool", "<?"),
    8: ("string", None),
    9: ("array", None),
    10: ("u64", "<Q"),
    11: ("i64", "<q"),
    12: ("f64", "<d"),
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
MAX_STRING = 1 << 30
_U64 = struct.Struct("<Q")  # a longer string or array is a corrupt header, not a model


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: GGMLType
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length
    file: Path
    offset: int  # absolute byte offset in `file`
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The torch / Hugging Face order: [..., rows, row length]."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFFile:
    path: Path  # the first file of a split set
    files: list[Path]
    version: int
    metadata: dict = field(default_factory=dict)
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)


class _Reader:
    """Sequential little-endian reads from a header (buffered); every short read is a truncated file."""

    def __init__(self, path: Path, f):
        self.path, self.f = path, f
        self.size = path.stat().st_size

    def take(self, n: int, what: str) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise CheckpointError(f"{self.path}: truncated GGUF file (header ends inside {what})")
        return b

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        if n > MAX_STRING or n > self.size:
            raise CheckpointError(f"{self.path}: corrupt GGUF header ({what}: string of {n} bytes)")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: corrupt GGUF header ({what} is not UTF-8)") from None

    def value(self, vtype: int, what: str):
        if vtype not in VALUE_TYPES:
            raise CheckpointError(f"{self.path}: metadata {what} has unknown value type {vtype}")
        fmt = VALUE_TYPES[vtype][1]
        if fmt is not None:
            return self.scalar(fmt, what)
        if vtype == 8:
            return self.string(what)
        etype, n = self.scalar("<I", what), self.scalar("<Q", what)
        if n > MAX_STRING or n > self.size:
            raise CheckpointError(f"{self.path}: corrupt GGUF header ({what}: array of {n} elements)")
        if etype in _NUMPY:
            dt = np.dtype(_NUMPY[etype])
            return np.frombuffer(self.take(n * dt.itemsize, what), dtype=dt).tolist()
        if etype == 8:  # (a vocabulary: 150k+ strings; the plain loop, without per-item method calls)
            return self._strings(n, what)
        return [self.value(etype, what) for _ in range(n)]

    def _strings(self, n: int, what: str) -> list[str]:
        read, length, out = self.f.read, _U64.unpack, []
        try:
            for _ in range(n):
                k = length(read(8))[0]
                b = read(k)
                if len(b) != k:
                    break
                out.append(b.decode("utf-8"))
        except (struct.error, UnicodeDecodeError):
            out = []
        if len(out) != n:
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF header (in {what})")
        return out


def split_files(path: Path) -> list[Path]:
    """The files of a split set named by its first (`-00001-of-0000N.gguf`), else [path]."""
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    if int(m["i"]) != 1:
        raise CheckpointError(
            f"{path}: part {int(m['i'])} of a split GGUF set; give the first part "
            f"({m['stem']}-00001-of-{m['n']}.gguf)"
        )
    n = int(m["n"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF set of {n} files lacks {', '.join(missing)}")
    return files


def _read_one(path: Path, out: GGUFFile, first: bool) -> None:
    with open(path, "rb", buffering=1 << 20) as f:
        r = _Reader(path, f)
        if r.take(4, "the magic") != MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (no 'GGUF' magic)")
        version = r.scalar("<I", "the version")
        if version not in (2, 3):
            raise CheckpointError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
        n_tensors, n_kv = r.scalar("<Q", "the tensor count"), r.scalar("<Q", "the metadata count")
        if n_tensors > r.size or n_kv > r.size:
            raise CheckpointError(
                f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata entries)"
            )
        meta = {}
        for _ in range(n_kv):
            key = r.string("a metadata key")
            meta[key] = r.value(r.scalar("<I", f"metadata {key}"), key)
        if first:
            out.version, out.metadata = version, meta
        align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align < 1 or align & (align - 1):
            raise CheckpointError(f"{path}: general.alignment {align!r} is not a power of two")
        table = []
        for _ in range(n_tensors):
            name = r.string("a tensor name")
            n_dims = r.scalar("<I", f"tensor {name}")
            if n_dims > 8:
                raise CheckpointError(f"{path}: tensor {name} has {n_dims} dims (corrupt header)")
            dims = tuple(r.scalar("<Q", f"tensor {name}") for _ in range(n_dims))
            type_id, offset = r.scalar("<I", f"tensor {name}"), r.scalar("<Q", f"tensor {name}")
            table.append((name, dims, type_id, offset))
        data = -(-r.f.tell() // align) * align
    for name, dims, type_id, offset in table:
        t = TYPES.get(type_id)
        if t is None:
            raise CheckpointError(f"{path}: tensor {name} has unknown ggml type id {type_id}")
        if dims and dims[0] % t.block:
            raise CheckpointError(
                f"{path}: tensor {name} ({t.name}) has rows of {dims[0]} elements, not a "
                f"multiple of its block of {t.block}"
            )
        rows = 1
        for d in dims[1:]:
            rows *= d
        nbytes = rows * t.row_bytes(dims[0] if dims else 1)
        if offset % align:
            raise CheckpointError(f"{path}: tensor {name} data offset {offset} is not aligned to {align}")
        if data + offset + nbytes > r.size:
            raise CheckpointError(
                f"{path}: truncated GGUF file (tensor {name} ends at byte {data + offset + nbytes}, "
                f"file has {r.size})"
            )
        if name in out.tensors:
            raise CheckpointError(f"{path}: tensor {name} appears twice")
        out.tensors[name] = GGUFTensor(name, t, dims, path, data + offset, nbytes)


def read_gguf(path: str | Path) -> GGUFFile:
    """Header, metadata and tensor table of a .gguf file (every file of a split set)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"missing GGUF file {path}")
    files = split_files(path)
    out = GGUFFile(path, files, 0)
    for i, f in enumerate(files):
        _read_one(f, out, first=i == 0)
    return out


def is_gguf(path: str | Path) -> bool:
    """A model argument naming a GGUF file (by its name: `.gguf`)."""
    p = Path(path)
    return p.suffix == ".gguf" and p.is_file()
