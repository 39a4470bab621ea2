"""AsyncEngine: the one engine thread, and the asyncio side HTTP handlers talk to.

Invariants:
- Only the engine thread calls into `llm.engine`, `llm.kv` and `llm.experts` (step, add_request,
  abort, expert_stats, counters). Handlers never touch them: they put commands into `_inbox`
  (a thread-safe queue.Queue) and read results from per-request asyncio queues that the engine
  thread fills with `loop.call_soon_threadsafe`.
- Requests join and leave between steps: the thread drains its inbox (adds, aborts) before
  every step, so a new request waits at most one step to be admitted.
- Every admitted request ends with exactly one item per sample whose `finish_reason` is set (or
  one error item), unless the client aborted it first; an aborted request gets no more items.
- `snapshot()` returns the last state the engine thread published (a fresh dict after every
  step, published before that step's tokens are delivered; expert statistics refreshed at most
  once a second while busy and whenever the engine goes idle); readers must not mutate it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field

from ..engine.params import ParamError, SamplingParams
from .errors import ApiError
from .metrics import ServerMetrics
from .stats_log import ThroughputLog

log = logging.getLogger("expertcache.server")

IDLE_POLL_S = 0.5
EXPERT_STATS_EVERY_S = 1.0


@dataclass
class Final:
    """What a finished request reports besides its text: usage and llama.cpp-style timings."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: dict
    cumulative_logprob: float = 0.0
    prompt_logprobs: list | None = None  # TokenLogprob per prompt token (first None), when asked for


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    final: Final | None = None
    error: str | None = None
    index: int = 0  # sample number within the request
    logprobs: list | None = None  # TokenLogprob per token in token_ids, when asked for
    request_id: str = ""
    prompt_logprobs: list | None = None  # on a sample's first item, when asked for (echo)


@dataclass
class RequestHandle:
    """The handler's side of one request; `queue` yields Delta items in order."""

    request_id: str
    prompt_len: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # may be shared by several handles
    admitted: asyncio.Future | None = None
    finished: bool = False
    samples: int = 1

    async def deltas(self):
        """This request's items (its own queue only) until every sample finished or an error."""
        left = self.samples
        while not self.finished:
            item: Delta = await self.queue.get()
            if item.error is not None:
                self.finished = True
            elif item.finish_reason is not None:
                left -= 1
                self.finished = left == 0
            yield item


@dataclass
class _Track:
    """Engine-thread bookkeeping of one request."""

    handle: RequestHandle
    arrival: float
    experts_at_start: tuple[int, int] | None
    first: float | None = None
    last: float | None = None
    n_tokens: int = 0


def _expert_totals(stats: dict) -> tuple[int, int] | None:
    try:
        return int(stats["hits"]), int(stats["misses"])
    except (KeyError, TypeError, ValueError):
        return None


