"""CPU kernels computing y = x W^T straight from a weight's stored bytes (bf16, fp16, fp8, int8,
int4, mxfp4): the expert FFN of a whole MoE layer in one call, and dense projections / lm_head.

Shape legend:
    T tokens, H hidden, I moe intermediate, K top_k, S slots of a pool, N x Kin one weight
    x [T, H] float32   slots [T, K] int64 (-1: pair skipped)   weights [T, K]
    pool: {"gate_up": [S, 2I, H], "down": [S, H, I]} plain, or a QuantMethod's parts {"gate.weight": [S, ...], ...}

Backends: "cpp" (csrc/expert_kernels.cpp, built by build.py; AVX2/FMA/F16C, threads from
csrc/thread_pool.h, as many as torch.set_num_threads / --threads sets) or "torch" (the callers'
own torch code, used with a printed note when the extension cannot be built or loaded). Every
entry point returns None / False when it does not apply, and the caller computes with torch.
Within "cpp", MXFP4 and int4 (groups a multiple of 32) weights go to AVX-512 kernels
(csrc/nibble_kernels.cpp) where the CPU has AVX-512 F/BW/VL/VNNI, in both CPU maths;
EXPERTCACHE_CPU_ISA=avx2 (or `isa.avx512 = False`) keeps them on the AVX2 kernels; in fast math, from 4
tokens of a weight they run 32-row strips (`isa.strip_tokens = 0`: never), their products on AMX where the
CPU has it (`isa.amx = False` or EXPERTCACHE_CPU_ISA=avx512: on VNNI); `isa` is the kernels' one object
of these switches (CpuIsa). `kernel_name` says which kernel reads a
weight. Under fast math at prefill, a bf16 dense weight of at least its measured
crossover of tokens goes to torch's bf16 matmul instead (prefill_gemm.py; EXPERTCACHE_PREFILL_GEMM=0: never).
"""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import prefill_gemm
from .build import extension, on_load, why
from .formats import GGUF_SMALL_T, GGUF_UNIT_ROWS, Unsupported, of_parts, plain_spec, quant_spec

# Tokens of one weight above which the tiled path (convert a tile once, reuse it for every token)
# replaces the GEMV path (convert in registers per group of 4 tokens), by weight format code; rows of a
# weight per unit of work handed to a thread (ROWS_PER_UNIT for bf16; UNIT_ROWS: about the same bytes
# in another format, by format code). How they were measured: docs/results.md, "Where the code's
# tuning constants come from".
SMALL_T = {0: 1 << 30, 1: 1 << 30, 2: 1 << 30, 3: 256, 4: 1 << 30, 5: 1 << 30, 6: 24}
ROWS_PER_UNIT = 256
UNIT_ROWS = {0: 0.125, 1: 1, 2: 1, 3: 2, 4: 2, 5: 4, 6: 4}
SMALL_T.update(GGUF_SMALL_T)  # the GGUF block formats (codes 7-15, csrc/ggml_kernels.cpp)
UNIT_ROWS.update(GGUF_UNIT_ROWS)
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}
# The CPU math of the kernels (`--cpu-math`). exact: float32 activations, the fp32 logits within 1e-4
# of the torch path. fast: as llama.cpp computes, bf16 weights against activations rounded to bf16
# (vdpbf16ps) and int8 weights against activations quantized to int8 per block of 64 (vpdpbusd);
# mxfp4 and int4 (groups a multiple of 32) against activations quantized to int8 per block of 32, as
# llama.cpp pairs its 4-bit formats with q8 (csrc/nibble_kernels.h); GGUF blocks against activations
# quantized as llama.cpp pairs each type (Q8_0 / Q8_K-style, csrc/ggml_kernels.cpp); the other formats
# stay exact.
# It needs AVX-512 F/BW/VL/BF16/VNNI (csrc/fast_kernels.h).
CPU_MATHS = {"exact": 0, "fast": 1}
CPU_MATH_NOTES = {
    "exact": "float32 activations",
    "fast": "bf16 and int8 weights against activations rounded to bf16 / int8 blocks of 64, "
    "mxfp4 and int4 against int8 blocks of 32, GGUF blocks against int8 blocks of 32 (Q8_0) or 256 "
    "(Q8_K), AVX-512 BF16/VNNI; other formats exact",
}
_math = [0]  # the code in effect: set by cpu_math() around a forward
_FAST = CPU_MATHS["fast"]


