"""Executors of a schedule (experts/schedule.py): one interface, three backends.

    submit(op, fn)   issue op: fn() runs on op's queue once every op in op.waits has ended
                     (and the op before it on that queue); fn None: nothing to run (done)
    join(op_id)      the host blocks until op ended (re-raises its error)
    layer_done(id)   what the layer's caller needs before it reads the output: CUDA and inline
                     nothing (stream order / already run), threads: the host waits for that device op
    drain()          every issued op has ended (checks, close); re-raises an op's error
    log              threads backend: ("start"|"end", op id, queue) in the order they happened

No backend keeps an op's return value: what one op hands the next (the CPU job's partial sums)
travels in the bindings (experts/bindings.py) and is dropped by its consumer, so the bytes an
executor holds after a layer are zero whatever the step's size. Ops' completions (`_Done`: an
event, an error) are kept by id while a later op may wait on them and pruned each layer.

`InlineExecutor` (a CPU device): every op runs at submit, in issue order, on the calling thread:
no events; queue order is issue order. `io_lanes` > 0 (overlap_io): disk reads run on that many
I/O threads instead, and prefetch copies (h2d, tag "prefetch") on one copy lane, so the hits
compute while the misses' reads and the next layer's copies are in flight; an op waiting on one
blocks on its future. A later h2d goes to the copy lane too while it has one pending (the h2d
queue stays one FIFO). A read whose fn has `on_caller` set (bytes a peer rank sent: only the engine
thread may take them) runs on the caller.

`ThreadExecutor` (CI): every queue is a worker thread (io: `io_lanes` threads sharing one FIFO)
with a threading.Event per op, so the CUDA semantics (in-order queues, cross-queue events) hold
on a CPU and ordering bugs show up as wrong results or deadlocks in tests. `before(op)` is called
on the worker before fn, `on_wait(op, ids)` when op must wait for ops that have not ended (their
ids): tests block and release latches there to force interleavings (no sleeps). `exclusive`:
queues whose fns must not run at once (the C++ kernels' thread pool takes one job at a time).
`enqueuer=True`: GPU ops are routed as `CudaExecutor` routes them (an op behind unfinished host work
goes through one enqueuer thread, `_deferred`), so the per-queue FIFO rule is tested on a CPU.

`CudaExecutor`: device = the caller's current stream, taken per layer (`run_layer`), d2h and h2d =
side streams, one CUDA event per GPU op (blocking: the threads that wait on them sleep instead of
spinning on a core the launching thread needs); cpu = one worker thread, io = a thread pool. A GPU
op whose waits include an unfinished host op (a disk read, the CPU job), or whose queue has an
op still in the enqueuer, is enqueued by the `enqueuer` thread (one FIFO), so the host thread never
blocks on a prefetch's read and no GPU op overtakes an earlier one of its queue (the schedule's
"last reader" bookkeeping assumes queue order); a GPU op waiting on such an op waits (host side)
until that op's event is recorded, then on the event (stream side). Host ops wait on GPU ops with
event.synchronize() on their own thread.

`sync_io` (overlap_io=False, every backend): a read runs on the calling thread once its waits
ended, so the step waits for each read before issuing the next op.
"""

from __future__ import annotations

import queue as queue_mod
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .schedule import LayerSchedule, Op

GPU_QUEUES = ("device", "d2h", "h2d")
PRUNE_AT = 64  # completions kept before a layer's end prunes the ended ones


class _Done:
    """One op's completion (host side): `event` set when it ended; its error."""

    __slots__ = ("cuda_event", "error", "event", "op")

    def __init__(self, op: Op | None = None):
        self.event = threading.Event()
        self.error = self.cuda_event = None
        self.op = op


