"""Available RAM honours memory cgroup limits (expertcache/ramlimit.py), and a low-memory CPU plan's
`auto` expert budget is the RAM left after the engine's other terms.

The cgroup files are fake trees written here in the kernel's formats (v1 and v2), so the expected
room is computed by hand from the numbers written: limit - (usage - inactive file pages), the least
over the cgroup and its ancestors.
"""

from __future__ import annotations

import pytest
import torch

from expertcache import LLM, ramlimit
from expertcache.build import plan as budget

GiB = 1 << 30


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    root, proc = tmp_path / "cgroup", tmp_path / "proc_self_cgroup"
    monkeypatch.setattr(ramlimit, "ROOT", root)
    monkeypatch.setattr(ramlimit, "PROC_CGROUP", proc)
    meminfo = tmp_path / "meminfo"
    _write(meminfo, f"MemTotal: {64 << 20} kB\nMemFree: 1000 kB\nMemAvailable: {40 << 20} kB\n")
    monkeypatch.setattr(ramlimit, "MEMINFO", meminfo)
    return root, proc


def test_v1_limit_with_a_tighter_parent(fake):
    root, proc = fake
    _write(proc, "4:memory:/box/job\n3:cpu:/\n0::/\n")
    mem = root / "memory"
    _write(mem / "box/job/memory.limit_in_bytes", str(6 * GiB))
    _write(mem / "box/job/memory.usage_in_bytes", str(2 * GiB))
    _write(mem / "box/job/memory.stat", f"cache 100\ntotal_inactive_file {GiB // 2}\n")
    _write(mem / "box/memory.limit_in_bytes", str(5 * GiB))  # the parent's limit binds
    _write(mem / "box/memory.usage_in_bytes", str(3 * GiB))
    _write(mem / "box/memory.stat", "total_inactive_file 0\n")
    _write(mem / "memory.limit_in_bytes", "9223372036854771712")  # the root: no limit
    got, why = ramlimit.available()
    assert got == 5 * GiB - 3 * GiB  # job: 6 - (2 - 0.5) = 4.5 GiB; box: 2 GiB
    assert "box" in why and "job" not in why


def test_v2_limit_and_max(fake):
    root, proc = fake
    _write(proc, "0::/user.slice/app\n")
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(root / "user.slice/app/memory.max", str(3 * GiB))
    _write(root / "user.slice/app/memory.current", str(GiB))
    _write(root / "user.slice/app/memory.stat", f"anon 1\ninactive_file {GiB // 4}\nactive_file 5\n")
    _write(root / "user.slice/memory.max", "max")
    assert ramlimit.available()[0] == 3 * GiB - (GiB - GiB // 4)


def test_no_cgroup_limit_is_mem_available(fake):
    root, proc = fake
    _write(proc, "0::/\n")
    _write(root / "cgroup.controllers", "memory\n")
    _write(root / "memory.max", "max")
    assert ramlimit.available() == (40 * GiB, "MemAvailable")


def test_a_limit_above_mem_available_does_not_raise_it(fake):
    root, proc = fake
    _write(proc, "4:memory:/big\n")
    _write(root / "memory/big/memory.limit_in_bytes", str(100 * GiB))
    _write(root / "memory/big/memory.usage_in_bytes", str(GiB))
    assert ramlimit.available() == (40 * GiB, "MemAvailable")


def test_low_memory_auto_budget_is_what_the_other_terms_leave(checkpoint, monkeypatch):
    """--low-memory with no budgets on a CPU: the expert slots get the RAM left after the plan's other
    terms (dense, KV, activations, logits), no host copy, and a margin; a cgroup too small for the
    smallest plan is refused before any weight is read."""
    path = checkpoint("qwen3_moe", dtype=torch.bfloat16)
    free = {"b": 0}
    monkeypatch.setattr(ramlimit, "available", lambda: (free["b"], "memory cgroup /test (limit)"))
    probe = LLM(
        str(path), low_memory=True, device_memory="50%", host_memory=0, kv_cache_memory="1MiB"
    ).device_plan
    other = probe.total - probe.terms["expert_slots"]
    per_layer_expert = probe.terms["expert_slots"] // probe.experts.device.slots  # one slot in every layer
    slots = 3  # room for exactly 3 experts per layer after the margin
    free["b"] = other + budget.LOW_MEMORY_MARGIN + slots * per_layer_expert + per_layer_expert // 2
    llm = LLM(str(path), low_memory=True, kv_cache_memory="1MiB")
    assert llm.device_plan.experts.device.slots == slots and llm.device_plan.experts.host.slots == 0
    assert any(
        "auto device budget (CPU, low memory)" in line and "memory cgroup /test" in line
        for line in llm.plan_lines
    )
    free["b"] = other + budget.LOW_MEMORY_MARGIN + per_layer_expert  # below top_k slots per layer
    with pytest.raises(Exception, match="holds 1 experts per layer, but a token needs top_k"):
        LLM(str(path), low_memory=True, kv_cache_memory="1MiB")
