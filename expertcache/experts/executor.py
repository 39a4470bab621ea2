"""Executors of a schedule (experts/schedule.py): one interface, two backends.

    submit(op, fn)   issue op: fn() runs on op's queue once every op in op.waits has ended
                     (and the op before it on that queue); fn None: nothing to run (done)
    join(op_id)      the host blocks until op ended -> fn's result (the ids read, the CPU job)
    layer_done(id)   what the layer's caller needs before it reads the output: CUDA nothing
                     (stream order), threads: the host waits for that device op
    drain()          every issued op has ended (checks, close); re-raises an op's error
    log              threads backend: ("start"|"end", op id, queue) in the order they happened

`ThreadExecutor` (CI): every queue is a worker thread (io: `io_lanes` threads sharing one FIFO)
with a threading.Event per op, so the CUDA semantics (in-order queues, cross-queue events) hold
on a CPU and ordering bugs show up as wrong results or deadlocks in tests. `before(op)` is called
on the worker before fn, `on_wait(op, ids)` when op must wait for
ops that have not ended (their ids): tests
block and release latches there to force interleavings (no sleeps). `exclusive`: queues
whose fns must not run at once (the C++ kernels' thread pool takes one job at a time).

`CudaExecutor`: device = the compute stream given at construction (not a thread's current
stream), d2h and h2d = side streams, one CUDA event per GPU op; cpu = one worker thread, io = a
thread pool. A GPU op whose waits include a host op (a disk read, the CPU job) is enqueued by
the `enqueuer` thread once those ended, so the host thread never blocks on a prefetch's read; a
GPU op waiting on such an op waits (host side) until that op's event is recorded, then on the
event (stream side). Host ops wait on GPU ops with event.synchronize() on their own thread.
"""

from __future__ import annotations

import queue as queue_mod
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .schedule import LayerSchedule, Op

GPU_QUEUES = ("device", "d2h", "h2d")


class _Done:
    """One op's completion (host side): `event` set when it ended; its result or error."""

    __slots__ = ("event", "result", "error", "cuda_event", "op")

    def __init__(self, op: Op | None = None):
        self.event = threading.Event()
        self.result = self.error = self.cuda_event = None
        self.op = op


class Executor:
    """The interface (module doc). Ops' completions are kept by id until `prune` forgets ended ones:
    a wait on an id no longer known is satisfied (its op ended long ago)."""

    def __init__(self):
        self.done: dict[int, _Done] = {}
        self.lock = threading.Lock()

    def submit(self, op: Op, fn: Callable[[], Any] | None) -> None:
        raise NotImplementedError

    def join(self, op_id: int):
        d = self.done.get(op_id)
        if d is None:
            return None
        d.event.wait()
        if d.error is not None:
            raise d.error
        return d.result

    def layer_done(self, op_id: int) -> None:
        pass

    def drain(self) -> None:
        for i in list(self.done):
            self.join(i)
        self.prune()

    def prune(self) -> None:
        with self.lock:
            for i in [i for i, d in self.done.items() if d.event.is_set() and d.error is None]:
                del self.done[i]

    def run_layer(self, sched: LayerSchedule, fns: dict[int, Callable[[], Any]]) -> None:
        """Issue a layer's ops in order; before the add, the host joins the CPU job (rule 3)."""
        for o in sched.ops:
            if o.id == sched.add:
                for w in o.waits:
                    self.join(w)
            self.submit(o, fns.get(o.id))
        for o in sched.ops:  # an op of this layer that already failed (a read, the CPU job) fails the step
            d = self.done.get(o.id)
            if d is not None and d.event.is_set() and d.error is not None:
                raise d.error
        if len(self.done) > 4096:
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


def _in_mode(fn):
    """fn under the submitting thread's inference mode (thread-local in torch): worker threads write
    the caller's inference tensors."""
    import torch

    if fn is None:
        return None
    mode = torch.is_inference_mode_enabled()

    def run():
        with torch.inference_mode(mode):
            return fn()
    return run


def _run(d: _Done, fn) -> None:
    try:
        d.result = fn() if fn is not None else None
    except BaseException as e:  # noqa: BLE001 - handed to whoever joins
        d.error = e
    finally:
        d.event.set()


