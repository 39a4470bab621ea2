"""The C++ kernels' ISA switches are chosen on the Python side (kernels.isa, a CpuIsa whose defaults come
from EXPERTCACHE_CPU_ISA) and handed to the extension when it loads (build.on_load); the C++ reads no
environment. Each case runs in a fresh interpreter: the switches are set once per process at load."""

from __future__ import annotations

import os
import subprocess
import sys

from expertcache import kernels


def _run(code: str, isa: str) -> list[str]:
    env = {**os.environ, "EXPERTCACHE_CPU_ISA": isa}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_extension_ignores_the_environment():
    """Loaded without the Python side's hook, the extension starts with every switch allowed whatever
    EXPERTCACHE_CPU_ISA says."""
    code = (
        "from expertcache.kernels import build; build._on_load.clear(); e = build.extension(); "
        "print(e.get_avx512(), e.get_strip_tokens(), e.get_amx() == e.amx_supported())"
    )
    assert _run(code, "avx2") == ["True", "4", "True"]


def test_the_config_object_decides_at_load():
    """kernels.isa's defaults are what the loaded extension starts with: set in code, the environment
    unset; from the environment (avx2: no AVX-512 4-bit kernels, no AMX)."""
    code = (
        "from expertcache import kernels; "
        "kernels.isa.defaults = kernels.IsaDefaults(avx512=False, amx=False, strip_tokens=0); "
        "e = kernels.extension(); print(e.get_avx512(), e.get_strip_tokens(), e.get_amx())"
    )
    assert _run(code, "") == ["False", "0", "False"]
    code = "from expertcache import kernels; e = kernels.extension(); print(e.get_avx512(), e.get_amx())"
    assert _run(code, "avx2") == ["False", "False"]
    assert kernels.backend() == "cpp"  # the cases above ran the C++ kernels, not the torch fallback


def test_a_hook_added_after_the_load_runs_at_once():
    seen = []
    kernels.extension()
    kernels.build.on_load(seen.append)
    try:
        assert seen == [kernels.extension()]
    finally:
        kernels.build._on_load.remove(seen.append)
