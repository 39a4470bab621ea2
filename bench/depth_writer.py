"""A quantized model at full depth without its bf16 source at full depth (Qwen3-30B-A3B: ~61 GB of bf16,
more than a benchmark machine's disk holds beside the rest, and an hour of quantizing on 2 cores),
written one layer at a time into
  - expertcache's int4 checkpoint (quantize/rewrite.py's layout and config: routed experts per expert,
    group 128, everything else bf16 as real_scale.write_checkpoint draws it), and
  - llama.cpp's GGUF, in the types llama-quantize gives each tensor. A template file (the converter's
    output of real_scale's 1-layer checkpoint, through llama-quantize) gives the metadata, the tokenizer,
    the tensors outside the layers (bytes copied: the 1-layer checkpoint's embeddings, lm_head and norm
    are the full one's, drawn first from the same seed) and each layer tensor's type (layer 0's, for
    every layer); the layers' dense tensors are real_scale's bf16 draws encoded by ggml's reference
    rounding (expertcache/quant/ggml.py: Q4_0, Q8_0; F32 as is).
The routed experts (97% of the bytes) are drawn as stored blocks, as real_scale draws gpt-oss's MXFP4
codes: uniform random 4-bit codes and random positive scales (Q4_0: fp16 d per 32; int4: float32 scale
and zero point 7-9 per 128), weights of the bf16 draw's size (rms ~ 1/sqrt(in)). The two engines then
read different random weights of the same shapes and nearly the same bytes (4.5 against 4.31 bits a
weight); what a token computes does not depend on the values.
`check_against_template` writes the 1-layer GGUF this way and compares it with llama.cpp's (names,
types, shapes, metadata; the bytes of everything but the routed experts): what llama.cpp loads, it
loads here too, and the dense tensors are quantized as llama-quantize quantizes them.
Q4_K_M (a template of llama-quantize's Q4_K_M, GGUF only: no int4 twin): each tensor takes layer 0's type
except attn_v and ffn_down_exps, which take Q6_K in the layers llama-quantize's `use_more_bits` picks
(llama-quant.cpp) and Q4_K elsewhere; the K-quant tensors, dense ones included, are drawn as valid random
blocks (the engines' speed does not depend on the values; no reference K-quant encoder here), F32 ones as
real_scale draws them. Its check is against a 2-layer template: names, types, shapes, metadata, and the
bytes of the tensors outside the layers and of layer 0's F32 tensors.

Shape legend: E experts, H hidden, I expert intermediate; ggml dims are the reverse of the arrays'.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

# HF name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}."); qwen3moe (convert_hf_to_gguf.py's map)
QWEN3_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
EXPERT_PROJS = {
    "gate_proj": "ffn_gate_exps.weight",
    "up_proj": "ffn_up_exps.weight",
    "down_proj": "ffn_down_exps.weight",
}
CODE_RMS = 4.61  # rms of (q - 8) for q uniform in 0..15
INT4_GROUP = 128


def gguf_module(llama_cpp: Path):
    """The gguf-py vendored beside llama.cpp's converter (the one that wrote the template)."""
    import sys

    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf

    return gguf


def expert_shapes(cfg: dict) -> dict[str, tuple[int, int, int]]:
    """proj -> [E, out, in]."""
    E, H, I = cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    return {"gate_proj": (E, I, H), "up_proj": (E, I, H), "down_proj": (E, H, I)}


def _scales(shape, rms: float, g: torch.Generator) -> torch.Tensor:
    return rms / CODE_RMS * (0.75 + 0.5 * torch.rand(shape, generator=g))


