"""Every fused-MoE kernel specialization the engine can launch, compiled ahead of time for real GPU targets
without a GPU (triton.compile with a GPUTarget: PTX and a cubin from the wheel's ptxas), and its resources
checked against each target's limits.

    python -m expertcache.kernels.triton_aot [--targets 80 86 89 90 120] [--jobs N] [--json FILE]

What is enumerated comes from the code's own tables: the slot formats (triton_pool.QUANT_FORMATS), the
launch configurations (triton_moe.CONFIGS), the family variants (VARIANTS: SwiGLU without biases, the
GPT-OSS expert: clamped SwiGLU, interleaved gate_up, biases, transposed plain parts or fused quantized
ones) and the activation dtypes the engine runs with (DTYPES). For each, a small pool of that format is
packed with the project's QuantMethod (GGUF's block types: zero bytes in their layout; a gguf-mixed pool
compiles the same kernels, one FMT each for gate_up and down), and `triton_moe.launches` (what fused_moe
launches) gives each kernel's arguments; Triton's own binder turns them into the signature, constexprs and attributes a
launch would compile (dtypes, 16-byte alignment, integers equal to 1 or divisible by 16), deduplicated.
Compiled kernels land in Triton's cache (TRITON_CACHE_DIR), so a second run costs little.

Checked per target (TARGETS): shared memory (metadata.shared) within the per-block limit, registers per
thread (the cubin's, read with the wheel's cuobjdump) within 255 and within the SM's register file for
the block's threads; fp8 weights decode through the table (no fp8 conversion instruction in the PTX) on
every target, so targets without fp8 units (sm_80, sm_86) run them.
Runs with TRITON_INTERPRET unset (the kernels must be JIT functions): the CLI and `compile_all` start
worker processes with it removed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

# cc -> (what it is, shared memory per block with opt-in, registers per SM)
TARGETS = {
    80: ("A100", 166912, 65536),
    86: ("RTX 30 / A10 / A40", 101376, 65536),
    89: ("RTX 40 / L4 / L40", 101376, 65536),
    90: ("H100 / H200", 232448, 65536),
    120: ("RTX 50", 101376, 65536),
}
MAX_REGS_PER_THREAD = 255
FP8_UNITS = 89  # first compute capability with fp8 conversion instructions
DTYPES = ("bfloat16", "float16", "float32")  # the engine's activation dtypes on CUDA
SHAPE = dict(S=2, H=256, I=256, K=2)  # a representative layer: every width a multiple of 128


class Variant(NamedTuple):
    act: str
    interleaved: bool
    transposed: bool  # plain parts stored [in, out]
    fused_quant: bool  # quantized gate_up as one part
    bias: bool


class FFN(NamedTuple):
    """What the kernels read of an experts.compute.ExpertFFN (that module sits above this layer)."""

    act: str
    interleaved: bool
    transposed: bool
    fused_quant: bool
    alpha: float
    limit: float


VARIANTS = {
    "swiglu": Variant("silu", False, False, False, False),
    "gpt-oss": Variant("clamped_swiglu", True, True, True, True),
}


class Spec(NamedTuple):
    """One kernel specialization: what triton.compile needs (picklable), and where it comes from."""

    kernel: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    label: str


def _jit(name: str):
    from . import triton_moe_jit

    fn = getattr(triton_moe_jit, name)
    if type(fn).__name__ != "JITFunction":
        raise RuntimeError(
            f"triton_aot: {name} is a {type(fn).__name__} (TRITON_INTERPRET is set?); "
            "compile ahead of time in a process without the interpreter"
        )
    return fn


_PACKED: dict = {}


def _pool(fmt: str, variant: Variant, dtype):
    """A pool of `fmt` for `variant` (CPU tensors) -> (pool, QuantMethod or None, ExpertFFN); None for
    plain experts in another dtype than the activations (the engine holds them in that dtype)."""
    import torch

    from ..quant.method import make_quant_method

    S, H, I = SHAPE["S"], SHAPE["H"], SHAPE["I"]
    g = torch.Generator().manual_seed(0)
    plain = fmt in ("bf16", "fp16", "fp32")
    ffn = FFN(
        act=variant.act,
        interleaved=variant.interleaved,
        transposed=variant.transposed and plain,
        fused_quant=variant.fused_quant and not plain,
        alpha=1.702,
        limit=7.0,
    )
    if plain:
        wdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[fmt]
        if wdt != dtype:
            return None  # plain experts are held in the activation dtype
        gu, dn = torch.randn(S, 2 * I, H, generator=g), torch.randn(S, H, I, generator=g)
        if ffn.transposed:
            gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
        pool, method = {"gate_up": gu.to(wdt), "down": dn.to(wdt)}, None
    else:  # packed once per format and layout (the activation dtype does not change the stored bytes)
        method = make_quant_method(fmt)
        key = (fmt, ffn.fused_quant)
        if key not in _PACKED:
            shapes = {"down": (H, I)} | (
                {"gate_up": (2 * I, H)} if ffn.fused_quant else {"gate": (I, H), "up": (I, H)}
            )
            if fmt.startswith("gguf-"):  # the file's blocks: their layout, zeros (values compile nothing)
                parts = {
                    k: torch.zeros(t.shape, dtype=t.dtype)
                    for p, sh in shapes.items()
                    for k, t in method.layout(p, sh).items()
                }
            else:
                parts = method.pack(
                    {f"{p}.weight": torch.randn(*sh, generator=g) for p, sh in shapes.items()}
                )
            _PACKED[key] = {n: torch.stack([t] * S) for n, t in parts.items()}
        pool = dict(_PACKED[key])
    if variant.bias:
        pool["gate_up_bias"] = torch.randn(S, 2 * I, generator=g).to(dtype)
        pool["down_bias"] = torch.randn(S, H, generator=g).to(dtype)
    return pool, method, ffn


def specializations(target_cc: int, dtypes=DTYPES) -> list[Spec]:
    """Every distinct specialization fused_moe launches, over formats x configs x variants x `dtypes`, as
    Triton's binder makes it for compute capability `target_cc`."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from . import triton_moe
    from .triton_pool import QUANT_FORMATS

    backend = make_backend(GPUTarget("cuda", target_cc, 32))
    binders, out, seen = {}, [], set()
    S, H, K = SHAPE["S"], SHAPE["H"], SHAPE["K"]
    for fmt in QUANT_FORMATS:
        for vname, variant in VARIANTS.items():
            for dname in dtypes:
                dtype = getattr(torch, dname)
                made = _pool(fmt, variant, dtype)
                if made is None:
                    continue
                pool, method, ffn = made
                try:
                    proj = triton_moe.projections(pool, method, ffn)
                except ValueError:  # a layout the kernels refuse by name (the torch code computes it)
                    continue
                for cname in triton_moe.CONFIGS:
                    T = 1 if cname == "decode" else triton_moe.DECODE_PAIRS_PER_SLOT * S // K + 1
                    if triton_moe.config_name(T * K, S) != cname:
                        raise AssertionError(f"triton_aot: {T} tokens do not pick the {cname} config")
                    # what that device gets (a float32 dot: x in float32)
                    cfg = triton_moe.pick_config(T * K, S, TARGETS[target_cc][1], dtype == torch.float32)
                    slots = torch.arange(T * K).remainder(S).view(T, K)
                    al = triton_moe.alignment_to(triton_moe.host_alignment(slots, S, cfg["block_m"]), "cpu")
                    x = torch.zeros(T, H, dtype=dtype)
                    w = torch.zeros(T, K)
                    out_t = torch.zeros_like(x)
                    for kernel, _grid, args, consts, opts in triton_moe.launches(
                        x, pool, method, ffn, w, al, out_t, cfg, proj
                    ):
                        spec = bind(
                            kernel, args, consts, opts, backend, binders, f"{fmt}/{vname}/{dname}/{cname}"
                        )
                        if spec_key(spec) not in seen:
                            seen.add(spec_key(spec))
                            out.append(spec)
    return out


