"""experts/pool.py: a host tier is one region of exact size; slot views address it byte for byte;
page-locking goes in chunks of whole slots (no slot's bytes in two registrations) and falls back to
pageable memory (the CUDA runtime calls are
replaced by recorders: no GPU needed)."""

from __future__ import annotations

import gc

import pytest
import torch

from expertcache.experts import pool as pool_mod
from expertcache.experts.layout import Part
from expertcache.experts.pool import PAGE, SlotPool

# odd shapes and mixed dtypes: part sizes that are not multiples of the page or of each other
PARTS = [
    Part("gate_up", (6, 5), torch.bfloat16),
    Part("down", (5, 3), torch.float32),
    Part("scale", (7,), torch.uint8),
]
L, S = 3, 4


def expected_offsets(parts, layers, slots):
    """Each part's start in the region, from the stated layout: parts in order, each on a 4 KiB boundary."""
    out, at = {}, 0
    for p in parts:
        out[p.name] = at
        n = layers * slots * p.nbytes
        at += (n + PAGE - 1) // PAGE * PAGE
    return out, at


def random_bytes(p: Part, gen) -> torch.Tensor:
    raw = torch.randint(0, 256, (p.nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(p.dtype).view(p.shape)


def test_views_address_each_slot_byte_exact_in_the_region():
    pool = SlotPool(PARTS, L, S, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    written = {}
    for i in range(L):
        for s in range(S):
            for p in PARTS:
                written[p.name, i, s] = random_bytes(p, gen)
                pool.views(i, s)[p.name].copy_(written[p.name, i, s])
    offsets, total = expected_offsets(PARTS, L, S)
    assert pool.offsets == offsets
    # read the region back chunk by chunk (as it is page-locked), compare with the stated layout
    region = bytes(torch.cat([pool.region[o : o + n] for o, n in _chunks(total, 1000)]).numpy())
    for (name, i, s), t in written.items():
        p = next(q for q in PARTS if q.name == name)
        at = offsets[name] + (i * S + s) * p.nbytes
        assert region[at : at + p.nbytes] == bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy()), (
            name,
            i,
            s,
        )
    # the per-layer views are the same memory
    for (name, i, s), t in written.items():
        assert torch.equal(pool.layer(i)[name][s].view(torch.uint8), t.view(torch.uint8))


def _chunks(total, chunk):
    return [(o, min(chunk, total - o)) for o in range(0, total, chunk)]


def test_byte_accounting_is_exact_and_never_a_power_of_two():
    pool = SlotPool(PARTS, L, S, torch.device("cpu"))
    nbytes = L * S * (6 * 5 * 2 + 5 * 3 * 4 + 7)
    assert pool.nbytes == nbytes
    assert pool.reserved_bytes == pool.region.numel() == expected_offsets(PARTS, L, S)[1]
    assert pool.reserved_bytes - nbytes < PAGE * len(PARTS)
    # one allocation: every part lives in the region's storage
    base = pool.region.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in pool.buf.values())
    # a tier just above a power of two (3 MiB + a little) is not rounded to 4 MiB
    big = [Part("w", (1536 * 1024 + 3,), torch.bfloat16)]
    p2 = SlotPool(big, 1, 1, torch.device("cpu"))
    assert p2.nbytes == 3 * 2**20 + 6
    assert p2.reserved_bytes == 3 * 2**20 + PAGE
    assert p2.pinned is False and p2.pinned_bytes == 0


class FakeRuntime:
    """Records cudaHostRegister / cudaHostUnregister calls; `fail_at`: the call index that fails."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.registered, self.unregistered = fail_at, [], []

    def register(self, ptr, n):
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            return False
        self.registered.append((ptr, n))
        return True

    def unregister(self, ptr):
        self.unregistered.append(ptr)


@pytest.fixture
def runtime(monkeypatch):
    def make(fail_at=None, chunk=8192):
        rt = FakeRuntime(fail_at)
        monkeypatch.setattr(pool_mod, "cuda_host_register", rt.register)
        monkeypatch.setattr(pool_mod, "cuda_host_unregister", rt.unregister)
        monkeypatch.setattr(pool_mod, "clear_cuda_error", lambda: None)
        monkeypatch.setattr(pool_mod, "PIN_CHUNK", chunk)
        return rt

    return make


def containing(regs, lo, hi):
    """The registrations [(ptr, n)] that hold any byte of [lo, hi)."""
    return [(p, n) for p, n in regs if p < hi and lo < p + n]


def assert_registrations_tile(regs, base, total):
    """In order, contiguous, page-aligned, covering [base, base + total) exactly."""
    at = base
    for p, n in regs:
        assert p == at and (p - base) % PAGE == 0 and n > 0 and n % PAGE == 0, (p - base, n)
        at += n
    assert at == base + total


# page-multiple slots (split into chunks of whole slots), slots that tile pages four to one, and odd ones
PIN_PARTS = [
    Part("gate_up", (2, 1024), torch.bfloat16),
    Part("down", (512,), torch.bfloat16),
    Part("scale", (7,), torch.uint8),
]


def test_pinned_region_is_registered_in_slot_aligned_chunks_and_released(runtime):
    rt = runtime(chunk=3 * 8192)
    pool = SlotPool(PIN_PARTS, 5, 6, torch.device("cpu"), pin=True)
    base, total = pool.region.data_ptr(), pool.reserved_bytes
    assert pool.pinned and pool.pinned_bytes == total
    assert_registrations_tile(rt.registered, base, total)
    # every copy the engine makes from a host slot (one part of one slot) lies in exactly one registration
    for i in range(5):
        for s in range(6):
            for name, t in pool.views(i, s).items():
                lo = t.data_ptr()
                assert len(containing(rt.registered, lo, lo + t.numel() * t.element_size())) == 1, (
                    name,
                    i,
                    s,
                )
    # chunks of whole slots, about PIN_CHUNK: gate_up (4 KiB slots) in chunks of 6 slots; down's 1 KiB slots
    # four to a page, so chunks of 24; scale's 7-byte slots never end on a page: one registration
    # (down: 30 KiB of slots in a 32 KiB page-rounded part)
    assert [n for _, n in rt.registered] == [6 * 4096] * 5 + [24 * 1024, 6 * 1024 + 2048] + [PAGE]
    assert rt.unregistered == []
    del pool
    gc.collect()
    assert rt.unregistered == [p for p, _ in rt.registered]


def test_no_slot_of_a_qwen3_sized_tier_straddles_two_registrations():
    """Qwen3-30B-A3B's parts (gate_up 6 MiB, down 3 MiB per slot; 48 layers x 128 experts) with 1 GiB
    chunks: each slot's byte range in one registration (1 GiB is 170.67 gate_up slots: cutting the
    region every 1 GiB, as before, splits a slot at every boundary)."""
    slots = 48 * 128
    parts, at = [], 0
    for slot in (2 * 768 * 2048 * 2, 2048 * 768 * 2):
        parts.append((at, slot, slots))
        at += -(-slot * slots // PAGE) * PAGE
    chunks = pool_mod.pin_chunks(parts, at)
    assert_registrations_tile(chunks, 0, at)
    assert max(n for _, n in chunks) <= pool_mod.PIN_CHUNK
    import numpy as np

    starts = np.array([o for o, _ in chunks])
    for off, slot, n in parts:
        lo = off + slot * np.arange(n)
        first, last = np.searchsorted(starts, lo, "right"), np.searchsorted(starts, lo + slot - 1, "right")
        assert (first == last).all()  # the first and the last byte of each slot in the same chunk
    naive = np.arange(0, at, 1 << 30)
    lo = parts[0][0] + parts[0][1] * np.arange(slots)
    assert (
        np.searchsorted(naive, lo, "right") != np.searchsorted(naive, lo + parts[0][1] - 1, "right")
    ).sum() > 0


def test_pinning_failure_falls_back_to_pageable_with_a_note(runtime, capsys):
    rt = runtime(fail_at=2)
    pool = SlotPool(PARTS, 20, 30, torch.device("cpu"), pin=True)
    assert pool.pinned is False and pool.pinned_bytes == 0
    assert len(rt.registered) == 2 and rt.unregistered == [p for p, _ in rt.registered]
    assert "could not page-lock the host tier" in capsys.readouterr().err
    # still a working tier
    pool.views(19, 29)["down"].fill_(2.5)
    assert float(pool.buf["down"][19, 29].sum()) == 2.5 * 15


def test_pin_is_refused_for_a_device_tier():
    with pytest.raises(ValueError, match="pin=True is for a tier in host RAM"):
        SlotPool(PARTS, 1, 1, torch.device("meta"), pin=True)


def test_the_memory_plan_is_what_the_tiers_allocate(cache_checkpoint):
    from expertcache import LLM
    from expertcache.build.plan import plan_tiers as plan_memory

    llm = LLM(str(cache_checkpoint), device="cpu", device_memory="25%", host_memory="50%")
    try:
        plan = plan_memory(llm.source, llm.device, llm.dtype, "25%", "50%")
        cache = llm.experts
        assert 0 < cache.host_slots < 16 and cache.device_slots == plan.device.slots
        assert cache.host.nbytes == plan.host_used
        assert cache.dev.nbytes == plan.device_used  # the CPU reserves no staging expert
        for pool in (cache.host, cache.dev):
            assert (
                pool.reserved_bytes == pool.region.numel()
                and 0 <= pool.reserved_bytes - pool.nbytes < 2 * PAGE
            )
    finally:
        llm.close()


def test_layers_of_different_layouts_are_grouped_each_slot_its_layers_bytes(runtime):
    """A LayerParts pool (GGUF types per layer): layers 0 and 2 in one layout, layer 1 in another; each
    group its own buffers in the one region, exact bytes, slots addressed per layer, pinned in whole slots."""
    from expertcache.experts.layout import LayerParts

    a = (Part("gate.q4_k", (4, 144), torch.uint8), Part("down.q6_k", (4, 210), torch.uint8))
    b = (Part("gate.q4_k", (4, 144), torch.uint8), Part("down.q4_k", (4, 144), torch.uint8))
    parts, slots = LayerParts([a, b, a]), 5
    rt = runtime(chunk=8192)
    pool = SlotPool(parts, 3, slots, torch.device("cpu"), pin=True)
    assert pool.nbytes == slots * (2 * sum(p.nbytes for p in a) + sum(p.nbytes for p in b))
    assert pool.reserved_bytes - pool.nbytes < PAGE * 4  # four parts, each on a page boundary
    assert pool.where == {0: (0, 0), 2: (0, 1), 1: (1, 0)}
    assert_registrations_tile(rt.registered, pool.region.data_ptr(), pool.reserved_bytes)
    gen = torch.Generator().manual_seed(1)
    written = {}
    for i, layout in enumerate(parts):
        for s in range(slots):
            v = pool.views(i, s)
            assert sorted(v) == sorted(p.name for p in layout)
            for p in layout:
                written[i, s, p.name] = torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=gen)
                v[p.name].copy_(written[i, s, p.name])
    for (i, s, name), t in written.items():  # no slot overlaps another layer's or layout's
        assert torch.equal(pool.views(i, s)[name], t) and torch.equal(pool.layer(i)[name][s], t)
        lo = pool.views(i, s)[name].data_ptr()
        assert len(containing(rt.registered, lo, lo + t.numel())) == 1
    assert pool.layer(1) is pool.layer(1) and set(pool.layer(1)) == {"gate.q4_k", "down.q4_k"}
    with pytest.raises(ValueError, match="parts of 3 layers for 2 layers"):
        SlotPool(parts, 2, slots, torch.device("cpu"))
