"""Each family's CUDA path run on fake CUDA tensors: construction, one prefill and two decode steps.

`FakeTensorMode` gives tensors on cuda:0 without a GPU: shapes, dtypes and devices are computed, no value
is. A CPU tensor mixed into a device op raises FakeTensorDeviceMismatchError, `.item()` raises
DataDependentOutputException, so a stray host tensor or host read in the forward fails here.

What a CPU-only torch lacks, and the stand-ins:
- Python indexing (`x[2:5]`, `x[idx] = v`) of a fake cuda:0 tensor raises "PyTorch is not linked with
  support for cuda devices": `Tensor.__getitem__` takes a CUDA device guard, and a CPU-only build has no
  guard implementation for CUDA (aten ops such as index_select and index_put_ work: FakeTensorMode's own
  `_ensureCUDADeviceGuardSet` does not reach the indexing path in torch 2.13). Minimal reproduction:
  `with FakeTensorMode(): torch.empty(10, 8, device="cuda")[2:5]`. The fix: c10's NoOpDeviceGuardImpl
  registered for CUDA by a three-line extension (GUARD below), built once per session.
- `torch.cuda.is_available()` must say True for the engine to build on "cuda", but FakeTensorMode reads it
  too and then makes `torch.tensor(..., device="cuda")` on the real device: FakeCuda keeps its CPU-only
  handling.
- host tensors: FakeCuda fakes only what touches the device, so disk reads, the host tier and the cache's
  host arrays keep real values; streams, events, pinned memory, host registration, device properties and
  memory queries are recording stand-ins (`_cuda_stand_ins`); Triton launches are recorded with their
  grids and the devices of their tensors (`Launch`), not run.
- the routing read (host_routing.to_host, the MoE layer's one device -> host read) returns a fixed
  routing of real host ids: a fake tensor has no values for the cache to plan from.

Asserted per family, resident and tiered (misses copied, or computed by the CPU worker): the engine builds
on cuda:0 and compiles its Triton kernels at construction (warm_up once per pool format); every step's
logits are float32 [sequences, vocab] on cuda:0; the KV cache and lm_head are bf16 on cuda:0; per MoE
layer and step, three Triton launches on cuda:0 tensors (resident) and the launching thread's host reads:
none with every expert resident, exactly one routing read with one event wait and no blocking copy to the
host (tiered; the CPU job's rows go by asynchronous copies into pinned memory, at most two a layer).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import types
from collections import Counter

import gpt_oss_checkpoints as G
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from expertcache import LLM, SamplingParams
from expertcache.experts import manager
from expertcache.kernels import build as kernel_build
from expertcache.kernels import triton_moe

GUARD = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <Python.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
static PyModuleDef mod = {PyModuleDef_HEAD_INIT, "fake_cuda_guard", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_fake_cuda_guard(void) { return PyModule_Create(&mod); }
"""

# the ledger keys storages by data pointer, which a fake tensor does not have (all read as 0 here)
pytestmark = pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")


@pytest.fixture(scope="session")
def cuda_guard(tmp_path_factory):
    """The device guard a CPU-only torch lacks (a CUDA build has its own: nothing to load)."""
    from torch.utils.cpp_extension import load

    if torch.backends.cuda.is_built():
        return None
    d = tmp_path_factory.mktemp("fake-cuda-guard")
    (d / "fake_cuda_guard.cpp").write_text(GUARD)
    return load("fake_cuda_guard", [str(d / "fake_cuda_guard.cpp")], build_directory=str(d))


REPRO = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():
    x = torch.empty(10, 8, device="cuda")
    assert x.index_select(0, torch.zeros(2, dtype=torch.long, device="cuda")).shape == (2, 8)  # aten: fine
    x[2:5]
"""


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a CUDA build of torch has the device guard")
def test_without_the_guard_indexing_fails():
    """The minimal reproduction, in a fresh process (no guard loaded): the day it passes, the guard can go."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", REPRO], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "PyTorch is not linked with support for cuda devices" in r.stderr, r.stderr


def test_indexing_a_fake_cuda_tensor_needs_the_guard(cuda_guard):
    """The reproduction of what fails without the guard, run with it: indexing and slicing work."""
    with FakeCuda():
        x = torch.empty(10, 8, device="cuda")
        assert x[2:5].shape == (3, 8) and x[torch.tensor([1, 2], device="cuda")].device.type == "cuda"
        x[torch.tensor([0], device="cuda")] = torch.zeros(1, 8, device="cuda")
        with pytest.raises(Exception, match="[Dd]evice"):  # a host tensor mixed in is still refused
            x + torch.ones(8, device="cpu").as_subclass(torch.Tensor)[None].expand(10, 8).contiguous()


