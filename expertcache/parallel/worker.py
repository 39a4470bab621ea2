"""Starting the ranks on one machine: `launch` (rank 0 spawns ranks 1..N-1 and joins) and
`worker_main` (what each spawned rank runs), and the torchrun rank check.

parallel/ sits below llm.py: a worker rank joins the group here and then hands it to `serve`, the
picklable callable rank 0 passed to `launch` (llm.serve_ep_rank: it builds that rank's LLM and
mirrors rank 0). The torchrun ranks 1..N-1 start through llm.run_torchrun_worker. This module
imports group.py, never the other way round.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading

import torch
import torch.distributed as dist

from .group import DEFAULT_TIMEOUT_S, EPGroup, ExpertParallelError, loopback_interface, private_rendezvous


def launch(
    world_size: int,
    device: torch.device,
    serve,
    worker_kwargs: dict,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    exit_on_failure: bool = False,
) -> EPGroup:
    """Spawn ranks 1..N-1 on this machine (each joins, then calls serve(worker_kwargs, group)) and
    join as rank 0."""
    if dist.is_initialized():
        raise ExpertParallelError(
            "this process already belongs to a torch.distributed group (one "
            "expert-parallel LLM per process: close() the other one first)"
        )
    init, store_dir = private_rendezvous()
    # the ranks' data links on loopback only (read when each process creates its gloo/NCCL
    # sockets; the spawned workers inherit it)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = loopback_interface()
    procs = _spawn(world_size, device, init, timeout_s, serve, worker_kwargs)
    why = _join_watching(procs, world_size, device, init, timeout_s)
    if why is not None:
        for p in procs:
            p.kill()
        shutil.rmtree(store_dir, ignore_errors=True)
        raise ExpertParallelError(f"expert-parallel group of {world_size} did not form: {why}") from None
    return EPGroup(0, world_size, device, timeout_s, procs, exit_on_failure, store_dir)


def _spawn(world_size: int, device: torch.device, init: str, timeout_s: float, serve, worker_kwargs) -> list:
    """Ranks 1..N-1 as fresh interpreters (multiprocessing spawn), each running worker_main."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for r in range(1, world_size):
        dev = torch.device("cuda", r % torch.cuda.device_count()) if device.type == "cuda" else device
        p = ctx.Process(
            target=worker_main,
            args=(r, world_size, str(dev), init, timeout_s, serve, worker_kwargs),
            name=f"expertcache-ep-rank{r}",
            daemon=True,
        )
        p.start()
        procs.append(p)
    return procs


def _join_watching(procs: list, world_size: int, device: torch.device, init: str, timeout_s: float):
    """Join as rank 0 on a helper thread while watching the workers: one that dies before it joins
    (an import error, killed) is named at once instead of after the start's timeout. -> None when the
    group formed, else why not."""
    failed: list = []

    def join():
        try:
            EPGroup.init_process(0, world_size, device, init, timeout_s)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            failed.append(e)

    joiner = threading.Thread(target=join, daemon=True, name="ep-join")
    joiner.start()
    why = None
    while joiner.is_alive() and why is None:
        joiner.join(0.2)
        why = next(
            (
                f"rank {r} exited with code {p.exitcode}"
                for r, p in enumerate(procs, start=1)
                if p.exitcode is not None
            ),
            None,
        )
    return why if why is not None else (failed[0] if failed else None)


def worker_main(
    rank: int, world_size: int, device: str, init_method: str, timeout_s: float, serve, kwargs: dict
) -> None:
    threads = kwargs.pop("threads", None) or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    group = EPGroup.join(rank, world_size, torch.device(device), init_method, timeout_s)
    serve(kwargs, group)


def torchrun_rank() -> int | None:
    """This process's rank when started by torchrun with several ranks, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["RANK"])
    return None
