"""Tiny GGUF files for the tests, written with the `gguf` package's writer the way llama.cpp's
converter lays them out: its tensor names, experts stacked per layer [E, out, in] (ggml dims
[in, out, E]), `{arch}.*` hyperparameters, `tokenizer.ggml.*` from a tokenizer.json.

`write_gguf(path, tensors, cfg, types)`: HF-named float tensors -> a .gguf file, each tensor in the
ggml type `types(gguf_name)` (quantized by the gguf package's numpy quantisers);
`random_blocks(type, rows, cols)`: valid random blocks of any block type (finite scales), as bytes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def stack_experts(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(the tensors that are not routed experts, {"blk.L.ffn_P_exps.weight": the experts stacked [E, out, in]})."""
    rest, experts = {}, {}
    for name, t in tensors.items():
        m = EXPERT.match(name)
        if m:
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = t
        else:
            rest[name] = t
    stacked = {
        f"blk.{layer}.ffn_{proj}_exps.weight": torch.stack([per[j] for j in range(len(per))])
        for (layer, proj), per in experts.items()
    }
    return rest, stacked


def gguf_names(tensors: dict[str, torch.Tensor], gate_up: bool = False) -> dict[str, np.ndarray]:
    """HF names -> the converter's names; experts stacked [E, out, in] per layer and projection (`gate_up`:
    gate and up in one stack ffn_gate_up_exps [E, 2 x out, in], gate rows first)."""
    rest, out = stack_experts(tensors)
    for name, t in rest.items():
        if name in GLOBAL:
            out[GLOBAL[name]] = t
            continue
        m = LAYER_RE.match(name)
        if m is None or m[2] not in LAYER:
            raise ValueError(f"no GGUF name for {name}")
        out[f"blk.{m[1]}.{LAYER[m[2]]}.{m[3]}"] = t
    if gate_up:
        for k in [k for k in out if k.endswith("ffn_gate_exps.weight")]:
            out[k.replace("ffn_gate_exps", "ffn_gate_up_exps")] = torch.cat(
                (out.pop(k), out.pop(k.replace("gate", "up"))), dim=1
            )
    return {k: v.detach().float().numpy() for k, v in out.items()}


def default_types(expert: str = "F32", dense: str = "F32"):
    """1-D tensors and the router stay F32 (as the converter keeps them); experts and 2-D dense weights
    in the given types."""

    def pick(name: str, arr: np.ndarray) -> str:
        if arr.ndim == 1 or "ffn_gate_inp" in name or name.endswith(".bias"):
            return "F32"
        t = expert if "_exps" in name else dense
        # llama-quantize's fallback: a row that is not whole blocks of the type stays unquantized
        return t if arr.shape[-1] % gguf.GGML_QUANT_SIZES[Q[t]][0] == 0 else "F32"

    return pick


def qwen3moe_metadata(cfg: dict) -> list[tuple[str, object, str]]:
    a = "qwen3moe"
    return [
        (f"{a}.block_count", cfg["num_hidden_layers"], "u32"),
        (f"{a}.context_length", cfg["max_position_embeddings"], "u32"),
        (f"{a}.embedding_length", cfg["hidden_size"], "u32"),
        (f"{a}.feed_forward_length", cfg.get("intermediate_size", 0), "u32"),
        (f"{a}.attention.head_count", cfg["num_attention_heads"], "u32"),
        (f"{a}.attention.head_count_kv", cfg["num_key_value_heads"], "u32"),
        (
            f"{a}.rope.freq_base",
            float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))),
            "f32",
        ),
        (f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"], "f32"),
        (f"{a}.expert_used_count", cfg["num_experts_per_tok"], "u32"),
        (f"{a}.expert_count", cfg.get("num_experts", cfg.get("num_local_experts")), "u32"),
        (
            f"{a}.attention.key_length",
            cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            "u32",
        ),
        (
            f"{a}.attention.value_length",
            cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            "u32",
        ),
        (f"{a}.expert_feed_forward_length", cfg["moe_intermediate_size"], "u32"),
    ]


TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