def rows_per_unit(code: int) -> int:
    """Rows of a weight of format `code` per unit of work."""
    return max(1, int(ROWS_PER_UNIT * UNIT_ROWS[code]))


ISA_NAMES = ("avx2", "avx512")  # EXPERTCACHE_CPU_ISA: the best the CPU has when unset


@dataclass(frozen=True)
class IsaDefaults:
    """The ISA switches a process starts with, from EXPERTCACHE_CPU_ISA (read here only: the C++ kernels
    are handed them when they load, `CpuIsa.apply`): avx2 forbids the AVX-512 4-bit kernels, avx512
    keeps those off AMX."""

    avx512: bool = True
    amx: bool = True
    strip_tokens: int = 4

    @classmethod
    def from_env(cls, value: str | None = None) -> IsaDefaults:
        """Another value than ISA_NAMES is as unset."""
        isa = os.environ.get("EXPERTCACHE_CPU_ISA", "") if value is None else value
        return cls(avx512=isa != "avx2", amx=isa not in ISA_NAMES)


class CpuIsa:
    """The kernels' instruction-set switches, one object (`kernels.isa`); each reads and sets the loaded
    kernels' own state (without them, nothing computes that they steer: the defaults are reported).

    avx512: allow (the default unless EXPERTCACHE_CPU_ISA=avx2) or forbid the AVX-512 4-bit kernels;
      forbidden, mxfp4 and int4 are computed by the AVX2 kernels in both CPU maths (exactly).
    amx: allow (the default unless EXPERTCACHE_CPU_ISA is avx2 or avx512) or forbid the strips' products
      on AMX (TDPBSUD, csrc/nibble_kernels.h); they run only where the CPU has AMX-TILE/INT8 and Linux
      grants the tile state, with the VNNI strips' outputs bit for bit, else on VNNI.
    strip_tokens: tokens of one weight from which the fast math's AVX-512 4-bit kernels run 32-row strips
      with the rows in the lanes (default 4; 0: never, pairs of rows at every T); a negative count is
      refused."""

    def __init__(self, defaults: IsaDefaults | None = None):
        self.defaults = defaults or IsaDefaults.from_env()

    def apply(self, ext) -> None:
        """The defaults into a just-loaded extension (build.on_load): it starts with every switch allowed
        and reads no environment itself."""
        ext.set_avx512(self.defaults.avx512)
        ext.set_amx(self.defaults.amx)
        ext.set_strip_tokens(self.defaults.strip_tokens)

    @property
    def avx512(self) -> bool:
        return extension().get_avx512() if extension() is not None else self.defaults.avx512

    @avx512.setter
    def avx512(self, on: bool) -> None:
        if extension() is not None:
            extension().set_avx512(bool(on))

    @property
    def amx(self) -> bool:
        """Allowed and supported (the strips' products run on AMX)."""
        return extension().get_amx() if extension() is not None else False

    @amx.setter
    def amx(self, on: bool) -> None:
        if extension() is not None:
            extension().set_amx(bool(on))

    @property
    def strip_tokens(self) -> int:
        return extension().get_strip_tokens() if extension() is not None else self.defaults.strip_tokens

    @strip_tokens.setter
    def strip_tokens(self, tokens: int) -> None:
        if tokens < 0:
            raise ValueError(f"strip_tokens: tokens must be >= 0 (0: never), got {tokens}")
        if extension() is not None:
            extension().set_strip_tokens(tokens)

    @contextmanager
    def override(self, **switches):
        """Set some switches (avx512, amx, strip_tokens) for a block, restored afterwards."""
        saved = {name: getattr(self, name) for name in switches}
        try:
            for name, value in switches.items():
                setattr(self, name, value)
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)


isa = CpuIsa()
on_load(isa.apply)


def kernel_name(spec: tuple, math: str = "exact") -> str:
    """The kernel that computes a weight of kernel spec `spec` in CPU math `math` (benchmarks print it)."""
    return extension().kernel_of(spec, CPU_MATHS[math]) if extension() is not None else "torch"


