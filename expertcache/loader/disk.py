"""Disk tier: read one expert's byte ranges from the checkpoint's own safetensors files.

With O_DIRECT (the default where the filesystem allows it) reads bypass the page
cache, so streaming a model larger than RAM does not silently fill memory. O_DIRECT
needs offsets, lengths and buffer addresses aligned to the block size; expert ranges
in safetensors are not, so each range is widened to aligned bounds and read into a
per-thread page-aligned bounce buffer, then the wanted bytes are copied out. Where
O_DIRECT is refused (tmpfs, some overlay filesystems) reads fall back to buffered
pread followed by POSIX_FADV_DONTNEED on the range.

Reads run on a small thread pool (`submit`) so several ranges are in flight at once.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

ALIGN = 4096


class DiskReader:
    def __init__(self, o_direct: bool = True, threads: int = 4):
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="expert-io")
        self.local = threading.local()
        self.fds: dict[tuple[Path, bool], int] = {}
        self.lock = threading.Lock()
        self.bytes_read = 0
        self.direct_used = False

    def _fd(self, path: Path) -> tuple[int, bool]:
        with self.lock:
            if self.o_direct and (path, True) not in self.fds and (path, False) not in self.fds:
                try:
                    self.fds[path, True] = os.open(path, os.O_RDONLY | os.O_DIRECT)
                except OSError:
                    pass
            if (path, True) in self.fds:
                return self.fds[path, True], True
            if (path, False) not in self.fds:
                self.fds[path, False] = os.open(path, os.O_RDONLY)
            return self.fds[path, False], False

    def _bounce(self, n: int) -> mmap.mmap:
        buf = getattr(self.local, "buf", None)
        if buf is None or len(buf) < n:
            buf = mmap.mmap(-1, max(n, 1 << 20))  # anonymous mmap: page aligned
            self.local.buf = buf
        return buf

    def read_range(self, path: Path, offset: int, dst: memoryview) -> None:
        """Fill dst (len n) with bytes [offset, offset+n) of path."""
        n = len(dst)
        fd, direct = self._fd(path)
        if direct:
            start = offset - offset % ALIGN
            end = -(-(offset + n) // ALIGN) * ALIGN
            buf = self._bounce(end - start)
            try:
                got = os.preadv(fd, [memoryview(buf)[: end - start]], start)
            except OSError:  # e.g. EINVAL on a filesystem that accepted the flag but not the read
                got = -1
            if got >= offset - start + n:
                dst[:] = memoryview(buf)[offset - start : offset - start + n]
                self.direct_used = True
                self._count(n)
                return
            fd, _ = self._fd_buffered(path)
        got = os.preadv(fd, [dst], offset)
        if got != n:
            raise OSError(f"{path}: short read at byte {offset} ({got} of {n} bytes): file truncated?")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
        self._count(n)

    def _fd_buffered(self, path: Path) -> tuple[int, bool]:
        with self.lock:
            if (path, False) not in self.fds:
                self.fds[path, False] = os.open(path, os.O_RDONLY)
            return self.fds[path, False], False

    def _count(self, n: int) -> None:
        with self.lock:
            self.bytes_read += n

    def read_into(self, ranges: list[tuple[Path, int, int]], dst: torch.Tensor) -> None:
        """Read the concatenation of `ranges` into the contiguous CPU tensor dst (byte for byte)."""
        mv = memoryview(dst.view(torch.uint8).reshape(-1).numpy())
        pos = 0
        for path, off, n in ranges:
            self.read_range(path, off, mv[pos : pos + n])
            pos += n
        assert pos == dst.numel() * dst.element_size(), "ranges do not match the destination size"

    def submit(self, ranges, dst: torch.Tensor) -> Future:
        return self.pool.submit(self.read_into, ranges, dst)

    def read_parts(self, ranges: dict[str, list], dst: dict[str, torch.Tensor]) -> None:
        """One expert: every part `name` of dst from ranges[name]. Ranges of another layout than dst's
        (they have `convert`, e.g. experts.layout.StoredRanges) are read into their `scratch()` tensors,
        then converted into dst."""
        convert = getattr(ranges, "convert", None)
        if convert is not None:
            raw = ranges.scratch()
            for name, t in raw.items():
                self.read_into(ranges[name], t)
            convert(raw, dst)
            return
        for name, t in dst.items():
            self.read_into(ranges[name], t)

    def submit_parts(self, ranges: dict[str, list], dst: dict[str, torch.Tensor], then=None) -> Future:
        """read_parts on the I/O pool, then `then()` (if given) on the same thread; the future
        completes when every part is in and `then` returned."""

        def job():
            self.read_parts(ranges, dst)
            if then is not None:
                then()

        return self.pool.submit(job)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


def drop_cached(paths) -> None:
    """Ask the OS to drop what its page cache holds of these files (POSIX_FADV_DONTNEED: clean pages no
    process maps). Called before the engine allocates its weights: it copies the files' bytes into memory of
    its own or reads past the cache (O_DIRECT), so a cached copy (another program's mmap of the same
    GGUF, an earlier load) only takes the room the 2 MiB pages of hostmem.py would be made from: after
    llama.cpp had run on a 48-layer GGUF, 60-66% of the engine's weights got them, against ~90%."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # reading it names the problem
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
