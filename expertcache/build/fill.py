"""Fill: the dense weights read from the checkpoint into tensors allocated through the Ledger, then the
experts into what allocate.py made.

`read_dense` returns the `DenseWeights` MoETransformer is assembled from (it reads nothing itself):
each weight is read on the host, checked for NaN/inf, converted to the dtype it is held in
(kernels.dense_dtype), and derived as the model keeps it (q/k/v fused, `--dense` / `--lm-head` quantized, zero-centred norms
offset, a linear-attention layer's derived tensors); the tensor the model keeps is then allocated
through the ledger under "dense" and the read copied into it. What a layer object derives from its
weights (Rotary's frequencies, GatedDeltaNet's -exp(A_log) and transposed conv) and a quantized
weight's packed parts are counted as they are made.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import hostmem, kernels
from ..layers.basic import QuantizedWeight, Rotary, load_quant_method
from ..layers.gated_deltanet import GatedDeltaNet
from ..layers.gated_deltanet import load_weights as load_linear_attn
from ..layers.mla import load_mla
from ..loader.checks import check_dense
from ..loader.rows import RowReader
from ..models.embedding import EMBED, Table, on_disk, tied
from ..quant.checkpoint import load_dense


@dataclass
class DenseWeights:
    """What MoETransformer holds besides its expert provider, by layer (keys as the model reads them:
    input_ln, post_ln, one of linear | mha | mla, router[, router_bias, correction, shared, shared_gate]
    or mlp)."""

    embed: Table | RowReader  # rows(input_ids [T]) -> [T, H]
    rotary: Rotary
    layers: list[dict]
    norm: torch.Tensor
    lm_head: object  # [V, H] tensor or QuantizedWeight
    dense_quantized: list[QuantizedWeight] = field(default_factory=list)  # what --dense quantized at load


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
    def embedding(self) -> Table | RowReader:
        """Under low memory on the CPU (untied) the table's rows stay on disk, read per step
        (models/embedding.py); else held in its stored float dtype (rows converted after the lookup)
        unless lm_head shares it."""
        ck, cfg = self.ck, self.ck.cfg
        emb = ck.index.info(EMBED, (cfg.vocab_size, cfg.hidden_size))
        keep = (
            not tied(cfg, ck.index)
            and emb.dtype in (torch.bfloat16, torch.float16)
            and self.dtype == torch.float32
        )
        disk = on_disk(cfg, ck.index, self.device, self.low_memory)
        if disk:
            table = RowReader(emb, self.check_finite)
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
                    self.read(f"{p}.mlp.gate_proj.weight", (inter, H)),
                    self.read(f"{p}.mlp.up_proj.weight", (inter, H)),
                    self.read(f"{p}.mlp.down_proj.weight", (H, inter)),
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
                    self.read(f"{se}.gate_proj.weight", (S, H)),
                    self.read(f"{se}.up_proj.weight", (S, H)),
                    self.read(f"{se}.down_proj.weight", (H, S)),
                )
            )
            if cfg.shared_expert_gate:
                layer["shared_gate"] = self.load(f"{prefix}.{names.shared_expert_gate}.weight", (1, H))
        return layer

    def mha(self, p: str) -> dict[str, torch.Tensor]:
        """q/k/v/o projections (+ biases, q/k norms) of layer prefix p, temporaries; q/k/v fused (fuse_qkv)."""
        cfg, H, read = self.ck.cfg, self.ck.cfg.hidden_size, self.read
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q_rows = 2 * q_dim if cfg.attn_output_gate else q_dim  # per head: [query, gate]
        a = {
            "q_proj.weight": read(f"{p}.self_attn.q_proj.weight", (q_rows, H)),
            "k_proj.weight": read(f"{p}.self_attn.k_proj.weight", (kv_dim, H)),
            "v_proj.weight": read(f"{p}.self_attn.v_proj.weight", (kv_dim, H)),
            "o_proj.weight": read(f"{p}.self_attn.o_proj.weight", (H, q_dim)),
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
        if tied(cfg, ck.index):
            w = embed.table
        else:
            w = (self.read if self.head_method is not None else self.load)(
                "lm_head.weight", (cfg.vocab_size, cfg.hidden_size)
            )
        return w if self.head_method is None else self.quantize(w, self.head_method)


def read_dense(ck, config, ledger, progress=None) -> DenseWeights:
    """Every dense weight of the checkpoint, read into tensors allocated through `ledger`."""
    r = DenseReader(ck, config, ledger, progress)
    embed = r.embedding()
    rotary = Rotary(ck.cfg, r.device)
    ledger.charge("dense", rotary.inv_freq)
    layers = [r.layer(i) for i in range(ck.cfg.num_layers)]
    norm = r.norm("model.norm.weight", (ck.cfg.hidden_size,))
    return DenseWeights(embed, rotary, layers, norm, r.head(embed), r.packed)


def fuse_qkv(a: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q/k/v projection weights of one dtype -> one "qkv_proj.weight" [q_rows + 2 kv_dim, H] (and
    "qkv_proj.bias" when all three have one): a decode step makes one projection call, not three.
    Left apart when their dtypes differ (or only some have biases)."""
    names = ("q_proj", "k_proj", "v_proj")
    ws = [a[f"{n}.weight"] for n in names]
    bs = [a.get(f"{n}.bias") for n in names]
    has_bias = [b is not None for b in bs]
    if len({w.dtype for w in ws}) != 1 or any(has_bias) != all(has_bias):
        return a
    if all(has_bias) and len({b.dtype for b in bs}) != 1:
        return a
    out = {k: t for k, t in a.items() if not k.startswith(names)}
    out["qkv_proj.weight"] = hostmem.cat(ws)
    if all(has_bias):
        out["qkv_proj.bias"] = torch.cat(bs)
    return out


def fill_experts(experts, progress=None) -> None:
    """The experts read into the pools allocate.py made (a provider without pools of its own reads
    nothing here: the tiered cache read its host tier when it was made)."""
    load = getattr(experts, "load", None)
    if load is not None:
        load(progress)
