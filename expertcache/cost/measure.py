"""A `this-cpu` hardware profile from quick micro-measurements (a second or two in all), and on
CUDA a `this-machine` one (the engine's default there): the same plus the host -> device link
(pinned; pageable in its notes), the device's bandwidth at the decode shape and its bf16 TFLOP/s.

- cpu_mem_gbs: a float32 tensor copy much larger than the caches (bytes read + written / s)
- cpu_gflops:  a float32 matmul (2 * n**3 FLOP / s); `gemv=True` measures one-row products
               [1, H] @ [H, I] instead, the shape of a decode step
- disk_gbs:    O_DIRECT reads of checkpoint files with the engine's DiskReader (page cache
               bypassed where the filesystem allows it; otherwise a warm-cache figure, flagged)
- layer_overhead_ms: the host's cost per MoE layer per step, scaled from the figure measured on the
               reference machine (profiles.HOST_REF) by this host's cost of one small aten op
               (`host_op_us`, thread CPU time): the layer's host work is Python and op dispatch, so
               it scales with how fast this core dispatches
- cpu_job_ms (CUDA): a layer's CPU job's fixed cost, measured: the rows' device -> host copy into
               pinned memory, a worker thread woken and joined, the result's copy back and the add
Each figure is the best of a few repetitions, measured with torch's current thread count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..loader.disk import DiskReader
from .profiles import BUILTIN, Profile


@dataclass
class Measured:
    profile: Profile
    threads: int
    disk_direct: bool  # False: reads went through the page cache, disk_gbs is optimistic
    notes: str


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def mem_gbs(mib: int = 256, reps: int = 3) -> float:
    src = torch.ones(mib << 18)  # float32: mib MiB
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    return 2 * src.numel() * 4 / _best(lambda: dst.copy_(src), reps) / 1e9


def matmul_gflops(n: int = 512, reps: int = 3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n**3 / _best(lambda: a @ b, reps) / 1e9


def gemv_gflops(h: int = 256, i: int = 512, batch: int = 64, reps: int = 5) -> float:
    """One-row products against `batch` different weight matrices (cache-cold like experts)."""
    ws = [torch.randn(h, i) for _ in range(batch)]
    x = torch.randn(1, h)

    def run():
        for w in ws:
            x @ w

    run()
    return 2 * h * i * batch / _best(run, reps) / 1e9


def disk_gbs(files: list[Path], limit: int = 256 << 20, chunk: int = 4 << 20) -> tuple[float, bool]:
    """Sequential O_DIRECT reads of up to `limit` bytes over `files`; (GB/s, direct used)."""
    reader = DiskReader(o_direct=True, threads=1)
    buf = torch.empty(chunk, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    total = 0
    t0 = time.perf_counter()
    try:
        for f in files:
            size = f.stat().st_size
            for off in range(0, size - chunk + 1, chunk):
                reader.read_range(f, off, mv)
                total += chunk
                if total >= limit:
                    break
            if total >= limit:
                break
        dt = time.perf_counter() - t0
        direct = reader.direct_used
    finally:
        reader.close()
    if total == 0:
        raise ValueError("disk_gbs: the files are smaller than one read chunk")
    return total / dt / 1e9, direct


def host_op_us(n: int = 4000, reps: int = 5, device=None) -> float:
    """Host (thread CPU) microseconds of one small aten op: an out= add on a 16-element tensor (on
    `device`: the launch's host side), the best of `reps` runs of n."""
    x = torch.zeros(16, device=device)
    y = torch.empty_like(x)

    def run():
        for _ in range(n):
            torch.add(x, 1.0, out=y)

    run()
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        run()
        best = min(best, time.thread_time() - t0)
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return best / n * 1e6


def host_layer_ms(ref: Profile, device=None) -> float:
    """`ref`'s layer_overhead_ms scaled by this host's small-op cost against the reference machine's
    (profiles.HOST_REF)."""
    from .profiles import HOST_REF

    return round(ref.layer_overhead_ms * host_op_us(device=device) / HOST_REF["op_us"], 3)


def cpu_job_ms(device, hidden: int = 2048, rows: int = 1, reps: int = 20) -> float:
    """A layer's CPU job's fixed cost (ms) on `device`: rows -> pinned host memory, a worker thread
    woken and joined (threading.Event), the (empty) result back to the device and the add."""
    import threading

    x = torch.randn(rows, hidden, device=device)
    out = torch.zeros_like(x)
    host = torch.empty(rows, hidden, pin_memory=torch.device(device).type == "cuda")
    go, done = threading.Event(), threading.Event()
    stop = []

    def worker():
        while True:
            go.wait()
            go.clear()
            if stop:
                return
            done.set()

    th = threading.Thread(target=worker, daemon=True)
    th.start()

    def job():
        host.copy_(x, non_blocking=True)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        go.set()
        done.wait()
        done.clear()
        out.add_(host.to(device, non_blocking=True))
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    try:
        job()
        return round(_best(job, reps) * 1e3, 4)
    finally:
        stop.append(1)
        go.set()
        th.join()


def measure_cpu_profile(
    model_dir: str | Path | None = None, name: str = "this-cpu", gemv: bool = False
) -> Measured:
    """Profile(name, link 0, disk, cpu mem, cpu GFLOP/s) of this machine (no GPU terms)."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if model_dir else []
    disk, direct = disk_gbs(files) if files else (3.0, False)
    mem = mem_gbs()
    flops = gemv_gflops() if gemv else matmul_gflops()
    notes = "" if files else "disk not measured (no model dir): 3 GB/s assumed"
    if files and not direct:
        notes = "O_DIRECT refused: disk figure includes the page cache"
    prof = Profile(
        name,
        link_gbs=0.0,
        disk_gbs=round(disk, 3),
        cpu_mem_gbs=round(mem, 3),
        cpu_gflops=round(flops, 2),
        layer_overhead_ms=host_layer_ms(BUILTIN["cpu-only"]),
    )
    return Measured(prof, torch.get_num_threads(), direct, notes)


def link_gbs(device, mib: int = 64, pinned: bool = True, reps: int = 3) -> float:
    """Host -> device copy bandwidth (GB/s) of a `mib` MiB buffer, pinned or pageable."""
    src = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(mib << 20, dtype=torch.uint8, device=device)

    def copy():
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize(device)

    copy()
    return src.numel() / _best(copy, reps) / 1e9


def gpu_figures(
    device, hidden: int = 2048, inter: int = 768, experts: int = 64, reps: int = 5
) -> tuple[float, float]:
    """(GB/s, TFLOP/s) of the device: one-row bf16 products against `experts` expert-shaped
    weights (the decode shape: bandwidth-bound), and a 4096^3 bf16 matmul (compute-bound)."""
    ws = [
        torch.randn(2 * inter + hidden, hidden, device=device, dtype=torch.bfloat16) for _ in range(experts)
    ]
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)

    def gemv():
        for w in ws:
            x @ w.T
        torch.cuda.synchronize(device)

    gemv()
    gbs = sum(w.numel() * 2 for w in ws) / _best(gemv, reps) / 1e9
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

    def mm():
        a @ a
        torch.cuda.synchronize(device)

    mm()
    return gbs, 2 * 4096**3 / _best(mm, reps) / 1e12


def measure_cuda_profile(device, model_dir=None) -> Measured:
    """The this-cpu figures plus this device's: link (pinned; the pageable figure in the notes),
    device memory bandwidth at the decode shape and bf16 TFLOP/s."""
    m = measure_cpu_profile(model_dir, name="this-machine", gemv=True)
    pinned, pageable = link_gbs(device), link_gbs(device, pinned=False)
    gbs, tflops = gpu_figures(device)
    from dataclasses import replace

    prof = replace(
        m.profile,
        link_gbs=round(pinned, 2),
        gpu_mem_gbs=round(gbs, 1),
        gpu_tflops=round(tflops, 1),
        layer_overhead_ms=host_layer_ms(BUILTIN["rtx4090-pcie4"], device),
        cpu_job_ms=cpu_job_ms(device),
    )
    notes = "; ".join(x for x in (m.notes, f"pageable link {pageable:.1f} GB/s") if x)
    return Measured(prof, m.threads, m.disk_direct, notes)


_MEASURED: dict[tuple, Measured] = {}


def _cache_file() -> Path:
    import os

    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "expertcache" / "this-cpu.json"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo; platform.processor() where that cannot be read): part of the
    key of every per-machine measurement."""
    import platform

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def _hardware_key(model_dir) -> str:
    import os

    dev = Path(model_dir).stat().st_dev if model_dir else -1  # the disk figure is the model's filesystem's
    return (
        f"v2|{cpu_name()}|cores={os.cpu_count()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
        f"|dev={dev}"
    )


def this_cpu(
    model_dir: str | Path | None = None, refresh: bool = False, device=None
) -> tuple[Measured, bool]:
    """The `this-cpu` profile (with a CUDA `device`: `this-machine`, its link and device figures
    too), measured once per machine (hardware key: CPU model, cores, torch threads and version, the
    model's filesystem, the device's name) and cached in memory and in
    $XDG_CACHE_HOME/expertcache/this-cpu.json. -> (measurement, True when it came from the cache)."""
    import json

    key = _hardware_key(model_dir)
    if device is not None:
        key += f"|gpu={torch.cuda.get_device_name(device)}"
    if not refresh and key in _MEASURED:
        return _MEASURED[key], True
    path = _cache_file()
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    if not refresh and isinstance(saved.get(key), dict):
        d = saved[key]
        try:
            m = Measured(Profile(**d["profile"]), d["threads"], d["disk_direct"], d["notes"])
            _MEASURED[key] = m
            return m, True
        except (KeyError, TypeError):
            pass  # an older or damaged entry: measure again
    m = measure_cpu_profile(model_dir) if device is None else measure_cuda_profile(device, model_dir)
    _MEASURED[key] = m
    saved[key] = {
        "profile": m.profile.__dict__,
        "threads": m.threads,
        "disk_direct": m.disk_direct,
        "notes": m.notes,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved, indent=1))
    except OSError:
        pass  # a read-only home: measured again next process
    return m, False


