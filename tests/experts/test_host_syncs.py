"""A MoE layer reads its routing from the device once.

On CUDA every host read of a device tensor (tolist, item, nonzero, bincount, unique, a boolean
mask, .cpu(), a copy into host memory, bool()/int() of one) waits for every queued kernel. The CPU
suite stands in for the device: what a GPU would hold (the layer's inputs x, ids, weights and the
device slot pools) is an `OnDevice` tensor, a subclass that every torch operation passes on to
its results, and each of those host reads of one is recorded. The C++ kernels are switched off, so
the layer takes the torch code that CUDA runs. The expected record per MoE layer is exactly one
copy into host memory: the step's expert ids (with the held prediction's, when prefetching). A
non-blocking copy into host memory (the CPU job's rows: on CUDA into pinned memory on a side
stream, waited for by the CPU worker, never by the launching thread) is recorded apart, as
"copy_ to host (async)". Every executor that runs a CPU device's step is counted (inline, and
threads: the CUDA backend's semantics on worker threads).

Reference for the outputs: each (token, k) pair computed alone in float64 from the resident experts.
"""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors_reference import independent_slot_checks

from expertcache import LLM, kernels
from expertcache.experts.manager import TieredExperts
from expertcache.experts.provider import ResidentExperts

# methods and functions that read a tensor's values on the host
READS = {
    "tolist",
    "item",
    "cpu",
    "numpy",
    "nonzero",
    "argwhere",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__contains__",
    "__repr__",
    "__format__",
    "__array__",
    "unique",
    "unique_consecutive",
    "bincount",
    "masked_select",
    "equal",
    "allclose",
    "is_nonzero",
    "repeat_interleave",
}
INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put", "index"}

_lock = threading.Lock()
RECORD: list[str] = []


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class OnDevice(torch.Tensor):
    """A tensor a GPU would hold; records every host read of it in RECORD."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        on = [t for t in _tensors((args, kwargs)) if isinstance(t, OnDevice)]
        read = None
        if on and name in READS:
            read = name
        elif (
            on
            and name in INDEXING
            and any(t.dtype == torch.bool for t in _tensors(args[1:2]) if isinstance(t, OnDevice))
        ):
            read = f"{name}[bool mask]"
        elif name == "copy_" and not isinstance(args[0], OnDevice) and isinstance(args[1], OnDevice):
            nb = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            read = "copy_ to host (async)" if nb else "copy_ to host"
        if read is not None:
            with _lock:
                RECORD.append(read)
        return super().__torch_function__(func, types, args, kwargs)


def dev(t: torch.Tensor) -> OnDevice:
    return t.as_subclass(OnDevice)


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


def layer_reads(fn, *args) -> tuple[torch.Tensor, list[str]]:
    with _lock:
        RECORD.clear()
    out = fn(*args)
    with _lock:
        got = list(RECORD)
    return (plain(out) if isinstance(out, torch.Tensor) else out), got


def test_the_stand_in_device_records_host_reads():
    t = dev(torch.tensor([3, 1, 2]))
    for read, want in [
        (lambda: t.tolist(), "tolist"),
        (lambda: bool((t > 2).any()), "__bool__"),
        (lambda: t[t > 1], "__getitem__[bool mask]"),
        (lambda: torch.bincount(t), "bincount"),
        (lambda: (t == 1).nonzero(), "nonzero"),
        (lambda: torch.empty(3, dtype=torch.long).copy_(t), "copy_ to host"),
        (lambda: [0, 1, 2, 3][t[0]], "__index__"),
        (lambda: t.cpu(), "cpu"),
    ]:
        _, got = layer_reads(read)
        assert got == [want]
    _, got = layer_reads(lambda: (t * 2)[torch.tensor([0, 2])] + t.new_ones(2))  # device-side work only
    assert got == []
    assert isinstance(t[torch.tensor([0])] + 1, OnDevice)  # results stay on the device


def torch_path(monkeypatch):
    """The layer's torch code (what CUDA runs): no C++ kernels, fp32 compute copies in the slots."""
    monkeypatch.setattr(kernels, "extension", lambda: None)
    assert kernels.backend() == "torch"


def routing(gen, T, E, K):
    ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].contiguous()
    w = torch.softmax(torch.rand(T, K, generator=gen), dim=1)
    return ids, w