class Executor:
    """The interface (module doc). Ops' completions are kept by id until `prune` forgets ended ones:
    a wait on an id no longer known is satisfied (its op ended long ago)."""

    inline = False  # ops run at submit on the calling thread (InlineExecutor)

    def __init__(self, sync_io: bool = False):
        self.done: dict[int, _Done] = {}
        self.lock = threading.Lock()
        self.sync_io = sync_io

    def submit(self, op: Op, fn: Callable[[], Any] | None) -> None:
        raise NotImplementedError

    def join(self, op_id: int) -> None:
        d = self.done.get(op_id)
        if d is None:
            return
        d.event.wait()
        if d.error is not None:
            raise d.error

    def layer_done(self, op_id: int) -> None:
        pass

    def drain(self) -> None:
        """Every issued op has ended; then the first error among them is raised (after a failure the
        others still end first, so nothing is in flight when a caller closes)."""
        first = None
        for i in list(self.done):
            d = self.done.get(i)
            if d is None:
                continue
            d.event.wait()
            if first is None and d.error is not None:
                first = d.error
        if first is not None:
            raise first
        self.prune()

    def prune(self) -> None:
        with self.lock:
            for i in [i for i, d in self.done.items() if d.event.is_set() and d.error is None]:
                del self.done[i]

    def run_layer(self, sched: LayerSchedule, fns) -> None:
        """Issue a layer's ops in order (`fns`: op id -> fn, or a list aligned with sched.ops);
        before the add, the host joins the CPU job (rule 3)."""
        listed = isinstance(fns, list)
        for n, o in enumerate(sched.ops):
            if o.id == sched.add:
                for w in o.waits:
                    self.join(w)
            self.submit(o, fns[n] if listed else fns.get(o.id))
        for o in sched.ops:  # an op of this layer that already failed (a read, the CPU job) fails the step
            d = self.done.get(o.id)
            if d is not None and d.event.is_set() and d.error is not None:
                raise d.error
        if len(self.done) > PRUNE_AT:
            self.prune()

    def close(self) -> None:
        pass

    def _new(self, op: Op) -> _Done:
        d = _Done(op)
        with self.lock:
            self.done[op.id] = d
        return d

    def _deps(self, op: Op) -> list[_Done]:
        with self.lock:
            return [self.done[w] for w in op.waits if w in self.done]


class InlineExecutor(Executor):
    """A CPU device's backend: ops run at submit on the calling thread (module doc)."""

    inline = True

    def __init__(self, io_lanes: int = 0):
        super().__init__(sync_io=io_lanes <= 0)
        self.io = ThreadPoolExecutor(io_lanes, thread_name_prefix="expert-io") if io_lanes > 0 else None
        self.copy = ThreadPoolExecutor(1, thread_name_prefix="expert-copy") if io_lanes > 0 else None
        self.copy_tail: Future | None = None  # the last op issued to the copy lane
        self.pending: dict[int, Future] = {}  # ops in flight on the lanes

    def submit(self, op: Op, fn) -> None:
        pending = self.pending
        if pending:
            for w in op.waits:
                f = pending.get(w)
                if f is not None:
                    f.result()  # re-raises a failed read: the op that needed it fails
        if fn is None:
            return
        if self.io is not None:
            q = op.queue
            if q == "io" and not getattr(fn, "on_caller", False):
                self.pending[op.id] = self.io.submit(_in_mode(fn))
                return
            if q == "h2d" and (
                op.tag == "prefetch" or (self.copy_tail is not None and not self.copy_tail.done())
            ):
                self.pending[op.id] = self.copy_tail = self.copy.submit(_in_mode(fn))
                return
        fn()

    def join(self, op_id: int) -> None:
        f = self.pending.get(op_id)
        if f is not None:
            f.result()

    def drain(self) -> None:
        try:
            for f in list(self.pending.values()):
                f.result()
        finally:
            self.pending.clear()

    def run_layer(self, sched: LayerSchedule, fns) -> None:
        listed = isinstance(fns, list)
        submit = self.submit
        for n, o in enumerate(sched.ops):
            submit(o, fns[n] if listed else fns.get(o.id))
        if self.pending:  # ended reads are forgotten; a failed one fails this step
            for i, f in list(self.pending.items()):
                if f.done():
                    del self.pending[i]
                    f.result()

    def close(self) -> None:
        for p in (self.io, self.copy):
            if p is not None:
                p.shutdown(wait=True)


def _in_mode(fn):
    """fn under the submitting thread's inference mode (thread-local in torch): worker threads write
    the caller's inference tensors."""
    import torch

    if fn is None:
        return None
    mode = torch.is_inference_mode_enabled()

    def run():
        with torch.inference_mode(mode):
            fn()

    return run


def _run(d: _Done, fn) -> None:
    try:
        if fn is not None:
            fn()  # its return value is not kept (module doc)
    except BaseException as e:  # noqa: BLE001 - handed to whoever joins
        d.error = e
    finally:
        d.event.set()


