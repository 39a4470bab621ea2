"""Where the project caches what it builds (the demo checkpoint, the compiled C++ kernels)."""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """$EXPERTCACHE_CACHE_DIR, else $XDG_CACHE_HOME/expertcache, else ~/.cache/expertcache."""
    if os.environ.get("EXPERTCACHE_CACHE_DIR"):
        return pathlib.Path(os.environ["EXPERTCACHE_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "expertcache"
