"""Counters of the expert tiers, and their save/load format.

Units: a *use* is one distinct expert needed by one MoE layer in one forward step
(what moves bytes); `use_counts` [layers, experts] counts routed (token, expert)
pairs instead, for heatmaps and static placement.

expert_stats() layout:
    hits, misses            uses found / not found in the fastest tier
    bytes_moved             bytes copied into the fastest tier + bytes read from disk
    per_tier                {"device": {...}, "host": {...}, "disk": {...}}
    per_layer               [{layer, hits, misses, bytes_moved, prefetch_issued, prefetch_useful,
                              host_prefetch_issued, host_prefetch_useful, cpu_computed, ...}]
    cpu_computed_share      share of misses computed on the CPU from host RAM
    cpu_admitted_share      share of misses computed on the CPU and also copied into a device slot
    use_counts              [[...]] layers x experts
    residency               [[...]] layers x experts: 2 in a device slot, 1 in host RAM, 0 only on disk
                            (added by TieredExperts.stats)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass
class LayerCounters:
    hits: int = 0
    misses: int = 0
    bytes_moved: int = 0  # into the fastest tier
    host_hits: int = 0
    host_misses: int = 0
    disk_bytes: int = 0
    prefetch_issued: int = 0
    prefetch_useful: int = 0  # prefetched experts later used while still resident
    host_prefetch_issued: int = 0  # disk -> host reads ahead (prefetch "host")
    host_prefetch_useful: int = 0
    cpu_computed: int = 0  # misses computed on the CPU (admitted or not)
    cpu_admitted: int = 0  # of those, copied into a device slot beside the CPU job (reuse predicted)
    demoted: int = 0  # experts evicted from the device tier whose bytes went to a host slot (exclusive)
    waves: int = 0  # uses computed through the staging slots (no slot could be kept)


def collect(
    layers: dict[int, LayerCounters], use_counts: torch.Tensor, device_slots: int, host_slots: int | None
) -> dict:
    tot = LayerCounters()
    for c in layers.values():
        for k, v in asdict(c).items():
            setattr(tot, k, getattr(tot, k) + v)
    uses = tot.hits + tot.misses
    return {
        "hits": tot.hits,
        "misses": tot.misses,
        "hit_rate": tot.hits / uses if uses else 0.0,
        "bytes_moved": tot.bytes_moved + tot.disk_bytes,
        "cpu_computed_share": tot.cpu_computed / tot.misses if tot.misses else 0.0,
        "cpu_admitted_share": tot.cpu_admitted / tot.misses if tot.misses else 0.0,
        "prefetch": {"issued": tot.prefetch_issued, "useful": tot.prefetch_useful},
        "per_tier": {
            "device": {
                "slots_per_layer": device_slots,
                "hits": tot.hits,
                "misses": tot.misses,
                "bytes_in": tot.bytes_moved,
            },
            "host": {
                "slots_per_layer": host_slots,
                "hits": tot.host_hits,
                "misses": tot.host_misses,
                "prefetch_issued": tot.host_prefetch_issued,
                "prefetch_useful": tot.host_prefetch_useful,
                "demoted": tot.demoted,
            },
            "disk": {"bytes_read": tot.disk_bytes},
        },
        "per_layer": [{"layer": layer, **asdict(c)} for layer, c in sorted(layers.items())],
        "use_counts": use_counts.tolist(),
    }


def summary_line(s: dict) -> str:
    host = s["per_tier"]["host"]
    hu = host["hits"] + host["misses"]
    parts = [f"expert hit rate device {s['hit_rate']:.1%}"]
    if hu:
        parts.append(f"host {host['hits'] / hu:.1%}")
    parts.append(f"moved {s['bytes_moved'] / 1e9:.3f} GB")
    if s["misses"]:
        parts.append(
            f"cpu-computed {s['cpu_computed_share']:.0%} of misses"
            + (f" ({s['cpu_admitted_share']:.0%} admitted too)" if s.get("cpu_admitted_share") else "")
        )
    return ", ".join(parts)


def save_stats(path: str | Path, use_counts: torch.Tensor, layers: list[int], model: str) -> None:
    Path(path).write_text(
        json.dumps(
            {
                "format": "expertcache-stats-v1",
                "model": model,
                "layers": layers,
                "use_counts": use_counts.tolist(),
            }
        )
    )


def load_stats(path: str | Path, layers: list[int], num_experts: int) -> torch.Tensor:
    try:
        d = json.loads(Path(path).read_text())
        counts = torch.tensor(d["use_counts"], dtype=torch.float64)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: not an expertcache stats file ({e})") from None
    if d.get("layers") != layers or tuple(counts.shape) != (len(layers), num_experts):
        raise ValueError(
            f"{path}: stats are for layers {d.get('layers')} x {list(counts.shape)[1:]} experts, "
            f"this model has layers {layers} x {num_experts}"
        )
    return counts
