"""Rows of one 2-D checkpoint tensor read from disk on demand (the embedding table under --low-memory).

Shapes: V = the tensor's rows (vocab), H = its columns (hidden size), T = ids asked for, U = distinct ids.

An embedding table is only gathered from, one row per token: a step needs T rows of H elements, never
the V x H table (gpt-oss-20b: 201088 x 2880 bf16 = 1.16 GB). `RowReader.rows(ids)` reads each distinct
id once with os.pread (ids that follow each other in the tensor in one read), straight into the result.

Page cache, not O_DIRECT (the expert tier's loader/disk.py): a row is H x itemsize bytes (5.6 KiB for
gpt-oss-20b), not a multiple of the 4 KiB blocks O_DIRECT needs, so every row would be widened to two or
three blocks through a bounce buffer and read from the device again at every use, while a chat repeats
the same few thousand tokens. Buffered reads keep the rows in use in the page cache, which a memory
cgroup charges but reclaims (clean pages, no writeback) before it kills anything; the anonymous memory
the process holds for the table is nil. The descriptor is advised POSIX_FADV_RANDOM, so a row read does
not pull the kernel's read-ahead window (up to 128 KiB) of rows nobody asked for into that cache.

A GGUF table in a block type (Q4_0, Q4_K, Q6_K, ...) is read the same way: row r is its r-th row of
blocks, a contiguous byte range (H / block elements x block bytes), decoded after the read (by the
`decode` it is given: quant/ggml.py's) into the float32 the index lists it as.

Invariants:
- the tensor is stored row-major as its dtype (a plain safetensors tensor) or as rows of ggml blocks
  (`readable`), so row r is bytes [offset + r x row bytes, + row bytes) of its file;
- rows come back in the stored dtype, float32 for blocks (converting is the caller's, exactly as after
  a resident gather);
- an id outside [0, V) is refused naming the id before any read (it would read another tensor's bytes);
- with check_finite, a row holding NaN/inf is refused naming the tensor, the row (token id) and the file.
The file is opened once (a checkpoint replaced on disk after the load is not seen) and closed with the
reader.
"""

from __future__ import annotations

import math
import os
import weakref

import torch

from ..errors import CheckpointError
from .checks import SKIP_HINT
from .safetensors_index import TensorInfo

ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp8 would need its scale: not read by rows


def row_blocks(info: TensorInfo):
    """The ggml type (quant/ggml_blocks.py GGMLType) of a 2-D GGUF tensor stored as rows of blocks in
    order (gguf/index.py GGUFInfo: its `type`, rows not permuted), else None."""
    t = getattr(info, "type", None)
    if t is None or t.block == 1 or len(info.shape) != 2 or getattr(info, "permute_heads", 0):
        return None
    return t if info.nbytes == info.shape[0] * t.row_bytes(info.shape[1]) else None


def readable(info: TensorInfo) -> bool:
    """info is a plain 2-D float tensor whose bytes are its rows in order (not a view over other
    stored tensors, e.g. a quantized module's PackedInfo, whose nbytes are its stored parts'), or a
    GGUF table of blocks (`row_blocks`)."""
    return len(info.shape) == 2 and (
        (info.dtype in ROW_DTYPES and info.nbytes == math.prod(info.shape) * info.dtype.itemsize)
        or row_blocks(info) is not None
    )


class RowReader:
    """rows(ids [T]) -> [T, H] in the stored dtype (float32 for blocks), read from the checkpoint's file."""

    def __init__(self, info: TensorInfo, check_finite: bool = True, decode=None):
        """`decode(type name, blocks uint8 [N, block bytes]) -> float32 [N, block]`: a table of blocks'
        decoder (quant/ggml.py `decode`, passed in: the loader sits below quant)."""
        if not readable(info):
            raise ValueError(
                f"{info.file.name}: tensor {info.name} ({info.dtype}, shape {list(info.shape)}) is not "
                "a plain 2-D float tensor or a GGUF table of blocks; its rows cannot be read one by one"
            )
        self.info, self.check_finite = info, check_finite
        self.num_rows, self.row_len = info.shape
        self.blocks = row_blocks(info)  # None: rows stored as info.dtype
        if self.blocks is not None and decode is None:
            raise ValueError(
                f"{info.file.name}: tensor {info.name} is {self.blocks.name} blocks: RowReader needs their decoder"
            )
        self.decode = decode
        self.row_bytes = info.nbytes // self.num_rows
        self.fd = os.open(info.file, os.O_RDONLY)
        self._close = weakref.finalize(self, os.close, self.fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, info.offset, info.nbytes, os.POSIX_FADV_RANDOM)
        self.bytes_read = 0

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] integer token ids -> [T, H] (the stored dtype); each distinct id read once."""
        flat = ids.reshape(-1).cpu()
        if flat.is_floating_point() or flat.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got {flat.dtype}")
        if flat.numel() == 0:
            return torch.empty(*ids.shape, self.row_len, dtype=self.info.dtype)
        uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)  # [U], [T]
        u = uniq.tolist()
        if u[0] < 0 or u[-1] >= self.num_rows:
            bad = u[0] if u[0] < 0 else u[-1]
            raise ValueError(
                f"token id {bad} is outside the vocabulary [0, {self.num_rows}) of tensor "
                f"{self.info.name} ({self.info.file.name})"
            )
        raw = torch.empty(len(u), self.row_bytes, dtype=torch.uint8)  # [U, row bytes]
        dst = memoryview(raw.reshape(-1).numpy())
        # runs of consecutive ids, one read each: run k is u[starts[k]:starts[k + 1]]
        starts = [0, *(i for i in range(1, len(u)) if u[i] != u[i - 1] + 1), len(u)]
        for a, b in zip(starts, starts[1:]):
            self._read(u[a], dst[a * self.row_bytes : b * self.row_bytes])
        if self.blocks is None:
            out = raw.view(self.info.dtype)  # [U, H]
        else:
            out = self.decode(self.blocks.name, raw.view(-1, self.blocks.block_bytes)).view(
                len(u), self.row_len
            )
        if self.check_finite:
            self._check(u, out)
        return out.index_select(0, inverse).reshape(*ids.shape, self.row_len)

    def _read(self, first: int, dst: memoryview) -> None:
        """Rows first.. into dst (a whole number of rows)."""
        pos, offset = 0, self.info.offset + first * self.row_bytes
        while pos < len(dst):
            got = os.preadv(self.fd, [dst[pos:]], offset + pos)
            if got <= 0:
                raise CheckpointError(
                    f"{self.info.file}: short read of tensor {self.info.name} rows from {first} "
                    f"(byte {offset + pos}): file truncated?"
                )
            pos += got
        self.bytes_read += pos

    def _check(self, u: list[int], out: torch.Tensor) -> None:
        """out [U, H]: row k is token u[k]."""
        finite = torch.isfinite(out).all(-1)  # [U]
        if not bool(finite.all()):
            token = u[int(torch.nonzero(~finite)[0])]
            raise CheckpointError(
                f"{self.info.file.name}: tensor {self.info.name} row {token} (token id {token}) "
                f"holds non-finite values (NaN or inf); {SKIP_HINT}"
            )

    def close(self) -> None:
        self._close()
