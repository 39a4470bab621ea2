"""The expert-parallel process group: start or join it, collectives with failures named by rank.

Rank 0 runs the scheduler (and the HTTP server); ranks 1..N-1 are workers that mirror every
model forward. Two ways in:
- `worker.launch(world_size, device, serve, worker_kwargs)` on one machine: the ranks rendezvous
  through a file store in a private directory (mode 0700, removed at close: no TCP store listening
  anywhere) and their gloo/NCCL sockets are bound to the loopback interface; it spawns the workers
  (fresh interpreters, `multiprocessing` spawn; each calls `serve(worker_kwargs, group)`) and joins
  as rank 0;
- `from_env()` under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by it), any number
  of machines: torchrun's TCP store and the ranks' links trust the network (docs/parallel.md).
Every message between ranks is plain data and tensors (parallel/wire.py), never a pickle.
Backend: NCCL when the device is CUDA, gloo otherwise. Two timeouts: the start (forming the
group, the checkpoint check, every rank loading its model: `STARTUP_TIMEOUT_S`, or the step
timeout when longer) and the steps (every collective of serving: the group's `timeout_s`). A
failed or timed-out collective raises `ExpertParallelError` naming the rank that died (rank 0
watches the processes it spawned) or the timeout.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ExpertCacheError
from . import wire

DEFAULT_TIMEOUT_S = 120.0
# group formation, checkpoint check and model load on every rank: a fresh interpreter importing torch
# and loading a large checkpoint on a loaded machine can take minutes (a rank that dies meanwhile is
# still named at once: its process exits or its connection drops)
STARTUP_TIMEOUT_S = 600.0
DEAD_RANK_WAIT_S = 10.0  # after a failed collective, how long rank 0 waits to see which worker exited


class ExpertParallelError(ExpertCacheError, RuntimeError):
    """A rank died, hung past the timeout, or disagrees with rank 0 about the checkpoint."""


def loopback_interface() -> str:
    """The loopback interface's name (lo on Linux, lo0 on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next(
        (n for n in ("lo", "lo0") if n in names), next((n for n in names if n.startswith("lo")), "lo")
    )


