"""Expert parallelism over torch.distributed: placement, EPLB rebalancing, the per-rank provider."""

from .config import ParallelConfig
from .group import EPGroup, ExpertParallelError, checkpoint_fingerprint
from .placement import Placement, balanced_placement, static_placement

__all__ = [
    "ParallelConfig",
    "EPGroup",
    "ExpertParallelError",
    "checkpoint_fingerprint",
    "Placement",
    "balanced_placement",
    "static_placement",
    "start",
]


def start(expert_parallel, device, worker_kwargs: dict, serve):
    """-> (ParallelConfig, EPGroup). `expert_parallel`: ranks (int), a ParallelConfig, or a worker's
    (config, joined group). Under torchrun the group comes from its environment; otherwise rank 0
    spawns ranks 1..N-1 on this machine, each calling serve(worker_kwargs, its joined group)
    (`serve`: a picklable module-level function, as multiprocessing spawn needs)."""
    from .worker import launch, torchrun_rank

    if isinstance(expert_parallel, tuple):
        return expert_parallel
    cfg = ParallelConfig.of(expert_parallel)
    if torchrun_rank() is not None:
        group = EPGroup.from_env(device, cfg.timeout_s)
        group.exit_on_failure = cfg.exit_on_failure
        if group.world_size != cfg.world_size:
            raise ExpertParallelError(
                f"--expert-parallel {cfg.world_size} but torchrun started {group.world_size} ranks"
            )
        return cfg, group
    return cfg, launch(
        cfg.world_size,
        device,
        serve,
        {**worker_kwargs, "expert_parallel": cfg},
        cfg.timeout_s,
        cfg.exit_on_failure,
    )