def backend() -> str:
    """'cpp' when the C++ kernels are in use, else 'torch'."""
    return "torch" if extension() is None else "cpp"


@contextmanager
def cpu_threads(device: torch.device | str):
    """Around a forward pass on the CPU with the C++ kernels: the kernels compute on torch's thread
    count (torch.set_num_threads / --threads) and torch's own ops (attention, norms, routing: small
    next to the kernels' work) run on one thread, restored afterwards. Why (decode on a busy machine,
    measured): docs/results.md, "On a busy machine"."""
    n = torch.get_num_threads()
    if n <= 1 or torch.device(device).type != "cpu" or backend() != "cpp":
        yield
        return
    ext = extension()
    ext.set_threads(n)
    torch.set_num_threads(1)
    prefill_gemm.set_forward_threads(n)  # the bf16 matmul at prefill runs on the kernels' count
    try:
        yield
    finally:
        prefill_gemm.set_forward_threads(0)
        torch.set_num_threads(n)
        ext.set_threads(0)


def cpu_math_unavailable(math: str) -> str | None:
    """Why CPU math `math` cannot be used here (None: it can); raises ValueError for an unknown name."""
    if math not in CPU_MATHS:
        raise ValueError(f"cpu_math: one of {', '.join(CPU_MATHS)}, got {math!r}")
    if math == "exact":
        return None
    if extension() is None:
        return f"the C++ kernels are not in use ({why()})"
    if not extension().fast_supported():
        return "this CPU lacks AVX-512 F/BW/VL/BF16/VNNI"
    return None


@contextmanager
def cpu_math(math: str):
    """Around a forward: the kernels compute with CPU math `math` (CPU_MATHS), restored afterwards."""
    saved = _math[0]
    _math[0] = CPU_MATHS[math]
    try:
        yield
    finally:
        _math[0] = saved