def private_rendezvous() -> tuple[str, Path]:
    """-> (init_method, directory): a torch FileStore in a fresh directory only this user can enter."""
    d = Path(tempfile.mkdtemp(prefix="expertcache-ep-"))  # mkdtemp: mode 0700, owned by us
    return f"file://{d / 'store'}", d


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """sha256 of config.json and every safetensors header (names, dtypes, shapes, offsets); of a GGUF file
    (set), its metadata and tensor table (names, types, dims, file names, offsets)."""
    d, h = Path(model_dir), hashlib.sha256()
    if d.suffix == ".gguf":
        from ..gguf.reader import read_gguf  # here: parallel/ needs the reader for this alone

        gf = read_gguf(d)
        h.update(repr(sorted((k, repr(v)) for k, v in gf.metadata.items())).encode())
        for t in gf.tensors.values():
            h.update(f"{t.name} {t.type.name} {t.dims} {t.file.name} {t.offset} {t.nbytes}".encode())
        return h.hexdigest()
    h.update((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + fh.read(min(n, 1 << 26)))
    return h.hexdigest()


class EPGroup:
    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        procs: list | None = None,
        exit_on_failure: bool = False,
        store_dir: Path | None = None,
    ):
        self.rank, self.world_size, self.device, self.timeout_s = rank, world_size, device, timeout_s
        self.store_dir = store_dir  # rank 0 of a spawned group: the rendezvous directory, removed at close
        self.exit_on_failure = exit_on_failure
        self.procs = procs or []  # rank 0 only: the spawned workers (ranks 1..N-1)
        self.failed: str | None = None
        self.stopping = False  # rank 0 told the workers to stop: their exits are expected
        # the steps' collectives: the step timeout (the default group keeps the start's)
        self.pg = dist.new_group(timeout=timedelta(seconds=timeout_s))
        # a second gloo group for rearrangement moves on a background thread (never on the engine
        # thread's group, whose collectives must stay in one order on every rank)
        self.move_group = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if world_size > 1 else None
        )
        if self.procs:
            threading.Thread(target=self._watch, daemon=True, name="ep-watch").start()

    # -- start / join ---------------------------------------------------------------------------
    @staticmethod
    def init_process(
        rank: int, world_size: int, device: torch.device, init_method: str, timeout_s: float
    ) -> None:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S)),
        )

    @classmethod
    def join(
        cls,
        rank: int,
        world_size: int,
        device: torch.device,
        init_method: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> "EPGroup":
        cls.init_process(rank, world_size, device, init_method, timeout_s)
        return cls(rank, world_size, device, timeout_s)

    @classmethod
    def from_env(cls, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> "EPGroup":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return cls.join(rank, world, device, "env://", timeout_s)

    # -- failures --------------------------------------------------------------------------------
    def _watch(self) -> None:
        while self.failed is None:
            for r, p in enumerate(self.procs, start=1):
                if p.exitcode is not None and self.failed is None and not self.stopping:
                    self._fail(f"expert-parallel rank {r} exited with code {p.exitcode}")
                    return
            time.sleep(0.2)

    def _fail(self, why: str) -> None:
        self.failed = why
        if self.exit_on_failure:
            print(f"error: {why}; stopping", file=sys.stderr, flush=True)
            for p in self.procs:
                p.kill()
            os._exit(2)

    def _dead_worker(self) -> str | None:
        """Rank 0, after a failed collective: a worker that was killed may take a moment to be reaped
        (longer on a loaded machine); look at the processes directly until one has exited, for at
        most DEAD_RANK_WAIT_S. -> what happened to it, or None (no spawned worker exited)."""
        end = time.monotonic() + DEAD_RANK_WAIT_S
        while self.procs and not self.stopping:
            for r, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    return f"expert-parallel rank {r} exited with code {p.exitcode}"
            if time.monotonic() >= end:
                break
            time.sleep(0.05)
        return None

    def _call(self, what: str, fn, *args):
        if self.failed:
            raise ExpertParallelError(f"{self.failed} (before {what})")
        try:
            return fn(*args)
        except wire.WireError as e:  # a size no message may have: the ranks are out of step from here on
            self._fail(f"a malformed message between expert-parallel ranks (during {what}): {e}")
            raise ExpertParallelError(self.failed) from None
        except Exception as e:  # gloo/NCCL raise RuntimeError (or DistBackendError) on a lost peer or timeout
            who = (
                self.failed
                or self._dead_worker()
                or f"a rank did not answer within {self.timeout_s:.0f} s or lost its connection"
            )
            if not self.failed:
                self._fail(f"{who} (during {what})")
            raise ExpertParallelError(f"{who} (during {what}: {str(e).splitlines()[0][:200]})") from None

    # -- collectives (called from the engine thread only) ------------------------------------------
    def broadcast(self, obj=None, startup: bool = False):
        """Rank 0's `obj` to every rank (parallel/wire.py: plain data and tensors; tensors arrive on the
        CPU). `startup`: with the start's timeout (while ranks may still be loading)."""
        group = None if startup else self.pg

        def run():
            buf = wire.encode(obj).to(self.device) if self.rank == 0 else None
            size = torch.tensor(
                [buf.numel() if buf is not None else 0], dtype=torch.int64, device=self.device
            )
            dist.broadcast(size, 0, group)
            if buf is None:
                buf = torch.empty(wire.check_size(int(size.item())), dtype=torch.uint8, device=self.device)
            dist.broadcast(buf, 0, group)
            return buf

        return self._decode(self._call("broadcast", run))

    def _all_gather(self, what: str, obj, group) -> list:
        """Every rank's `obj` on every rank, as wire messages padded to the longest."""
        buf = wire.encode(obj).to(self.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world_size)]

        def run():
            dist.all_gather(sizes, torch.tensor([buf.numel()], dtype=torch.int64, device=self.device), group)
            longest = max(wire.check_size(int(s.item())) for s in sizes)
            padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
            padded[: buf.numel()] = buf
            out = [
                torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)
            ]
            dist.all_gather(out, padded, group)
            return [o[: int(s.item())] for o, s in zip(out, sizes)]

        return [self._decode(b) for b in self._call(what, run)]

    def _decode(self, buf: torch.Tensor):
        try:
            return wire.decode(buf)
        except wire.WireError as e:
            raise ExpertParallelError(f"a malformed message between expert-parallel ranks: {e}") from None

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        self._call("all_reduce", dist.all_reduce, t, dist.ReduceOp.SUM, self.pg)
        return t

    def all_true(self, flag: bool, startup: bool = False) -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        self._call("all_reduce", dist.all_reduce, t, dist.ReduceOp.MIN, None if startup else self.pg)
        return bool(t.item())

    def ready(self) -> None:
        """Every rank has loaded its model (the start's timeout): the steps' timeout applies from here."""
        self.all_true(True, startup=True)

    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        group=None,
        startup: bool = False,
    ) -> None:
        """Point-to-point: post every (tensor, peer rank) send and receive together (batch_isend_irecv)
        and wait for all of them. Every pair of ranks must list its transfers in the same order.
        `group`: another process group (the move group); `startup`: with the start's timeout."""
        group = dist.group.WORLD if startup else (group or self.pg)
        ops = [dist.P2POp(dist.isend, t, r, group) for t, r in sends] + [
            dist.P2POp(dist.irecv, t, r, group) for t, r in recvs
        ]
        if ops:
            self._call("point-to-point", lambda: [w.wait() for w in dist.batch_isend_irecv(ops)])

    def gather(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        got = self._all_gather("gather", obj, self.pg)
        return got if self.rank == 0 else None

    def check_same(self, what: str, value: str) -> None:
        values = self._all_gather("all_gather", value, None)
        bad = [r for r, v in enumerate(values) if v != values[0]]
        if bad:
            raise ExpertParallelError(
                f"ranks {bad} see a different {what} than rank 0 (every rank must load the same checkpoint)"
            )

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
