"""Weights on huge pages (expertcache/hostmem.py): placement checked against the kernel's own
accounting (/proc/self/smaps: the AnonHugePages of the mapping that holds a tensor), contents against
torch and safetensors, and a model loaded on huge pages against transformers."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import checkpoints as C
import pytest
import torch

from expertcache import hostmem

MiB = 1 << 20


def _thp_offered() -> bool:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return hostmem.enabled and p.exists() and "[never]" not in p.read_text()


needs_thp = pytest.mark.skipif(not _thp_offered(), reason="no transparent huge pages on this machine")


def _mapping(addr: int) -> dict | None:
    """The /proc/self/smaps entry (start, end, fields in bytes) of the mapping holding addr."""
    entry = None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            lo, hi = (int(v, 16) for v in head[0].split("-"))
            if entry is not None:
                return entry
            entry = {"start": lo, "end": hi} if lo <= addr < hi else None
        elif entry is not None and head[0].endswith(":") and len(head) >= 3 and head[2] == "kB":
            entry[head[0][:-1]] = int(head[1]) * 1024
    return entry


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes of t's mapping on huge pages, per the kernel."""
    m = _mapping(t.data_ptr())
    return 0 if m is None else m.get("AnonHugePages", 0)


@needs_thp
def test_large_tensor_sits_on_huge_pages():
    t = hostmem.empty((3 * MiB // 2, 2), torch.bfloat16)  # 6 MiB: three whole huge pages
    assert (
        t.data_ptr() % hostmem.HUGE_PAGE == 0 and t.shape == (3 * MiB // 2, 2) and t.dtype == torch.bfloat16
    )
    t.fill_(1.5)
    assert huge_bytes(t) >= 6 * MiB
    assert torch.equal(t, torch.full_like(t, 1.5))


@needs_thp
def test_tail_is_on_huge_pages_too():
    t = hostmem.empty((3 * MiB,), torch.uint8)  # 1.5 huge pages: the half page is a huge one as well
    t.fill_(7)
    assert huge_bytes(t) >= 4 * MiB


def _populate_offered() -> bool:
    m = mmap.mmap(-1, hostmem.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(hostmem.MADV_POPULATE_WRITE)
        return True
    except OSError:  # Linux before 5.14
        return False
    finally:
        m.close()


@needs_thp
@pytest.mark.parametrize("populate", [True, False])
def test_pages_are_taken_when_the_tensor_is_made(monkeypatch, populate):
    """Made, not first written: the pages (2 MiB ones) come while the model's memory is allocated, before its
    reads fill the page cache; hostmem.populate = False leaves them to the first touch."""
    if populate and not _populate_offered():
        pytest.skip("no MADV_POPULATE_WRITE before Linux 5.14")
    monkeypatch.setattr(hostmem, "populate", populate)
    t = hostmem.empty((8 * MiB,), torch.uint8)
    m = _mapping(t.data_ptr())
    if populate:
        assert m["Rss"] >= 8 * MiB and m.get("AnonHugePages", 0) >= 8 * MiB
    else:
        assert m["Rss"] < 2 * MiB


def test_small_tensors_and_other_devices_are_torch_empty(monkeypatch):
    def no_mapping(*a, **k):
        raise AssertionError("a mapping made for a small tensor")

    monkeypatch.setattr(hostmem.mmap, "mmap", no_mapping)
    t = hostmem.empty((100, 3), torch.float32)
    assert t.shape == (100, 3) and t.dtype == torch.float32
    m = hostmem.empty((4, MiB), torch.uint8, device="meta")
    assert m.device.type == "meta" and m.shape == (4, MiB)


@needs_thp
def test_disabled_gives_small_pages(monkeypatch):
    monkeypatch.setattr(hostmem, "enabled", False)
    t = hostmem.empty((8 * MiB,), torch.uint8)
    t.fill_(1)
    assert huge_bytes(t) == 0


@needs_thp
def test_mapping_is_released_with_the_last_view():
    t = hostmem.empty((4 * MiB,), torch.uint8)
    start = _mapping(t.data_ptr())["start"]
    view = t[MiB:]
    del t
    gc.collect()
    assert _mapping(start) is not None  # the view still holds it
    del view
    gc.collect()
    assert _mapping(start) is None


def test_cat_equals_torch_cat():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, 1024, generator=g).bfloat16() for n in (512, 256, 300)]
    out = hostmem.cat(parts)
    assert out.dtype == torch.bfloat16 and torch.equal(
        out.view(torch.int16), torch.cat(parts).view(torch.int16)
    )


def test_safetensors_load_is_byte_exact_and_huge(tmp_path):
    from safetensors.torch import load_file, save_file

    from expertcache.loader.safetensors_index import TensorIndex

    g = torch.Generator().manual_seed(1)
    tensors = {
        "big": torch.randn(1500, 1024, generator=g).bfloat16(),
        "small": torch.randn(7, 3, generator=g),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    index = TensorIndex(tmp_path)
    ref = load_file(tmp_path / "model.safetensors")
    for name in tensors:
        got = index.load(name)
        assert got.dtype == ref[name].dtype and torch.equal(
            got.view(torch.uint8), ref[name].view(torch.uint8)
        )
    if _thp_offered():
        big = index.load("big")
        assert big.data_ptr() % hostmem.HUGE_PAGE == 0 and huge_bytes(big) >= 2 * MiB


@needs_thp
def test_model_weights_on_huge_pages_match_transformers(tmp_path):
    """Expert pools, the fused qkv and lm_head of a loaded model sit on huge pages, and the model's
    greedy tokens are transformers' own."""
    from expertcache import LLM, SamplingParams

    # big enough for 2 MiB weights in bf16: gate_up [8, 2048, 128], down [8, 128, 1024], qkv [8192, 128]
    path = C.make_checkpoint(
        tmp_path,
        "qwen3_moe",
        dtype=torch.bfloat16,
        hidden_size=128,
        moe_intermediate_size=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
    )
    llm = LLM(str(path), max_model_len=64, kv_cache_memory="8MiB")
    m = llm.model
    pool = m.experts.pools[0]
    qkv = m.layers[0]["attn"].w["qkv_proj.weight"]
    for t in (pool["gate_up"], pool["down"], qkv):
        assert t.nbytes >= 2 * MiB and t.data_ptr() % hostmem.HUGE_PAGE == 0 and huge_bytes(t) >= 2 * MiB
    prompt = [5, 9, 14, 3, 22]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    ref = C.reference_greedy(C.load_reference(path), prompt, 6)
    assert out[0].token_ids == ref
