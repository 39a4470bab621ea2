"""What one use of one expert costs under a hardware Profile: the terms every consumer shares.

    gpu_use(u)   = max(eb / gpu_mem, 2 Pe u / gpu_flops)     a resident expert, u rows
    cpu_use(u)   = max(eb / cpu_mem, 2 Pe u / cpu_flops)     computed on the CPU from host RAM
    transfer     = eb / link  (+ eb / disk when from_disk)   bytes to the device
    cpu_job      = cpu_job_ms                                the CPU path's fixed cost per layer: the rows
                                                             copy, the worker's wake-up, the join and the add
    cpu_faster(u, first) <=> cpu_use(u) + disk + (cpu_job if first) < transfer + gpu_use(u)
    peer         = peer_latency + eb / peer                  one expert from another rank's memory
    peer_faster  <=> peer < disk                             (expert parallelism's peer tier)

(eb = bytes of one expert, Pe = its parameters; bandwidths in bytes/s, throughputs in FLOP/s).
A miss read from disk pays the disk on both sides, so the per-miss choice does not depend on it.
The engine asks `cpu_faster(tokens, first=...)` for each missing expert (cpu_compute="auto" on CUDA):
`first` when no expert of the layer's step goes to the CPU yet, so the first one pays the CPU job's
fixed cost and the others only their own use; it is this step's latency only; the step planner still admits an
expert computed on the CPU into a device
slot where the layer's policy predicts reuse (the copy runs beside the CPU job);
an expert-parallel group asks `peer_faster()` once, for its measured or profiled link;
trace.simulate prices a replay with the same terms; plan.speed calls simulate.
"""

from __future__ import annotations

from dataclasses import dataclass

from .profiles import BUILTIN, Profile

# used when none is given (plan; the engine on a machine with CUDA measures its own: cost.measure "this-machine")
DEFAULT_PROFILE = {"cpu": "cpu-only", "cuda": "rtx4090-pcie4"}

GB, TF = 1e9, 1e12


@dataclass(frozen=True)
class ExpertCost:
    profile: Profile
    expert_bytes: int
    expert_params: int

    def gpu_use(self, rows: float = 1.0) -> float:
        p = self.profile
        return max(
            self.expert_bytes / (p.gpu_mem_gbs * GB), 2 * self.expert_params * rows / (p.gpu_tflops * TF)
        )

    def cpu_use(self, rows: float = 1.0) -> float:
        p = self.profile
        return max(
            self.expert_bytes / (p.cpu_mem_gbs * GB), 2 * self.expert_params * rows / (p.cpu_gflops * 1e9)
        )

    def disk(self) -> float:
        return self.expert_bytes / (self.profile.disk_gbs * GB) if self.profile.disk_gbs > 0 else 0.0

    def transfer(self, from_disk: bool = False) -> float:
        link = self.profile.link_gbs
        return (self.expert_bytes / (link * GB) if link > 0 else float("inf")) + (
            self.disk() if from_disk else 0.0
        )

    def cpu_job(self) -> float:
        """The CPU path's fixed cost per layer (seconds), paid once by the first CPU expert of a step."""
        return self.profile.cpu_job_ms / 1e3

    def cpu_faster(self, rows: float, from_disk: bool = False, first: bool = False) -> bool:
        """Is a missing expert used by `rows` rows cheaper computed on the CPU than moved to the device?
        `first`: no other expert of this layer's step is on the CPU, so this one pays `cpu_job`."""
        if not self.profile.has_gpu:
            return True
        d = self.disk() if from_disk else 0.0
        fixed = self.cpu_job() if first else 0.0
        return self.cpu_use(rows) + d + fixed < self.transfer(from_disk) + self.gpu_use(rows)

    def peer(self) -> float:
        p = self.profile
        return p.peer_latency_ms / 1e3 + (
            self.expert_bytes / (p.peer_gbs * GB) if p.peer_gbs > 0 else float("inf")
        )

    def peer_faster(self) -> bool:
        """Is an expert missing from this rank's memory cheaper fetched from a peer rank's memory than
        read from this rank's disk? (The peer's bytes replace the disk read; the rest of the miss is
        the same either way.)"""
        return self.peer() < self.disk()


def default_profile(device: str) -> Profile:
    return BUILTIN[DEFAULT_PROFILE[device]]