class FakeCuda(FakeTensorMode):
    """FakeTensorMode for device tensors only: an op whose tensors are all real host tensors, with no CUDA
    device asked for, runs for real (disk reads, the host tier, the planner's host arrays keep their
    values); anything touching a fake tensor or making one on CUDA is faked, a real host tensor mixed into
    it is refused as on a GPU. It keeps its CPU-only handling (torch.tensor(..., device="cuda") made on
    the host and moved, no device initialisation) while torch.cuda.is_available() says True."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)

    @property
    def avoid_device_init(self):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        devices = [torch.device(d) for d in leaves if isinstance(d, torch.device)]
        if kwargs.get("device") is not None:
            devices.append(torch.device(kwargs["device"]))
        if not any(isinstance(t, FakeTensor) for t in leaves) and all(d.type == "cpu" for d in devices):
            if kwargs.get("pin_memory"):  # pinned host memory: a recorded stand-in (plain host memory)
                kwargs = {**kwargs, "pin_memory": False}
            return func(*args, **kwargs)  # host work: real
        # a real host tensor becomes an ordinary fake one here (not a constant that the fake mode would
        # copy to the device for real)
        args, kwargs = torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: t if isinstance(t, FakeTensor) else self.from_tensor(t), (args, kwargs)
        )
        return super().__torch_dispatch__(func, types, args, kwargs)


class Record:
    def __init__(self):
        self.events: list[tuple] = []
        self.main = threading.get_ident()
        self.lock = threading.Lock()

    def add(self, *what) -> None:
        with self.lock:
            self.events.append((threading.get_ident() == self.main, *what))

    def count(self, name: str, main_only: bool = True) -> int:
        return sum(1 for e in self.events if e[1] == name and (e[0] or not main_only))

    def clear(self) -> None:
        with self.lock:
            self.events.clear()


class Launch:
    """Stands for a Triton kernel: kernel[grid](*args) records its name, grid and tensors' devices."""

    def __init__(self, kernel, rec: Record):
        self.name, self.rec = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel"), rec

    def __getitem__(self, grid):
        def launch(*args, **kw):
            devices = {str(a.device) for a in args if isinstance(a, torch.Tensor)}
            self.rec.add("launch", self.name, tuple(grid), tuple(sorted(devices)))

        return launch


class DeviceToHost(TorchDispatchMode):
    """Records the launching thread's copies from the device into host memory (stacked on the fake mode)."""

    def __init__(self, rec: Record):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and args[0].device.type == "cpu" and args[1].is_cuda:
            nb = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            self.rec.add("d2h copy (async)" if nb else "d2h copy")  # async: into pinned memory, no wait
        elif func is torch.ops.aten._to_copy.default and args[0].is_cuda:
            if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu":
                self.rec.add("d2h copy")
        return func(*args, **kwargs)


def _cuda_stand_ins(rec: Record, mp: pytest.MonkeyPatch) -> None:
    cuda = torch.cuda
    props = types.SimpleNamespace(
        name="fake GPU (80 GiB, sm_90)",
        total_memory=80 << 30,
        major=9,
        minor=0,
        multi_processor_count=132,
        shared_memory_per_block_optin=232448,
    )

    class Event:
        def __init__(self, *a, **k):
            pass

        def record(self, stream=None):
            rec.add("event.record")

        def synchronize(self):
            rec.add("event.synchronize")

        def wait(self, stream=None):
            rec.add("event.wait")

        def query(self):
            return True

    class Stream:
        def __init__(self, device=None, priority=0):
            self.device = device

        def wait_stream(self, other):
            rec.add("stream.wait_stream")

        def wait_event(self, ev):
            rec.add("stream.wait_event")

        def record_event(self, ev=None):
            ev = ev or Event()
            ev.record(self)
            return ev

        def synchronize(self):
            rec.add("stream.synchronize")

        def query(self):
            return True

    compute = Stream("cuda:0")
    for name, value in dict(
        is_available=lambda: True,
        device_count=lambda: 1,
        current_device=lambda: 0,
        get_device_properties=lambda d=None: props,
        get_device_capability=lambda d=None: (props.major, props.minor),
        get_device_name=lambda d=None: props.name,
        mem_get_info=lambda d=None: (props.total_memory, props.total_memory),
        memory_reserved=lambda d=None: 0,
        memory_allocated=lambda d=None: 0,
        synchronize=lambda d=None: rec.add("device.synchronize"),
        set_device=lambda d: None,
        device=lambda d: contextlib.nullcontext(),
        Stream=Stream,
        Event=Event,
        current_stream=lambda d=None: compute,
        stream=lambda s: contextlib.nullcontext(),
        cudart=lambda: types.SimpleNamespace(
            cudaHostRegister=lambda ptr, n, flags: (rec.add("cudaHostRegister", n), 0)[1],
            cudaHostUnregister=lambda ptr: 0,
        ),
    ).items():
        mp.setattr(cuda, name, value)
    mp.setattr(torch.Tensor, "pin_memory", lambda self, *a: (rec.add("pin_memory"), self)[1])
    mp.setattr(torch.Tensor, "record_stream", lambda self, s: rec.add("record_stream"))
    real_launches = triton_moe.launches

    def launches(*a, **k):
        return [(Launch(kern, rec), grid, args, c, o) for kern, grid, args, c, o in real_launches(*a, **k)]

    mp.setattr(triton_moe, "launches", launches)

    def warm_up(pool, method=None, ffn=None, dtype=torch.bfloat16, top_k=1, configs=("decode",)):
        rec.add("warm_up", tuple(sorted({str(t.device) for t in pool.values()})), dtype, tuple(configs))
        return len(configs)

    mp.setattr(triton_moe, "warm_up", warm_up)
    mp.setitem(kernel_build._state, "mod", None)  # the torch code CUDA runs beside the kernels: no C++
    mp.setitem(kernel_build._state, "why", "EXPERTCACHE_KERNELS=torch")