def resolve_profile(spec: str | None, device: str, model_dir=None) -> tuple[Profile, str]:
    """(Profile, how it was chosen) for `plan` and the engine's per-miss choice. None: the default for
    the device (cost.model.DEFAULT_PROFILE); "this-cpu": measured once and cached (on cuda its GPU and
    link figures come from the default CUDA profile); else a built-in name or FILE.toml[:NAME]. A CPU
    device drops a profile's GPU figures; a CUDA device needs them."""
    from dataclasses import replace

    from .model import DEFAULT_PROFILE
    from .profiles import get_profile

    how = "given"
    if spec is None and device == "cuda" and torch.cuda.is_available():
        spec = "this-machine"  # measured at start-up, once per machine: no assumed card decides the misses
    if spec is None:
        spec, how = DEFAULT_PROFILE[device], f"default for device {device}"
    if spec == "this-machine":
        if device != "cuda" or not torch.cuda.is_available():
            raise ValueError("profile: 'this-machine' measures a CUDA device; none is available here")
        m, cached = this_cpu(model_dir, device=torch.device("cuda"))
        prof = m.profile
        how = f"measured {'earlier (cached)' if cached else 'now'} with {m.threads} torch threads" + (
            f"; {m.notes}" if m.notes else ""
        )
    elif spec == "this-cpu":
        m, cached = this_cpu(model_dir)
        prof = m.profile
        how = f"measured {'earlier (cached)' if cached else 'now'} with {m.threads} torch threads" + (
            f"; {m.notes}" if m.notes else ""
        )
        if device == "cuda":
            g = BUILTIN[DEFAULT_PROFILE["cuda"]]
            prof = replace(
                prof,
                link_gbs=g.link_gbs,
                gpu_mem_gbs=g.gpu_mem_gbs,
                gpu_tflops=g.gpu_tflops,
                layer_overhead_ms=host_layer_ms(g),
                cpu_job_ms=g.cpu_job_ms,
            )
            how += f"; link and GPU figures from {g.name}"
    else:
        prof = get_profile(spec)
    if device == "cpu" and prof.has_gpu:
        prof, how = (
            replace(prof, gpu_mem_gbs=0.0, gpu_tflops=0.0),
            how + "; GPU figures ignored for device cpu",
        )
    if device == "cuda" and not prof.has_gpu:
        raise ValueError(f"profile: {prof.name!r} has no GPU figures; pick a GPU profile for device cuda")
    return prof, how
