"""Disk tier: byte-exact reads of arbitrary (unaligned) ranges with O_DIRECT and the buffered fallback."""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest
import torch

from expertcache.loader.disk import DiskReader
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
