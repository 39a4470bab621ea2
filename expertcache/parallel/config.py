"""`ParallelConfig`: the expert-parallel options, validated once (CLI flags or LLM(expert_parallel=...))."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

PEER_TIER = ("auto", "on", "off")
DEFAULTS = {"eplb_window_size": 1000, "eplb_step_interval": 3000}  # vLLM's


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int  # ranks (processes); each owns a share of every MoE layer's experts
    num_redundant_experts: int = 0  # extra physical experts per layer: replicas of the hottest
    eplb: bool = False  # rebalance the placement from measured load every eplb_step_interval steps
    eplb_window_size: int | None = None  # steps of routing load the balancer looks at (EPLB only; 1000)
    eplb_step_interval: int | None = None  # steps between rebalances (EPLB only; 3000)
    timeout_s: float = 120.0  # a collective that waits longer names the failure and stops
    exit_on_failure: bool = False  # the CLI and server: a dead or hung rank ends the process (exit 2)
    # an expert missing from a rank's memory tiers that another rank holds in memory comes over the
    # link instead of from disk: "auto" when the cost model says the link beats the disk, "on", "off"
    peer_tier: str = "auto"

    def __post_init__(self):
        def need(ok: bool, field: str, value, what: str):
            if not ok:
                raise ConfigError(f"expert parallel: {field}={value!r} is invalid; {what}")

        for field in ("eplb_window_size", "eplb_step_interval"):
            value = getattr(self, field)
            need(value is None or self.eplb, field, value, "it only applies with eplb=True (--enable-eplb)")
            if value is None:  # frozen: the default is filled in once, here
                object.__setattr__(self, field, DEFAULTS[field])
        need(
            isinstance(self.world_size, int) and self.world_size >= 1,
            "world_size",
            self.world_size,
            "expected an integer >= 1 (--expert-parallel)",
        )
        need(
            isinstance(self.num_redundant_experts, int) and self.num_redundant_experts >= 0,
            "num_redundant_experts",
            self.num_redundant_experts,
            "expected an integer >= 0",
        )
        need(
            isinstance(self.eplb_window_size, int) and self.eplb_window_size >= 1,
            "eplb_window_size",
            self.eplb_window_size,
            "expected an integer >= 1",
        )
        need(
            isinstance(self.eplb_step_interval, int) and self.eplb_step_interval >= 1,
            "eplb_step_interval",
            self.eplb_step_interval,
            "expected an integer >= 1",
        )
        need(
            self.peer_tier in PEER_TIER,
            "peer_tier",
            self.peer_tier,
            f"expected one of {PEER_TIER} (--peer-tier)",
        )
        need(self.timeout_s > 0, "timeout_s", self.timeout_s, "expected seconds > 0")
        need(
            not (self.num_redundant_experts and self.world_size == 1),
            "num_redundant_experts",
            self.num_redundant_experts,
            "replicas need --expert-parallel >= 2",
        )

    @classmethod
    def of(cls, value) -> "ParallelConfig":
        if isinstance(value, ParallelConfig):
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expert_parallel={value!r}: expected a number of ranks or a ParallelConfig")
        return cls(world_size=value)
