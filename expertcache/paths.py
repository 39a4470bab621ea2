"""Where the project caches what it builds (the demo checkpoint, the compiled C++ kernels), and the
checks a directory must pass before code or data is loaded from it."""

from __future__ import annotations

import os
import pathlib
import stat

from .errors import ConfigError


def cache_root() -> pathlib.Path:
    """$EXPERTCACHE_CACHE_DIR, else $XDG_CACHE_HOME/expertcache, else ~/.cache/expertcache."""
    if os.environ.get("EXPERTCACHE_CACHE_DIR"):
        return pathlib.Path(os.environ["EXPERTCACHE_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "expertcache"


class UnsafeDirectoryError(ConfigError):
    """A cache directory another user could write into (its contents could be someone else's code)."""


def private_dir(path: pathlib.Path, below: pathlib.Path | None = None) -> pathlib.Path:
    """Create `path` (and its missing parents up to `below`) with mode 0700, then check `path` and every
    directory from `below` down to it: a real directory (not a symlink), owned by this user, not
    writable by group or others. -> path; raises UnsafeDirectoryError naming the directory and why."""
    path = pathlib.Path(path)
    below = pathlib.Path(below) if below is not None else path
    chain = [path] + [p for p in path.parents if below in (p, *p.parents)]
    below.parent.mkdir(parents=True, exist_ok=True)  # above the cache: ordinary directories
    for d in reversed(chain):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        check_private(d)
    return path


def check_private(path: pathlib.Path, kind: str = "directory") -> None:
    """Refuse `path` unless it is owned by this user and not writable by group or others (a directory:
    also not a symlink)."""
    st = os.lstat(path)
    if kind == "directory" and not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectoryError(
            f"cache directory {path} is not a directory (a symlink or a file); "
            "remove it or set EXPERTCACHE_CACHE_DIR to a directory of your own"
        )
    if st.st_uid != os.getuid():
        raise UnsafeDirectoryError(
            f"cache {kind} {path} is owned by user id {st.st_uid}, not by this user "
            f"({os.getuid()}): refusing to load from it; set EXPERTCACHE_CACHE_DIR "
            "to a directory of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectoryError(
            f"cache {kind} {path} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): refusing to load from it; "
            f"chmod go-w {path}"
        )
