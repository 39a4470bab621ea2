"""Entry point of ranks 1..N-1 spawned by `EPGroup.launch`, and the torchrun rank check.

parallel/ sits below llm.py: a worker rank joins the group here and then hands it to `serve`, the
picklable callable rank 0 passed to `start` (llm.serve_ep_rank: it builds that rank's LLM and
mirrors rank 0). The torchrun ranks 1..N-1 start through llm.run_torchrun_worker.
"""

from __future__ import annotations

import os

import torch


def worker_main(
    rank: int, world_size: int, device: str, init_method: str, timeout_s: float, serve, kwargs: dict
) -> None:
    from .group import EPGroup

    threads = kwargs.pop("threads", None) or max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(threads)
    group = EPGroup.join(rank, world_size, torch.device(device), init_method, timeout_s)
    serve(kwargs, group)


def torchrun_rank() -> int | None:
    """This process's rank when started by torchrun with several ranks, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["RANK"])
    return None
