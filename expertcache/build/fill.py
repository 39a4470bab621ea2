"""Fill: the dense weights read from the checkpoint into tensors allocated through the Ledger, then the
experts into what allocate.py made.

`read_dense` returns the `DenseWeights` MoETransformer is assembled from (it reads nothing itself):
each weight is read on the host, checked for NaN/inf, converted to the dtype it is held in
(kernels.dense_dtype), and derived as the model keeps it (q/k/v fused, `--dense` / `--lm-head` quantized, zero-centred norms
offset, a linear-attention layer's derived tensors); the tensor the model keeps is then allocated
through the ledger under "dense" and the read copied into it. On the CPU a GGUF file's lm_head and
standard attention / dense MLP matrices in a type the kernels read (build/plan.py `file_blocks`) are
read as the file's blocks and held as they are (`QuantizedWeight.stored`; q/k/v fused by row when
they share a type), said in one line at load; so is a GGUF embedding table in a block type
(models/embedding.py `held_blocks`: its rows decoded per lookup; tied, lm_head reads the same blocks where
a kernel reads the type). What a layer object derives from its
weights (Rotary's frequencies, GatedDeltaNet's -exp(A_log) and transposed conv) and a quantized
weight's packed parts are counted as they are made.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

import torch

from .. import hostmem, kernels
from ..layers.basic import QuantizedWeight, Rotary, load_quant_method
from ..layers.gated_deltanet import GatedDeltaNet
from ..layers.gated_deltanet import load_weights as load_linear_attn
from ..layers.mla import load_mla
from ..loader.checks import check_dense
from ..loader.rows import RowReader
from ..models.embedding import EMBED, BlockTable, Table, held_blocks, on_disk, tied
from ..quant import make_quant_method
from ..quant.checkpoint import load_dense
from ..quant.ggml import decode
from ..quant.ggml_blocks import BY_NAME
from ..units import fmt_bytes
from .plan import file_blocks


@dataclass
class DenseWeights:
    """What MoETransformer holds besides its expert provider, by layer (keys as the model reads them:
    input_ln, post_ln, one of linear | mha | mla, router[, router_bias, correction, shared, shared_gate]
    or mlp)."""

    embed: Table | BlockTable | RowReader  # rows(input_ids [T]) -> [T, H]
    rotary: Rotary
    layers: list[dict]
    norm: torch.Tensor
    lm_head: object  # [V, H] tensor or QuantizedWeight
    dense_quantized: list[QuantizedWeight] = field(default_factory=list)  # what --dense quantized at load
    file_blocks: list[QuantizedWeight] = field(default_factory=list)  # held as the GGUF file's blocks


class FileBlocks(QuantizedWeight):
    """A matrix read as its GGUF file's blocks, a host temporary: DenseReader.keep holds its parts."""