def reads_stored(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether weights on `device` computed in `dtype` stay in their stored format (bf16 dense weights,
    expert slots): the C++ kernels read them as stored, so they are never widened to float32 copies."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and backend() == "cpp"


def dense_dtype(
    stored: torch.dtype, ndim: int, device: torch.device | str, dtype: torch.dtype, low_memory: bool = False
) -> torch.dtype:
    """The dtype a dense weight stored as `stored` is held in: a 2-D weight narrower than `dtype` keeps
    its stored float dtype where the kernels read it (or in low-memory mode: converted per use)."""
    narrow = ndim == 2 and stored in (torch.bfloat16, torch.float16) and stored.itemsize < dtype.itemsize
    return stored if narrow and (low_memory or reads_stored(device, dtype)) else dtype


def _usable(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.is_cpu and extension() is not None


# Specs are built once per weight, not once per call (a decode token makes ~100 kernel calls, and
# building a spec in Python costs about as much as a small projection's dispatch). An entry is keyed
# by the weight's tensor objects (the id of the first, all checked through weakrefs) and dropped when
# the first dies; it is kept only when its specs are views of those tensors' storage (a converted copy
# would go stale when a slot is refilled), so it never holds memory the weights do not.
_SPECS: dict[int, tuple] = {}  # id(first tensor) -> (weakrefs of the tensors, key, specs or None)


def _views_only(specs: tuple, tensors: list[torch.Tensor]) -> bool:
    """Every tensor of `specs` (kernel specs, and any tensors or other values beside them) is a view of
    one of `tensors`."""
    own = {t.untyped_storage().data_ptr() for t in tensors}
    held = [t for spec in specs if isinstance(spec, tuple) for t in spec[1:4]] + list(specs)
    return all(t.untyped_storage().data_ptr() in own for t in held if isinstance(t, torch.Tensor))


def _cached_specs(tensors: list[torch.Tensor], key: tuple, build) -> tuple | None:
    """build() -> a tuple of specs (None: the kernels do not read these weights), once per weights."""
    first = tensors[0]
    hit = _SPECS.get(id(first))
    if (
        hit is not None
        and hit[1] == key
        and len(hit[0]) == len(tensors)
        and all(r() is t for r, t in zip(hit[0], tensors))
    ):
        return hit[2]
    try:
        specs = build()
    except Unsupported:
        specs = None
    if specs is None or _views_only(specs, tensors):
        specs = _unheld(specs, {id(t) for t in tensors})
        k = id(first)
        refs = [weakref.ref(first, lambda _, k=k, table=_SPECS: table.pop(k, None))] + [
            weakref.ref(t) for t in tensors[1:]
        ]
        _SPECS[k] = (refs, key, specs)
    return specs


def _unheld(specs, ids: set[int]):
    """specs with each of the weights' own tensor objects (ids) replaced by a new view of it: an entry
    holding `first` itself would keep it alive, its weakref's callback would never drop the entry, and
    every short-lived pool (a miss computed from a scratch read) would stay in memory for good."""
    if isinstance(specs, tuple):
        return tuple(_unheld(s, ids) for s in specs)
    if isinstance(specs, list):
        return [_unheld(s, ids) for s in specs]
    return specs.detach() if isinstance(specs, torch.Tensor) and id(specs) in ids else specs


_DENSE: dict[
    int, tuple
] = {}  # id(dense weight) -> (weakref, spec or None), as _SPECS for one tensor (a faster lookup)


def dense_spec(w: torch.Tensor) -> tuple | None:
    """The kernel spec of a dense CPU weight [N, K] (bf16/fp16/fp32), or None: built once per weight."""
    hit = _DENSE.get(id(w))
    if hit is not None and hit[0]() is w:
        return hit[1]
    try:
        spec = plain_spec(w.unsqueeze(0)) if w.is_cpu and w.dim() == 2 else None
    except Unsupported:
        spec = None
    if spec is None or _views_only((spec,), [w]):
        k = id(w)
        _DENSE[k] = (weakref.ref(w, lambda _, k=k, table=_DENSE: table.pop(k, None)), spec)
    return spec


def dense_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [..., Kin] float32 @ w [N, Kin]^T for a bf16/fp16/fp32 weight, or None when the kernels
    do not apply (then the caller uses torch)."""
    if not _usable(x):
        return None
    spec = dense_spec(w)
    if spec is None:
        return None
    if _math[0] == _FAST and prefill_dense(x, w):  # the math first: nothing more at exact decode
        prefill_gemm.CALLS["dense"] += 1
        return prefill_gemm.bf16_linear(x, w)
    return _linear(x, spec)


def prefill_step(t: int) -> bool:
    """Whether a step of `t` tokens may send weights to the bf16 matmul (kernels/prefill_gemm.py): fast
    math in effect, the path on and t at least its smallest probed count. The attention block
    (layers/block.py) declines such a step, so its projections go through linear."""
    return _math[0] == _FAST and t >= prefill_gemm.MIN_T and prefill_gemm.enabled()


def prefill_dense(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x [..., K] @ bf16 w [N, K]^T goes to the bf16 matmul: fast math, and x's tokens at least
    the crossover of w's shape class (measured at its first use)."""
    N, K = w.shape
    t = x.numel() // K
    if w.dtype != torch.bfloat16 or not prefill_step(t):
        return False

    def probe():
        rows = w[: prefill_gemm.PROBE_ROWS]
        rows = rows.contiguous()
        spec = plain_spec(rows.unsqueeze(0))
        xs = {n: torch.randn(n, K) for n in prefill_gemm.PROBE_T}
        return (lambda n: _linear(xs[n], spec)), (lambda n: prefill_gemm.bf16_linear(xs[n], rows))

    return prefill_gemm.takes(t, "dense", "bf16", N, K, probe)


_UNIT_ROWS_OF = {code: rows_per_unit(code) for code in UNIT_ROWS}


def _linear(x: torch.Tensor, spec: tuple) -> torch.Tensor:
    """x [..., K] @ W^T through the kernel, for a weight of `spec` [N, K]."""
    code = spec[0]
    return extension().linear(x.contiguous(), spec, 0, SMALL_T[code], _UNIT_ROWS_OF[code], _math[0])


def projection(spec: tuple, bias: torch.Tensor | None = None) -> tuple:
    """A projection as the attention block reads it: (spec, bias, small_t, rows per unit)."""
    return (spec, bias, SMALL_T[spec[0]], _UNIT_ROWS_OF[spec[0]])


def attn_block(
    h: torch.Tensor,
    mlp: torch.Tensor | None,
    input_ln: torch.Tensor,
    post_ln: torch.Tensor,
    eps: float,
    qkv: tuple | list,
    o: tuple,
    router: tuple,
    attention: tuple,
    top_k: int,
    renorm: bool,
    moe: tuple | None = None,
) -> tuple:
    """A MoE layer's attention half in one call (csrc/decode_block.cpp), in the CPU math in effect:
    -> (s, h2, x2, logits, ids or None, weights or None, out or None). qkv / o / router: projection()
    (qkv: or a list of q's, k's and v's, their outputs joined by column); attention: the attention
    kernel's arguments after eps (cos, sin, caches, batch tensors, window, scale, sinks), preceded by
    the head norms (q_norm, k_norm); moe: moe_args() of a pool whose slot
    s holds expert s (then out: that layer's MoE output, once the top-k answered)."""
    q_norm, k_norm, *rest = attention
    return extension().attn_block(
        h, mlp, input_ln, post_ln, eps, qkv, o, router, _math[0], q_norm, k_norm, *rest, top_k, renorm, moe
    )


def attn_stack(
    h: torch.Tensor,
    mlp: torch.Tensor | None,
    layers: list,
    kv: list,
    step: tuple,
    eps: float,
    start: int,
    with_moe: bool,
) -> tuple:
    """Consecutive layers' attention blocks in one call from layer `start` (csrc/decode_block.cpp), each
    with its MoE inside, until a layer's MoE needs Python or the last layer -> (stop, sums, s, h2, x2,
    logits, ids, weights, out) of layer `stop`; sums: the residual sums s of the layers run. layers[i]:
    (input_ln, post_ln, qkv, o, router, q_norm, k_norm, window, scale, sinks, top_k, renorm, moe args);
    kv[i]: (k_cache, v_cache); step: the attention's per-step tensors (cos, sin, slot_mapping,
    block_tables, seq_of_token, positions)."""
    return extension().attn_stack(h, mlp, layers, kv, step, eps, _math[0], start, with_moe)


def _rows(spec: tuple, rows: slice) -> tuple:
    """The spec of some rows of a weight (gate or up out of a fused gate_up)."""
    code, data, scale, zero, n, k, g, bo = spec
    if bo > 1 and scale.shape[1] > 1:
        raise Unsupported("rows of a block-scaled fused gate_up")
    data = data[:, rows]
    scale = scale[:, rows] if scale is not None and scale.shape[1] > 1 else scale
    zero = zero[:, rows] if zero is not None else None
    return (code, data, scale, zero, data.shape[1], k, g, bo)


def quant_weight_spec(
    method, parts: dict[str, torch.Tensor], proj: str, shape: tuple[int, int]
) -> tuple | None:
    """The kernel spec of one weight [N, K] stored by QuantMethod `method` as `parts` {"<proj>.<suffix>":
    tensor}, or None when no kernel reads that format. Built once per weight: its tensors are views
    of the parts, so it stays valid while they do."""
    try:
        return quant_spec(method, {k: t.unsqueeze(0) for k, t in parts.items()}, proj, *shape)
    except Unsupported:
        return None


def quant_linear(x: torch.Tensor, spec: tuple | None) -> torch.Tensor | None:
    """x [..., K] float32 @ W^T for the weight of `spec` (quant_weight_spec), or None when the kernels
    do not apply (then the caller uses torch)."""
    return None if spec is None or not _usable(x) else _linear(x, spec)


def pool_primary(pool: dict[str, torch.Tensor], method, proj: str) -> torch.Tensor:
    """Projection `proj`'s primary tensor [S, rows, ...] of a quantized pool (its key may name its type:
    GGUF types per layer, "gate.q4_k")."""
    return pool[f"{proj}.{of_parts(method, pool, proj).primary}"]


def pool_specs(pool: dict[str, torch.Tensor], method, H: int, ffn=None) -> tuple:
    """(gate, up, down) specs of a pool for hidden size H and the experts' layout `ffn`
    (experts.compute.ExpertFFN; None = gate rows first, [out, in]); raises Unsupported."""
    interleaved = ffn is not None and ffn.interleaved
    if ffn is not None and ffn.transposed and method is None:
        raise Unsupported("plain weights stored [in, out]")
    fused = method is None or (ffn is not None and ffn.fused_quant)
    if fused:
        gu = (
            plain_spec(pool["gate_up"])
            if method is None
            else quant_spec(method, pool, "gate_up", pool_primary(pool, method, "gate_up").shape[1], H)
        )
        I = gu[4] // 2
        gate, up = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, I), slice(I, 2 * I))
        gate, up = _rows(gu, gate), _rows(gu, up)
    else:
        I = pool_primary(pool, method, "gate").shape[1]  # every format's primary tensor is [S, rows, ...]
        gate, up = quant_spec(method, pool, "gate", I, H), quant_spec(method, pool, "up", I, H)
    down = plain_spec(pool["down"]) if method is None else quant_spec(method, pool, "down", H, I)
    return gate, up, down


