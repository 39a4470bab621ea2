"""The decoder shared by every family: embed -> [attention, MLP or MoE] x L -> norm -> lm_head.

Dense weights (embeddings, attention, norms, routers, shared experts, dense MLPs,
lm_head) are loaded to the compute device at construction, but for an untied
embedding under low memory on the CPU, whose rows are read per step
(models/embedding.py). Routed experts are not: each MoE layer calls the
ExpertProvider, which owns where they live.

Before layer l's experts run, the router of the next MoE layer is applied to the
current residual stream (normed with that layer's post-attention norm): the
prediction is handed to `experts.prefetch` so transfers overlap this layer's work.

The token mixer is chosen per layer: softmax attention over the paged KV cache (kv holds one
(k, v) pair per attention layer, in layer order) or, in hybrid models, a Gated DeltaNet layer
over the per-sequence state cache (`states`, layers/gated_deltanet.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import hostmem, kernels
from ..experts.provider import ExpertProvider
from ..layers.attention import Attention, AttnBatch
from ..layers.basic import QuantizedWeight, Rotary, add_rms_norm, linear, load_quant_method, rms_norm, swiglu
from ..layers.block import AttnBlock, AttnStack
from ..layers.gated_deltanet import GatedDeltaNet, StateBatch, load_weights as load_linear_attn
from ..layers.mla import MLAttention, load_mla
from ..layers.moe import route
from ..loader.safetensors_index import TensorIndex
from ..quant.checkpoint import load_dense
from ..loader.checks import check_dense
from ..loader.rows import RowReader
from ..spec.model_config import ModelConfig
from .embedding import EMBED, Table, on_disk, tied
from .registry import Family


# Bytes of per-layer outputs a forward keeps for `finite_after` (decode steps: T x H x 4 x L, e.g.
# 8 x 4096 x 4 x 94 = 12 MiB); a bigger forward checks its logits rows after every layer instead.
KEEP_LAYER_OUTPUTS = 16 << 20


class MoETransformer:
    def __init__(self, cfg: ModelConfig, family: Family, index: TensorIndex, experts: ExpertProvider,
                 device: torch.device, dtype: torch.dtype, progress: Callable[[int], None] | None = None,
                 quant=None, low_memory: bool = False, check_finite: bool = True, lm_head: str | None = None,
                 cpu_math: str = "exact", dense: str | None = None):
        self.cfg, self.experts, self.device, self.dtype = cfg, experts, device, dtype
        self.cpu_math = cpu_math  # kernels.CPU_MATHS: how the CPU kernels compute in every forward
        # per forward with logits_rows: `finite_after` [num_layers, B] bool, row b's hidden state finite
        # after layer l (read only when a sequence's logits are not finite, to name the layer where it
        # started): derived on first read from the layers' outputs kept by the forward
        self._finite_after: torch.Tensor | None = None
        self._layer_outputs: tuple[list[torch.Tensor], torch.Tensor] | None = None  # ([L] x [T, H], rows)
        self.record_routing = False
        # route_override(layer, ids, weights) -> (ids, weights): replaces the router's choice
        # (benchmarks drive routing from a synthetic trace); None = the model's own router. If it
        # has .lookahead(layer, ids) -> ids, that replaces the next-layer prediction too.
        self.route_override = None
        self.routing: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        H, V, names = cfg.hidden_size, cfg.vocab_size, family.names
        dense_method = None if dense is None else load_quant_method(dense, "dense")

        self.dense_quantized: list[QuantizedWeight] = []  # what `dense` quantized at load

        def quantize(w):
            self.dense_quantized.append(QuantizedWeight(w, dense_method))
            return self.dense_quantized[-1]

        def quantized(ws):  # `dense`: a standard attention's projections and the dense MLPs, quantized at load
            if dense_method is None:
                return ws
            if isinstance(ws, tuple):
                return tuple(quantize(w) for w in ws)
            return {k: quantize(w) if k.endswith("proj.weight") else w for k, w in ws.items()}

        def load(name, shape, as_dtype=None):
            t = load_dense(index, name, shape, quant)
            check_dense(index, name, t, check_finite)
            t = t.to(device=device, dtype=as_dtype or kernels.dense_dtype(t.dtype, t.dim(), device, dtype, low_memory))
            if progress:
                progress(t.numel() * index.info(name).dtype.itemsize)
            return t

        def norm(name, shape):  # zero-centred norms (norm_offset 1) scale by 1 + weight
            t = load(name, shape)
            return t + cfg.norm_offset if cfg.norm_offset else t

        # The embedding table is only gathered from: under low memory on the CPU (untied) its rows stay
        # on disk, read per step (models/embedding.py); else it is held in its stored float dtype (exact:
        # rows are converted after the lookup) unless lm_head shares it. Saves V x H x 2 bytes on CPU.
        emb = index.info(EMBED, (V, H))
        keep = not tied(cfg, index) and emb.dtype in (torch.bfloat16, torch.float16) and dtype == torch.float32
        disk = on_disk(cfg, index, device, low_memory)
        self.embed: Table | RowReader  # rows(input_ids [T]) -> [T, H]
        if disk:
            self.embed = RowReader(emb, check_finite)
        elif keep:
            table = index.load(emb.name, (V, H))
            check_dense(index, emb.name, table, check_finite)
            self.embed = Table(table.to(device))
        else:
            self.embed = Table(load(emb.name, (V, H)))
        if (disk or keep) and progress:  # (on disk: counted as done, nothing of it is read at load)
            progress(emb.nbytes)
        self.rotary = Rotary(cfg, device)
        self.layers = []
        self.kv_index = {layer: n for n, layer in enumerate(cfg.attention_layer_ids)}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            layer = {
                "input_ln": norm(f"{p}.input_layernorm.weight", (H,)),
                "post_ln": norm(f"{p}.post_attention_layernorm.weight", (H,)),
            }
            if cfg.is_linear(i):
                layer["linear"] = GatedDeltaNet(cfg, i, load_linear_attn(load, index, f"{p}.linear_attn", cfg))
            else:
                layer["attn"] = (MLAttention(cfg, i, load_mla(cfg, p, load), self.rotary) if cfg.mla is not None
                                 else Attention(cfg, i, quantized(self._mha_weights(p, load, norm)), self.rotary))
            if cfg.moe_layers[i]:
                prefix = next((f"{p}.{m}" for m in names.moe_prefixes if f"{p}.{m}.{names.router}.weight" in index),
                              f"{p}.{names.moe_prefixes[0]}")
                r32 = torch.float32 if cfg.router.float32_logits else None  # the reference keeps these in fp32
                layer["router"] = load(f"{prefix}.{names.router}.weight", (cfg.num_experts, H), r32)
                if cfg.router_bias:
                    layer["router_bias"] = load(f"{prefix}.{names.router}.bias", (cfg.num_experts,), r32)
                if cfg.router.kind == "noaux_tc":
                    layer["correction"] = load(f"{prefix}.{names.router}.e_score_correction_bias", (cfg.num_experts,),
                                               torch.float32)
                if cfg.shared_expert_intermediate_size:
                    S, se = cfg.shared_expert_intermediate_size, f"{prefix}.{names.shared_expert}"
                    layer["shared"] = quantized((load(f"{se}.gate_proj.weight", (S, H)),
                                                 load(f"{se}.up_proj.weight", (S, H)), load(f"{se}.down_proj.weight", (H, S))))
                    if cfg.shared_expert_gate:
                        layer["shared_gate"] = load(f"{prefix}.{names.shared_expert_gate}.weight", (1, H))
            else:
                I = cfg.intermediate_size
                layer["mlp"] = quantized((load(f"{p}.mlp.gate_proj.weight", (I, H)), load(f"{p}.mlp.up_proj.weight", (I, H)),
                                          load(f"{p}.mlp.down_proj.weight", (H, I))))
            self.layers.append(layer)
        self.norm = norm("model.norm.weight", (H,))
        if tied(cfg, index):
            self.lm_head = self.embed.table
        else:
            self.lm_head = load("lm_head.weight", (V, H))
        if lm_head is not None:  # e.g. "int8": quantized at load, read once per token in that format
            self.lm_head = QuantizedWeight(self.lm_head, load_quant_method(lm_head))
        moe = cfg.moe_layer_ids
        self.next_moe = {a: b for a, b in zip(moe, moe[1:])}
        # a MoE layer's attention half in one C++ call where every piece runs on the kernels anyway
        # (layers/block.py; bit-identical to the Python path). fused_blocks = False: the Python path.
        self.blocks = [AttnBlock.build(cfg, layer, device, dtype) for layer in self.layers]
        self.fused_blocks = True
        # and the MoE call inside the block where the experts are resident (slot = expert id), the
        # layer has no shared expert and the router does not scale its weights
        self._block_moe = [
            experts.kernel_moe_args(i, H) if b is not None and "shared" not in layer and cfg.router.scaling == 1.0
            else None for i, (b, layer) in enumerate(zip(self.blocks, self.layers))]
        # and, where every layer has a block, the whole stack of them in one call a step
        self.stack = AttnStack.build(self.blocks, self._block_moe)

    def _mha_weights(self, p: str, load, norm) -> dict[str, torch.Tensor]:
        """q/k/v/o projections (+ biases, q/k norms) of layer prefix p; q/k/v fused (fuse_qkv)."""
        cfg, H = self.cfg, self.cfg.hidden_size
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q_rows = 2 * q_dim if cfg.attn_output_gate else q_dim  # per head: [query, gate]
        a = {
            "q_proj.weight": load(f"{p}.self_attn.q_proj.weight", (q_rows, H)),
            "k_proj.weight": load(f"{p}.self_attn.k_proj.weight", (kv_dim, H)),
            "v_proj.weight": load(f"{p}.self_attn.v_proj.weight", (kv_dim, H)),
            "o_proj.weight": load(f"{p}.self_attn.o_proj.weight", (H, q_dim)),
        }
        if cfg.qkv_bias:
            for n, d in (("q", q_rows), ("k", kv_dim), ("v", kv_dim)):
                a[f"{n}_proj.bias"] = load(f"{p}.self_attn.{n}_proj.bias", (d,))
        if cfg.o_bias:
            a["o_proj.bias"] = load(f"{p}.self_attn.o_proj.bias", (H,))
        if cfg.qk_norm:
            qn, kn = (cfg.head_dim, cfg.head_dim) if cfg.qk_norm == "head" else (q_dim, kv_dim)
            a["q_norm.weight"] = norm(f"{p}.self_attn.q_norm.weight", (qn,))
            a["k_norm.weight"] = norm(f"{p}.self_attn.k_norm.weight", (kn,))
        if cfg.attn_sinks:
            a["sinks"] = load(f"{p}.self_attn.sinks", (cfg.num_heads,))
        return fuse_qkv(a)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttnBatch, kv: list[tuple[torch.Tensor, torch.Tensor]],
                logits_rows: torch.Tensor | None = None, states: StateBatch | None = None) -> torch.Tensor:
        """input_ids [T] -> logits [len(logits_rows) or T, V] in float32. kv: one (k, v) cache pair per
        attention layer; states: the sequences' linear-attention states (hybrid models only)."""
        with kernels.cpu_threads(self.device), kernels.cpu_math(self.cpu_math):
            return self._forward(input_ids, batch, kv, logits_rows, states)

    @property
    def finite_after(self) -> torch.Tensor | None:
        """[num_layers, B] bool for the last forward with logits_rows: row b finite after layer l."""
        if self._finite_after is None and self._layer_outputs is not None:
            hs, rows = self._layer_outputs
            self._finite_after = torch.stack([torch.isfinite(h[rows]).all(-1) for h in hs]) if hs else None
            self._layer_outputs = None
        return self._finite_after

    def _forward(self, input_ids, batch, kv, logits_rows, states):
        eps = self.cfg.rms_norm_eps
        h = self.embed.rows(input_ids).to(self.dtype)  # [T, H]
        self.routing = {}
        self._finite_after = self._layer_outputs = None
        # every layer's output h (a new tensor each layer) is kept while they are few bytes, and only
        # checked if the logits turn out non-finite; a bigger step checks its B rows after each layer
        keep = h.numel() * h.element_size() * len(self.layers) <= KEEP_LAYER_OUTPUTS
        outs: list[torch.Tensor] = []

        def done(h):  # h: a layer's output
            if logits_rows is not None:
                outs.append(h if keep else torch.isfinite(h[logits_rows]).all(-1))

        self.experts.begin_step()
        try:
            mlp = None  # the previous layer's MLP / MoE output, added into h by the next norm
            blocks = self.blocks if self.fused_blocks else ()
            # the MoE inside the block only when nothing needs the routing in Python this step
            with_moe = self.route_override is None and not self.record_routing
            moes = self._block_moe if with_moe else [None] * len(blocks)
            stacked = self.stack is not None and self.fused_blocks and self._run_stack(h, batch, kv, with_moe, done)
            if stacked:
                h, mlp = stacked
            for i, layer in enumerate(() if stacked else self.layers):
                fused = blocks[i](h, mlp, batch, *kv[self.kv_index[i]], moes[i]) if blocks and blocks[i] else None
                if fused is not None:
                    s, h, x, routed, out = fused
                    if mlp is not None:
                        done(s)
                    mlp = out if out is not None else self._moe(i, layer, h, x, routed)
                    continue
                if mlp is None:
                    x = rms_norm(h, layer["input_ln"], eps)
                else:
                    h, x = add_rms_norm(h, mlp, layer["input_ln"], eps)
                    done(h)
                if "linear" in layer:
                    mix = layer["linear"](x, batch.seq_of_token, batch.row_of_token, batch.max_q, states)
                else:
                    mix = layer["attn"](x, batch, *kv[self.kv_index[i]])
                h, x = add_rms_norm(h, mix, layer["post_ln"], eps)
                mlp = self._moe(i, layer, h, x) if "router" in layer else swiglu(x, *layer["mlp"])
            if mlp is not None:
                h = h + mlp
                done(h)
        finally:
            self.experts.end_step()
        if logits_rows is not None:
            if keep:
                self._layer_outputs = (outs, logits_rows)
            else:
                self._finite_after = torch.stack(outs) if outs else None
            h = h.index_select(0, logits_rows)  # (h[rows] runs torch's much longer indexing path)
        return linear(rms_norm(h, self.norm, eps), self.lm_head).float()

    def _run_stack(self, h: torch.Tensor, batch: AttnBatch, kv: list, with_moe: bool, done) -> tuple | None:
        """Every layer through the stack of blocks (layers/block.py AttnStack), a layer whose MoE needs
        Python run here between two calls -> (h, mlp) after the last layer, or None: the attention
        kernel does not take this step (nothing has run)."""
        kv = [kv[self.kv_index[i]] for i in range(len(self.layers))]
        if not self.stack.takes(batch, kv):
            return None
        mlp, start = None, 0
        while start < len(self.layers):
            stop, sums, _, h, x, routed, out = self.stack(h, mlp, batch, kv, start, with_moe)
            for s in sums:
                done(s)
            mlp = out if out is not None else self._moe(stop, self.layers[stop], h, x, routed)
            start = stop + 1
        return h, mlp

    def _route(self, layer: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return route(x, layer["router"], cfg.top_k, cfg.norm_topk_prob, cfg.router, layer.get("correction"),
                     layer.get("router_bias"))

    def _moe(self, i: int, layer: dict, h: torch.Tensor, x: torch.Tensor, routed: tuple | None = None) -> torch.Tensor:
        ids, w = self._route(layer, x) if routed is None else routed
        if self.route_override is not None:
            ids, w = self.route_override(i, ids, w)
        ahead = None
        nxt = self.next_moe.get(i)
        if nxt is not None and (self.experts.wants_prefetch or self.record_routing):
            nl = self.layers[nxt]
            ahead, _ = self._route(nl, rms_norm(h, nl["post_ln"], self.cfg.rms_norm_eps))
            if hasattr(self.route_override, "lookahead"):
                ahead = self.route_override.lookahead(nxt, ahead)
            if self.experts.wants_prefetch:
                self.experts.prefetch(nxt, ahead)
        if self.record_routing:
            self.routing[i] = (ids, w, ahead)
        out = self.experts.forward(i, x, ids, w)
        if "shared" in layer:
            s = swiglu(x, *layer["shared"])
            if "shared_gate" in layer:
                s = torch.sigmoid(linear(x, layer["shared_gate"])) * s
            out = out + s
        return out


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