def _routing_read(rec: Record, num_experts: int):
    """host_routing.to_host's stand-in: records the read, returns fixed real ids of the tensor's shape."""
    calls = [0]

    def to_host(t: torch.Tensor) -> torch.Tensor:
        assert t.is_cuda and t.dtype == torch.int64, (t.device, t.dtype)
        rec.add("routing read", tuple(t.shape))
        rec.add("event.synchronize")  # the real one waits on its copy's event
        calls[0] += 1
        return ((torch.arange(t.numel()) * 3 + calls[0]) % num_experts).view(t.shape)  # real (host op)

    return to_host


def _model_dir(family, tmp_path_factory, checkpoint):
    if family == "gpt_oss":
        return G.make_gpt_oss(tmp_path_factory.mktemp("gpt-oss-fake"), dtype=torch.bfloat16)
    return checkpoint(family, dtype=torch.bfloat16)


FAMILIES = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "qwen3_next",
    "gpt_oss",
]


def _run(llm, rec: Record, mode: FakeCuda) -> list[tuple]:
    """Greedy: prompts of 5 and 3 tokens, 3 new tokens (one prefill, two decode steps). Each step's forward
    runs under the fake mode with the launching thread's device -> host copies recorded; the engine
    samples from zeros of the logits' shape -> per step (logits device, dtype, shape, events)."""
    runner, steps, errors = llm.engine.runner, [], []
    forward = runner.run_rows

    def run_rows(work, full):
        rec.clear()
        try:
            with mode, DeviceToHost(rec):
                logits, spans = forward(work, full)
        except Exception as e:  # the engine would retry the sequences one by one: keep the first cause
            errors.append(e)
            raise
        steps.append((logits.device, logits.dtype, tuple(logits.shape), list(rec.events)))
        return torch.zeros(logits.shape), spans

    runner.run_rows = run_rows
    llm.generate([[3, 4, 5, 6, 7], [3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    if errors:
        raise errors[0]
    return steps


TIERED = dict(device_memory="50%", host_memory="100%", cache_policy="lru")
CACHES = {
    "resident": {},
    "tiered": dict(TIERED, cpu_compute="never"),  # misses copied to device slots
    "tiered-cpu": dict(TIERED, cpu_compute="always"),  # misses computed by the CPU worker, rows copied
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_runs_on_fake_cuda(family, cache, cuda_guard, tmp_path_factory, checkpoint, monkeypatch):
    path = _model_dir(family, tmp_path_factory, checkpoint)
    rec, mode = Record(), FakeCuda()
    _cuda_stand_ins(rec, monkeypatch)
    kw, tiered, cpu = CACHES[cache], cache != "resident", cache == "tiered-cpu"
    with mode:
        llm = LLM(str(path), device="cuda", check_finite=False, max_num_seqs=4, block_size=4, **kw)
    try:
        model = llm.engine.runner.model
        cfg = model.cfg
        moe_layers = len(cfg.moe_layer_ids)
        assert model.device == torch.device("cuda", 0) or str(model.device) == "cuda"
        assert model.dtype == torch.bfloat16
        assert isinstance(model.experts, manager.TieredExperts) == tiered
        warm = [e for e in rec.events if e[1] == "warm_up"]
        # one call for every layer's pool (one format), both launch configurations, at construction
        assert [e[2:] for e in warm] == [(("cuda:0",), torch.bfloat16, ("decode", "prefill"))], warm
        assert llm.engine.runner.warm_calls == 2
        assert all(
            k.is_cuda and k.dtype == torch.bfloat16 for pair in llm.engine.runner.kv.tensors for k in pair
        )
        assert model.lm_head.is_cuda and model.lm_head.dtype == torch.bfloat16
        if tiered:
            monkeypatch.setattr(manager, "to_host", _routing_read(rec, cfg.num_experts))
        steps = _run(llm, rec, mode)
    finally:
        llm.close()
        del llm
        gc.collect()  # the host tier's registration released while cudart is still the stand-in
    assert [s[2] for s in steps] == [(2, cfg.vocab_size)] * 3  # one prefill, two decode steps
    for device, dtype, _, events in steps:
        assert device == torch.device("cuda", 0) and dtype == torch.float32
        main = Counter(e[1] for e in events if e[0])
        launches = [e for e in events if e[1] == "launch"]
        assert all(e[4] == ("cuda:0",) for e in launches), launches
        if tiered:
            assert main["routing read"] == moe_layers, main
            assert main["event.synchronize"] == moe_layers, main
            assert main["d2h copy"] == 0, main
            # the CPU job's rows: x and the weights, one async copy each per layer with CPU-computed experts
            assert main["d2h copy (async)"] <= 2 * moe_layers and (main["d2h copy (async)"] > 0) == cpu, main
        else:
            assert len(launches) == 3 * moe_layers, launches  # gate_up, down, the sum over top-k
            assert main["d2h copy"] == 0 and main["event.synchronize"] == 0, main


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "gpt_oss"])
def test_decode_graphs_capture_and_replay_on_fake_cuda(
    family, cuda_guard, tmp_path_factory, checkpoint, monkeypatch
):
    """--cuda-graphs on the fake device: the prefill runs eagerly, the first decode step runs the segments
    and then captures each (under CaptureRules: no host read, no copy between devices), the second replays
    them, the MoE ops eager between them every step (three launches a layer)."""
    from test_cuda_graphs import CaptureRules

    path = _model_dir(family, tmp_path_factory, checkpoint)
    rec, mode = Record(), FakeCuda()
    _cuda_stand_ins(rec, monkeypatch)

    class CUDAGraph:
        def replay(self):
            rec.add("graph.replay")

        def pool(self):
            return "the graphs' pool"

    @contextlib.contextmanager
    def graph(g, pool=None, **kw):
        rec.add("graph.capture", pool)
        with CaptureRules():
            yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    with mode:
        llm = LLM(
            str(path), device="cuda", check_finite=False, max_num_seqs=4, block_size=4, cuda_graphs=True
        )
    try:
        moe_layers = len(llm.engine.runner.model.cfg.moe_layer_ids)
        steps = _run(llm, rec, mode)
        graphs = llm.engine.runner.graphs
    finally:
        llm.close()
        del llm
        gc.collect()
    assert [s[2][0] for s in steps] == [2, 2, 2] and all(s[0] == torch.device("cuda", 0) for s in steps)
    counts = [Counter(e[1] for e in s[3] if e[0]) for s in steps]
    assert [c["graph.capture"] for c in counts] == [0, moe_layers + 1, 0]
    assert [c["graph.replay"] for c in counts] == [0, 0, moe_layers + 1]
    assert all(c["launch"] == 3 * moe_layers and c["d2h copy"] == 0 for c in counts), counts
    assert list(graphs.buckets) == [(2, 2)] and (graphs.steps, graphs.replays) == (2, 1)


def test_no_warm_up_where_triton_does_not_compute(cuda_guard, checkpoint, monkeypatch):
    """--moe-kernel torch on CUDA: nothing to compile, so construction makes no warm-up call; on the CPU
    neither."""
    rec, mode = Record(), FakeCuda()
    _cuda_stand_ins(rec, monkeypatch)
    path = checkpoint("qwen3_moe", dtype=torch.bfloat16)
    with mode:
        llm = LLM(str(path), device="cuda", check_finite=False, moe_kernel="torch")
    try:
        assert llm.engine.runner.warm_calls == 0 and rec.count("warm_up", main_only=False) == 0
    finally:
        llm.close()
        del llm
        gc.collect()
    cpu = LLM(str(path), device="cpu")
    try:
        assert cpu.engine.runner.warm_calls == 0 and rec.count("warm_up", main_only=False) == 0
    finally:
        cpu.close()