def _biases(pool: dict[str, torch.Tensor], interleaved: bool) -> list:
    gu, d = pool.get("gate_up_bias"), pool.get("down_bias")
    if gu is None:
        g = u = None
    else:
        I = gu.shape[1] // 2
        g, u = (gu[:, 0::2], gu[:, 1::2]) if interleaved else (gu[:, :I], gu[:, I:])
    return [None if b is None else b.float().contiguous() for b in (g, u, d)]


def _moe_args(pool: dict[str, torch.Tensor], method, H: int, ffn) -> tuple:
    """The kernel's arguments that depend on the pool alone: (gate, up, down specs, activation, alpha,
    limit, the three biases, small_t, rows per unit); raises Unsupported where the kernel does not apply."""
    if any(t.device.type != "cpu" for t in pool.values()):
        raise Unsupported("a pool off the CPU")
    act = "silu" if ffn is None else ffn.act
    if act not in ACTIVATIONS:
        raise Unsupported(f"activation {act}")
    gate, up, down = pool_specs(pool, method, H, ffn)
    alpha, limit = (1.0, float("inf")) if ffn is None else (ffn.alpha, ffn.limit)
    bias = _biases(pool, ffn is not None and ffn.interleaved)
    code = gate[0]
    return (gate, up, down, ACTIVATIONS[act], alpha, limit, *bias, SMALL_T[code], _UNIT_ROWS_OF[code])