def bind(kernel, args, consts, opts, backend, binders: dict, label: str = "") -> Spec:
    """What a launch of `kernel` with these arguments compiles for `backend`'s target: Triton's own binder
    (types, 16-byte alignment, integers equal to 1 or divisible by 16; do_not_specialize honoured)."""
    from triton.runtime.jit import create_function_from_signature

    name = kernel.__name__
    if name not in binders:
        binders[name] = create_function_from_signature(kernel.signature, kernel.params, backend)
    kw = dict(consts, **opts)
    bound, spec, options = binders[name](*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, spec, options)
    return Spec(name, signature, constexprs, attrs, dict(opts), label)


def spec_key(s: Spec) -> tuple:
    """Two launches compile the same kernel iff their keys are equal."""
    return (
        s.kernel,
        repr(s.signature),
        repr(sorted(s.constexprs.items())),
        repr(sorted(s.attrs.items())),
        repr(sorted(s.options.items())),
    )


FMT_OF = {
    "bf16": "float",
    "fp16": "float",
    "fp32": "float",
    "fp8": "fp8",
    "fp8-channel": "fp8",
    "fp8-tensor": "fp8",
    "int8": "int8",
    "int4": "int4",
    "mxfp4": "mxfp4",
    "gguf-q8_0": "q8_0",
    "gguf-q4_0": "q4_0",
    "gguf-q5_0": "q5_0",
    "gguf-iq4_nl": "iq4_nl",
    "gguf-mxfp4": "gguf-mxfp4",
    "gguf-q4_k": "q4_k",
    "gguf-q5_k": "q5_k",
    "gguf-q6_k": "q6_k",
    "gguf-iq4_xs": "iq4_xs",
}  # the tile decoder (constexpr FMT) of each format


