"""A quantized model at full depth without its bf16 source at full depth (Qwen3-30B-A3B: ~61 GB of bf16,
more than a benchmark machine's disk holds beside the rest): bench/real_scale.py's random weights,
generated one layer at a time and written straight into
  - expertcache's int4 checkpoint (what `expertcache quantize --experts int4` makes of real_scale's bf16
    checkpoint: the same generator, the same order, so the same tensors byte for byte), and
  - llama.cpp's GGUF of the same weights, in the types llama-quantize gives them: a template file (the
    converter's output of the 1-layer checkpoint, through llama-quantize) gives the metadata, the
    tokenizer, the tensors outside the layers (bytes copied: the 1-layer checkpoint's embeddings,
    lm_head and norm are the full one's, drawn first from the same seed) and each layer tensor's type
    (layer 0's, for every layer); the layers' Q4_0 / Q8_0 blocks by ggml's reference rounding
    (expertcache/quant/ggml.py), F32 as is.
`check_against_template` writes the 1-layer GGUF this way and compares it with the template tensor by
tensor (names, types, shapes, bytes): the proof that the name map and the quantizer are llama.cpp's.

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


def gguf_module(llama_cpp: Path):
    """The gguf-py vendored beside llama.cpp's converter (the one that wrote the template)."""
    import sys

    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf

    return gguf


