"""llama.cpp's tensor names -> the Hugging Face names the families read.

    token_embd.weight            model.embed_tokens.weight
    output_norm.weight           model.norm.weight
    output.weight                lm_head.weight            (absent: tied to the embedding)
    blk.N.<gguf>.{weight,bias}   model.layers.N.<LAYER[gguf]>.{weight,bias}
    blk.N.ffn_{gate,up,down}_exps.{weight,bias}   routed experts, stacked [in, out, E] (ggml dims):
                                 served per expert as model.layers.N.<moe>.experts.j.<proj>.weight
                                 (index.py), biases [out, E] as experts.<proj>_bias
    blk.N.ffn_gate_up_exps.weight                 gate and up in one stack [in, 2 x out, E] (gate rows first):
                                 served as experts.gate_up_proj [E, 2I, ...] with experts.down_proj
    blk.N.ffn_{gate,up,down}.J.weight             one expert each (older Mixtral files): the same names
    blk.N.<key>                  model.layers.N.<Arch.layer_names[key]>  (a family's own, e.g. qwen35.py)
`hf_name` returns None for a tensor no family reads here (the caller lists those it leaves out).
"""

from __future__ import annotations

import re

from .families import Arch

GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # multi-head latent attention (deepseek2); attn_k_b + attn_v_b (newer files) are kv_b_proj split (index.py)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
KV_B_SPLIT = {"attn_k_b": "k", "attn_v_b": "v"}
MOE = {
    "ffn_gate_inp": "{router}",
    "ffn_gate_shexp": "{shared}.gate_proj",
    "ffn_up_shexp": "{shared}.up_proj",
    "ffn_down_shexp": "{shared}.down_proj",
    "ffn_gate_inp_shexp": "shared_expert_gate",
    "exp_probs_b": "{router}.e_score_correction",
}
EXPERTS = {
    "ffn_gate_exps": "gate",
    "ffn_up_exps": "up",
    "ffn_down_exps": "down",
    "ffn_gate_up_exps": "gate_up",
}  # gate_up: [in, 2 x out, E], gate rows first (llama-graph.cpp)
BLOCK = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
ANY_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
PER_EXPERT = re.compile(
    r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$"
)  # older Mixtral files: one per expert


def hf_name(name: str, a: Arch) -> str | None:
    """The HF name of a dense tensor (None: an expert stack, see `expert_stack`, or not read)."""
    base, _, suffix = name.rpartition(".")
    if base in GLOBAL and suffix == "weight":
        return f"{GLOBAL[base]}.weight"
    m = ANY_LAYER.match(name)
    own = dict(a.layer_names)
    if m and m[2] in own:
        return f"model.layers.{m[1]}.{own[m[2]]}"
    m = BLOCK.match(name)
    if m is None:
        return None
    layer, key, suffix = m.groups()
    if key == "attn_sinks":  # HF: self_attn.sinks, no .weight
        return f"model.layers.{layer}.self_attn.sinks"
    if key in LAYER:
        return f"model.layers.{layer}.{LAYER[key]}.{suffix}"
    if key in MOE:
        mod = MOE[key].format(router=a.router, shared=a.shared_expert)
        if key == "exp_probs_b":  # HF: <router>.e_score_correction_bias, no .weight/.bias suffix
            return f"model.layers.{layer}.{a.moe_prefix}.{mod}_bias"
        return f"model.layers.{layer}.{a.moe_prefix}.{mod}.{suffix}"
    return None


def expert_piece(name: str) -> tuple[int, str, int] | None:
    """(layer, gate|up|down, expert) of a per-expert tensor blk.N.ffn_gate.J.weight (older files), else None."""
    m = PER_EXPERT.match(name)
    return None if m is None else (int(m[1]), m[2], int(m[3]))


def expert_stack(name: str) -> tuple[int, str, str] | None:
    """(layer, gate|up|down, weight|bias) of a stacked routed-expert tensor, else None."""
    m = BLOCK.match(name)
    if m is None or m[2] not in EXPERTS:
        return None
    return int(m[1]), EXPERTS[m[2]], m[3]


def gguf_name(name: str, a: Arch) -> str | None:
    """The llama.cpp name of an HF tensor name (errors name both), None where none maps to it."""
    inverse_global = {f"{v}.weight": f"{k}.weight" for k, v in GLOBAL.items()}
    if name in inverse_global:
        return inverse_global[name]
    own = {hf: g for g, hf in a.layer_names}
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    if m and m[2] in own:
        return f"blk.{m[1]}.{own[m[2]]}"
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
    if m is None:
        return None
    layer, module, suffix = m.groups()
    modules = {v: k for k, v in LAYER.items()}
    modules.update(
        {f"{a.moe_prefix}.{v.format(router=a.router, shared=a.shared_expert)}": k for k, v in MOE.items()}
    )
    if ".experts." in module:
        proj = module.rsplit(".", 1)[-1]
        canon = {
            "gate_proj": "gate",
            "up_proj": "up",
            "down_proj": "down",
            "w1": "gate",
            "w3": "up",
            "w2": "down",
            "gate_up_proj": "gate",
            "down": "down",
        }.get(proj)
        return None if canon is None else f"blk.{layer}.ffn_{canon}_exps.{suffix}"
    return f"blk.{layer}.{modules[module]}.{suffix}" if module in modules else None