class ThreadExecutor(Executor):
    """CPU backend: one worker thread per queue (module doc)."""

    def __init__(self, io_lanes: int = 2, before: Callable[[Op], None] | None = None,
                 on_wait: Callable[[Op, list[int]], None] | None = None, exclusive: tuple[str, ...] = ()):
        super().__init__()
        self.before, self.on_wait, self.exclusive = before, on_wait, set(exclusive)
        self.compute_lock = threading.Lock()
        self.log: list[tuple[str, int, str]] = []
        self.queues = {q: queue_mod.SimpleQueue() for q in ("device", "d2h", "h2d", "cpu", "io")}
        lanes = {"io": io_lanes}
        self.threads = [threading.Thread(target=self._worker, args=(q,), daemon=True, name=f"sched-{q}-{k}")
                        for q in self.queues for k in range(lanes.get(q, 1))]
        for t in self.threads:
            t.start()

    def submit(self, op: Op, fn) -> None:
        d = self._new(op)
        self.queues[op.queue].put((op, _in_mode(fn), d, self._deps(op)))

    def layer_done(self, op_id: int) -> None:
        self.join(op_id)

    def _worker(self, q: str) -> None:
        while True:
            item = self.queues[q].get()
            if item is None:
                return
            op, fn, d, deps = item
            pending = [w.op.id for w in deps if not w.event.is_set()]
            if self.on_wait is not None and pending:
                self.on_wait(op, pending)
            for w in deps:
                w.event.wait()
            err = next((w.error for w in deps if w.error is not None), None)
            if err is not None:  # an op this one needed failed: fail too, naming the first cause
                d.error = err
                d.event.set()
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

    def close(self) -> None:
        for q, qu in self.queues.items():
            for t in self.threads:
                if t.name.startswith(f"sched-{q}-"):
                    qu.put(None)
        for t in self.threads:
            t.join()


class CudaExecutor(Executor):
    """CUDA backend (module doc)."""

    def __init__(self, device, io_lanes: int = 4):
        import torch

        super().__init__()
        self.torch = torch
        self.streams = {"device": torch.cuda.current_stream(device), "d2h": torch.cuda.Stream(device),
                        "h2d": torch.cuda.Stream(device)}
        self.cpu = ThreadPoolExecutor(1, thread_name_prefix="expert-cpu")
        self.io = ThreadPoolExecutor(io_lanes, thread_name_prefix="expert-io")
        self.enqueuer = ThreadPoolExecutor(1, thread_name_prefix="expert-enqueue")
        self.recorded: dict[int, threading.Event] = {}

    def submit(self, op: Op, fn) -> None:
        d = self._new(op)
        deps, fn = self._deps(op), _in_mode(fn)
        if fn is None:
            d.event.set()
            return
        if op.queue in GPU_QUEUES:
            if any(w.op.queue not in GPU_QUEUES and not w.event.is_set() for w in deps):
                self.enqueuer.submit(self._enqueue, op, fn, d, deps)
            else:
                self._enqueue(op, fn, d, deps)
                if d.error is not None:  # enqueued by this thread: its caller hears of it now
                    raise d.error
        else:
            pool = self.cpu if op.queue == "cpu" else self.io
            pool.submit(self._host_op, fn, d, deps)

    def _enqueue(self, op: Op, fn, d: _Done, deps: list[_Done]) -> None:
        torch = self.torch
        stream = self.streams[op.queue]
        try:
            for w in deps:
                if w.op.queue in GPU_QUEUES:
                    w.event.wait()  # recorded (host side); the stream waits on the CUDA event below
                    if w.cuda_event is not None:
                        stream.wait_event(w.cuda_event)
                else:
                    w.event.wait()
                if w.error is not None:
                    raise w.error
            with torch.cuda.stream(stream):
                d.result = fn()
                d.cuda_event = torch.cuda.Event()
                d.cuda_event.record(stream)
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

    def join(self, op_id: int):
        r = super().join(op_id)
        d = self.done.get(op_id)
        if d is not None and d.cuda_event is not None:
            d.cuda_event.synchronize()
        return r

    def drain(self) -> None:
        super().drain()
        self.torch.cuda.synchronize()

    def prune(self) -> None:
        """Forget ops the device has finished too (a recorded event is not a finished copy)."""
        with self.lock:
            for i in [i for i, d in self.done.items() if d.event.is_set() and d.error is None
                      and (d.cuda_event is None or d.cuda_event.query())]:
                del self.done[i]

    def close(self) -> None:
        for p in (self.enqueuer, self.cpu, self.io):
            p.shutdown(wait=True)


def make_executor(kind: str, device) -> Executor:
    """"cuda" (a CUDA device) or "threads" (the CPU backend)."""
    if kind == "cuda":
        if device.type != "cuda":
            raise ValueError(f"executor 'cuda' needs a CUDA device, got {device}")
        return CudaExecutor(device)
    if kind == "threads":
        return ThreadExecutor(exclusive=("device", "cpu"))
    raise ValueError(f"executor must be 'cuda' or 'threads', got {kind!r}")


__all__ = ["CudaExecutor", "Executor", "ThreadExecutor", "make_executor"]
