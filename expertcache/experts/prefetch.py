"""What to read ahead, and whether: the prefetch mode, the predicted experts to take, and the
per-layer gate that stops prefetching where it does more harm than good. Used by the engine
(experts.manager) and by trace replay, so both make the same choices."""

from __future__ import annotations

import torch


def most_predicted(ids: list[int]) -> list[int]:
    """Distinct predicted experts, most predicted first (ties: first appearance); -1 skipped.
    Prefetch takes at most a tier's capacity of them: a batch predicting more experts than the
    tier holds would otherwise read experts only to evict them in the same step."""
    counts: dict[int, int] = {}
    for e in ids:
        if e >= 0:
            counts[e] = counts.get(e, 0) + 1
    if len(counts) == len(ids):  # each predicted once (a decode row): first appearance order
        return list(counts)
    return sorted(counts, key=counts.__getitem__, reverse=True)  # stable: ties keep their order


class PrefetchGate:
    """Per layer: stop prefetching where it does more harm than good.

    Per step that prefetched: `used` prefetches took a read off the critical path; `harm` demand
    misses hit experts a prefetch had evicted; the unused ones (`issued - used`) spent bandwidth for
    nothing. Prefetch never lowers the bytes moved, it only hides latency, so an unused read is
    priced by `waste`: 1.0 where the disk (or the CPU doing the conversions) is the bottleneck, 0.25
    for CUDA copies, which overlap compute on an otherwise idle link (an estimate, not measured).
    score = EWMA (alpha 0.25, from 0.5) of (used - harm - waste * unused) / issued; below `threshold`
    a layer prefetches only every `probe_every`-th time, so it notices when predictions improve.
    Measured (bench/prefetch_gate.py, README): ungated, read-ahead on a random-weight model whose
    router predicts poorly lowered the hit rate 0.629 -> 0.550 and doubled disk reads; gated it
    stays at 0.626, while on the trained tinymoe-py16 it still raises 0.538 -> 0.598. Replay
    (trace.replay) runs the same gate."""

    def __init__(
        self,
        layers: int,
        threshold: float | None = 0.0,
        alpha: float = 0.25,
        probe_every: int = 16,
        waste: float = 1.0,
    ):
        self.threshold, self.alpha, self.probe_every, self.waste = threshold, alpha, probe_every, waste
        self.score = [0.5] * layers
        self.skipped = [0] * layers

    def allow(self, i: int) -> bool:
        if self.threshold is None or self.score[i] >= self.threshold:
            return True
        self.skipped[i] += 1
        if self.skipped[i] < self.probe_every:
            return False
        self.skipped[i] = 0
        return True

    def update(self, i: int, issued: int, used: int, harm: int) -> None:
        if issued:
            self.score[i] += self.alpha * (
                (used - harm - self.waste * (issued - used)) / issued - self.score[i]
            )


PREFETCH_MODES = ("auto", "device", "host", "off")


def resolve_prefetch(prefetch, device: torch.device, direct: bool, host_partial: bool) -> str:
    """prefetch (bool, None or a mode) -> "device" | "host" | "off".

    auto: prefetch hides a transfer behind compute. With CUDA that is the host -> device copy.
    On a CPU-only machine the "transfer" into fp32 device slots is a conversion that needs the
    same cores and memory bandwidth as compute and measured slower than demand loads (README,
    cache benchmark); a disk read needs no cores, so auto reads ahead from disk only: into host
    slots, or straight into the device slots when they keep the stored format (`direct`)."""
    mode = {True: "device", False: "off", None: "auto"}.get(prefetch, prefetch)
    if mode not in PREFETCH_MODES:
        raise ValueError(f"prefetch must be one of {', '.join(PREFETCH_MODES)} or a bool, got {prefetch!r}")
    if mode == "auto":
        mode = "device" if device.type == "cuda" or (direct and not host_partial) else "host"
    if mode == "host" and not host_partial:
        mode = "off"  # every expert is in host RAM already (or there is no host tier): nothing to read ahead
    return mode
