"""Builds (once, cached) and loads the C++ kernels; says why when they cannot be used.

The extension is compiled by torch.utils.cpp_extension (ninja + the system C++ compiler) into
<cache root>/kernels/<hash of the source and flags>/ (expertcache/paths.py: $EXPERTCACHE_CACHE_DIR or
~/.cache/expertcache), so a changed source never loads a stale build. Those directories are created
0700 and, like the built `.so`, refused (the torch path computes instead, with a note saying why)
when another user owns them or group/others can write them: a shared cache could hold someone
else's code. Concurrent processes share one build: the build runs under an exclusive `flock` on
`build.lock` (released by the kernel when a builder dies, so nothing goes stale), and a finished
build (the `built` marker) loads without any lock. `make setup` runs `python -m expertcache.kernels`
once, so the first model load does not pay the compile.

EXPERTCACHE_KERNELS=torch skips the extension (the pure-torch path); anything else uses it when
it builds and the CPU has AVX2, FMA and F16C.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path

from ..paths import UnsafeDirectoryError, check_private, private_dir

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))  # one module: module.cpp calls each source's register_* (registry.h)
HEADERS = sorted(CSRC.glob("*.h"))  # thread_pool.h: the kernels' own threads (not OpenMP); registry.h
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-pthread"]

_state: dict = {}
_on_load: list = []  # called with the module once it loads (kernels/__init__.py: kernels.isa's switches)


def on_load(fn) -> None:
    """Call fn(module) when the extension loads (at once when it already has)."""
    _on_load.append(fn)
    if _state.get("mod") is not None:
        fn(_state["mod"])


def cache_dir() -> Path:
    from ..paths import cache_root

    base = cache_root()
    code = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    digest = hashlib.sha256(code + " ".join(FLAGS).encode()).hexdigest()[:16]
    return base / "kernels" / digest


def _compile():
    if os.environ.get("EXPERTCACHE_KERNELS", "").lower() == "torch":
        return None, "EXPERTCACHE_KERNELS=torch"
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the C++ kernels are written for x86-64 AVX2, this CPU is {platform.machine()}"
    out = cache_dir()
    try:
        private_dir(out, below=out.parent.parent)  # <cache root>/kernels/<hash>, each 0700 and ours
        mod = _load_checked(out)
    except UnsafeDirectoryError as e:
        return None, str(e)
    if mod is not None:
        return (mod, "") if mod.cpu_supported() else (None, "this CPU lacks AVX2/FMA/F16C")
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        return None, "no C++ compiler found (install g++ and run `make setup`)"
    try:
        from torch.utils import cpp_extension  # noqa: F401 - only whether it imports
    except ImportError as e:  # pragma: no cover - torch always ships it
        return None, f"torch.utils.cpp_extension unavailable ({e})"
    try:  # the `ninja` package's binary (a dependency), found even when the venv is not activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    try:
        with build_lock(out):
            mod = _load_checked(out)  # another process finished the build while this one waited
            if mod is None:
                mod = _build(out)
    except UnsafeDirectoryError as e:
        return None, str(e)
    except Exception as e:  # a failed build must not stop the engine: the torch path computes the same
        return (
            None,
            f"building the C++ kernels failed ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]})",
        )
    if not mod.cpu_supported():
        return None, "this CPU lacks AVX2/FMA/F16C"
    return mod, ""


BUILT = "built"  # written after a build loaded: the directory's .so is complete
LOCK = "build.lock"  # flock'ed while building


@contextlib.contextmanager
def build_lock(out: Path):
    """Hold an exclusive flock on out/build.lock (blocks while another process builds)."""
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _load_checked(out: Path):
    """_load_built, the built .so first checked (ours, not writable by others); a damaged build -> None."""
    so = out / "expertcache_kernels.so"
    if (out / BUILT).exists() and so.exists():
        check_private(so, "file")
    try:
        return _load_built(out)
    except Exception:  # noqa: BLE001 - a damaged build directory: build it again
        (out / BUILT).unlink(missing_ok=True)
        return None


def _load_built(out: Path):
    """The module of a finished build in `out`, imported directly: no ninja run and no build lock, so
    a checkout elsewhere with the same sources (the directory is named by their hash) and processes
    loading at once never rebuild or wait. None when `out` holds no finished build."""
    if not (out / BUILT).exists():
        return None
    import importlib.util

    import torch  # noqa: F401 - the extension links against libtorch

    spec = importlib.util.spec_from_file_location("expertcache_kernels", out / "expertcache_kernels.so")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(out: Path):
    """Compile into `out`; the caller holds build_lock(out), so no other process is building there."""
    from torch.utils import cpp_extension

    # torch's own build lock (out/lock) is left behind by a process killed while compiling, and would
    # make this build wait forever; under build_lock no other build is running, so any is stale
    (out / "lock").unlink(missing_ok=True)
    print(
        f"expertcache: building the C++ CPU kernels once into {out} (about a minute)",
        file=sys.stderr,
        flush=True,
    )
    mod = cpp_extension.load(
        name="expertcache_kernels",
        sources=[str(f) for f in SOURCES],
        extra_cflags=FLAGS,
        extra_ldflags=["-pthread"],
        build_directory=str(out),
        verbose=False,
    )
    (out / BUILT).touch()
    return mod


def extension():
    """The loaded extension module, or None (then `why()` says why; a note is printed once)."""
    if "mod" not in _state:
        mod, why = _compile()
        _state["mod"], _state["why"] = mod, why
        for fn in _on_load if mod is not None else ():
            fn(mod)
        if mod is None and why != "EXPERTCACHE_KERNELS=torch":
            print(f"expertcache: using the pure-torch expert kernels: {why}", file=sys.stderr)
    return _state["mod"]


def why() -> str:
    extension()
    return _state["why"]
