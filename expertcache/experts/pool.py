"""SlotPool: one tier's slot bytes (which op writes or reads a slot when: experts/schedule.py).

Shape legend: L = MoE layers, S = slots per layer, part = one stored tensor of an expert (e.g. gate_up
[2I, H]); `buf[part]` is [L, S, *part.shape], `views(i, s)[part]` is [*part.shape] (layer i, slot s),
`layer(i)[part]` is [S, *part.shape].

Layers of different layouts (`parts` a layout.LayerParts: a GGUF file whose expert types differ between
layers): the layers of each distinct layout are one group with its own [Lg, S, *part.shape] buffers
(`groups`), so every slot holds exactly its layer's expert bytes; `views` / `layer` index the layer's
group, and `buf` is {(group, part): buffer}.

Memory:
- a device tier on a GPU: one torch.empty per part on that device;
- a tier in host RAM (the CPU device tier, and every host tier): ONE region for all its parts
  (hostmem.empty: 2 MiB pages where the OS offers them), each part starting on a 4 KiB page
  boundary. `nbytes` = the slot bytes (L * S * bytes per expert), `reserved_bytes` = the region's
  length = each part's bytes rounded up to 4 KiB: never more than PAGE - 1 bytes per part above
  `nbytes`, and nothing rounded to a power of two;
- `pin=True` (the compute device is CUDA): the region is registered with the CUDA runtime
  (cudaHostRegister) so copies from it to the device are asynchronous DMA, in chunks that never cut
  a slot (`pin_chunks`): each part's bytes alone, split only between whole slots at page boundaries
  into chunks of about PIN_CHUNK bytes (a part whose slots never end on a page is registered whole).
  So every copy of one slot's part lies in one registration (CUDA defines a copy from a range that
  spans two registrations nowhere). PyTorch's own pinned allocator (`pin_memory=True`) rounds every block up to
  a power of two: 54 GiB of Qwen3-30B-A3B experts would lock 96 GiB; this locks `reserved_bytes`.
  `pinned_bytes` is what is locked. If a chunk cannot be registered (locked-memory limit, RAM),
  every registered chunk is released, a note is printed and the tier stays pageable:
  `pinned` False (a pageable host -> device copy is slower and blocks the host: the cost model
  may price it so). Registration is released when the pool is collected.
"""

from __future__ import annotations

import math
import sys
import weakref

import torch

from .. import hostmem
from ..units import fmt_bytes
from .layout import LayerParts, parts_at, parts_nbytes

PAGE = 4096  # each part of a host region starts on a page boundary
PIN_CHUNK = 1 << 30  # about this many bytes registered with the CUDA runtime per call (whole slots)


