"""Disk tier: byte-exact reads of arbitrary (unaligned) ranges with O_DIRECT and the buffered fallback."""

from __future__ import annotations

import ctypes
import mmap
import os
import random
from pathlib import Path

import pytest
import torch

from expertcache.loader.disk import DiskReader, drop_cached
from expertcache.loader.safetensors_index import TensorIndex


@pytest.fixture(scope="module")
def blob(tmp_path_factory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("disk") / "blob.bin"
    data = random.Random(0).randbytes(3 * 1024 * 1024 + 123)
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("o_direct", [True, False])
def test_random_ranges_are_byte_exact(blob, o_direct):
    path, data = blob
    reader = DiskReader(o_direct=o_direct, threads=3)
    rng = random.Random(1)
    for _ in range(50):
        ranges = []
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(1, 300_000)
            off = rng.randint(0, len(data) - n)
            ranges.append((path, off, n))
        dst = torch.empty(sum(n for _, _, n in ranges), dtype=torch.uint8)
        reader.submit(ranges, dst).result()
        assert bytes(dst.numpy()) == b"".join(data[o : o + n] for _, o, n in ranges)
    # O_DIRECT is taken exactly where this filesystem supports it (ext4/xfs do; some tmpfs and overlay
    # filesystems refuse it and the reader falls back), and the open descriptor really carries the flag
    supported = o_direct_supported(path)
    assert reader.direct_used == (o_direct and supported)
    flags = [fd_flags(fd) for fd in reader.fds.values()]
    assert flags and all(bool(f & os.O_DIRECT) == (o_direct and supported) for f in flags), flags
    reader.close()


def o_direct_supported(path: Path) -> bool:
    """Independently of DiskReader: open with O_DIRECT and read one aligned block."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, 4096)  # page aligned
        return os.preadv(fd, [buf], 0) == 4096
    except OSError:
        return False
    finally:
        os.close(fd)


def fd_flags(fd: int) -> int:
    """The open flags of this process's descriptor `fd`, as the kernel reports them."""
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    raise AssertionError(f"no flags line in /proc/self/fdinfo/{fd}")


def test_reads_an_expert_into_a_typed_slot(checkpoint):
    from expertcache.experts.layout import ExpertSource
    from expertcache.models.registry import read_config

    ckpt = checkpoint("qwen3_moe", dtype=torch.bfloat16)
    family, cfg, _ = read_config(ckpt)
    source = ExpertSource(TensorIndex(ckpt), cfg, family.names)
    reader = DiskReader()
    slot = torch.empty(source.parts[0].shape, dtype=source.parts[0].dtype)
    reader.read_into(source.ranges(0, 3)["gate_up"], slot)
    from safetensors.torch import load_file

    ref = load_file(str(next(ckpt.glob("*.safetensors"))))
    p = "model.layers.0.mlp.experts.3"
    assert torch.equal(slot, torch.cat([ref[f"{p}.gate_proj.weight"], ref[f"{p}.up_proj.weight"]]))
    reader.close()


def test_short_read_names_the_file(blob, tmp_path):
    path, data = blob
    short = tmp_path / "short.bin"
    short.write_bytes(data[:1000])
    reader = DiskReader(o_direct=False)
    with pytest.raises(OSError, match="short.bin"):
        reader.read_into([(short, 900, 500)], torch.empty(500, dtype=torch.uint8))
    reader.close()


def _fs_type(path: Path) -> str:
    """The type of the filesystem holding path (the longest mount point above it in /proc/mounts)."""
    mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    above = [(len(m), t) for m, t in mounts if str(path).startswith(m.rstrip("/") + "/")]
    return max(above)[1] if above else "unknown"


def _cached_pages(path: Path) -> int:
    """Pages of the file in the page cache (mincore over a mapping of it: no page is read or faulted)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        del addr
        return sum(v & 1 for v in vec)


def test_drop_cached_leaves_none_of_a_read_file_in_the_page_cache(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(4 << 20))
    with open(path, "rb") as f:
        os.fsync(f.fileno())  # clean pages: the only kind an advice can drop
        f.read()
    if _fs_type(path) in ("tmpfs", "ramfs") or _cached_pages(path) == 0:
        pytest.skip(f"{_fs_type(path)}: no page cache to drop here")
    drop_cached([path, tmp_path / "missing.bin"])  # a missing file: nothing to drop, no error
    assert _cached_pages(path) == 0