class _Router:
    """Which GPU ops go through the enqueuer thread (shared by CudaExecutor and ThreadExecutor's
    emulation of it): an op behind unfinished host work, or one whose queue still has an op there
    (one FIFO per queue: a later op of a queue never overtakes an earlier one)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queued = dict.fromkeys(GPU_QUEUES, 0)  # ops of each queue in the enqueuer now

    def deferred(self, op: Op, deps: list[_Done]) -> bool:
        with self.lock:
            if self.queued[op.queue] or any(
                w.op.queue not in GPU_QUEUES and not w.event.is_set() for w in deps
            ):
                self.queued[op.queue] += 1
                return True
        return False

    def left(self, op: Op) -> None:
        with self.lock:
            self.queued[op.queue] -= 1


class ThreadExecutor(Executor):
    """CPU backend: one worker thread per queue (module doc)."""

    def __init__(
        self,
        io_lanes: int = 2,
        before: Callable[[Op], None] | None = None,
        on_wait: Callable[[Op, list[int]], None] | None = None,
        exclusive: tuple[str, ...] = (),
        enqueuer: bool = False,
        sync_io: bool = False,
    ):
        super().__init__(sync_io)
        self.before, self.on_wait, self.exclusive = before, on_wait, set(exclusive)
        self.compute_lock = threading.Lock()
        self.log: list[tuple[str, int, str]] = []
        self.queues = {q: queue_mod.SimpleQueue() for q in ("device", "d2h", "h2d", "cpu", "io")}
        self.router = _Router() if enqueuer else None
        if enqueuer:
            self.queues["enqueue"] = queue_mod.SimpleQueue()
        lanes = {"io": io_lanes}
        self.threads = [
            threading.Thread(target=self._worker, args=(q,), daemon=True, name=f"sched-{q}-{k}")
            for q in self.queues
            for k in range(lanes.get(q, 1))
        ]
        for t in self.threads:
            t.start()

    def submit(self, op: Op, fn) -> None:
        d = self._new(op)
        deps = self._deps(op)
        if self.sync_io and op.queue == "io":  # on this thread, once its waits ended
            for w in deps:
                w.event.wait()
            err = next((w.error for w in deps if w.error is not None), None)
            if err is not None:
                d.error = err
                d.event.set()
            else:
                _run(d, _in_mode(fn))
            return
        item = (op, _in_mode(fn), d, deps)
        if self.router is not None and op.queue in GPU_QUEUES and self.router.deferred(op, deps):
            self.queues["enqueue"].put(item)
            return
        self.queues[op.queue].put(item)

    def layer_done(self, op_id: int) -> None:
        self.join(op_id)

    def _worker(self, q: str) -> None:
        while True:
            item = self.queues[q].get()
            if item is None:
                return
            if q == "enqueue":  # the emulated enqueuer: wait for the host deps, then queue the op
                op, deps = item[0], item[3]
                for w in deps:
                    if w.op.queue not in GPU_QUEUES:
                        w.event.wait()
                self.queues[op.queue].put(item)
                self.router.left(op)
                item = op = deps = None
                continue
            op, fn, d, deps = item
            item = None  # nothing of a run op outlives it on this thread (its fn holds the layer's tensors)
            pending = [w.op.id for w in deps if not w.event.is_set()]
            if self.on_wait is not None and pending:
                self.on_wait(op, pending)
            for w in deps:
                w.event.wait()
            err = next((w.error for w in deps if w.error is not None), None)
            if err is not None:  # an op this one needed failed: fail too, naming the first cause
                d.error = err
                d.event.set()
                op = fn = d = deps = None
                continue
            if self.before is not None:
                self.before(op)
            with self.lock:
                self.log.append(("start", op.id, q))
            if q in self.exclusive:
                with self.compute_lock:
                    _run(d, fn)
            else:
                _run(d, fn)
            with self.lock:
                self.log.append(("end", op.id, q))
            op = fn = d = deps = None

    def close(self) -> None:
        # the enqueuer first: an op it still holds reaches its queue before that queue's worker stops
        order = sorted(self.queues, key=lambda q: q != "enqueue")
        for q in order:
            mine = [t for t in self.threads if t.name.startswith(f"sched-{q}-")]
            for _ in mine:
                self.queues[q].put(None)
            if q == "enqueue":
                for t in mine:
                    t.join()
        for t in self.threads:
            t.join()


class CudaExecutor(Executor):
    """CUDA backend (module doc)."""

    def __init__(self, device, io_lanes: int = 4, sync_io: bool = False):
        import torch

        super().__init__(sync_io)
        self.torch, self.device = torch, device
        self.streams = {
            "device": torch.cuda.current_stream(device),
            "d2h": torch.cuda.Stream(device),
            "h2d": torch.cuda.Stream(device),
        }
        init = (lambda: torch.cuda.set_device(device)) if device.index is not None else None
        self.cpu = ThreadPoolExecutor(1, thread_name_prefix="expert-cpu", initializer=init)
        self.io = ThreadPoolExecutor(io_lanes, thread_name_prefix="expert-io", initializer=init)
        self.enqueuer = ThreadPoolExecutor(1, thread_name_prefix="expert-enqueue", initializer=init)
        self.router = _Router()

    def run_layer(self, sched: LayerSchedule, fns) -> None:
        self.streams["device"] = self.torch.cuda.current_stream(self.device)  # the caller's, per layer
        super().run_layer(sched, fns)

    def submit(self, op: Op, fn) -> None:
        d = self._new(op)
        deps, fn = self._deps(op), _in_mode(fn)
        if fn is None:
            d.event.set()
            return
        if op.queue in GPU_QUEUES:
            if self.router.deferred(op, deps):
                self.enqueuer.submit(self._deferred, op, fn, d, deps)
            else:
                self._enqueue(op, fn, d, deps)
                if d.error is not None:  # enqueued by this thread: its caller hears of it now
                    raise d.error
        elif self.sync_io and op.queue == "io":
            self._host_op(fn, d, deps)
        else:
            pool = self.cpu if op.queue == "cpu" else self.io
            pool.submit(self._host_op, fn, d, deps)

    def _deferred(self, op: Op, fn, d: _Done, deps: list[_Done]) -> None:
        try:
            self._enqueue(op, fn, d, deps)
        finally:
            self.router.left(op)

    def _enqueue(self, op: Op, fn, d: _Done, deps: list[_Done]) -> None:
        torch = self.torch
        stream = self.streams[op.queue]
        try:
            for w in deps:
                w.event.wait()  # GPU op: recorded (host side), the stream waits on its CUDA event below
                if w.error is not None:
                    raise w.error
                if w.op.queue in GPU_QUEUES and w.cuda_event is not None:
                    stream.wait_event(w.cuda_event)
            with torch.cuda.stream(stream):
                fn()
                ev = torch.cuda.Event(blocking=True)  # other threads wait on it: they sleep, not spin
                ev.record(stream)
                d.cuda_event = ev
        except BaseException as e:  # noqa: BLE001
            d.error = e
        finally:
            d.event.set()  # "recorded": GPU completion is d.cuda_event's

    def _host_op(self, fn, d: _Done, deps: list[_Done]) -> None:
        for w in deps:
            w.event.wait()
            if w.cuda_event is not None:
                w.cuda_event.synchronize()
            if w.error is not None:
                d.error = w.error
                d.event.set()
                return
        _run(d, fn)

    def join(self, op_id: int) -> None:
        super().join(op_id)
        d = self.done.get(op_id)
        if d is not None and d.cuda_event is not None:
            d.cuda_event.synchronize()

    def drain(self) -> None:
        super().drain()
        self.torch.cuda.synchronize(self.device)

    def prune(self) -> None:
        """Forget ops the device has finished too (a recorded event is not a finished copy)."""
        with self.lock:
            for i in [
                i
                for i, d in self.done.items()
                if d.event.is_set() and d.error is None and (d.cuda_event is None or d.cuda_event.query())
            ]:
                del self.done[i]

    def close(self) -> None:
        for p in (self.enqueuer, self.cpu, self.io):
            p.shutdown(wait=True)


EXECUTORS = ("inline", "threads", "cuda")


def make_executor(kind: str, device, overlap_io: bool = True) -> Executor:
    """ "inline" (a CPU device), "cuda" (a CUDA device) or "threads" (the CPU backend of the CUDA
    path's tests: its GPU ops routed as the CUDA backend routes them); `overlap_io` False: every read
    synchronous (module doc)."""
    if kind == "cuda":
        if device.type != "cuda":
            raise ValueError(f"executor 'cuda' needs a CUDA device, got {device}")
        return CudaExecutor(device, sync_io=not overlap_io)
    if kind in ("threads", "inline") and device.type == "cuda":
        raise ValueError(f"executor {kind!r} runs a CPU device's steps; a CUDA device takes 'cuda'")
    if kind == "threads":
        return ThreadExecutor(exclusive=("device", "cpu"), enqueuer=True, sync_io=not overlap_io)
    if kind == "inline":
        return InlineExecutor(io_lanes=2 if overlap_io else 0)
    raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {kind!r}")


__all__ = ["EXECUTORS", "CudaExecutor", "Executor", "InlineExecutor", "ThreadExecutor", "make_executor"]