def representative(specs: list[Spec]) -> list[Spec]:
    """The specializations that bound the rest: per tile decoder, config, kernel and activation dtype
    (bf16, and float32: its float32 dot needs the most shared memory), the one with the most code (the
    GPT-OSS variant: biases and the clamped activation); and the reduction."""
    out, seen = [], set()
    for s in sorted(specs, key=lambda s: "gpt-oss" not in s.label):
        fmt, _variant, dtype, config = s.label.split("/")
        if s.kernel == "reduce_kernel":
            key = (s.kernel,)
        elif (dtype == "bfloat16" and fmt != "fp32") or (dtype == "float32" and fmt not in ("bf16", "fp16")):
            key = (s.kernel, FMT_OF[fmt], dtype, config)
        else:
            continue
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def _resources(cubin: bytes) -> dict:
    """REG, SHARED (static), LOCAL (spills) of the cubin's one function, from cuobjdump -res-usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    line = next(x for x in text.splitlines() if "REG:" in x)
    return {
        k: int(v)
        for k, v in (kv.split(":")[:2] for kv in line.split() if ":" in kv and kv.split(":")[1].isdigit())
    }


def compile_one(spec: Spec, cc: int) -> dict:
    """Compile `spec` for sm_`cc` -> its resources and the checks' inputs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t = time.monotonic()
    src = ASTSource(_jit(spec.kernel), spec.signature, spec.constexprs, spec.attrs)
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=spec.options)
    res = _resources(k.asm["cubin"])
    ptx = k.asm["ptx"]
    return {
        "kernel": spec.kernel,
        "label": spec.label,
        "cc": cc,
        "shared": int(k.metadata.shared),
        "static_shared": res.get("SHARED", 0),
        "regs": res["REG"],
        "local": res.get("LOCAL", 0),
        "num_warps": int(k.metadata.num_warps),
        "num_stages": int(k.metadata.num_stages),
        "fp8_cvt": "e4m3" in ptx,
        "seconds": round(time.monotonic() - t, 3),
    }


def _work(args) -> list[dict]:
    cc, specs = args
    return [compile_one(s, cc) for s in specs]


def problems(r: dict) -> list[str]:
    """What in a compiled kernel would fail or misbehave on its target (empty: nothing)."""
    _, shared_max, regfile = TARGETS[r["cc"]]
    threads = 32 * r["num_warps"]
    out = []
    if r["shared"] + r["static_shared"] > shared_max:
        out.append(f"shared memory {r['shared'] + r['static_shared']} B > {shared_max} B per block")
    if r["regs"] > MAX_REGS_PER_THREAD or r["regs"] * threads > regfile:
        out.append(
            f"{r['regs']} registers x {threads} threads > the limits ({MAX_REGS_PER_THREAD}/thread, {regfile}/SM)"
        )
    if r["fp8_cvt"]:
        out.append(
            "an fp8 conversion instruction in the PTX" + (" (no fp8 units)" if r["cc"] < FP8_UNITS else "")
        )
    return out


def compile_all(
    targets=tuple(TARGETS), jobs: int | None = None, dtypes=DTYPES, subset: bool = False
) -> list[dict]:
    """Enumerate and compile every specialization (`subset`: the representative ones) for every target,
    `jobs` processes at a time (each started without TRITON_INTERPRET)."""
    os.environ.pop("TRITON_INTERPRET", None)
    import multiprocessing as mp

    jobs = jobs or os.cpu_count() or 1
    work = []
    for cc in targets:
        specs = specializations(cc, dtypes)
        if subset:
            specs = representative(specs)
        n = max(1, -(-len(specs) // jobs))
        work += [(cc, specs[i : i + n]) for i in range(0, len(specs), n)]
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        return [r for rs in ex.map(_work, work) for r in rs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="*", type=int, default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--json", default=None, help="write every compiled kernel's figures here")
    ap.add_argument(
        "--representative", action="store_true", help="only the specializations that bound the rest"
    )
    args = ap.parse_args(argv)
    t = time.monotonic()
    results = compile_all(args.targets, args.jobs, args.dtypes, args.representative)
    bad = 0
    for cc in args.targets:
        rs = [r for r in results if r["cc"] == cc]
        worst = {k: max(r[k] for r in rs) for k in ("shared", "regs", "local")}
        errs = [(r, p) for r in rs for p in problems(r)]
        bad += len(errs)
        print(
            f"triton_aot sm_{cc} kernels={len(rs)} max_shared={worst['shared']} max_regs={worst['regs']} "
            f"max_spill_bytes={worst['local']} problems={len(errs)}"
        )
        for r, p in errs:
            print(f"triton_aot sm_{cc} {r['kernel']} {r['label']}: {p}")
    print(f"triton_aot seconds={time.monotonic() - t:.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
