"""Qwen3.5-MoE GGUF files (arch qwen35moe) for the tests, as llama.cpp's converter writes them
(convert_hf_to_gguf.py Qwen3_5MoeTextModel: its _LinearAttentionVReorderBase and Qwen3NextModel steps,
restated here from that source, not from expertcache/gguf/qwen35.py), and the oracle that reads one back.

`qwen35_names(tensors, cfg, mtp_layer)`: HF tensors -> GGUF arrays (v heads tiled, A_log -> -exp(A_log),
conv1d squeezed, zero-centred norms + 1; with `mtp_layer` the last layer copied there plus nextn tensors,
as a file with Qwen3.5's MTP head carries); `qwen35_metadata(cfg, nextn)`; `qwen35_state(path, cfg,
num_layers)`: every tensor dequantized by the gguf package and put back under the HF names.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from gguf_files import GLOBAL, LAYER, LAYER_RE, dequantized_arrays, stack_experts

LAYER35 = {
    **LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}
BARE = {"linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias"}  # no .weight in HF


def _sizes(cfg: dict) -> tuple[int, int, int, int]:
    """(k heads, v heads per k head, q+k rows, v head dim)."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    return hk, hv // hk, 2 * hk * cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]


def reorder_heads(t: torch.Tensor, dim: int, a: int, b: int, d: int) -> torch.Tensor:
    """Heads along `dim` viewed [a, b, d] -> [b, a, d]: (a, b) = (Hk, r) is the converter's
    _reorder_v_heads (grouped -> tiled); (r, Hk) undoes it."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], a, b, d, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape).contiguous()


def converter_change(key: str, t: torch.Tensor, cfg: dict, undo: bool = False) -> torch.Tensor:
    """One linear-attention / norm tensor as the converter writes it (`key`: the HF name after layer N), or with
    `undo` the file's tensor put back (v heads tiled <-> grouped, A_log <-> -exp(A_log), conv1d [C, 1, K] <->
    [C, K], zero-centred norms + 1 <-> - 1)."""
    hk, r, qk, dv = _sizes(cfg)
    a, b = (r, hk) if undo else (hk, r)
    if key == "linear_attn.in_proj_qkv.weight":
        t = torch.cat((t[:qk], reorder_heads(t[qk:], 0, a, b, dv)))
    elif key == "linear_attn.in_proj_z.weight":
        t = reorder_heads(t, 0, a, b, dv)
    elif key in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.dt_bias"):
        t = reorder_heads(t, 0, a, b, 1)
    elif key == "linear_attn.A_log":
        t = reorder_heads(torch.log(-t), 0, a, b, 1) if undo else -torch.exp(reorder_heads(t, 0, a, b, 1))
    elif key == "linear_attn.conv1d.weight":
        t = t if undo else t.squeeze()
        t = torch.cat((t[:qk], reorder_heads(t[qk:], 0, a, b, dv)))
        t = t.unsqueeze(1) if undo else t
    elif key == "linear_attn.out_proj.weight":
        t = reorder_heads(t, 1, a, b, dv)
    elif key.endswith("norm.weight") and key != "linear_attn.norm.weight":
        t = t - 1 if undo else t + 1
    return t


def qwen35_names(tensors: dict[str, torch.Tensor], cfg: dict, mtp_layer: int | None = None) -> dict:
    rest, out = stack_experts(tensors)
    for name, t in rest.items():
        if name in GLOBAL:
            out[GLOBAL[name]] = t + 1 if name == "model.norm.weight" else t
            continue
        layer, key = re.match(r"^model\.layers\.(\d+)\.(.+)$", name).groups()
        t = converter_change(key, t.float(), cfg)
        if key in BARE:
            out[f"blk.{layer}.{BARE[key]}"] = t
        else:
            m = LAYER_RE.match(name)
            out[f"blk.{layer}.{LAYER35[m[2]]}.{m[3]}"] = t
    if mtp_layer is not None:
        last, H = f"blk.{mtp_layer - 1}.", cfg["hidden_size"]
        out.update(
            {k.replace(last, f"blk.{mtp_layer}."): v for k, v in list(out.items()) if k.startswith(last)}
        )
        out[f"blk.{mtp_layer}.nextn.eh_proj.weight"] = torch.full((H, 2 * H), 0.01)
        for n in ("enorm", "hnorm", "shared_head_norm"):
            out[f"blk.{mtp_layer}.nextn.{n}.weight"] = torch.ones(H)
    return {k: v.detach().float().contiguous().numpy() for k, v in out.items()}


def qwen35_metadata(cfg: dict, nextn: int = 0) -> list[tuple[str, object, str]]:
    a, rope, n = "qwen35moe", cfg["rope_parameters"], cfg["num_hidden_layers"]
    return [
        (f"{a}.block_count", n + nextn, "u32"),
        (f"{a}.context_length", cfg["max_position_embeddings"], "u32"),
        (f"{a}.embedding_length", cfg["hidden_size"], "u32"),
        (f"{a}.attention.head_count", cfg["num_attention_heads"], "u32"),
        (f"{a}.attention.head_count_kv", cfg["num_key_value_heads"], "u32"),
        (f"{a}.rope.freq_base", rope["rope_theta"], "f32"),
        (f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"], "f32"),
        (f"{a}.expert_count", cfg["num_experts"], "u32"),
        (f"{a}.expert_used_count", cfg["num_experts_per_tok"], "u32"),
        (f"{a}.attention.key_length", cfg["head_dim"], "u32"),
        (f"{a}.attention.value_length", cfg["head_dim"], "u32"),
        (f"{a}.expert_feed_forward_length", cfg["moe_intermediate_size"], "u32"),
        (f"{a}.expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"], "u32"),
        (f"{a}.nextn_predict_layers", nextn, "u32"),
        (f"{a}.ssm.conv_kernel", cfg["linear_conv_kernel_dim"], "u32"),
        (f"{a}.ssm.state_size", cfg["linear_key_head_dim"], "u32"),
        (f"{a}.ssm.group_count", cfg["linear_num_key_heads"], "u32"),
        (f"{a}.ssm.time_step_rank", cfg["linear_num_value_heads"], "u32"),
        (
            f"{a}.ssm.inner_size",
            cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"],
            "u32",
        ),
        (
            f"{a}.attention.recurrent_layers",
            [t == "linear_attention" for t in cfg["layer_types"]] + [False] * nextn,
            "bool[]",
        ),
        (f"{a}.full_attention_interval", 4, "u32"),
        (f"{a}.rope.dimension_count", int(cfg["head_dim"] * rope["partial_rotary_factor"]), "u32"),
        (f"{a}.rope.dimension_sections", [11, 11, 10, 0], "i32[]"),
    ]


def qwen35_state(path, cfg: dict) -> dict[str, torch.Tensor]:
    """The oracle: the file's tensors of the decoder's layers, dequantized by the gguf package, with the
    converter's changes undone (heads back from tiled, log(-ssm_a), conv1d [C, 1, K], norms - 1)."""
    inverse = {v: k for k, v in LAYER35.items()}
    inverse_bare = {v: k for k, v in BARE.items()}
    inverse_global = {v: k for k, v in GLOBAL.items()}
    out = {}
    for name, w in dequantized_arrays(path).items():
        w = torch.from_numpy(np.ascontiguousarray(w))
        if name in inverse_global:
            out[inverse_global[name]] = w - 1 if name == "output_norm.weight" else w
            continue
        _, layer, key = name.split(".", 2)
        if int(layer) >= cfg["num_hidden_layers"]:
            continue
        p = f"model.layers.{layer}"
        m = re.match(r"^ffn_(gate|up|down)_exps\.weight$", key)
        if m:
            for j in range(w.shape[0]):
                out[f"{p}.mlp.experts.{j}.{m[1]}_proj.weight"] = w[j]
            continue
        hf = inverse_bare.get(key) or f"{inverse[key.rsplit('.', 1)[0]]}.{key.rsplit('.', 1)[1]}"
        w = converter_change(hf, w, cfg, undo=True)
        out[f"{p}.{hf}"] = w
    return out