def _embeddings(cfg: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    """real_scale.write_checkpoint's first shard, drawn in its order."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    return {
        "model.embed_tokens.weight": torch.randn(V, H, generator=g).bfloat16(),
        "lm_head.weight": (torch.randn(V, H, generator=g) * H**-0.5).bfloat16(),
        "model.norm.weight": (1 + 0.1 * torch.randn(H, generator=g)).bfloat16(),
    }


def gguf_layer(t: dict[str, torch.Tensor], i: int, E: int) -> dict[str, torch.Tensor]:
    """Layer i's tensors (real_scale.layer_tensors, hub names) under their GGUF names, experts stacked
    [E, out, in] (float32)."""
    p = f"model.layers.{i}."
    out = {f"blk.{i}.{g}": t[p + h].float() for h, g in QWEN3_NAMES.items()}
    for proj, g in EXPERT_PROJS.items():
        out[f"blk.{i}.{g}"] = torch.stack([t[f"{p}mlp.experts.{e}.{proj}.weight"] for e in range(E)]).float()
    return out


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
    rows = enc(w.reshape(-1, w.shape[-1]))
    return rows.reshape(*w.shape[:-1], -1).numpy()


def _copy_metadata(gguf, reader, writer, layers: int) -> None:
    arch = reader.fields["general.architecture"].contents()
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        value = layers if key == f"{arch}.block_count" else f.contents()
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, f.types[0], sub)


def write_gguf(gguf, template: Path, out: Path, cfg: dict, layers, outside: dict) -> Path:
    """The GGUF at cfg's depth: `layers` yields each layer's hub-named tensors in order; `outside`
    maps the template's non-layer tensor names to nothing (their bytes are copied)."""
    reader = gguf.GGUFReader(str(template))
    types = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".gguf.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    _copy_metadata(gguf, reader, writer, cfg["num_hidden_layers"])
    E, L = cfg["num_experts"], cfg["num_hidden_layers"]
    plan = []  # (name, type) in writing order
    for name in outside:
        t = types[name]
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for i in range(L):
        for name0, t in ((n, types[n]) for n in types if n.startswith("blk.0.")):
            name = f"blk.{i}." + name0[len("blk.0.") :]
            writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
            plan.append((name, t.tensor_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name in outside:
        writer.write_tensor_data(np.asarray(types[name].data))
    for i, hub in enumerate(layers):
        named = gguf_layer(hub, i, E)
        for name, qtype in (x for x in plan if x[0].startswith(f"blk.{i}.")):
            writer.write_tensor_data(encode(gguf, named.pop(name), qtype))
        if named:
            raise SystemExit(f"depth_writer: {template} has no tensors {sorted(named)} in layer 0")
    writer.close()
    tmp.rename(out)
    return out


class Int4Writer:
    """expertcache's int4 checkpoint, a shard per layer (quantize/rewrite.py's layout and config)."""

    def __init__(self, out: Path, cfg: dict, tokenizer: Path):
        from expertcache.quant.method import make_quant_method

        self.out, self.cfg = out, cfg
        self.method = make_quant_method("int4")
        self.weight_map: dict[str, str] = {}
        self.n = cfg["num_hidden_layers"] + 1
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokenizer / f, out / f)

    def shard(self, k: int, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        stored = {}
        for name, t in tensors.items():
            if ".experts." in name:
                prefix, proj = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
                for key, v in self.method.pack({f"{proj}.weight": t.float()}).items():
                    stored[f"{prefix}.{key}"] = v
            else:
                stored[name] = t
        fname = f"model-{k + 1:05d}-of-{self.n:05d}.safetensors"
        save_file(
            {k_: v.contiguous() for k_, v in stored.items()}, str(self.out / fname), metadata={"format": "pt"}
        )
        self.weight_map.update(dict.fromkeys(stored, fname))

    def close(self, manifest: dict) -> Path:
        (self.out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": self.weight_map}, indent=1)
        )
        cfg = {**self.cfg, "quantization_config": {"quant_method": "expertcache", "experts": "int4"}}
        (self.out / "config.json").write_text(json.dumps(cfg, indent=2))
        (self.out / "manifest.json").write_text(json.dumps(manifest))
        return self.out


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
    """int4 checkpoint (`ckpt`, None: none) and GGUF (`out`) of real_scale's model at `layers` layers,
    generated once, one layer in memory at a time."""
    import real_scale as R

    manifest = {"model": model, "layers": layers, "seed": seed, "version": 1, "direct": "int4", **overrides}
    done = ckpt is None or (
        (ckpt / "manifest.json").exists() and json.loads((ckpt / "manifest.json").read_text()) == manifest
    )
    if done and out.exists():
        return ckpt, out
    cfg = R.model_config(model, layers, **overrides)
    g = torch.Generator().manual_seed(seed)
    emb = _embeddings(cfg, g)
    ints = Int4Writer(ckpt, cfg, tokenizer) if ckpt is not None else None
    if ints:
        ints.shard(0, emb)
    outside = {"token_embd.weight": None, "output_norm.weight": None, "output.weight": None}

    def each_layer():
        for i in range(layers):
            t = R.layer_tensors(model, cfg, i, g)
            if ints:
                ints.shard(i + 1, t)
            yield t

    if out.exists():
        out.unlink()
    write_gguf(gguf, template, out, cfg, each_layer(), outside)
    if ints:
        ints.close(manifest)
    return ckpt, out


def check_against_template(gguf, model: str, tokenizer: Path, template: Path, scratch: Path) -> None:
    """Write the 1-layer GGUF directly and compare it with llama.cpp's (`template`), every tensor's
    name, type, shape and bytes; SystemExit naming the first difference."""
    _, mine = write_both(gguf, model, 1, tokenizer, template, None, scratch / "depth-check.gguf")
    a, b = gguf.GGUFReader(str(template)), gguf.GGUFReader(str(mine))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    if set(ta) != set(tb):
        raise SystemExit(f"depth_writer: tensors differ from {template}: {sorted(set(ta) ^ set(tb))}")
    for name, t in ta.items():
        u = tb[name]
        if t.tensor_type != u.tensor_type or list(t.shape) != list(u.shape):
            raise SystemExit(
                f"depth_writer: {name}: {t.tensor_type.name} {list(t.shape)} in {template}, "
                f"{u.tensor_type.name} {list(u.shape)} written"
            )
        if not np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(u.data).view(np.uint8)):
            raise SystemExit(f"depth_writer: {name}: bytes differ from {template}")
    mine.unlink()
    print(
        f"depth_writer: 1-layer GGUF written directly = {template.name}, {len(ta)} tensors byte for byte",
        flush=True,
    )