def cuda_host_register(ptr: int, nbytes: int) -> bool:
    """Page-lock host bytes [ptr, ptr + nbytes) for the CUDA runtime -> whether it worked."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0


def cuda_host_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def clear_cuda_error() -> None:
    """A failed runtime call (a refused cudaHostRegister) stays the runtime's last error, which torch's
    next kernel-launch check would raise on an unrelated kernel: one launch here takes it."""
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


def pin_chunks(parts: list[tuple[int, int, int]], total: int) -> list[tuple[int, int]]:
    """The registrations of a region of `total` bytes holding `parts` [(offset, slot bytes, slots)] (each
    offset on a page, in order) -> (offset, length) chunks covering [0, total) in order. A chunk is a
    whole number of one part's slots and starts and ends on a page (two registrations never share one):
    a part is split every lcm(slot bytes, PAGE) * n bytes (n slots' worth of about PIN_CHUNK bytes, at
    least one such step), its last chunk running to the next part's offset (or the region's end)."""
    out = []
    for j, (off, slot, n) in enumerate(parts):
        end = parts[j + 1][0] if j + 1 < len(parts) else total
        if off % PAGE or end < off + slot * n:
            raise ValueError(
                f"pin_chunks: part {j} at byte {off} ({n} slots of {slot} B) is not page-aligned "
                f"or overruns byte {end}"
            )
        step = math.lcm(slot, PAGE) if slot else end - off
        step *= max(1, PIN_CHUNK // step)
        out += [(o, min(step, end - o)) for o in range(off, end, step)] if end > off else []
        if out and out[-1][0] + out[-1][1] != end:
            raise AssertionError("pin_chunks: chunks do not cover the part")
    return out


def _release(ptrs: list[int], keep: torch.Tensor) -> None:
    """Unregister the chunks at `ptrs` (`keep`: the region, alive until they are unregistered)."""
    for p in ptrs:
        cuda_host_unregister(p)


class SlotPool:
    """One tier's bytes: per part a [layers, slots, ...] buffer (`buf`). See the module docstring for
    memory."""

    def __init__(self, parts, layers: int, slots: int, device: torch.device, pin: bool = False):
        self.device = device
        self.pinned = False
        self.pinned_bytes = 0
        self.region: torch.Tensor | None = None  # host tiers: the uint8 bytes every part lives in
        self.offsets: dict = {}  # host tiers: part (or (group, part)) -> its byte offset in the region
        self.layout: list[tuple[int, int, int]] = []  # host tiers: (offset, slot bytes, slots) per part
        if isinstance(parts, LayerParts) and len(parts) != layers:
            raise ValueError(f"SlotPool: parts of {len(parts)} layers for {layers} layers")
        by_layout: dict[tuple, list[int]] = {}
        for i in range(layers):
            by_layout.setdefault(tuple(parts_at(parts, i)), []).append(i)
        # (layer indices, parts) per group; `where[i]` = (group, index in it); None: one group
        self.group_parts = [(ls, ps) for ps, ls in by_layout.items()] or [([], tuple(parts_at(parts, 0)))]
        self.where = (
            None
            if len(self.group_parts) == 1
            else {i: (g, j) for g, (ls, _) in enumerate(self.group_parts) for j, i in enumerate(ls)}
        )
        self.nbytes = slots * sum(len(ls) * parts_nbytes(ps) for ls, ps in self.group_parts)
        if device.type == "cpu":
            groups = self._host_region(slots)
            self.reserved_bytes = self.region.numel()
        else:
            if pin:
                raise ValueError("SlotPool: pin=True is for a tier in host RAM, not on device " + str(device))
            groups = [
                {p.name: torch.empty((len(ls), slots, *p.shape), dtype=p.dtype, device=device) for p in ps}
                for ls, ps in self.group_parts
            ]
            self.reserved_bytes = self.nbytes
        self.groups = groups
        self.buf = (
            groups[0]
            if self.where is None
            else {(g, n): t for g, b in enumerate(groups) for n, t in b.items()}
        )
        if pin:
            self._pin()
        self._layers_of: dict | None = None  # the `buf` dict the per-layer views were made from
        self._layers: list[dict[str, torch.Tensor]] = []

    def _host_region(self, slots: int) -> list[dict[str, torch.Tensor]]:
        total, spans = 0, []
        one = self.where is None
        for g, (ls, parts) in enumerate(self.group_parts):
            for p in parts:
                n = len(ls) * slots * p.nbytes
                self.offsets[p.name if one else (g, p.name)] = total
                self.layout.append((total, p.nbytes, len(ls) * slots))
                spans.append((g, p, total, n))
                total += -(-n // PAGE) * PAGE
        self.region = hostmem.empty((total,), torch.uint8)
        groups: list[dict[str, torch.Tensor]] = [{} for _ in self.group_parts]
        for g, p, off, n in spans:
            groups[g][p.name] = (
                self.region[off : off + n].view(p.dtype).view(len(self.group_parts[g][0]), slots, *p.shape)
            )
        return groups

    def _pin(self) -> None:
        base, done = self.region.data_ptr(), []
        for off, n in pin_chunks(self.layout, self.region.numel()):
            if not cuda_host_register(base + off, n):
                clear_cuda_error()
                _release(done, self.region)
                print(
                    f"note: could not page-lock the host tier ({fmt_bytes(self.region.numel())}, failed at "
                    f"byte {off}); it stays in pageable memory, so host -> device copies are slower and "
                    "block the host (raise `ulimit -l` or lower --host-memory to pin it)",
                    file=sys.stderr,
                )
                return
            done.append(base + off)
        self.pinned, self.pinned_bytes = True, self.region.numel()
        weakref.finalize(self, _release, done, self.region)

    def _at(self, i: int) -> tuple[dict[str, torch.Tensor], int]:
        """Layer i's group buffers and its index in them."""
        if self.where is None:
            return self.buf, i
        g, j = self.where[i]
        return self.groups[g], j

    def views(self, i: int, s: int) -> dict[str, torch.Tensor]:
        b, j = self._at(i)
        return {n: t[j, s] for n, t in b.items()}

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's slots {part: [slots, ...]} (the same dict every call: do not modify it).
        The views are made once per `buf` (the same tensor objects every step, so the kernels build
        their weight specs once per layer: kernels.moe caches them by these objects); assigning a new
        `buf` dict makes new ones (one layout)."""
        if self._layers_of is not self.buf:
            n = len(self.where) if self.where is not None else len(next(iter(self.buf.values())))
            self._layers = []
            for k in range(n):
                b, j = self._at(k)
                self._layers.append({name: t[j] for name, t in b.items()})
            self._layers_of = self.buf
        return self._layers[i]
