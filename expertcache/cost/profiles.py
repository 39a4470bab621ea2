"""Hardware profiles for the cost model (cost.model: the engine's per-miss choice, trace simulate, plan).

A Profile is bandwidths in GB/s (10**9 bytes/s) and throughputs in GFLOP/s or
TFLOP/s. `gpu_tflops == 0` means no accelerator: everything runs on the CPU.
Built-in numbers are rough sustained figures, not peaks.

User profiles come from TOML (tomllib): either tables `[profiles.NAME]` with the
fields below, or the fields at top level (the profile is then named after the
file stem). Select one with `get_profile("rigs.toml:NAME")`, `get_profile("rig.toml")`
(a single profile) or a built-in name.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class Profile:
    name: str
    link_gbs: float  # host -> device copy bandwidth
    disk_gbs: float  # disk -> host read bandwidth
    cpu_mem_gbs: float
    cpu_gflops: float
    gpu_mem_gbs: float = 0.0
    gpu_tflops: float = 0.0
    step_overhead_ms: float = 0.0  # fixed cost per forward step (dispatch, launches); calibrated, 0 = ignored
    layer_overhead_ms: float = (
        0.0  # fixed host cost per MoE layer per step (planner, op dispatch); see BUILTIN
    )
    cpu_job_ms: float = (
        0.0  # fixed cost of a layer's CPU job (rows copy, worker wake-up, join, add); see BUILTIN
    )
    # expert parallelism: the link between two ranks (NVLink, PCIe P2P, Ethernet, loopback gloo), what
    # the peer tier pays per expert fetched from another rank's memory; 0 = not known (the group
    # measures its own link once at start)
    peer_gbs: float = 0.0  # rank -> rank bandwidth
    peer_latency_ms: float = 0.0  # fixed cost of one rank -> rank transfer
    # a card profile (`plan --gpu NAME`): the device-memory plan's figures for a GPU not present here
    vram_gib: float = 0.0  # total device memory, GiB
    context_mib: float = 0.0  # what the CUDA context takes on it (driver, runtime, cuBLAS), MiB
    capability: float = 0.0  # compute capability, e.g. 8.9

    @property
    def has_gpu(self) -> bool:
        return self.gpu_tflops > 0


# The reference machine of the host figures (this project's 2-core Xeon, torch 2.13, one torch thread):
# its cost of one small aten op (cost.measure.host_op_us, thread CPU time) against which `this-cpu` and
# `this-machine` scale the layer overhead of their base profile (cost.measure.host_layer_ms).
HOST_REF = {"op_us": 2.5}
# A GPU host's time per MoE layer per decode step on the scheduled path (an estimate from the CPU's
# measurements; the device check bench/simulate_validate.py replaces it), and the CPU path's fixed cost
# per layer on a GPU host (an estimate; `this-machine` measures it). Where the figures come from:
# docs/results.md, "Where the code's tuning constants come from".
GPU_LAYER_MS = 1.0
GPU_CPU_JOB_MS = 0.1

BUILTIN: dict[str, Profile] = {
    p.name: p
    for p in (
        # layer_overhead_ms: CPU 1.2, measured (docs/results.md, "Where the code's tuning constants come
        # from"); GPU = GPU_LAYER_MS (above). cpu_job_ms: GPU_CPU_JOB_MS (above); 0 without a GPU
        # (everything is the CPU path).
        Profile("cpu-only", link_gbs=0, disk_gbs=3, cpu_mem_gbs=50, cpu_gflops=800, layer_overhead_ms=1.2),
        Profile(
            "laptop-pcie3",
            link_gbs=12,
            disk_gbs=2,
            cpu_mem_gbs=40,
            cpu_gflops=400,
            gpu_mem_gbs=190,
            gpu_tflops=9,
            layer_overhead_ms=GPU_LAYER_MS,
            cpu_job_ms=GPU_CPU_JOB_MS,
        ),
        Profile(
            "rtx3060-pcie4",
            link_gbs=25,
            disk_gbs=5,
            cpu_mem_gbs=55,
            cpu_gflops=1000,
            gpu_mem_gbs=360,
            gpu_tflops=25,
            layer_overhead_ms=GPU_LAYER_MS,
            cpu_job_ms=GPU_CPU_JOB_MS,
        ),
        Profile(
            "rtx4090-pcie4",
            link_gbs=25,
            disk_gbs=6,
            cpu_mem_gbs=70,
            cpu_gflops=1500,
            gpu_mem_gbs=1000,
            gpu_tflops=160,
            layer_overhead_ms=GPU_LAYER_MS,
            cpu_job_ms=GPU_CPU_JOB_MS,
        ),
        Profile(
            "a100-pcie4",
            link_gbs=25,
            disk_gbs=6,
            cpu_mem_gbs=150,
            cpu_gflops=2000,
            gpu_mem_gbs=1900,
            gpu_tflops=300,
            layer_overhead_ms=GPU_LAYER_MS,
            cpu_job_ms=GPU_CPU_JOB_MS,
        ),
        # cards (vram_gib, context_mib, capability: the device-memory plan); context figures are typical
        # CUDA 12 contexts with cuBLAS loaded (about 0.3-0.6 GiB), not measured here
        Profile(
            "rtx4060-8gb",
            link_gbs=13,
            disk_gbs=5,
            cpu_mem_gbs=55,
            cpu_gflops=1000,
            gpu_mem_gbs=272,
            gpu_tflops=15,
            layer_overhead_ms=GPU_LAYER_MS,
            cpu_job_ms=GPU_CPU_JOB_MS,
            vram_gib=8,
            context_mib=400,
            capability=8.9,
        ),
        Profile(
            "rtx3060-12gb",
            link_gbs=25,
            disk_gbs=5,
            cpu_mem_gbs=55,
            cpu_gflops=1000,
            gpu_mem_gbs=360,
            gpu_tflops=25,
            layer_overhead_ms=GPU_LAYER_MS,
            cpu_job_ms=GPU_CPU_JOB_MS,
            vram_gib=12,
            context_mib=400,
            capability=8.6,
        ),
        Profile(
            "rtx4090-24gb",
            link_gbs=25,
            disk_gbs=6,
            cpu_mem_gbs=70,
            cpu_gflops=1500,
            gpu_mem_gbs=1000,
            gpu_tflops=160,
            layer_overhead_ms=GPU_LAYER_MS,
            cpu_job_ms=GPU_CPU_JOB_MS,
            vram_gib=24,
            context_mib=500,
            capability=8.9,
        ),
        Profile(
            "a100-80gb",
            link_gbs=25,
            disk_gbs=6,
            cpu_mem_gbs=150,
            cpu_gflops=2000,
            gpu_mem_gbs=1900,
            gpu_tflops=300,
            layer_overhead_ms=GPU_LAYER_MS,
            cpu_job_ms=GPU_CPU_JOB_MS,
            vram_gib=80,
            context_mib=500,
            capability=8.0,
        ),
        Profile(
            "h200-141gb",
            link_gbs=50,
            disk_gbs=10,
            cpu_mem_gbs=250,
            cpu_gflops=3000,
            gpu_mem_gbs=4800,
            gpu_tflops=750,
            layer_overhead_ms=GPU_LAYER_MS,
            cpu_job_ms=GPU_CPU_JOB_MS,
            vram_gib=140,
            context_mib=550,
            capability=9.0,
        ),
        Profile(
            "h100-pcie5",
            link_gbs=50,
            disk_gbs=10,
            cpu_mem_gbs=250,
            cpu_gflops=3000,
            gpu_mem_gbs=2000,
            gpu_tflops=750,
            layer_overhead_ms=GPU_LAYER_MS,
            cpu_job_ms=GPU_CPU_JOB_MS,
        ),
    )
}

_FIELDS = {f.name for f in fields(Profile)} - {"name"}
_REQUIRED = {"link_gbs", "disk_gbs", "cpu_mem_gbs", "cpu_gflops"}


def _from_table(name: str, table: dict, where: str) -> Profile:
    unknown = set(table) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown profile field {min(unknown)!r}; known: {sorted(_FIELDS)}")
    missing = _REQUIRED - set(table)
    if missing:
        raise ValueError(f"{where}: profile {name!r} lacks field {min(missing)!r}")
    for k, v in table.items():
        if not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{where}: field {k!r} must be a number >= 0, got {v!r}")
    return Profile(name=name, **{k: float(v) for k, v in table.items()})


def load_profiles(path: str | Path) -> dict[str, Profile]:
    path = Path(path)
    with open(path, "rb") as f:
        data = tomllib.load(f)
    if "profiles" in data:
        if not isinstance(data["profiles"], dict):
            raise ValueError(f"{path}: 'profiles' must be a table of tables")
        return {n: _from_table(n, t, f"{path} [profiles.{n}]") for n, t in data["profiles"].items()}
    return {path.stem: _from_table(path.stem, data, str(path))}


def get_profile(spec: str) -> Profile:
    """A built-in name, "file.toml" (one profile) or "file.toml:NAME"."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    file, _, name = spec.partition(".toml")
    if not _:
        raise ValueError(f"profile: unknown {spec!r}; built-ins: {sorted(BUILTIN)} or a .toml file")
    profs = load_profiles(file + ".toml")
    name = name.lstrip(":")
    if not name:
        if len(profs) != 1:
            raise ValueError(f"profile: {file}.toml holds {sorted(profs)}; pick one with FILE.toml:NAME")
        return next(iter(profs.values()))
    if name not in profs:
        raise ValueError(f"profile: {name!r} not in {file}.toml ({sorted(profs)})")
    return profs[name]
