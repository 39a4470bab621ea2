"""Host memory for weights: large CPU tensors backed by 2 MiB pages where the OS offers them.

A decode step streams each weight it reads once from memory. On 4 KiB pages the cores' hardware
prefetchers stop at every page boundary and every page costs a TLB entry; on Linux's transparent
huge pages (the `madvise` mode included) a stream runs on. On the yardstick (2 threads, bf16,
`--cpu-math fast`), the checkpoint loaded on each page size in one process and decoded alternately
(bench/pages_bench.py): decode 1.061x (per-round median 1.096); a MoE layer 892 -> 807 us.

    empty(shape, dtype, device=None) -> an uninitialised tensor, as torch.empty. On the CPU, for
        2 MiB or more: its data starts on a 2 MiB boundary of a private anonymous mapping, advised
        MADV_HUGEPAGE over the tensor's bytes rounded up to whole 2 MiB pages. So it may hold up to
        2 MiB - 4 KiB more resident memory than its bytes (a tail left on small pages streamed a
        3 MB projection 20% slower). Its pages are taken at once (MADV_POPULATE_WRITE, Linux 5.14;
        `populate`), while the model is being allocated, not at each page's first write during the
        reads, when the page cache those reads fill has fragmented free memory: on a 48-layer GGUF of
        19 GB in 23 GB of RAM, 90% of the weights on 2 MiB pages against 73%, the MoE call 17.5 ->
        19.9 GB/s (bench/decode_breakdown.py --moe-gap). The mapping is unmapped when the last view of
        the storage goes.
    cat(ts) -> torch.cat(ts) (along dim 0, same dtype and device) into empty()'s memory.
    enabled: False gives torch.empty everywhere (set before a model loads; benchmarks compare).

Smaller tensors, other devices and platforms without MADV_HUGEPAGE get torch.empty.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
enabled = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")
MADV_POPULATE_WRITE = 23  # linux/mman.h (Linux 5.14); Python's mmap names it from 3.13 only
populate = True


def empty(shape, dtype: torch.dtype = torch.uint8, device=None) -> torch.Tensor:
    shape = tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if not enabled or nbytes < HUGE_PAGE or (device is not None and torch.device(device).type != "cpu"):
        return torch.empty(shape, dtype=dtype, device=device)
    try:
        m = mmap.mmap(-1, nbytes + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no address space for the slack: the allocator's own memory
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # keeps m alive as long as the storage lives
    start = (-raw.data_ptr()) % HUGE_PAGE
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    m.madvise(mmap.MADV_HUGEPAGE, start, span)
    if populate:
        try:
            m.madvise(MADV_POPULATE_WRITE, start, span)
        except OSError:  # before Linux 5.14: the pages come at first touch
            pass
    return raw[start : start + nbytes].view(dtype).view(shape)


def cat(ts: list[torch.Tensor]) -> torch.Tensor:
    first = ts[0]
    return torch.cat(
        ts, out=empty((sum(t.shape[0] for t in ts), *first.shape[1:]), first.dtype, first.device)
    )
