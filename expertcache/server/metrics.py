"""Prometheus metrics of the server, in a registry of its own (no process-global state).

Two sources:
- events the engine thread reports as they happen (admissions, tokens, finishes): counters
  and latency histograms, updated through ServerMetrics' on_* methods (prometheus_client
  objects are thread-safe);
- engine state read at scrape time from the engine thread's last published snapshot
  (`snapshot()` callable): KV usage, prefix cache and expert cache counters. Absent expert
  statistics (the all-resident provider reports none) read as 0.

Names follow vLLM's (`vllm:` -> `expertcache:`) so existing dashboards map over.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "expertcache:"
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)


def _num(x) -> float:
    try:
        return float(x or 0)
    except (TypeError, ValueError):
        return 0.0


def expert_tiers(stats: dict) -> dict[str, dict[str, float]]:
    """{tier: {"hits", "misses", "bytes"}} from expert_stats(), tolerant of missing keys."""
    out: dict[str, dict[str, float]] = {}
    per_tier = stats.get("per_tier") if isinstance(stats, dict) else None
    if isinstance(per_tier, dict) and per_tier:
        for tier, d in per_tier.items():
            if not isinstance(d, dict):
                continue
            out[str(tier)] = {
                "hits": _num(d.get("hits")),
                "misses": _num(d.get("misses")),
                "bytes": sum(_num(v) for k, v in d.items() if "bytes" in k),
            }
    elif isinstance(stats, dict) and stats:
        out["device"] = {
            "hits": _num(stats.get("hits")),
            "misses": _num(stats.get("misses")),
            "bytes": _num(stats.get("bytes_moved")),
        }
    return out


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], dict], load_progress: Callable[[], float]):
        self.snapshot, self.load_progress = snapshot, load_progress

    def collect(self):
        snap = self.snapshot() or {}
        g = GaugeMetricFamily(P + "model_load_progress", "Share of checkpoint bytes loaded (1 when ready)")
        g.add_metric([], self.load_progress())
        yield g
        g = GaugeMetricFamily(P + "kv_cache_usage_perc", "KV cache usage (1 = every block in use)")
        g.add_metric([], _num(snap.get("kv_cache_usage")))
        yield g
        c = CounterMetricFamily(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        c.add_metric([], _num(snap.get("prefix_cache_queries")))
        yield c
        c = CounterMetricFamily(P + "prefix_cache_hits", "Prompt tokens served from the prefix cache")
        c.add_metric([], _num(snap.get("prefix_cache_hits")))
        yield c
        counters = snap.get("engine_counters") or {}
        c = CounterMetricFamily(
            P + "prompt_tokens_computed", "Prompt tokens prefilled (prefix cache hits excluded)"
        )
        c.add_metric([], _num(counters.get("prompt_tokens")))
        yield c
        c = CounterMetricFamily(P + "num_preemptions", "Sequences preempted for lack of KV blocks")
        c.add_metric([], _num(snap.get("num_preemptions")))
        yield c
        stats = snap.get("expert_stats") or {}
        tiers = expert_tiers(stats) or {"device": {"hits": 0.0, "misses": 0.0, "bytes": 0.0}}
        for key, name, doc in (
            ("hits", "expert_cache_hits", "Expert uses found in the tier"),
            ("misses", "expert_cache_misses", "Expert uses not found in the tier"),
            ("bytes", "expert_cache_bytes", "Bytes moved into / read from the tier"),
        ):
            c = CounterMetricFamily(P + name, doc, labels=["tier"])
            for tier, d in tiers.items():
                c.add_metric([tier], d[key])
            yield c
        g = GaugeMetricFamily(P + "expert_cpu_computed_share", "Share of expert misses computed on the CPU")
        g.add_metric([], _num(stats.get("cpu_computed_share")))
        yield g
        ep = stats.get("expert_parallel")
        if isinstance(ep, dict):
            yield from _parallel_metrics(ep)


def _parallel_metrics(ep: dict):
    """Expert-parallel gauges: per-rank routed pairs of the last step, balance, rearrangements."""
    g = GaugeMetricFamily(
        P + "ep_pairs_per_rank", "Routed (token, expert) pairs per rank in the last step", labels=["rank"]
    )
    for r, n in enumerate(ep.get("pairs_per_rank_last_step") or []):
        g.add_metric([str(r)], _num(n))
    yield g
    g = GaugeMetricFamily(
        P + "ep_balance", "Max / mean routed pairs per rank (1 = balanced)", labels=["window"]
    )
    g.add_metric(["last_step"], _num(ep.get("balance_last_step")))
    g.add_metric(["mean"], _num(ep.get("balance_mean")))
    yield g
    c = CounterMetricFamily(P + "ep_rearrangements", "Expert placements switched to (EPLB)")
    c.add_metric([], _num(ep.get("rearrangements")))
    yield c
    c = CounterMetricFamily(
        P + "ep_bytes_rearranged", "Expert bytes loaded by the ranks for new placements", labels=["source"]
    )
    c.add_metric(["disk"], _num(ep.get("bytes_rearranged")))
    c.add_metric(["peer"], _num(ep.get("bytes_rearranged_peer")))
    yield c
    c = CounterMetricFamily(
        P + "ep_peer_hits", "Expert misses served from another rank's memory (peer tier)", labels=["rank"]
    )
    for r in ep.get("ranks") or []:
        c.add_metric([str(r.get("rank"))], _num((r.get("peer") or {}).get("hits")))
    yield c
    c = CounterMetricFamily(
        P + "ep_peer_bytes", "Expert bytes moved rank to rank by the peer tier", labels=["rank", "direction"]
    )
    for r in ep.get("ranks") or []:
        for d in ("in", "out"):
            c.add_metric([str(r.get("rank")), d], _num((r.get("peer") or {}).get(f"bytes_{d}")))
    yield c


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge(P + "num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter(P + "request_success", "Finished requests", ["finished_reason"], registry=r)
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds", "Arrival to last token", buckets=E2E_BUCKETS, registry=r
        )

    def attach(self, snapshot: Callable[[], dict], load_progress: Callable[[], float]) -> None:
        self.registry.register(_SnapshotCollector(snapshot, load_progress))

    # -- called by the engine thread --
    def on_admit(self, prompt_len: int) -> None:
        self.prompt_tokens.inc(prompt_len)

    def on_tokens(self, n: int, ttft: float | None, itl: float | None) -> None:
        self.generation_tokens.inc(n)
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)

    def on_finish(self, reason: str, e2e: float | None) -> None:
        self.finished.labels(reason).inc()
        if e2e is not None:
            self.e2e.observe(e2e)

    def set_queue(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
