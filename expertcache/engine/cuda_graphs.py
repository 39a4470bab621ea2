"""Decode steps as CUDA graphs of the dense segments between MoE layers (`--cuda-graphs`; not yet run on a
GPU, so off by default).

A step whose sequences each add one token is cut at the MoE ops, as vLLM's piecewise graphs are (its
expert-offload PR #37190 splits them at the MoE op the same way): segment 0 runs the embedding and every
layer up to the first MoE layer's router; segment k runs MoE layer m(k-1)'s shared expert and every layer
after it up to MoE layer m(k)'s router; the last ends with the logits. Each segment is captured once per
bucket (batch padded to a power of two up to max_num_seqs, block-table width padded to a power of two)
and replayed; the MoE op between two segments stays eager (the cache reads its ids on the host, plans
and copies), reading the segment's static outputs and writing its result into a static buffer.

Shape legend:
    n sequences of the step, B its bucket (n <= B), NB block-table width of the bucket, bs block size,
    L = NB * bs keys per sequence, H hidden, V vocabulary, K top_k, h heads, g kv heads, D head dim
    ints [B, 4 + NB] int64 (the step's one host -> device copy): token id, position, KV slot, source row,
    block table; rows n.. are padding: token 0, position 0, the first row's slot and source row 0, so
    their KV write repeats row 0's (the same slot, the same values)
    mlp [B, H] the MoE op's result (rows n.. hold whatever: padding rows are never read)

Attention in a segment reads the padded block table whole ([B, L, g, D] gathered) with a mask from the
positions (kp <= p, and kp > p - window), the sink logit as one more softmax column, scores in float32:
no host value decides a shape or a branch. On a CPU device `DecodeGraphs(..., capture=False)` calls the
same segment functions on the same static buffers, rewritten in place every step (the tests' replay).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..errors import ConfigError
from ..layers.attention import Attention
from ..layers.basic import add_rms_norm, linear, rms_norm, swiglu
from ..models.embedding import Table


def why_not(model) -> str | None:
    """Why the model's decode step cannot be captured (None: it can)."""
    if not isinstance(model.embed, Table):
        return "the embedding rows are read from disk per step (--low-memory)"
    for i, layer in enumerate(model.layers):
        if "linear" in layer:
            return f"layer {i} is a linear-attention (Gated DeltaNet) layer: no graph path for its state yet"
        if not isinstance(layer.get("attn"), Attention):
            return f"layer {i}'s attention ({type(layer.get('attn')).__name__}) has no graph path yet"
    return None


