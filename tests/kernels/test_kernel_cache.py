"""The compiled-kernel cache: private directories, refused when another user could have written them,
and one build at a time under a real file lock (no stale-lock guess)."""

from __future__ import annotations

import fcntl
import os
import stat
import types

import pytest

from expertcache import paths
from expertcache.kernels import build


def _mode(p):
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_cache_directories_are_created_private(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTCACHE_CACHE_DIR", str(tmp_path / "a" / "cache"))
    out = build.cache_dir()
    paths.private_dir(out, below=out.parent.parent)
    for d in (out, out.parent, out.parent.parent):
        assert d.is_dir() and _mode(d) == 0o700 and os.lstat(d).st_uid == os.getuid(), d


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_group_or_world_writable_cache_is_refused(tmp_path, monkeypatch, mode):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(mode)
    monkeypatch.setenv("EXPERTCACHE_CACHE_DIR", str(root))
    monkeypatch.setattr(build, "_load_built", lambda out: pytest.fail("loaded from an unsafe directory"))
    mod, why = build._compile()
    assert mod is None and str(root) in why and "writable by group or others" in why and f"{mode:04o}" in why


def test_cache_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(root, 65534, 65534)  # nobody
    else:
        monkeypatch.setattr(paths.os, "getuid", lambda: os.getuid() + 1)
    monkeypatch.setenv("EXPERTCACHE_CACHE_DIR", str(root))
    monkeypatch.setattr(build, "_load_built", lambda out: pytest.fail("loaded from another user's directory"))
    mod, why = build._compile()
    assert mod is None and str(root) in why and "owned by user id" in why


def test_symlinked_cache_directory_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(paths.UnsafeDirectoryError, match="is not a directory"):
        paths.private_dir(tmp_path / "link")


def test_writable_built_module_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTCACHE_CACHE_DIR", str(tmp_path / "cache"))
    out = paths.private_dir(build.cache_dir(), below=tmp_path / "cache")
    so = out / "expertcache_kernels.so"
    so.write_bytes(b"not a module")
    so.chmod(0o666)
    (out / build.BUILT).touch()
    monkeypatch.setattr(build, "_load_built", lambda out: pytest.fail("imported a world-writable .so"))
    mod, why = build._compile()
    assert mod is None and str(so) in why and "writable by group or others" in why


def test_build_runs_under_an_exclusive_flock_and_drops_torchs_stale_lock(tmp_path, monkeypatch):
    """A build holds build.lock (another process's flock on it would block) and removes torch's own
    baton left by a killed builder; the finished build is marked and then loaded."""
    monkeypatch.setenv("EXPERTCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EXPERTCACHE_KERNELS", raising=False)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    out = paths.private_dir(build.cache_dir(), below=tmp_path / "cache")
    (out / "lock").touch()  # torch's FileBaton of a builder killed mid-compile
    seen = {}

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        fd = os.open(os.path.join(build_directory, build.LOCK), os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):  # held by the builder
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        seen["stale lock left"] = os.path.exists(os.path.join(build_directory, "lock"))
        return types.SimpleNamespace(cpu_supported=lambda: True)

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(build.shutil, "which", lambda name: "/usr/bin/" + name)
    mod, why = build._compile()
    assert why == "" and mod.cpu_supported() and seen == {"stale lock left": False}
    assert (out / build.BUILT).exists()
    fd = os.open(out / build.LOCK, os.O_RDWR)  # released after the build
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_waiting_builder_loads_the_build_another_process_finished(tmp_path, monkeypatch):
    """The build lock is taken, then the directory looked at again: a build finished meanwhile loads."""
    monkeypatch.setenv("EXPERTCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EXPERTCACHE_KERNELS", raising=False)
    paths.private_dir(build.cache_dir(), below=tmp_path / "cache")
    calls = []
    finished = types.SimpleNamespace(cpu_supported=lambda: True)

    def load_built(o):
        calls.append("load")
        return None if len(calls) == 1 else finished  # finished by the time the lock is held

    monkeypatch.setattr(build, "_load_built", load_built)
    monkeypatch.setattr(build, "_build", lambda o: pytest.fail("built again"))
    monkeypatch.setattr(build.shutil, "which", lambda name: "/usr/bin/" + name)
    mod, why = build._compile()
    assert mod is finished and why == "" and calls == ["load", "load"]