def moe(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    method,
    out: torch.Tensor,
    ffn=None,
) -> bool:
    """out += the grouped expert FFN over pool slots (one call for the layer), for the experts' layout
    and activation `ffn` (experts.compute.ExpertFFN, None = SwiGLU); biases are the pool parts
    "gate_up_bias" [S, 2I] and "down_bias" [S, H]. False: not handled (a format, layout or dtype the
    kernels do not read); `out` is then untouched."""
    if out.dtype != torch.float32 or not out.is_contiguous():
        return False
    return moe_out(x, slots, weights, pool, method, ffn, out) is not None


def moe_args(pool: dict[str, torch.Tensor], method, H: int, ffn=None) -> tuple | None:
    """The MoE kernel's arguments for a pool (built once per pool), or None: no kernel reads it."""
    if extension() is None:
        return None
    return _cached_specs(
        list(pool.values()), (method, H, ffn, tuple(pool)), lambda: _moe_args(pool, method, H, ffn)
    )


def moe_out(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    pool: dict[str, torch.Tensor],
    method,
    ffn=None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """moe() into `out`, or into a zeroed output the kernel makes (out None) -> the output; None: not
    handled."""
    if not _usable(x):
        return None
    args = moe_args(pool, method, x.shape[1], ffn)
    if args is None:
        return None
    return extension().moe(x, slots, weights, *args[:9], out, *args[9:], _math[0])  # made contiguous there


__all__ = [
    "isa",
    "CpuIsa",
    "IsaDefaults",
    "prefill_dense",
    "prefill_gemm",
    "prefill_step",
    "kernel_name",
    "attn_block",
    "attn_stack",
    "backend",
    "dense_spec",
    "projection",
    "cpu_math",
    "cpu_math_unavailable",
    "cpu_threads",
    "CPU_MATHS",
    "dense_linear",
    "moe",
    "moe_args",
    "moe_out",
    "pool_primary",
    "pool_specs",
    "reads_stored",
    "dense_dtype",
    "quant_linear",
    "quant_weight_spec",
    "why",
    "Unsupported",
]