class AsyncEngine:
    def __init__(self, llm, metrics: ServerMetrics, log_interval: float = 10.0):
        self.llm = llm
        self.metrics = metrics
        self._inbox: queue.Queue = queue.Queue()
        self._tracks: dict[str, _Track] = {}
        self._stop = threading.Event()
        self._snapshot: dict = {}
        self._expert_stats: dict = {}
        self._expert_stats_at = 0.0
        self._step_totals: tuple[int, tuple[int, int] | None] | None = None
        self._log = ThroughputLog(log_interval)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # -- handler side (event loop thread) -------------------------------------------------------
    def start(self) -> None:
        self._refresh_expert_stats(force=True)
        self._publish()
        self._thread.start()

    async def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue | None = None,
    ) -> RequestHandle:
        """Queue a request and wait until the engine accepted it; ApiError (400) if it refused.
        Its items go to `queue` when given (one queue for the prompts of a batched request)."""
        loop = asyncio.get_running_loop()
        handle = RequestHandle(
            request_id, len(prompt_ids), loop, admitted=loop.create_future(), samples=params.n
        )
        if queue is not None:
            handle.queue = queue
        self._inbox.put(("add", handle, prompt_ids, params, time.perf_counter()))
        try:
            await handle.admitted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return handle

    def abort(self, request_id: str) -> None:
        """Safe from any thread; a finished or unknown id is ignored."""
        self._inbox.put(("abort", request_id))

    def snapshot(self) -> dict:
        return self._snapshot

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.llm.engine
        while not self._stop.is_set():
            try:
                idle = not eng.has_unfinished()
                self._drain(block=idle)
                if eng.has_unfinished():
                    self._step()
                else:  # idle (or emptied by the aborts just drained): /stats shows it now, not a poll later
                    self._refresh_expert_stats()
                    self._publish()
                self._log.maybe_log(self._snapshot)
            except Exception:  # noqa: BLE001 - the thread must outlive any one bad request or step
                log.exception("engine loop error")
                time.sleep(0.1)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._command(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _command(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, handle, prompt_ids, params, arrival = cmd
            try:
                self.llm.engine.add_request(prompt_ids, params, handle.request_id)
            except (
                ParamError
            ) as e:  # the field's own name (the server's checks came first: e.g. logit_bias ids)
                self._resolve(handle, ApiError(f"'{e.field}' {e.reason}", e.field, code=e.code))
                return
            except ValueError as e:
                self._resolve(handle, ApiError(str(e)))
                return
            except Exception as e:  # noqa: BLE001
                log.exception("add_request failed")
                self._resolve(
                    handle,
                    ApiError(f"engine error: {type(e).__name__}: {e}", status=500, type="server_error"),
                )
                return
            self._tracks[handle.request_id] = _Track(handle, arrival, self._totals_now())
            self.metrics.on_admit(len(prompt_ids))
            self._resolve(handle, None)
        elif cmd[0] == "abort":
            if self._tracks.pop(cmd[1], None) is not None:
                self.llm.engine.abort(cmd[1])
                self.metrics.on_finish("abort", None)

    def _step(self) -> None:
        try:
            outs = self.llm.engine.step()
        except Exception as e:  # an engine bug must not take the server down: fail what is in flight
            self._fail_all(e)
            return
        now = time.perf_counter()
        self._step_totals = None
        deliveries: list[tuple[RequestHandle, Delta]] = []
        ended: set[str] = set()
        for out in outs:
            tr = self._tracks.get(out.request_id)
            if tr is None:
                continue
            self._count_tokens(tr, out, now)
            delta = self._delta(tr, out, now, ended)
            if delta is not None:
                deliveries.append((tr.handle, delta))
        for rid in ended:  # requests whose last sample finished (all are out of the engine by now)
            if rid in self._tracks and not self.llm.engine.samples(rid):
                del self._tracks[rid]
        # publish first: a client that got its answer then reads /stats or /metrics sees this step
        self._refresh_expert_stats(force=not self.llm.engine.has_unfinished())
        self._publish()
        for handle, delta in deliveries:
            self._push(handle, delta)

    def _fail_all(self, e: Exception) -> None:
        log.exception("engine step failed; failing %d requests", len(self._tracks))
        for rid, tr in list(self._tracks.items()):
            self.llm.engine.abort(rid)
            self._push(
                tr.handle, Delta("", [], error=f"engine error: {type(e).__name__}: {e}", request_id=rid)
            )
            self.metrics.on_finish("error", None)
        self._tracks.clear()
        self._publish()

    def _count_tokens(self, tr: _Track, out, now: float) -> None:
        if out.new_token_ids:
            n = len(out.new_token_ids)
            self.metrics.on_tokens(
                n,
                ttft=now - tr.arrival if tr.first is None else None,
                itl=None if tr.first is None else now - tr.last,
            )
            tr.first = tr.first if tr.first is not None else now
            tr.last = now
            tr.n_tokens += n

    def _delta(self, tr: _Track, out, now: float, ended: set[str]) -> Delta | None:
        """What one step output sends its client (None: nothing); a finished sample's request id goes
        into `ended`, a failed one ends its request at once."""
        reason, rid = out.finish_reason, out.request_id
        if reason is None:
            if not (out.text_delta or out.new_token_ids):
                return None
            first = len(out.seq.generated) == 1
            return Delta(
                out.text_delta,
                list(out.new_token_ids),
                index=out.index,
                logprobs=out.logprobs,
                request_id=rid,
                prompt_logprobs=out.seq.prompt_logprobs if first else None,
            )
        if reason.startswith("error"):  # one failed sample fails the request
            del self._tracks[rid]
            ended.discard(rid)
            self.llm.engine.abort(rid)
            self.metrics.on_finish("error", None)
            return Delta("", [], error=reason.removeprefix("error: "), request_id=rid)
        ended.add(rid)
        self.metrics.on_finish(reason, now - tr.arrival)
        return Delta(
            out.text_delta,
            list(out.new_token_ids),
            reason,
            self._final(tr, out.seq),
            index=out.index,
            logprobs=out.logprobs,
            request_id=rid,
            prompt_logprobs=out.seq.prompt_logprobs if len(out.seq.generated) <= 1 else None,
        )

    def _final(self, tr: _Track, seq) -> Final:
        completion = len(seq.generated)
        first = tr.first if tr.first is not None else time.perf_counter()
        last = tr.last if tr.last is not None else first
        gen_s = last - first
        prompt_ms = (first - tr.arrival) * 1000
        prompt_n = seq.prompt_len - seq.num_cached
        timings = {
            "cache_n": seq.num_cached,
            "prompt_n": prompt_n,
            "prompt_ms": round(prompt_ms, 3),
            "prompt_per_second": round(prompt_n / prompt_ms * 1000, 3) if prompt_ms > 0 else 0.0,
            "predicted_n": completion,
            "predicted_ms": round(gen_s * 1000, 3),
            # tokens after the first over the time since the first (1 / time per output token)
            "predicted_per_second": round((completion - 1) / gen_s, 3)
            if completion > 1 and gen_s > 0
            else 0.0,
        }
        end = self._totals_now()
        if tr.experts_at_start is not None and end is not None:
            uses = (end[0] - tr.experts_at_start[0]) + (end[1] - tr.experts_at_start[1])
            # engine-wide over the request's lifetime: shared with the requests batched alongside it
            timings["expert_hit_rate"] = round((end[0] - tr.experts_at_start[0]) / uses, 4) if uses else None
        return Final(
            seq.prompt_len, completion, seq.num_cached, timings, seq.cumulative_logprob, seq.prompt_logprobs
        )

    def _totals_now(self) -> tuple[int, int] | None:
        """Engine-wide expert (hits, misses) as of the last step; computed at most once per step."""
        steps = self.llm.engine.counters.steps
        if self._step_totals is None or self._step_totals[0] != steps:
            try:
                totals = _expert_totals(self.llm.expert_stats() or {})
            except Exception:  # noqa: BLE001 - statistics must never fail a request
                totals = None
            self._step_totals = (steps, totals)
        return self._step_totals[1]

    def _refresh_expert_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._expert_stats_at < EXPERT_STATS_EVERY_S:
            return
        self._expert_stats_at = now
        try:
            self._expert_stats = self.llm.expert_stats() or {}
        except Exception:  # noqa: BLE001
            log.exception("expert_stats() failed")
            self._expert_stats = {}

    def _publish(self) -> None:
        eng, kv = self.llm.engine, self.llm.kv
        sched = eng.scheduler
        snap = {
            "time": time.time(),
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "num_preemptions": sched.num_preemptions,
            "kv_cache_usage": kv.usage(),
            "kv_cache_blocks": kv.num_blocks,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "engine_counters": asdict(eng.counters),
            "expert_stats": self._expert_stats,
        }
        self._snapshot = snap
        self.metrics.set_queue(snap["running"], snap["waiting"])

    # -- delivery -------------------------------------------------------------------------------
    @staticmethod
    def _resolve(handle: RequestHandle, error: Exception | None) -> None:
        def settle():
            if handle.admitted.done():  # the handler gave up (client went away)
                return
            if error is None:
                handle.admitted.set_result(None)
            else:
                handle.admitted.set_exception(error)

        try:
            handle.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # event loop closed: server shutting down
            pass

    @staticmethod
    def _push(handle: RequestHandle, item: Delta) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, item)
        except RuntimeError:
            pass
