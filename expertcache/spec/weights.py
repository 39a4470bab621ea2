"""WeightNames: how a model family names its MoE tensors (read by experts.layout and the families)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightNames:
    moe_prefixes: tuple[
        str, ...
    ]  # module holding router + experts, tried in order ("mlp", "block_sparse_moe")
    router: str  # under the moe prefix
    expert_projs: tuple[str, str, str]  # (gate, up, down) names inside experts.{j}
    shared_expert: str = "shared_expert"
    shared_expert_gate: str = "shared_expert_gate"
    # fused experts (experts.gate_up_proj / down_proj): stored [E, in, out] instead of [E, out, in],
    # and gate/up rows alternating (gate = even rows) instead of gate half then up half
    fused_transposed: bool = False
    gate_up_interleaved: bool = False
