"""GGUF metadata -> the Hugging Face config dict each family's parser already reads.

llama.cpp's converter writes a model's hyperparameters as `{arch}.*` keys (`general.architecture`
= arch); `hf_config` rebuilds config.json's fields from them, so the same family parser
(models/*.py) and the same model code serve a GGUF file and a safetensors checkpoint. What the
converter does not write is stated once, in `NOT_IN_METADATA`. Each `Arch` also says how its tensors
are named (names.py) and whether its q/k rows were permuted by the converter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from . import qwen35

# Facts llama.cpp builds into its graph code instead of writing them to the file:
NOT_IN_METADATA = {
    # qwen3moe: llama.cpp always renormalises the top-k weights (its graph passes norm_w = true);
    # Qwen3-MoE's config.json says norm_topk_prob: true
    "qwen3moe": {"norm_topk_prob": True},
    # gpt-oss: the clamped SwiGLU's constants are in llama.cpp's graph (alpha 1.702, limit 7.0), as in
    # GPT-OSS's config.json; its YaRN's beta_fast 32 / beta_slow 1 and truncate false are config.json's too
    "gpt-oss": {
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
    # mixtral: renormalised top-k softmax is the family's routing, nothing to state
    # deepseek2: the converter writes YaRN's mscale_all_dim (as rope.scaling.yarn_log_multiplier = 0.1 x it)
    # but not mscale; DeepSeek's published configs have mscale = mscale_all_dim
    "deepseek2": {"mscale_equals_mscale_all_dim": True},
    # qwen35moe: llama.cpp renormalises the top-k softmax weights (norm_w = true in its graph), as
    # Qwen3.5-MoE's model code always does (its config.json has no norm_topk_prob)
    "qwen35moe": {"norm_topk_prob": True},
}
# (tied embeddings are not metadata either: a file without output.weight ties lm_head to the embedding)


class Meta:
    """Typed reads of one file's metadata under `{arch}.`; a missing required key names the file.
    `tensors`: the file's tensor names (a config fact a tensor's presence states, e.g. q/k norms)."""

    def __init__(self, path: Path, metadata: dict, arch: str, tensors=()):
        self.path, self.m, self.arch, self.tensors = path, metadata, arch, tensors

    def get(self, key: str, default=None):
        return self.m.get(f"{self.arch}.{key}", default)

    def req(self, key: str):
        full = f"{self.arch}.{key}"
        if full not in self.m:
            raise CheckpointError(f"{self.path}: missing metadata {full} (needed for the {self.arch} config)")
        return self.m[full]


@dataclass(frozen=True)
class Arch:
    arch: str  # general.architecture
    hf_architecture: str  # config.json "architectures"[0] of the same model
    fields: Callable[[Meta], dict]  # the family's own fields
    moe_prefix: str = "mlp"  # HF module of router + experts
    router: str = "gate"
    shared_expert: str = "shared_expert"
    permute_qk: bool = False  # the converter permuted q/k rows (ggml's "normal" rope: llama)
    # experts served as stacks experts.gate_up_proj [E, 2I, ...] / down_proj (+ _bias) instead of per expert
    # (a family with expert biases reads only that layout); the family's WeightNames fields to override
    fused_experts: bool = False
    weight_names: tuple = ()
    # the family's own layer tensors: (GGUF name after "blk.N.", HF name after "model.layers.N.") pairs
    layer_names: tuple = ()
    # the converter's value / shape changes undone at load: undo(path, metadata, arch) -> a callable
    # (HF name, stored shape) -> (HF shape, fn(tensor) -> HF values, or None) (qwen35.py)
    undo: Callable | None = None


ARCHES: dict[str, Arch] = {}


def register(a: Arch) -> Arch:
    ARCHES[a.arch] = a
    return a


def _rope(m: Meta) -> dict:
    out = {"rope_theta": float(m.get("rope.freq_base", 10000.0))}
    kind = m.get("rope.scaling.type")
    if kind not in (None, "none"):
        scaling = {"rope_type": kind, "factor": float(m.req("rope.scaling.factor"))}
        orig = m.get("rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        out["rope_scaling"] = scaling
    return out


def _base(m: Meta) -> dict:
    heads = int(m.req("attention.head_count"))
    hidden = int(m.req("embedding_length"))
    kv = m.get("attention.head_count_kv", heads)
    if isinstance(kv, list):
        raise CheckpointError(f"{m.path}: {m.arch}.attention.head_count_kv varies per layer; not supported")
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(m.req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": int(m.get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(m.req("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(m.get("context_length", 32768)),
        "hidden_act": "silu",
        **_rope(m),
    }


def _experts(m: Meta) -> dict:
    return {"num_experts": int(m.req("expert_count")), "num_experts_per_tok": int(m.req("expert_used_count"))}


def _qwen3moe(m: Meta) -> dict:
    return {
        **_base(m),
        **_experts(m),
        "moe_intermediate_size": int(m.req("expert_feed_forward_length")),
        "intermediate_size": int(m.get("feed_forward_length", 0)),
        "norm_topk_prob": bool(m.get("expert_weights_norm", NOT_IN_METADATA["qwen3moe"]["norm_topk_prob"])),
    }


register(Arch("qwen3moe", "Qwen3MoeForCausalLM", _qwen3moe))


def _gpt_oss(m: Meta) -> dict:
    facts = NOT_IN_METADATA["gpt-oss"]
    hf = {
        **_base(m),
        "num_local_experts": int(m.req("expert_count")),
        "num_experts_per_tok": int(m.req("expert_used_count")),
        "intermediate_size": int(m.get("expert_feed_forward_length", m.get("feed_forward_length"))),
        "sliding_window": int(m.req("attention.sliding_window")),
        "attention_bias": True,
        "swiglu_alpha": facts["swiglu_alpha"],
        "swiglu_limit": facts["swiglu_limit"],
    }
    if "rope_scaling" in hf:
        hf["rope_scaling"].update({k: facts[k] for k in ("beta_fast", "beta_slow", "truncate")})
    return hf


register(
    Arch(
        "gpt-oss",
        "GptOssForCausalLM",
        _gpt_oss,
        router="router",
        fused_experts=True,
        weight_names=(("fused_transposed", False), ("gate_up_interleaved", False)),
    )
)


def _llama(m: Meta) -> dict:
    """arch `llama` with experts is Mixtral (a dense llama is not a MoE model)."""
    if not m.get("expert_count"):
        raise CheckpointError(
            f"{m.path}: a dense llama model (no llama.expert_count); expertcache runs MoE models"
        )
    hf = {
        **_base(m),
        "num_local_experts": int(m.req("expert_count")),
        "num_experts_per_tok": int(m.req("expert_used_count")),
        "intermediate_size": int(m.get("expert_feed_forward_length", m.get("feed_forward_length"))),
    }
    hf["head_dim"] = int(m.get("rope.dimension_count", hf["head_dim"]))
    return hf


register(Arch("llama", "MixtralForCausalLM", _llama, moe_prefix="block_sparse_moe", permute_qk=True))


GATING = {1: "softmax", 2: "sigmoid"}  # {arch}.expert_gating_func (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE)


def _glm4moe(m: Meta) -> dict:
    """GLM-4.5: block_count counts the trailing MTP layer(s) (nextn_predict_layers), which the family then
    drops as the safetensors path does; rope.dimension_count = the rotary dims (partial rotary)."""
    hf = _base(m)
    nextn = int(m.get("nextn_predict_layers", 0))
    gating = GATING.get(m.get("expert_gating_func", 2))
    if gating != "sigmoid":
        raise CheckpointError(
            f"{m.path}: {m.arch}.expert_gating_func {m.get('expert_gating_func')!r}: GLM-4.5 "
            "routes by sigmoid (2)"
        )
    hf.update(
        {
            "num_hidden_layers": hf["num_hidden_layers"] - nextn,
            "num_nextn_predict_layers": nextn,
            "n_routed_experts": int(m.req("expert_count")),
            "num_experts_per_tok": int(m.req("expert_used_count")),
            "moe_intermediate_size": int(m.req("expert_feed_forward_length")),
            "intermediate_size": int(m.get("feed_forward_length", 0)),
            "n_shared_experts": int(m.get("expert_shared_count", 0)),
            "first_k_dense_replace": int(m.get("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
            "n_group": int(m.get("expert_group_count", 1)),
            "topk_group": int(m.get("expert_group_used_count", 1)),
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "partial_rotary_factor": int(m.get("rope.dimension_count", hf["head_dim"])) / hf["head_dim"],
            "attention_bias": "blk.0.attn_q.bias" in m.tensors,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in m.tensors,
        }
    )
    return hf


register(Arch("glm4moe", "Glm4MoeForCausalLM", _glm4moe, shared_expert="shared_experts"))


def _deepseek2(m: Meta) -> dict:
    """DeepSeek-V2 (softmax routing) and V3 / Kimi-K2 (sigmoid + exp_probs_b, groups): MLA dims from
    key_length_mla / value_length_mla / kv_lora_rank / rope.dimension_count (the converter writes the
    attention as MQA: head_count_kv 1, key_length = kv_lora_rank + rope dims)."""
    hf = _base(m)
    heads, rope_dim = hf["num_attention_heads"], int(m.req("rope.dimension_count"))
    k_mla = int(m.get("attention.key_length_mla", hf["head_dim"]))
    gating = GATING.get(m.get("expert_gating_func", 1))
    if gating is None:
        raise CheckpointError(
            f"{m.path}: {m.arch}.expert_gating_func {m.get('expert_gating_func')!r} is not "
            "supported (1 softmax, 2 sigmoid)"
        )
    n_group, topk_group = int(m.get("expert_group_count", 1)), int(m.get("expert_group_used_count", 1))
    v3 = gating == "sigmoid"
    hf.update(
        {
            "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
            "num_key_value_heads": heads,
            "head_dim": rope_dim,  # (DeepseekV2/V3Config: head_dim = qk_rope_head_dim)
            "q_lora_rank": m.get("attention.q_lora_rank"),
            "kv_lora_rank": int(m.req("attention.kv_lora_rank")),
            "qk_rope_head_dim": rope_dim,
            "qk_nope_head_dim": k_mla - rope_dim,
            "v_head_dim": int(m.req("attention.value_length_mla")),
            "n_routed_experts": int(m.req("expert_count")),
            "num_experts_per_tok": int(m.req("expert_used_count")),
            "moe_intermediate_size": int(m.req("expert_feed_forward_length")),
            "intermediate_size": int(m.get("feed_forward_length", 0)),
            "n_shared_experts": int(m.get("expert_shared_count", 0)),
            "first_k_dense_replace": int(m.get("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
            "n_group": n_group,
            "topk_group": topk_group,
            "scoring_func": gating,
            "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if n_group > 1 else "greedy"),
        }
    )
    scaling = hf.get("rope_scaling")
    if scaling is not None and scaling["rope_type"] == "yarn":
        for key, hf_key in (
            ("beta_fast", "beta_fast"),
            ("beta_slow", "beta_slow"),
            ("attn_factor", "attention_factor"),
        ):
            if m.get(f"rope.scaling.yarn_{key}") is not None:
                scaling[hf_key] = float(m.get(f"rope.scaling.yarn_{key}"))
        log_mul = m.get("rope.scaling.yarn_log_multiplier")
        if log_mul is not None:
            scaling["mscale_all_dim"] = scaling["mscale"] = float(log_mul) / 0.1
    return hf


register(Arch("deepseek2", "DeepseekV2ForCausalLM", _deepseek2, shared_expert="shared_experts"))


def _qwen35moe(m: Meta) -> dict:
    """Qwen3.5/3.6-MoE: the Gated DeltaNet's sizes from ssm.* (group_count = key heads, time_step_rank =
    value heads, state_size = key head dim, inner_size = value heads x value head dim, conv_kernel);
    linear layers from attention.recurrent_layers, else every full_attention_interval-th layer is
    softmax attention; rope.dimension_count = the rotary dims (partial rotary); block_count counts the
    trailing MTP layer(s) (nextn_predict_layers), dropped as the safetensors path drops mtp.*.
    rope.dimension_sections (interleaved MRoPE) is not read: text positions are the same in every
    section, which is the plain rotary."""
    hf = _base(m)
    nextn = int(m.get("nextn_predict_layers", 0))
    n = hf["num_hidden_layers"] - nextn
    v_heads, inner = int(m.req("ssm.time_step_rank")), int(m.req("ssm.inner_size"))
    if v_heads <= 0 or inner % v_heads:
        raise CheckpointError(
            f"{m.path}: {m.arch}.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {v_heads}"
        )
    recurrent = m.get("attention.recurrent_layers")
    if recurrent is None:
        every = int(m.req("full_attention_interval"))
        recurrent = [(i + 1) % every != 0 for i in range(n)]
    elif len(recurrent) < n:
        raise CheckpointError(
            f"{m.path}: {m.arch}.attention.recurrent_layers has {len(recurrent)} entries for {n} layers"
        )
    shared = "blk.0.ffn_up_shexp.weight" in m.tensors
    hf.update(
        {
            "num_hidden_layers": n,
            "num_nextn_predict_layers": nextn,
            "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n]],
            "linear_num_key_heads": int(m.req("ssm.group_count")),
            "linear_num_value_heads": v_heads,
            "linear_key_head_dim": int(m.req("ssm.state_size")),
            "linear_value_head_dim": inner // v_heads,
            "linear_conv_kernel_dim": int(m.req("ssm.conv_kernel")),
            **_experts(m),
            "moe_intermediate_size": int(m.req("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(m.req("expert_shared_feed_forward_length"))
            if shared
            else 0,
            "partial_rotary_factor": int(m.req("rope.dimension_count")) / hf["head_dim"],
            "norm_topk_prob": NOT_IN_METADATA["qwen35moe"]["norm_topk_prob"],
        }
    )
    return hf


register(
    Arch(
        "qwen35moe",
        "Qwen3_5MoeForCausalLM",
        _qwen35moe,
        layer_names=qwen35.LAYER_NAMES,
        undo=qwen35.Undo,
    )
)


def hf_config(path: Path, metadata: dict, tensor_names, vocab_size: int) -> tuple[Arch, dict]:
    """(Arch, the config.json dict) from a file's metadata; `tensor_names`: the GGUF tensor names."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported (supported: {sorted(ARCHES)})"
        )
    a = ARCHES[arch]
    m = Meta(path, metadata, arch, tensor_names)
    hf = {
        "architectures": [a.hf_architecture],
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        **a.fields(m),
    }
    for key, hf_key in (
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
    ):
        if key in metadata:
            hf[hf_key] = int(metadata[key])
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    if eot is not None and hf.get("eos_token_id") not in (None, eot):
        hf["eos_token_id"] = [hf["eos_token_id"], int(eot)]
    return a, hf