class DenseReader:
    """The dense weights of one checkpoint, read into ledger-allocated tensors on the device."""

    def __init__(self, ck, config, ledger, progress=None):
        self.ck, self.ledger, self.progress = ck, ledger, progress
        self.device, self.dtype = config.load.torch_device, config.load.torch_dtype
        self.low_memory, self.check_finite = config.cache.low_memory, config.load.check_finite
        k = config.kernels
        self.dense_method = None if k.dense is None else load_quant_method(k.dense, "dense")
        self.head_method = None if k.lm_head is None else load_quant_method(k.lm_head)
        self.packed: list[QuantizedWeight] = []
        self.held_blocks: list[QuantizedWeight] = []
        self.dense_fmt, self.head_fmt = k.dense, k.lm_head

    # -- one tensor ---------------------------------------------------------------------------------
    def read(self, name: str, shape, as_dtype=None) -> torch.Tensor:
        """A temporary on the host: read, checked, in the dtype it is held in (keep copies it to the
        device: no second copy of it is made there)."""
        index = self.ck.index
        t = load_dense(index, name, shape, self.ck.quant)
        check_dense(index, name, t, self.check_finite)
        held = as_dtype or kernels.dense_dtype(t.dtype, t.dim(), self.device, self.dtype, self.low_memory)
        if self.progress:
            self.progress(t.numel() * index.info(name).dtype.itemsize)
        return t.to(dtype=held)

    def blocks(self, name: str, shape) -> FileBlocks | None:
        """Matrix `name` [out, in] as its file's blocks where it is held so (plan.py `file_blocks`),
        checked (its values finite, decoded a block of rows at a time), a temporary; else None."""
        ck = self.ck
        method = file_blocks(
            ck.index, name, ck.cfg, ck.family.names, self.device, self.dense_fmt, self.head_fmt
        )
        if method is None:
            return None
        raw = self.raw_blocks(name, shape)
        return FileBlocks.stored(make_quant_method(method), {"w.weight": raw}, tuple(shape))

    def raw_blocks(self, name: str, shape) -> torch.Tensor:
        """GGUF matrix `name` [out, in] as its file's blocks, uint8 [out, row bytes], a temporary, checked
        (its values finite, decoded a block of rows at a time)."""
        index = self.ck.index
        raw = index.blocks(name, tuple(shape))
        if self.check_finite:
            type_name, rows = index.block_type(name), max(1, (1 << 22) // shape[1])
            block_bytes = BY_NAME[type_name].block_bytes
            for i in range(0, shape[0], rows):
                check_dense(index, name, decode(type_name, raw[i : i + rows].reshape(-1, block_bytes)))
        if self.progress:
            self.progress(raw.numel())
        return raw

    def matrix(self, name: str, shape):
        """A 2-D weight: as its file's blocks (`blocks`), else read as float (`read`)."""
        return self.blocks(name, shape) or self.read(name, shape)

    def keep(self, tree):
        """Every tensor of `tree` (a tensor, tuple or dict of them) copied into one allocated through the
        ledger: what the model holds."""
        if isinstance(tree, torch.Tensor):
            dst = self.ledger.alloc(tuple(tree.shape), tree.dtype, "dense")
            return dst.copy_(tree)
        if isinstance(tree, tuple):
            return tuple(self.keep(t) for t in tree)
        if isinstance(tree, dict):
            return {k: self.keep(v) for k, v in tree.items()}
        if isinstance(tree, FileBlocks):  # the file's blocks: held as they are
            q = QuantizedWeight.stored(tree.method, self.keep(tree.parts), tree.shape)
            self.held_blocks.append(q)
            return q
        return tree  # a QuantizedWeight: counted when it was made

    def load(self, name: str, shape, as_dtype=None) -> torch.Tensor:
        return self.keep(self.read(name, shape, as_dtype))

    def norm(self, name: str, shape) -> torch.Tensor:
        t = self.read(name, shape)  # zero-centred norms (norm_offset 1) scale by 1 + weight
        return self.keep(t + self.ck.cfg.norm_offset if self.ck.cfg.norm_offset else t)

    def quantize(self, w: torch.Tensor, method) -> QuantizedWeight:
        q = QuantizedWeight(w.to(self.device), method)  # packed where it is computed from
        self.ledger.charge("dense", q.parts)
        return q

    def quantized(self, ws):
        """`--dense`: a standard attention's projections and the dense MLPs quantized at load."""
        if self.dense_method is None:
            return self.keep(ws)
        if isinstance(ws, tuple):
            out = tuple(self.quantize(w, self.dense_method) for w in ws)
        else:
            out = {
                k: self.quantize(w, self.dense_method) if k.endswith("proj.weight") else self.keep(w)
                for k, w in ws.items()
            }
        self.packed += [
            w for w in (out if isinstance(out, tuple) else out.values()) if isinstance(w, QuantizedWeight)
        ]
        return out

    # -- the model ----------------------------------------------------------------------------------
    def embedding(self) -> Table | BlockTable | RowReader:
        """Under low memory on the CPU (untied) the table's rows stay on disk, read per step; else a GGUF
        table in a block type on the CPU is held as the file's blocks (models/embedding.py); else held in
        its stored float dtype (rows converted after the lookup) unless lm_head shares it."""
        ck, cfg = self.ck, self.ck.cfg
        emb = ck.index.info(EMBED, (cfg.vocab_size, cfg.hidden_size))
        block_type = held_blocks(cfg, ck.index, self.device, self.low_memory, self.head_fmt)
        if block_type is not None:
            return BlockTable(self.keep(self.raw_blocks(EMBED, emb.shape)), block_type, cfg.hidden_size)
        keep = (
            not tied(cfg, ck.index)
            and emb.dtype in (torch.bfloat16, torch.float16)
            and self.dtype == torch.float32
        )
        disk = on_disk(cfg, ck.index, self.device, self.low_memory)
        if disk:
            table = RowReader(emb, self.check_finite, decode)
        elif keep:
            t = ck.index.load(emb.name, tuple(emb.shape))
            check_dense(ck.index, emb.name, t, self.check_finite)
            table = Table(self.keep(t))
        else:
            return Table(self.load(emb.name, tuple(emb.shape)))
        if self.progress:  # (on disk: counted as done, nothing of it is read at load)
            self.progress(emb.nbytes)
        return table

    def layer(self, i: int) -> dict:
        cfg, names, index, H = self.ck.cfg, self.ck.family.names, self.ck.index, self.ck.cfg.hidden_size
        p = f"model.layers.{i}"
        layer = {
            "input_ln": self.norm(f"{p}.input_layernorm.weight", (H,)),
            "post_ln": self.norm(f"{p}.post_attention_layernorm.weight", (H,)),
        }
        if cfg.is_linear(i):
            g = GatedDeltaNet(cfg, i, self.keep(load_linear_attn(self.read, index, f"{p}.linear_attn", cfg)))
            self.ledger.charge("dense", [g.neg_A, g.conv_w])  # derived from the layer's weights
            layer["linear"] = g
        elif cfg.mla is not None:
            layer["mla"] = self.keep(load_mla(cfg, p, self.read))
        else:
            layer["mha"] = self.quantized(self.mha(p))
        if not cfg.moe_layers[i]:
            inter = cfg.intermediate_size
            layer["mlp"] = self.quantized(
                (
                    self.matrix(f"{p}.mlp.gate_proj.weight", (inter, H)),
                    self.matrix(f"{p}.mlp.up_proj.weight", (inter, H)),
                    self.matrix(f"{p}.mlp.down_proj.weight", (H, inter)),
                )
            )
            return layer
        prefix = next(
            (f"{p}.{m}" for m in names.moe_prefixes if f"{p}.{m}.{names.router}.weight" in index),
            f"{p}.{names.moe_prefixes[0]}",
        )
        r32 = torch.float32 if cfg.router.float32_logits else None  # the reference keeps these in fp32
        E = cfg.num_experts
        layer["router"] = self.load(f"{prefix}.{names.router}.weight", (E, H), r32)
        if cfg.router_bias:
            layer["router_bias"] = self.load(f"{prefix}.{names.router}.bias", (E,), r32)
        if cfg.router.kind == "noaux_tc":
            layer["correction"] = self.load(
                f"{prefix}.{names.router}.e_score_correction_bias", (E,), torch.float32
            )
        if cfg.shared_expert_intermediate_size:
            S, se = cfg.shared_expert_intermediate_size, f"{prefix}.{names.shared_expert}"
            layer["shared"] = self.quantized(
                (
                    self.matrix(f"{se}.gate_proj.weight", (S, H)),
                    self.matrix(f"{se}.up_proj.weight", (S, H)),
                    self.matrix(f"{se}.down_proj.weight", (H, S)),
                )
            )
            if cfg.shared_expert_gate:
                layer["shared_gate"] = self.load(f"{prefix}.{names.shared_expert_gate}.weight", (1, H))
        return layer

    def mha(self, p: str) -> dict[str, torch.Tensor]:
        """q/k/v/o projections (+ biases, q/k norms) of layer prefix p, temporaries; q/k/v fused (fuse_qkv)."""
        cfg, H, read, matrix = self.ck.cfg, self.ck.cfg.hidden_size, self.read, self.matrix
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q_rows = 2 * q_dim if cfg.attn_output_gate else q_dim  # per head: [query, gate]
        a = {
            "q_proj.weight": matrix(f"{p}.self_attn.q_proj.weight", (q_rows, H)),
            "k_proj.weight": matrix(f"{p}.self_attn.k_proj.weight", (kv_dim, H)),
            "v_proj.weight": matrix(f"{p}.self_attn.v_proj.weight", (kv_dim, H)),
            "o_proj.weight": matrix(f"{p}.self_attn.o_proj.weight", (H, q_dim)),
        }
        if cfg.qkv_bias:
            for n, d in (("q", q_rows), ("k", kv_dim), ("v", kv_dim)):
                a[f"{n}_proj.bias"] = read(f"{p}.self_attn.{n}_proj.bias", (d,))
        if cfg.o_bias:
            a["o_proj.bias"] = read(f"{p}.self_attn.o_proj.bias", (H,))
        if cfg.qk_norm:
            qn, kn = (cfg.head_dim, cfg.head_dim) if cfg.qk_norm == "head" else (q_dim, kv_dim)
            for n, d in (("q", qn), ("k", kn)):
                t = read(f"{p}.self_attn.{n}_norm.weight", (d,))
                a[f"{n}_norm.weight"] = t + cfg.norm_offset if cfg.norm_offset else t
        if cfg.attn_sinks:
            a["sinks"] = read(f"{p}.self_attn.sinks", (cfg.num_heads,))
        return fuse_qkv(a)

    def head(self, embed) -> object:
        ck, cfg = self.ck, self.ck.cfg
        shape = (cfg.vocab_size, cfg.hidden_size)
        if tied(cfg, ck.index) and isinstance(embed, BlockTable) and self.head_method is None:
            method = make_quant_method(ck.index.block_method(EMBED))  # a kernel type: held_blocks
            return QuantizedWeight.stored(method, {"w.weight": embed.blocks}, shape)  # the same bytes
        if tied(cfg, ck.index):  # the float table, or one dequantized for --lm-head to pack
            w = ck.index.load(EMBED, shape) if isinstance(embed, BlockTable) else embed.table
        elif (blocks := self.blocks("lm_head.weight", shape)) is not None:
            return self.keep(blocks)
        else:
            w = (self.read if self.head_method is not None else self.load)("lm_head.weight", shape)
        return w if self.head_method is None else self.quantize(w, self.head_method)


def read_dense(ck, config, ledger, progress=None) -> DenseWeights:
    """Every dense weight of the checkpoint, read into tensors allocated through `ledger`."""
    r = DenseReader(ck, config, ledger, progress)
    embed = r.embedding()
    rotary = Rotary(ck.cfg, r.device)
    ledger.charge("dense", rotary.inv_freq)
    layers = [r.layer(i) for i in range(ck.cfg.num_layers)]
    norm = r.norm("model.norm.weight", (ck.cfg.hidden_size,))
    head = r.head(embed)
    if r.held_blocks:
        print(file_blocks_note(ck.index.model_dir, r.held_blocks, head), file=sys.stderr)
    if isinstance(embed, BlockTable):
        print(embedding_note(ck.index.model_dir, embed, head), file=sys.stderr)
    return DenseWeights(embed, rotary, layers, norm, head, r.packed, r.held_blocks)


def file_blocks_note(path, held: list[QuantizedWeight], head) -> str:
    """The load's line naming the dense matrices held in their GGUF file's bytes."""
    types = Counter(w.method.name.removeprefix("gguf-").upper() for w in held)
    what = ", ".join(f"{n} {t}" for t, n in sorted(types.items()))
    return (
        f"note: {path.name}: {len(held)} dense matrices ({what}; "
        f"{'the lm_head, ' if any(w is head for w in held) else ''}attention / dense MLP projections) "
        f"stay in their file bytes, {fmt_bytes(sum(w.nbytes for w in held))}, computed by the block kernels"
    )


def embedding_note(path, embed: BlockTable, head) -> str:
    """The load's line saying the embedding stays in its GGUF file's blocks (and lm_head reads them)."""
    shared = isinstance(head, QuantizedWeight) and head.parts["w.weight"] is embed.blocks
    return (
        f"note: {path.name}: the token embedding ({embed.type_name}, {fmt_bytes(embed.blocks.nbytes)}) "
        "stays in its file bytes, the rows a step looks up decoded"
        + ("; lm_head (tied) is computed from the same blocks by the block kernels" if shared else "")
    )


def fuse_qkv(a: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q/k/v projection weights of one dtype (or a file's blocks of one type) -> one "qkv_proj.weight"
    [q_rows + 2 kv_dim, H] (and "qkv_proj.bias" when all three have one): a decode step makes one
    projection call, not three. Left apart when their dtypes or types differ (or only some have biases)."""
    names = ("q_proj", "k_proj", "v_proj")
    ws = [a[f"{n}.weight"] for n in names]
    bs = [a.get(f"{n}.bias") for n in names]
    has_bias = [b is not None for b in bs]
    blocks = [isinstance(w, FileBlocks) for w in ws]
    if len({w.dtype for w in ws}) != 1 or any(has_bias) != all(has_bias) or any(blocks) != all(blocks):
        return a
    if all(has_bias) and len({b.dtype for b in bs}) != 1:
        return a
    if all(blocks) and len({w.method.name for w in ws}) != 1:
        return a  # blocks of different types (Q4_K_M's Q6_K v in some layers): three calls
    out = {k: t for k, t in a.items() if not k.startswith(names)}
    out["qkv_proj.weight"] = (
        FileBlocks.stored(  # the blocks' rows, q's then k's then v's
            ws[0].method,
            {k: hostmem.cat([w.parts[k] for w in ws]) for k in ws[0].parts},
            (sum(w.shape[0] for w in ws), ws[0].shape[1]),
        )
        if all(blocks)
        else hostmem.cat(ws)
    )
    if all(has_bias):
        out["qkv_proj.bias"] = torch.cat(bs)
    return out


def fill_experts(experts, progress=None) -> None:
    """The experts read into the pools allocate.py made (a provider without pools of its own reads
    nothing here: the tiered cache read its host tier when it was made)."""
    load = getattr(experts, "load", None)
    if load is not None:
        load(progress)