def tokenizer_metadata(
    tokenizer_json: Path,
    pre: str,
    vocab_size: int | None = None,
    eos: str | None = None,
    bos: str | None = None,
    chat_template: str | None = None,
    add_bos: bool = False,
) -> list[tuple[str, object, str]]:
    """tokenizer.ggml.* as llama.cpp's converter writes a byte-level BPE vocabulary: every id's piece
    ([PADi] unused where the vocabulary has a hole), added tokens control (special, or looking like
    <|...|>) or user-defined, merges "a b"."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    spec = json.loads(Path(tokenizer_json).read_text())
    vocab = tok.get_vocab(with_added_tokens=True)
    added = tok.get_added_tokens_decoder()
    n = vocab_size or max(vocab.values()) + 1
    reverse = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TOKEN_UNUSED)
            continue
        t = reverse[i]
        tokens.append(t)
        if i in added:
            looks = t.startswith("<|") and t.endswith("|>")
            types.append(TOKEN_CONTROL if added[i].special or looks else TOKEN_USER_DEFINED)
        else:
            types.append(TOKEN_NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    meta = [
        ("tokenizer.ggml.model", "gpt2", "str"),
        ("tokenizer.ggml.pre", pre, "str"),
        ("tokenizer.ggml.tokens", tokens, "str[]"),
        ("tokenizer.ggml.token_type", types, "i32[]"),
        ("tokenizer.ggml.merges", merges, "str[]"),
        ("tokenizer.ggml.add_bos_token", add_bos, "bool"),
    ]
    if eos is not None:
        meta.append(("tokenizer.ggml.eos_token_id", vocab[eos], "u32"))
    if bos is not None:
        meta.append(("tokenizer.ggml.bos_token_id", vocab[bos], "u32"))
    if chat_template is not None:
        meta.append(("tokenizer.chat_template", chat_template, "str"))
    return meta


def _add(w: gguf.GGUFWriter, key: str, value, kind: str) -> None:
    if kind == "u32":
        w.add_uint32(key, int(value))
    elif kind == "i32":
        w.add_int32(key, int(value))
    elif kind == "f32":
        w.add_float32(key, float(value))
    elif kind == "bool":
        w.add_bool(key, bool(value))
    elif kind == "str":
        w.add_string(key, value)
    elif kind.endswith("[]"):
        w.add_array(key, list(value))
    else:
        raise ValueError(kind)


def write_gguf(
    path,
    arch: str,
    arrays: dict[str, np.ndarray],
    metadata,
    types=None,
    raw: dict | None = None,
    alignment: int | None = None,
) -> Path:
    """Write float arrays (GGUF names, numpy [..., out, in]) in `types(name, arr)` ggml types; `raw`:
    {name: (ggml type name, uint8 bytes [..., rows, row bytes])} written as given."""
    types = types or default_types()
    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, kind in metadata:
        _add(w, key, value, kind)
    for name, arr in arrays.items():
        t = Q[types(name, arr)]
        if t == Q.F32:
            w.add_tensor(name, arr.astype(np.float32))
        elif t == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), t), raw_dtype=t)
    for name, (tname, data) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=Q[tname])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, cols / QK * BB]: random codes, every f16 scale a small finite value (e8m0 near 1
    for MXFP4), so the blocks decode to finite weights of a sensible size."""
    t = Q[type_name]
    qk, bb = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(rows * cols // qk, bb), dtype=np.uint8)

    def f16(n=1):
        return (
            (rng.uniform(0.002, 0.02, size=(b.shape[0], n)) * rng.choice([-1, 1], size=(b.shape[0], n)))
            .astype(np.float16)
            .view(np.uint8)
        )

    if type_name == "MXFP4":
        b[:, 0] = rng.integers(118, 124, size=b.shape[0])
    elif type_name == "Q6_K":
        b[:, 208:210] = f16()
    elif type_name in ("Q4_K", "Q5_K", "Q2_K"):
        off = 0 if type_name != "Q2_K" else 80
        b[:, off : off + 4] = np.abs(f16(2).view(np.float16)).view(np.uint8)
    elif type_name == "Q3_K":
        b[:, 108:110] = f16()
    elif type_name in ("Q4_1", "Q5_1"):
        b[:, 0:4] = f16(2)
    else:
        b[:, 0:2] = f16()
    return b.reshape(rows, -1)


def dequantized_tensors(path) -> dict[str, torch.Tensor]:
    """The oracle: every tensor of a GGUF file read by the gguf package and dequantized by it, under the
    HF names (experts unstacked), float32."""
    inverse_layer = {v: k for k, v in LAYER.items()}
    inverse_global = {v: k for k, v in GLOBAL.items()}
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(tuple(reversed([int(d) for d in t.shape])))
        if t.name in inverse_global:
            out[inverse_global[t.name]] = w
            continue
        layer, key, suffix = t.name.split(".", 1)[1].split(".")
        m = re.match(r"^ffn_(gate|up|down)_exps$", key)
        if key == "ffn_gate_up_exps":
            half = w.shape[1] // 2
            for j in range(w.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{j}.gate_proj.{suffix}"] = w[j, :half]
                out[f"model.layers.{layer}.mlp.experts.{j}.up_proj.{suffix}"] = w[j, half:]
        elif m:
            for j in range(w.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{j}.{m[1]}_proj.{suffix}"] = w[j]
        else:
            out[f"model.layers.{layer}.{inverse_layer[key]}.{suffix}"] = w
    return out


def reference_with(model, tensors: dict[str, torch.Tensor]):
    """A transformers model whose weights are `tensors` (HF names), every parameter replaced."""
    from checkpoints import fuse_experts

    state = model.state_dict()
    if any(k.endswith("experts.gate_up_proj") for k in state):  # transformers 5 holds experts fused
        tensors = fuse_experts(tensors)
    missing = set(state) - set(tensors)
    assert not missing, f"the GGUF file lacks {sorted(missing)[:4]}"
    model.load_state_dict({k: tensors[k].to(state[k].dtype) for k in state})
    return model


# -- GPT-OSS: llama.cpp's converter splits the fused, transposed, interleaved experts into stacks --------
GPT_OSS_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}


def gpt_oss_names(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    out = {}
    for name, t in tensors.items():
        if name in GLOBAL:
            out[GLOBAL[name]] = t
            continue
        layer, rest = name.split(".", 3)[2], name.split(".", 3)[3]
        blk = f"blk.{layer}"
        if rest == "self_attn.sinks":
            out[f"{blk}.attn_sinks.weight"] = t
        elif rest == "mlp.experts.gate_up_proj":  # [E, H, 2I], gate = even columns
            out[f"{blk}.ffn_gate_exps.weight"] = t[:, :, 0::2].transpose(1, 2)
            out[f"{blk}.ffn_up_exps.weight"] = t[:, :, 1::2].transpose(1, 2)
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[f"{blk}.ffn_gate_exps.bias"] = t[:, 0::2]
            out[f"{blk}.ffn_up_exps.bias"] = t[:, 1::2]
        elif rest == "mlp.experts.down_proj":  # [E, I, H]
            out[f"{blk}.ffn_down_exps.weight"] = t.transpose(1, 2)
        elif rest == "mlp.experts.down_proj_bias":
            out[f"{blk}.ffn_down_exps.bias"] = t
        else:
            module, suffix = rest.rsplit(".", 1)
            out[f"{blk}.{GPT_OSS_LAYER[module]}.{suffix}"] = t
    return {k: v.detach().float().contiguous().numpy() for k, v in out.items()}


def gpt_oss_metadata(cfg: dict) -> list[tuple[str, object, str]]:
    a, rope = "gpt-oss", cfg.get("rope_parameters") or cfg.get("rope_scaling")
    return [
        (f"{a}.block_count", cfg["num_hidden_layers"], "u32"),
        (f"{a}.context_length", cfg["max_position_embeddings"], "u32"),
        (f"{a}.embedding_length", cfg["hidden_size"], "u32"),
        (f"{a}.feed_forward_length", cfg["intermediate_size"], "u32"),
        (f"{a}.expert_feed_forward_length", cfg["intermediate_size"], "u32"),
        (f"{a}.attention.head_count", cfg["num_attention_heads"], "u32"),
        (f"{a}.attention.head_count_kv", cfg["num_key_value_heads"], "u32"),
        (f"{a}.attention.key_length", cfg["head_dim"], "u32"),
        (f"{a}.attention.value_length", cfg["head_dim"], "u32"),
        (f"{a}.rope.freq_base", rope["rope_theta"], "f32"),
        (f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"], "f32"),
        (f"{a}.expert_count", cfg["num_local_experts"], "u32"),
        (f"{a}.expert_used_count", cfg["num_experts_per_tok"], "u32"),
        (f"{a}.attention.sliding_window", cfg["sliding_window"], "u32"),
        (f"{a}.rope.scaling.type", "yarn", "str"),
        (f"{a}.rope.scaling.factor", rope["factor"], "f32"),
        (f"{a}.rope.scaling.original_context_length", rope["original_max_position_embeddings"], "u32"),
    ]


def gpt_oss_state(path) -> dict[str, torch.Tensor]:
    """The oracle for a GPT-OSS GGUF: the gguf package's dequantized tensors back in transformers' layout."""
    inverse = {v: k for k, v in GPT_OSS_LAYER.items()}
    inverse_global = {v: k for k, v in GLOBAL.items()}
    raw, out = {}, {}
    for t in gguf.GGUFReader(str(path)).tensors:
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        raw[t.name] = w.reshape(tuple(reversed([int(d) for d in t.shape])))
    for name, w in raw.items():
        if name in inverse_global:
            out[inverse_global[name]] = w
            continue
        _, layer, key, suffix = name.split(".")
        p = f"model.layers.{layer}"
        if key == "attn_sinks":
            out[f"{p}.self_attn.sinks"] = w
        elif key == "ffn_gate_exps":
            up = raw[f"blk.{layer}.ffn_up_exps.{suffix}"]
            if suffix == "weight":  # [E, I, H] x 2 -> [E, H, 2I] interleaved
                out[f"{p}.mlp.experts.gate_up_proj"] = (
                    torch.stack((w, up), dim=2).reshape(w.shape[0], -1, w.shape[2]).transpose(1, 2)
                )
            else:
                out[f"{p}.mlp.experts.gate_up_proj_bias"] = torch.stack((w, up), dim=2).reshape(
                    w.shape[0], -1
                )
        elif key == "ffn_down_exps":
            out[f"{p}.mlp.experts.down_proj" + ("" if suffix == "weight" else "_bias")] = (
                w.transpose(1, 2) if suffix == "weight" else w
            )
        elif key != "ffn_up_exps":
            out[f"{p}.{inverse[key]}.{suffix}"] = w
    return out


# -- Mixtral: arch llama with experts; the converter permutes q/k rows for ggml's rope -----------------
MIXTRAL_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
W = {"w1": "gate", "w3": "up", "w2": "down"}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: rotate-half pairs -> interleaved pairs per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def mixtral_names(tensors: dict[str, torch.Tensor], cfg: dict, stacked: bool = True) -> dict[str, np.ndarray]:
    out, experts = {}, {}
    for name, t in tensors.items():
        m = MIXTRAL_EXPERT.match(name)
        if m:
            if stacked:
                experts.setdefault((int(m[1]), W[m[3]]), {})[int(m[2])] = t
            else:
                out[f"blk.{m[1]}.ffn_{W[m[3]]}.{m[2]}.weight"] = t
            continue
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
        out.update(gguf_names({name: t}))
    for (layer, proj), per in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = torch.stack([per[j] for j in range(len(per))])
    out = {k: (v.detach().float().numpy() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
    for k in out:
        if k.endswith(("attn_q.weight", "attn_k.weight")):
            out[k] = permute(
                out[k], cfg["num_attention_heads"] if "attn_q" in k else cfg["num_key_value_heads"]
            )
    return out


def mixtral_metadata(cfg: dict) -> list[tuple[str, object, str]]:
    a = "llama"
    return [
        (f"{a}.block_count", cfg["num_hidden_layers"], "u32"),
        (f"{a}.context_length", cfg["max_position_embeddings"], "u32"),
        (f"{a}.embedding_length", cfg["hidden_size"], "u32"),
        (f"{a}.feed_forward_length", cfg["intermediate_size"], "u32"),
        (f"{a}.attention.head_count", cfg["num_attention_heads"], "u32"),
        (f"{a}.attention.head_count_kv", cfg["num_key_value_heads"], "u32"),
        (f"{a}.rope.freq_base", cfg["rope_parameters"]["rope_theta"], "f32"),
        (f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"], "f32"),
        (f"{a}.expert_count", cfg["num_local_experts"], "u32"),
        (f"{a}.expert_used_count", cfg["num_experts_per_tok"], "u32"),
        (f"{a}.rope.dimension_count", cfg["hidden_size"] // cfg["num_attention_heads"], "u32"),
    ]


def mixtral_state(path, cfg: dict) -> dict[str, torch.Tensor]:
    """The oracle for a Mixtral GGUF: the gguf package's dequantized tensors under transformers' names, q/k
    rows un-permuted, experts unstacked."""
    out = {}
    for name, w in dequantized_arrays(path).items():
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads"] if "attn_q" in name else cfg["num_key_value_heads"]
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        m = re.match(r"^blk\.(\d+)\.ffn_(gate|up|down)(_exps|\.(\d+))\.weight$", name)
        if m and m[3] == "_exps":
            for j in range(w.shape[0]):
                out[f"model.layers.{m[1]}.mlp.experts.{j}.{m[2]}_proj.weight"] = torch.from_numpy(w[j].copy())
        elif m:
            out[f"model.layers.{m[1]}.mlp.experts.{m[4]}.{m[2]}_proj.weight"] = torch.from_numpy(w.copy())
        else:
            out.update(_hf_of(name, torch.from_numpy(np.ascontiguousarray(w))))
    return out


def dequantized_arrays(path) -> dict[str, np.ndarray]:
    return {
        t.name: np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
            tuple(reversed([int(d) for d in t.shape]))
        )
        for t in gguf.GGUFReader(str(path)).tensors
    }


def _hf_of(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    inverse_layer = {v: k for k, v in LAYER.items()}
    inverse_global = {v: k for k, v in GLOBAL.items()}
    if name in inverse_global:
        return {inverse_global[name]: w}
    layer, key, suffix = name.split(".", 1)[1].split(".")
    return {f"model.layers.{layer}.{inverse_layer[key]}.{suffix}": w}


# -- GLM-4.5: shared experts, the router's correction bias, a dense first layer, the MTP layer ---------
GLM_LAYER = {
    **LAYER,
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def glm4moe_names(tensors: dict[str, torch.Tensor], mtp_layer: int | None = None) -> dict[str, np.ndarray]:
    """As the converter: experts stacked, e_score_correction_bias -> exp_probs_b.bias; with `mtp_layer`
    a copy of the last layer's tensors at that index plus a nextn tensor (what a GLM file carries)."""
    rest, out = stack_experts(tensors)
    for name, t in rest.items():
        if name in GLOBAL:
            out[GLOBAL[name]] = t
        elif name.endswith("mlp.gate.e_score_correction_bias"):
            out[f"blk.{name.split('.')[2]}.exp_probs_b.bias"] = t
        else:
            m = LAYER_RE.match(name)
            out[f"blk.{m[1]}.{GLM_LAYER[m[2]]}.{m[3]}"] = t
    if mtp_layer is not None:
        last = f"blk.{mtp_layer - 1}."
        out.update(
            {k.replace(last, f"blk.{mtp_layer}."): v for k, v in list(out.items()) if k.startswith(last)}
        )
        out[f"blk.{mtp_layer}.nextn.eh_proj.weight"] = torch.zeros(64, 128)
    return {k: v.detach().float().contiguous().numpy() for k, v in out.items()}


def glm4moe_metadata(cfg: dict, nextn: int = 0) -> list[tuple[str, object, str]]:
    a, rope = "glm4moe", cfg["rope_parameters"]
    return [
        (f"{a}.block_count", cfg["num_hidden_layers"] + nextn, "u32"),
        (f"{a}.context_length", cfg["max_position_embeddings"], "u32"),
        (f"{a}.embedding_length", cfg["hidden_size"], "u32"),
        (f"{a}.feed_forward_length", cfg["intermediate_size"], "u32"),
        (f"{a}.attention.head_count", cfg["num_attention_heads"], "u32"),
        (f"{a}.attention.head_count_kv", cfg["num_key_value_heads"], "u32"),
        (f"{a}.attention.key_length", cfg["head_dim"], "u32"),
        (f"{a}.attention.value_length", cfg["head_dim"], "u32"),
        (f"{a}.rope.dimension_count", int(cfg["head_dim"] * rope["partial_rotary_factor"]), "u32"),
        (f"{a}.rope.freq_base", rope["rope_theta"], "f32"),
        (f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"], "f32"),
        (f"{a}.expert_count", cfg["n_routed_experts"], "u32"),
        (f"{a}.expert_used_count", cfg["num_experts_per_tok"], "u32"),
        (f"{a}.expert_feed_forward_length", cfg["moe_intermediate_size"], "u32"),
        (f"{a}.expert_shared_count", cfg["n_shared_experts"], "u32"),
        (f"{a}.leading_dense_block_count", cfg["first_k_dense_replace"], "u32"),
        (f"{a}.expert_gating_func", 2, "u32"),
        (f"{a}.expert_weights_scale", cfg["routed_scaling_factor"], "f32"),
        (f"{a}.expert_weights_norm", cfg["norm_topk_prob"], "bool"),
        (f"{a}.nextn_predict_layers", nextn, "u32"),
    ]


def glm4moe_state(path, num_layers: int) -> dict[str, torch.Tensor]:
    """The oracle: dequantized tensors of layers < num_layers under transformers' names."""
    inverse = {v: k for k, v in GLM_LAYER.items()}
    inverse_global = {v: k for k, v in GLOBAL.items()}
    out = {}
    for name, w in dequantized_arrays(path).items():
        w = torch.from_numpy(np.ascontiguousarray(w))
        if name in inverse_global:
            out[inverse_global[name]] = w
            continue
        _, layer, key = name.split(".", 2)
        if int(layer) >= num_layers:
            continue
        key, suffix = key.rsplit(".", 1)
        m = re.match(r"^ffn_(gate|up|down)_exps$", key)
        if m:
            for j in range(w.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{j}.{m[1]}_proj.weight"] = w[j]
        elif key == "exp_probs_b":
            out[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"] = w
        else:
            out[f"model.layers.{layer}.{inverse[key]}.{suffix}"] = w
    return out


# -- DeepSeek-V2/V3: MLA (kv_b_proj split into attn_k_b / attn_v_b, as newer converters write it) -------
DS_LAYER = {
    **GLM_LAYER,
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
}


def deepseek_names(
    tensors: dict[str, torch.Tensor], cfg: dict, split_kv_b: bool = True
) -> dict[str, np.ndarray]:
    out, experts = {}, {}
    for name, t in tensors.items():
        m = EXPERT.match(name)
        if m:
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = t
        elif name in GLOBAL:
            out[GLOBAL[name]] = t
        elif name.endswith("mlp.gate.e_score_correction_bias"):
            out[f"blk.{name.split('.')[2]}.exp_probs_b.bias"] = t
        elif name.endswith("kv_b_proj.weight") and split_kv_b:  # convert_hf_to_gguf.py DeepseekV2Model
            layer, nope, v = name.split(".")[2], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b = t.view(cfg["num_attention_heads"], nope + v, t.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
            out[f"blk.{layer}.attn_k_b.weight"] = k_b.transpose(1, 2)
            out[f"blk.{layer}.attn_v_b.weight"] = v_b
        else:
            m = LAYER_RE.match(name)
            out[f"blk.{m[1]}.{DS_LAYER[m[2]]}.{m[3]}"] = t
    for (layer, proj), per in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = torch.stack([per[j] for j in range(len(per))])
    return {k: v.detach().float().contiguous().numpy() for k, v in out.items()}


def deepseek_metadata(cfg: dict) -> list[tuple[str, object, str]]:
    a, v3 = "deepseek2", cfg["model_type"] == "deepseek_v3"
    meta = [
        (f"{a}.block_count", cfg["num_hidden_layers"], "u32"),
        (f"{a}.context_length", cfg["max_position_embeddings"], "u32"),
        (f"{a}.embedding_length", cfg["hidden_size"], "u32"),
        (f"{a}.feed_forward_length", cfg["intermediate_size"], "u32"),
        (f"{a}.attention.head_count", cfg["num_attention_heads"], "u32"),
        (f"{a}.attention.head_count_kv", 1, "u32"),
        (f"{a}.rope.freq_base", cfg["rope_parameters"]["rope_theta"], "f32"),
        (f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"], "f32"),
        (f"{a}.expert_count", cfg["n_routed_experts"], "u32"),
        (f"{a}.expert_used_count", cfg["num_experts_per_tok"], "u32"),
        (f"{a}.leading_dense_block_count", cfg["first_k_dense_replace"], "u32"),
        (f"{a}.attention.kv_lora_rank", cfg["kv_lora_rank"], "u32"),
        (f"{a}.attention.key_length", cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], "u32"),
        (f"{a}.attention.value_length", cfg["kv_lora_rank"], "u32"),
        (f"{a}.attention.key_length_mla", cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], "u32"),
        (f"{a}.attention.value_length_mla", cfg["v_head_dim"], "u32"),
        (f"{a}.expert_feed_forward_length", cfg["moe_intermediate_size"], "u32"),
        (f"{a}.expert_shared_count", cfg["n_shared_experts"], "u32"),
        (f"{a}.expert_weights_scale", cfg["routed_scaling_factor"], "f32"),
        (f"{a}.rope.dimension_count", cfg["qk_rope_head_dim"], "u32"),
        (f"{a}.expert_gating_func", 2 if v3 else 1, "u32"),
    ]
    if cfg.get("q_lora_rank"):
        meta.append((f"{a}.attention.q_lora_rank", cfg["q_lora_rank"], "u32"))
    if cfg.get("norm_topk_prob"):
        meta.append((f"{a}.expert_weights_norm", True, "bool"))
    if cfg.get("n_group"):
        meta += [
            (f"{a}.expert_group_count", cfg["n_group"], "u32"),
            (f"{a}.expert_group_used_count", cfg["topk_group"], "u32"),
        ]
    return meta


def deepseek_state(path, cfg: dict) -> dict[str, torch.Tensor]:
    inverse = {v: k for k, v in DS_LAYER.items()}
    inverse_global = {v: k for k, v in GLOBAL.items()}
    arrays, out = dequantized_arrays(path), {}
    for name, w in arrays.items():
        w = torch.from_numpy(np.ascontiguousarray(w))
        if name in inverse_global:
            out[inverse_global[name]] = w
            continue
        _, layer, key = name.split(".", 2)
        key, suffix = key.rsplit(".", 1)
        p = f"model.layers.{layer}"
        m = re.match(r"^ffn_(gate|up|down)_exps$", key)
        if m:
            for j in range(w.shape[0]):
                out[f"{p}.mlp.experts.{j}.{m[1]}_proj.weight"] = w[j]
        elif key == "exp_probs_b":
            out[f"{p}.mlp.gate.e_score_correction_bias"] = w
        elif key == "attn_k_b":
            v = torch.from_numpy(np.ascontiguousarray(arrays[f"blk.{layer}.attn_v_b.weight"]))
            out[f"{p}.self_attn.kv_b_proj.weight"] = torch.cat((w.transpose(1, 2), v), dim=1).reshape(
                -1, w.shape[1]
            )
        elif key != "attn_v_b":
            out[f"{p}.{inverse[key]}.{suffix}"] = w
    return out