def brute_force(pool, x, ids, w):
    """sum_k w[t,k] * down(silu(gate x) * up x) of expert ids[t,k], pair by pair, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            g, u = (pool["gate_up"][e].double() @ x[t].double()).chunk(2)
            out[t] += float(w[t, k]) * (pool["down"][e].double() @ (torch.nn.functional.silu(g) * u))
    return out.float()


@pytest.fixture(scope="module")
def resident_pools(cache_checkpoint):
    """The reference: every expert resident, computed on plain tensors (torch path)."""
    mp = pytest.MonkeyPatch()
    torch_path(mp)
    try:
        llm = LLM(str(cache_checkpoint))
        assert isinstance(llm.experts, ResidentExperts)
        yield llm
    finally:
        llm.close()
        mp.undo()


@pytest.mark.parametrize("T", [3, 150])  # 6 pairs: one grouped GEMM; 300 pairs: the loop over slots
def test_resident_layer_reads_its_ids_once(resident_pools, monkeypatch, T):
    torch_path(monkeypatch)
    experts = resident_pools.experts
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, 64, generator=gen)
    ids, w = routing(gen, T, 16, 2)
    saved = experts.pools[0]
    experts.pools[0] = {n: dev(t) for n, t in saved.items()}
    try:
        out, got = layer_reads(experts.forward, 0, dev(x), dev(ids), dev(w))
    finally:
        experts.pools[0] = saved
    assert got == ["copy_ to host"]
    torch.testing.assert_close(out, brute_force(saved, x, ids, w), atol=1e-5, rtol=1e-5)


# (LLM keywords, prefetch on), with and without a partial host tier; exclusive tiers (demotions: a
# device -> host copy of slot bytes) exist on CPU devices only, so the stand-in leaves them out
CASES = [
    (dict(device_memory="25%", prefetch="device"), True),
    (dict(device_memory="25%", prefetch="off"), False),
    (dict(device_memory="13%", host_memory="38%", prefetch="host", exclusive=False), True),
    (
        dict(device_memory="19%", host_memory="38%", prefetch="device", overlap_io=False, exclusive=False),
        True,
    ),
    (dict(device_memory="13%", host_memory="25%", prefetch="off", exclusive=False), False),
    # every miss computed from its host copy off the device (CUDA's default sends decode misses there);
    # the stand-in's device is the CPU, so it cannot see that branch's own x -> host copy (a real one on CUDA)
    (dict(device_memory="25%", prefetch="off", cpu_compute="always"), False),
]


@pytest.mark.parametrize("backend", ["inline", "threads"])
@pytest.mark.parametrize(
    "kw,prefetch", CASES, ids=[",".join(f"{k}={v}" for k, v in kw.items()) for kw, _ in CASES]
)
def test_tiered_layer_reads_its_ids_once(
    cache_checkpoint, resident_pools, monkeypatch, kw, prefetch, backend
):
    torch_path(monkeypatch)
    llm = LLM(str(cache_checkpoint), verify=False, prefetch_gate=None, prefill_admit_tokens=32, **kw)
    try:
        tiered = llm.experts
        tiered.use_executor(backend)
        assert isinstance(tiered, TieredExperts) and tiered.wants_prefetch == prefetch
        tiered.dev.buf = {n: dev(t) for n, t in tiered.dev.buf.items()}
        # the layer computes from the pool's per-layer views: they must be the stand-in's too
        assert all(
            isinstance(t, OnDevice) for i in range(len(tiered.layers)) for t in tiered.dev.layer(i).values()
        )
        gen = torch.Generator().manual_seed(0)
        layers, ref = tiered.layers, resident_pools.experts
        # decode steps (the same routing twice in a row: hits), then a prefill of 150 tokens (waves)
        sizes = [1, 1, 4, 4, 2, 150, 3, 3]
        steps, last = [], None
        for T in sizes:
            step = (
                last
                if (last is not None and last[0][0].shape[0] == T)
                else [(torch.randn(T, 64, generator=gen), *routing(gen, T, 16, 2)) for _ in layers]
            )
            steps.append(step)
            last = step
        for step in steps:
            tiered.begin_step()
            for j, layer in enumerate(layers):
                x, ids, w = step[j]
                if prefetch and j + 1 < len(layers):  # the next layer's router, as models/transformer.py asks
                    tiered.prefetch(layers[j + 1], dev(step[j + 1][1]))
                out, got = layer_reads(tiered.forward, layer, dev(x), dev(ids), dev(w))
                tiered.executor.drain()  # threads: the workers' records are in
                with _lock:
                    got = list(RECORD)
                assert [r for r in got if r != "copy_ to host (async)"] == ["copy_ to host"], (
                    layer,
                    x.shape[0],
                )
                assert ("copy_ to host (async)" in got) <= (kw.get("cpu_compute") == "always")
                torch.testing.assert_close(
                    out, brute_force(ref.pools[layer], x, ids, w), atol=1e-5, rtol=1e-5
                )
            tiered.end_step()
        tiered.dev.buf = {n: plain(t) for n, t in tiered.dev.buf.items()}
        independent_slot_checks(monkeypatch)  # the reference read with safetensors, not the engine's reader
        tiered.check(contents=True)
        # every slot that holds an expert was compared (with cpu_compute=always no slot is ever filled)
        assert getattr(tiered, "independent_checks", 0) > 0 or kw.get("cpu_compute") == "always"
        s = llm.expert_stats()
        waves = sum(layer["waves"] for layer in s["per_layer"])
        if (
            kw.get("cpu_compute") == "always"
        ):  # nothing admitted: no hits, no waves, every miss off the device
            assert s["hits"] == 0 and s["misses"] > 0 and waves == 0 and s["cpu_computed_share"] == 1.0
        else:
            assert s["hits"] > 0 and s["misses"] > 0 and waves > 0 and s["cpu_computed_share"] == 0.0
        issued = s["prefetch"]["issued"] + s["per_tier"]["host"]["prefetch_issued"]
        assert (issued > 0) == prefetch
    finally:
        llm.close()
