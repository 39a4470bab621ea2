"""The fused MoE's kernels compiled ahead of time for sm_80, sm_86, sm_89, sm_90 and sm_120 on this CPU
(kernels/triton_aot.py: triton.compile with a GPUTarget, the wheel's ptxas and cuobjdump), each
specialization enumerated from the code's own tables through fused_moe's own launch arguments: shared
memory and registers within each target's limits, fp8 decoded through the table (no fp8 conversion
instruction, so sm_80/86 run it). The representative set (every tile decoder x config x kernel, the
heaviest variant; the GGUF decoders too) runs here; every specialization (formats x configs x variants x
dtypes, about 1900 compiles, 375 per target, CPU hours cold) is `python -m expertcache.kernels.triton_aot`
(docs/gpu.md). Compiled kernels stay in Triton's cache, so a second run costs seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from expertcache.kernels import triton_aot  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HAS_PTXAS = (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()
pytestmark = pytest.mark.skipif(not HAS_PTXAS, reason="the triton wheel ships no ptxas here")


def compile_in_subprocess(tmp_path, *flags) -> tuple[list[dict], str]:
    """The CLI in a process of its own (no TRITON_INTERPRET: another test module may have set it here)."""
    out = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-m", "expertcache.kernels.triton_aot", "--json", str(out), *flags],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        cwd=ROOT,
    )
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


def check(results: list[dict], want_labels: set[str] | None = None) -> None:
    assert {r["cc"] for r in results} == set(triton_aot.TARGETS)
    for r in results:
        assert triton_aot.problems(r) == [], (r["cc"], r["kernel"], r["label"], triton_aot.problems(r))
    for cc in triton_aot.TARGETS:
        got = {(r["kernel"], r["label"]) for r in results if r["cc"] == cc}
        if want_labels is not None:
            assert {lab for _, lab in got} >= want_labels, (cc, want_labels - {lab for _, lab in got})
        # both configs and the three kernels for every tile decoder
        for fmt in set(triton_aot.FMT_OF.values()):
            for config in ("decode", "prefill"):
                for kernel in ("gate_up_kernel", "down_kernel"):
                    assert any(
                        k == kernel and triton_aot.FMT_OF[lab.split("/")[0]] == fmt and lab.endswith(config)
                        for k, lab in got
                    ), (cc, fmt, config, kernel)
        assert any(k == "reduce_kernel" for k, _ in got)
    fp8 = [r for r in results if r["label"].startswith("fp8")]
    assert fp8 and not any(r["fp8_cvt"] for r in fp8)  # the table path on every target, sm_80/86 included


def test_representative_specializations_compile_within_every_targets_limits(tmp_path):
    results, stdout = compile_in_subprocess(tmp_path, "--representative")
    check(results)
    for cc in triton_aot.TARGETS:
        assert f"triton_aot sm_{cc} kernels=" in stdout and f"sm_{cc} kernels=0 " not in stdout
    # the prefill tiles where shared memory is small take SMALL_SHARED's stages (three would not fit)
    small = [
        r
        for r in results
        if r["cc"] == 86 and r["label"].endswith("prefill") and r["kernel"] != "reduce_kernel"
    ]
    assert small and all(r["num_stages"] == 2 for r in small)


def test_the_enumeration_follows_the_code_tables():
    """Every slot format the kernels read, both configs and both family variants appear; each registered
    family's expert layout is one of the variants (interleaved/transposed gate_up as GPT-OSS's)."""
    from expertcache.kernels import triton_moe
    from expertcache.kernels.triton_pool import QUANT_FORMATS
    from expertcache.models import registry  # registers every family (models/families.py)

    assert set(triton_aot.FMT_OF) == set(QUANT_FORMATS)
    assert set(triton_moe.CONFIGS) == {"decode", "prefill"}
    for fam in registry.FAMILIES.values():
        names = fam.names
        v = triton_aot.VARIANTS["gpt-oss" if names.gate_up_interleaved else "swiglu"]
        assert v.interleaved == names.gate_up_interleaved, fam.name
        assert v.transposed == bool(getattr(names, "fused_transposed", False)), fam.name


def test_token_and_pair_counts_make_no_new_specialization(tmp_path):
    """do_not_specialize: calls of 1, 3 and 17 tokens (pairs 2, 6, 34; rows as many) bind to the same
    kernels (Triton would otherwise specialise 1 and multiples of 16 apart)."""
    code = r"""
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from expertcache.kernels import triton_aot as A, triton_moe as M
backend, binders, keys = make_backend(GPUTarget("cuda", 90, 32)), {}, []
pool, method, ffn = A._pool("bf16", A.VARIANTS["swiglu"], torch.bfloat16)
proj = M.projections(pool, method, ffn)
for T in (1, 3, 8, 17):
    slots = torch.arange(T * 2).remainder(2).view(T, 2)
    al = M.alignment_to(M.host_alignment(slots, 2, 64), "cpu")
    x = torch.zeros(T, A.SHAPE["H"], dtype=torch.bfloat16)
    launches = M.launches(x, pool, method, ffn, torch.zeros(T, 2), al, torch.zeros_like(x), M.CONFIGS["prefill"], proj)
    keys.append([A.spec_key(A.bind(k, a, c, o, backend, binders)) for k, _g, a, c, o in launches])
print(all(k == keys[0] for k in keys))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "True"
