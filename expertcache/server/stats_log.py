"""The periodic status line (like vLLM's), written by the engine thread while the server is busy.

    Avg prompt throughput: 812.4 tok/s, Avg generation throughput: 45.1 tok/s, Running: 4 reqs,
    Waiting: 0 reqs, KV cache usage: 3.1%, Prefix cache hit rate: 41.0%, Expert hit rate: 77.2%

Rates are over the interval since the previous line; hit rates are cumulative. Nothing is
logged for an interval without work.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("expertcache.server")


def _rate(num: float, den: float) -> str:
    return f"{num / den:.1%}" if den else "n/a"


class ThroughputLog:
    def __init__(self, interval_s: float = 10.0):
        self.interval = interval_s
        self._t = time.monotonic()
        self._prompt = 0
        self._gen = 0

    def maybe_log(self, snap: dict) -> str | None:
        now = time.monotonic()
        if self.interval <= 0 or now - self._t < self.interval or not snap:
            return None
        c = snap["engine_counters"]
        dt, dp, dg = now - self._t, c["prompt_tokens"] - self._prompt, c["generated_tokens"] - self._gen
        self._t, self._prompt, self._gen = now, c["prompt_tokens"], c["generated_tokens"]
        if not (dp or dg or snap["running"] or snap["waiting"]):
            return None
        ex = snap.get("expert_stats") or {}
        hits, misses = ex.get("hits", 0) or 0, ex.get("misses", 0) or 0
        line = (
            f"Avg prompt throughput: {dp / dt:.1f} tok/s, Avg generation throughput: {dg / dt:.1f} tok/s, "
            f"Running: {snap['running']} reqs, Waiting: {snap['waiting']} reqs, "
            f"KV cache usage: {snap['kv_cache_usage']:.1%}, "
            f"Prefix cache hit rate: {_rate(snap['prefix_cache_hits'], snap['prefix_cache_queries'])}, "
            f"Expert hit rate: {_rate(hits, hits + misses)}"
        )
        ep = ex.get("expert_parallel")
        if ep:
            line += f", EP balance (max/mean): {ep['balance_mean']:.2f}"
            if ep.get("peer_tier"):
                line += f", EP peer hits: {ep.get('peer_hits', 0)}"
        log.info("%s", line)
        return line
