"""Entry points of ranks 1..N-1: spawned by `EPGroup.launch`, or started by torchrun."""

from __future__ import annotations

import os
import sys

import torch


def worker_main(rank: int, world_size: int, device: str, init_method: str, timeout_s: float, kwargs: dict) -> None:
    from ..llm import LLM
    from .group import EPGroup

    threads = kwargs.pop("threads", None) or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    group = EPGroup.join(rank, world_size, torch.device(device), init_method, timeout_s)
    cfg = kwargs.pop("expert_parallel")
    llm = LLM(**kwargs, expert_parallel=(cfg, group))
    try:
        llm.serve_worker()
    finally:
        llm.close()


def torchrun_rank() -> int | None:
    """This process's rank when started by torchrun with several ranks, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["RANK"])
    return None


def run_torchrun_worker(llm_kwargs: dict) -> int:
    """A torchrun rank other than 0: build the same LLM, mirror rank 0 until it stops."""
    from ..llm import LLM

    llm = LLM(**{**llm_kwargs, "progress": False})
    print(f"expert-parallel rank {os.environ['RANK']} ready", file=sys.stderr)
    try:
        llm.serve_worker()
    finally:
        llm.close()
    return 0