def q4_0_experts(shape, g: torch.Generator) -> np.ndarray:
    """Random Q4_0 blocks uint8 [E, out, in/32 x 18]: fp16 d, then 16 bytes of codes."""
    E, out, inp = shape
    d = _scales((E, out, inp // 32, 1), inp**-0.5, g).half().view(torch.uint8)
    codes = torch.randint(0, 256, (E, out, inp // 32, 16), generator=g, dtype=torch.uint8)
    return torch.cat((d, codes), dim=-1).reshape(E, out, -1).numpy()


def int4_experts(shape, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random int4 (quant/int4.py legend) stacked over experts: weight uint8 [E, out, in/2], scale
    float32 [E, out, in/128], zero uint8 [E, out, in/128]."""
    E, out, inp = shape
    ng = -(-inp // INT4_GROUP)
    w = torch.randint(0, 256, (E, out, inp // 2), generator=g, dtype=torch.uint8)
    zero = torch.randint(7, 10, (E, out, ng), generator=g, dtype=torch.uint8)
    return w, _scales((E, out, ng), inp**-0.5, g).float(), zero


def encode(gguf, w: torch.Tensor, qtype) -> np.ndarray:
    """float [..., in] -> the array GGUFWriter takes for `qtype` (uint8 block bytes, or F32 values)."""
    from expertcache.quant.ggml import quantize_q4_0, quantize_q8_0

    T = gguf.GGMLQuantizationType
    if qtype == T.F32:
        return w.float().numpy()
    enc = {T.Q4_0: quantize_q4_0, T.Q8_0: quantize_q8_0}.get(qtype)
    if enc is None:
        raise SystemExit(
            f"depth_writer: no encoder for {qtype.name} (layer tensors in Q4_0, Q8_0 or F32 only)"
        )
    return enc(w.reshape(-1, w.shape[-1]).float()).reshape(*w.shape[:-1], -1).numpy()


Q4_0_FILE, Q4_K_M_FILE = 2, 15  # general.file_type (llama_ftype) of the templates this writer takes
MORE_BITS = ("attn_v.weight", "ffn_down_exps.weight")  # Q4_K_M: Q6_K where use_more_bits


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's choice of the layers whose attn_v / ffn_down get more bits (Q4_K_M: Q6_K)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_types(gguf, reader, layers: int) -> dict[str, object]:
    """Every layer tensor's type at `layers` layers ("blk.{i}.{key}" -> GGMLQuantizationType): layer 0's of the
    template, Q4_K_M's attn_v / ffn_down_exps by use_more_bits; SystemExit for another kind of template."""
    T = gguf.GGMLQuantizationType
    f = reader.fields.get("general.file_type")
    kind = Q4_0_FILE if f is None else f.contents()  # none: every layer in layer 0's types
    if kind not in (Q4_0_FILE, Q4_K_M_FILE):
        raise SystemExit(
            f"depth_writer: template file_type {kind}: only Q4_0 ({Q4_0_FILE}) or Q4_K_M ({Q4_K_M_FILE})"
        )
    layer0 = {t.name[len("blk.0.") :]: t.tensor_type for t in reader.tensors if t.name.startswith("blk.0.")}
    out = {}
    for i in range(layers):
        for key, qt in layer0.items():
            if kind == Q4_K_M_FILE and key in MORE_BITS:
                qt = T.Q6_K if use_more_bits(i, layers) else T.Q4_K
            out[f"blk.{i}.{key}"] = qt
    return out


def byte_shape(gguf, logical: tuple[int, ...], qtype) -> tuple[int, ...]:
    """The array shape GGUFWriter takes for a tensor of `logical` shape (numpy order) in `qtype`."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return logical
    qk, bb = gguf.GGML_QUANT_SIZES[qtype]
    return (*logical[:-1], logical[-1] // qk * bb)


def k_blocks(gguf, qtype, shape: tuple[int, ...], g: torch.Generator) -> np.ndarray:
    """Valid random Q4_K / Q6_K blocks uint8 byte_shape(shape) of weights about in^-0.5 in size: random codes and
    6-bit scales and mins (Q6_K: int8 scales in -32..31), positive fp16 d (and dmin) that keep them there."""
    T = gguf.GGMLQuantizationType
    qk, bb = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) // qk
    b = torch.randint(0, 256, (n, bb), generator=g, dtype=torch.uint8)
    rms = shape[-1] ** -0.5
    if qtype == T.Q4_K:  # w = d sc q - dmin m: sc, q ~ 32, 7.5
        b[:, 0:4] = (rms / 240 * (0.75 + 0.5 * torch.rand(n, 2, generator=g))).half().view(torch.uint8)
    elif qtype == T.Q6_K:  # w = d sc (q - 32): |sc|, |q - 32| ~ 18
        b[:, 192:208] = torch.randint(-32, 32, (n, 16), generator=g, dtype=torch.int8).view(torch.uint8)
        b[:, 208:210] = (rms / 330 * (0.75 + 0.5 * torch.rand(n, 1, generator=g))).half().view(torch.uint8)
    else:
        raise SystemExit(f"depth_writer: no random blocks for {qtype.name}")
    return b.reshape(byte_shape(gguf, shape, qtype)).numpy()


def expert_blocks(gguf, qtype, shape: tuple[int, int, int], g: torch.Generator) -> np.ndarray:
    """One projection's routed experts [E, out, in] as random blocks of `qtype`."""
    return (
        q4_0_experts(shape, g) if qtype == gguf.GGMLQuantizationType.Q4_0 else k_blocks(gguf, qtype, shape, g)
    )


def _copy_metadata(gguf, reader, writer, layers: int) -> None:
    arch = reader.fields["general.architecture"].contents()
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        value = layers if key == f"{arch}.block_count" else f.contents()
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, f.types[0], sub)


OUTSIDE = ("token_embd.weight", "output_norm.weight", "output.weight")


def write_gguf(gguf, template: Path, out: Path, layers: int, each_layer, g: torch.Generator) -> Path:
    """The GGUF at `layers` layers; `each_layer(types)` yields each layer's (dense tensors under hub names,
    {proj: expert blocks of the layer's type}) in order (types: tensor_types'); dense tensors in a K-quant
    are drawn from `g` as random blocks."""
    reader = gguf.GGUFReader(str(template))
    src = {t.name: t for t in reader.tensors}
    layer0 = [n[len("blk.0.") :] for n in src if n.startswith("blk.0.")]
    missing = set(QWEN3_NAMES.values()) - set(layer0)
    if missing:  # checked before anything is written
        raise SystemExit(f"depth_writer: {template} has no tensors {sorted(missing)} in layer 0")
    types = tensor_types(gguf, reader, layers)
    T = gguf.GGMLQuantizationType
    for key in EXPERT_PROJS.values():
        if types[f"blk.0.{key}"] not in (T.Q4_0, T.Q4_K, T.Q6_K):
            raise SystemExit(f"depth_writer: {template}: blk.0.{key} is {types[f'blk.0.{key}'].name}")
    writer = gguf.GGUFWriter(
        str(out.with_suffix(".gguf.tmp")), reader.fields["general.architecture"].contents()
    )
    _copy_metadata(gguf, reader, writer, layers)
    for name in OUTSIDE:
        t = src[name]
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    logical = {k: tuple(int(d) for d in reversed(src[f"blk.0.{k}"].shape)) for k in layer0}
    for i in range(layers):
        for key in layer0:
            qt = types[f"blk.{i}.{key}"]
            shape = byte_shape(gguf, logical[key], qt)
            dtype = np.float32 if qt == T.F32 else np.uint8
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            writer.add_tensor_info(f"blk.{i}.{key}", shape, np.dtype(dtype), nbytes, qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name in OUTSIDE:
        writer.write_tensor_data(np.asarray(src[name].data))
    gguf_of = {g: h for h, g in QWEN3_NAMES.items()}
    experts_of = {g: h for h, g in EXPERT_PROJS.items()}
    for i, (dense, experts) in enumerate(each_layer(types)):
        for key in layer0:
            qt = types[f"blk.{i}.{key}"]
            if key in experts_of:
                writer.write_tensor_data(experts[experts_of[key]])
            elif key in gguf_of and qt in (T.Q4_K, T.Q6_K):
                writer.write_tensor_data(k_blocks(gguf, qt, logical[key], g))
            elif key in gguf_of:
                w = dense[f"model.layers.{i}.{gguf_of[key]}"]
                writer.write_tensor_data(encode(gguf, w, qt))
            else:
                raise SystemExit(f"depth_writer: {template}: no source for blk.0.{key}")
    writer.close()
    out.with_suffix(".gguf.tmp").rename(out)
    return out


class Int4Writer:
    """expertcache's int4 checkpoint, a shard per layer (quantize/rewrite.py's layout and config)."""

    def __init__(self, out: Path, cfg: dict, tokenizer: Path):
        self.out, self.cfg = out, cfg
        self.weight_map: dict[str, str] = {}
        self.n = cfg["num_hidden_layers"] + 1
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer / f, out / f)

    def shard(self, k: int, tensors: dict[str, torch.Tensor], experts: dict | None = None) -> None:
        """Shard k: `tensors` as they are, `experts` {proj: (weight, scale, zero) stacked [E, ...]} under
        their per-expert names in layer k - 1."""
        from safetensors.torch import save_file

        stored = dict(tensors)
        for proj, parts in (experts or {}).items():
            for j in range(parts[0].shape[0]):
                p = f"model.layers.{k - 1}.mlp.experts.{j}.{proj}"
                stored.update(
                    {
                        f"{p}.weight": parts[0][j],
                        f"{p}.weight_scale": parts[1][j],
                        f"{p}.weight_zero": parts[2][j],
                    }
                )
        fname = f"model-{k + 1:05d}-of-{self.n:05d}.safetensors"
        save_file(
            {n: v.contiguous() for n, v in stored.items()}, str(self.out / fname), metadata={"format": "pt"}
        )
        self.weight_map.update(dict.fromkeys(stored, fname))

    def close(self, manifest: dict) -> Path:
        (self.out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": self.weight_map}, indent=1)
        )
        q = {"quant_method": "expertcache", "experts": "int4", "group_size": INT4_GROUP}
        (self.out / "config.json").write_text(json.dumps({**self.cfg, "quantization_config": q}, indent=2))
        (self.out / "manifest.json").write_text(json.dumps(manifest))
        return self.out


def _manifest(model: str, layers: int, seed: int, overrides: dict) -> dict:
    return {"model": model, "layers": layers, "seed": seed, "version": 2, "direct": "int4", **overrides}


def written(ckpt: Path, layers: int, model: str = "qwen3-30b-a3b", seed: int = 0, **overrides) -> bool:
    """The int4 checkpoint at `ckpt` is this writer's of these arguments (its GGUF is written first)."""
    m = ckpt / "manifest.json"
    return m.exists() and json.loads(m.read_text()) == _manifest(model, layers, seed, overrides)


def write_both(
    gguf,
    model: str,
    layers: int,
    tokenizer: Path,
    template: Path,
    ckpt: Path | None,
    out: Path,
    seed: int = 0,
    **overrides,
) -> tuple[Path | None, Path]:
    """int4 checkpoint (`ckpt`; None: none, e.g. a Q4_K_M template's run) and GGUF (`out`) of real_scale's model
    at `layers` layers, one layer in memory at a time; reused while the checkpoint's manifest matches (without a
    checkpoint: while `out` exists)."""
    import real_scale as R

    manifest = _manifest(model, layers, seed, overrides)
    if (ckpt is None or written(ckpt, layers, model, seed, **overrides)) and out.exists():
        return ckpt, out
    cfg = R.model_config(model, layers, **overrides)
    g = torch.Generator().manual_seed(seed)
    emb = R.outer_tensors(cfg, g)
    ints = Int4Writer(ckpt, cfg, tokenizer) if ckpt is not None else None
    if ints:
        ints.shard(0, emb)
    shapes = expert_shapes(cfg)

    def each_layer(types):
        for i in range(layers):
            dense = R.layer_tensors(model, cfg, i, g, experts=False)
            blocks = {
                proj: expert_blocks(gguf, types[f"blk.{i}.{EXPERT_PROJS[proj]}"], s, g)
                for proj, s in shapes.items()
            }
            if ints:
                ints.shard(i + 1, dense, {proj: int4_experts(s, g) for proj, s in shapes.items()})
            yield dense, blocks

    out.unlink(missing_ok=True)
    write_gguf(gguf, template, out, layers, each_layer, g)
    if ints:
        ints.close(manifest)
    return ckpt, out


def check_against_template(
    gguf, model: str, tokenizer: Path, template: Path, scratch: Path, **overrides
) -> None:
    """Write the GGUF directly at the template's depth and compare it with llama.cpp's (`template`): every
    tensor's name, type and shape, the metadata, and the bytes of the tensors outside the layers and of the
    dense ones (Q4_0: every layer's, the template checkpoint's draws through llama's quantizer; Q4_K_M: layer
    0's F32 ones, its K-quant ones being random blocks); SystemExit naming a difference."""
    a = gguf.GGUFReader(str(template))
    layers = int(a.fields[f"{a.fields['general.architecture'].contents()}.block_count"].contents())
    k_quant = "general.file_type" in a.fields and a.fields["general.file_type"].contents() == Q4_K_M_FILE
    _, mine = write_both(
        gguf, model, layers, tokenizer, template, None, scratch / "depth-check.gguf", **overrides
    )
    b = gguf.GGUFReader(str(mine))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    if set(ta) != set(tb):
        raise SystemExit(f"depth_writer: tensors differ from {template}: {sorted(set(ta) ^ set(tb))}")
    compared = 0
    for name, t in ta.items():
        u = tb[name]
        if t.tensor_type != u.tensor_type or list(t.shape) != list(u.shape):
            raise SystemExit(
                f"depth_writer: {name}: {t.tensor_type.name} {list(t.shape)} in {template}, "
                f"{u.tensor_type.name} {list(u.shape)} written"
            )
        same = not name.startswith("blk.") or (
            "_exps." not in name
            and (
                not k_quant or (name.startswith("blk.0.") and t.tensor_type == gguf.GGMLQuantizationType.F32)
            )
        )
        if same:
            compared += 1
            if not np.array_equal(np.asarray(t.data), np.asarray(u.data)):
                raise SystemExit(f"depth_writer: {name}: bytes differ from {template}")
    for key, f in a.fields.items():
        if not key.startswith("GGUF.") and f.contents() != b.fields[key].contents():
            raise SystemExit(f"depth_writer: metadata {key} differs from {template}")
    mine.unlink()
    print(
        f"depth_writer: {layers}-layer GGUF written directly matches {template.name}: {len(ta)} tensors' names, "
        f"types and shapes, the metadata, the bytes of {compared} tensors",
        flush=True,
    )