def bucket(n: int) -> int:
    """The power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


def decode_attention(attn: Attention, x: torch.Tensor, st: dict, k_cache, v_cache) -> torch.Tensor:
    """One new token per sequence: x [B, H] -> the attention's output projection [B, H], the new keys and
    values written at st["slots"]; static shapes, no host read."""
    cfg, w, B = attn.cfg, attn.w, x.shape[0]
    h, g, d = attn.h, attn.g, attn.d
    qkv = linear(x, w["qkv_proj.weight"], w.get("qkv_proj.bias")) if attn.fused else None
    q, gate, k, v = attn._project(x, qkv)
    q, k, v = q.reshape(B, h, d), k.reshape(B, g, d), v.reshape(B, g, d)
    if cfg.qk_norm == "head":
        q = rms_norm(q, w["q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm.weight"], cfg.rms_norm_eps)
    cos, sin = (t[:, None, :] for t in attn.rotary._compute(st["positions"], q.dtype))
    q, k = attn.rotary._rotate(q, cos, sin), attn.rotary._rotate(k, cos, sin)
    src = st["src"]
    k_cache.view(-1, g, d).index_copy_(0, st["slots"], k.index_select(0, src).to(k_cache.dtype))
    v_cache.view(-1, g, d).index_copy_(0, st["slots"], v.index_select(0, src).to(v_cache.dtype))
    tables = st["tables"]
    L = tables.shape[1] * k_cache.shape[1]
    keys = k_cache.index_select(0, tables.reshape(-1)).view(B, L, g, d).float()
    vals = v_cache.index_select(0, tables.reshape(-1)).view(B, L, g, d).float()
    qg = q.float().view(B, g, h // g, d)
    scores = torch.einsum("bgrd,blgd->bgrl", qg, keys) * attn.scale  # [B, g, h/g, L]
    kpos, pos = st["kpos"][:L][None, :], st["positions"][:, None]
    seen = kpos <= pos
    if attn.window:
        seen = seen & (kpos > pos - attn.window)
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    if attn.sinks is not None:
        sink = attn.sinks.float().view(1, g, h // g, 1).expand(B, g, h // g, 1)
        p = torch.softmax(torch.cat((scores, sink), -1), -1)[..., :L]
    else:
        p = torch.softmax(scores, -1)
    o = torch.einsum("bgrl,blgd->bgrd", p, vals).reshape(B, h * d).to(x.dtype)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return linear(o, w["o_proj.weight"], w.get("o_proj.bias"))


class DecodeGraphs:
    """The decode step's segments per bucket: captured and replayed on CUDA (`capture`), else called."""

    def __init__(self, model, kv, max_num_seqs: int, capture: bool | None = None):
        why = why_not(model)
        if why is not None:
            raise ConfigError(f"cuda_graphs: {why}; run without --cuda-graphs")
        self.model, self.kv, self.max_batch = model, kv, bucket(max_num_seqs)
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.moe = [i for i, layer in enumerate(model.layers) if "router" in layer]
        self.buckets: dict[tuple[int, int], dict] = {}  # (B, NB) -> static buffers, outputs, graphs
        self.pool = None  # the graphs' shared memory pool (segments of a bucket replay in capture order)
        self.steps = self.replays = 0

    def takes(self, work) -> bool:
        """A step of one new token per sequence, routing not needed in Python, within the largest bucket."""
        m = self.model
        return (
            all(n == 1 for _, n in work)
            and len(work) <= self.max_batch
            and m.route_override is None
            and not m.record_routing
        )

    # -- the segments -------------------------------------------------------------------------------
    def segment(self, k: int, st: dict, prev: dict | None) -> dict:
        """Segment k on the bucket's static buffers st and segment k-1's outputs prev -> its outputs:
        h, x, ids, w (and ahead, the next MoE layer's predicted ids) before MoE layer moe[k]; logits
        after the last layer."""
        m, eps = self.model, self.model.cfg.rms_norm_eps
        if k == 0:
            h, mlp, start = m.embed.rows(st["ids"]).to(m.dtype), None, 0
        else:
            i = self.moe[k - 1]
            h, mlp, start = prev["h"], st["mlp"], i + 1
            if "shared" in m.layers[i]:
                mlp = mlp + _shared(m.layers[i], prev["x"])
        stop = self.moe[k] if k < len(self.moe) else None
        for i in range(start, len(m.layers) if stop is None else stop + 1):
            layer = m.layers[i]
            if mlp is None:
                x = rms_norm(h, layer["input_ln"], eps)
            else:
                h, x = add_rms_norm(h, mlp, layer["input_ln"], eps)
            mix = decode_attention(layer["attn"], x, st, *self.kv.tensors[m.kv_index[i]])
            h, x = add_rms_norm(h, mix, layer["post_ln"], eps)
            if i == stop:
                ids, w = m._route(layer, x)
                out = {"h": h, "x": x, "ids": ids, "w": w}
                nxt = m.next_moe.get(i)
                if nxt is not None and m.experts.wants_prefetch:
                    nl = m.layers[nxt]
                    out["ahead"] = m._route(nl, rms_norm(h, nl["post_ln"], eps))[0]
                return out
            mlp = swiglu(x, *layer["mlp"])
        if mlp is not None:
            h = h + mlp
        return {"logits": linear(rms_norm(h, m.norm, eps), m.lm_head).float()}

    # -- a step ---------------------------------------------------------------------------------------
    def _bucket(self, B: int, NB: int) -> dict:
        got = self.buckets.get((B, NB))
        if got is None:
            m, dev = self.model, self.model.device
            ints = torch.zeros(B, 4 + NB, dtype=torch.int64, device=dev)
            st = {
                "ints": ints,
                "ids": ints[:, 0],
                "positions": ints[:, 1],
                "slots": ints[:, 2],
                "src": ints[:, 3],
                "tables": ints[:, 4:],
                "kpos": torch.arange(NB * self.kv.block_size, device=dev),
                "mlp": torch.zeros(B, m.cfg.hidden_size, dtype=m.dtype, device=dev),
            }
            got = self.buckets[(B, NB)] = {"st": st, "outs": None, "graphs": None}
        return got

    def _fill(self, work, st: dict) -> None:
        """The step's ids, positions, slots, source rows and block tables into st["ints"] in one copy."""
        bs, (B, width) = self.kv.block_size, st["ints"].shape
        rows = []
        for b, (seq, _) in enumerate(work):
            p = seq.num_computed
            blocks = seq.block_ids
            slot = blocks[p // bs] * bs + p % bs
            rows.append([seq.tokens[p], p, slot, b, *blocks, *[0] * (width - 4 - len(blocks))])
        pad = [0, 0, rows[0][2], 0, *[0] * (width - 4)]
        rows += [pad] * (B - len(rows))
        host = torch.tensor(rows, dtype=torch.int64)
        st["ints"].copy_(host.pin_memory() if st["ints"].is_cuda else host, non_blocking=True)

    @torch.inference_mode()
    def run(self, work) -> torch.Tensor:
        """The step's logits [n, V] (float32), one row per sequence (under the eager forward's modes: the
        MoE ops' CPU jobs compute in the model's CPU math)."""
        with kernels.cpu_threads(self.model.device), kernels.cpu_math(self.model.cpu_math):
            return self._run(work)

    def _run(self, work) -> torch.Tensor:
        m, n = self.model, len(work)
        entry = self._bucket(bucket(n), bucket(max(len(s.block_ids) for s, _ in work)))
        st = entry["st"]
        self._fill(work, st)
        m.routing, m._finite_after, m._layer_outputs = {}, None, None
        replay = entry["graphs"] is not None
        m.experts.begin_step()
        try:
            out = None
            for k in range(len(self.moe) + 1):
                if replay:
                    entry["graphs"][k].replay()
                    out = entry["outs"][k]
                else:
                    out = self.segment(k, st, out)
                if k < len(self.moe):
                    self._moe(self.moe[k], out, st, n)
        finally:
            m.experts.end_step()
        self.steps += 1
        self.replays += replay
        logits = out["logits"][:n].clone()
        if self.capture and not replay:  # the first step of a bucket ran the segments: now capture them
            self._capture(entry)
        return logits

    def _moe(self, i: int, out: dict, st: dict, n: int) -> None:
        """MoE layer i, eager, on the real rows of segment outputs `out`; its result into st["mlp"]."""
        experts = self.model.experts
        if "ahead" in out:
            experts.prefetch(self.model.next_moe[i], out["ahead"][:n])
        st["mlp"][:n].copy_(experts.forward(i, out["x"][:n], out["ids"][:n], out["w"][:n]))

    def _capture(self, entry: dict) -> None:
        """Capture a bucket's segments in order into graphs sharing one pool (replayed in that order)."""
        st, graphs, outs, prev = entry["st"], [], [], None
        torch.cuda.synchronize(self.model.device)
        for k in range(len(self.moe) + 1):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                prev = self.segment(k, st, prev)
            self.pool = g.pool()
            graphs.append(g)
            outs.append(prev)
        entry["graphs"], entry["outs"] = graphs, outs


def _shared(layer: dict, x: torch.Tensor) -> torch.Tensor:
    """A MoE layer's shared expert (and its gate) on x."""
    s = swiglu(x, *layer["shared"])
    if "shared_gate" in layer:
        s = torch.sigmoid(linear(x, layer["shared_gate"])) * s
    return s
