"""Writing safetensors files with ordinary permissions.

safetensors' `save_file` creates files 0600; a checkpoint others on the machine (or a server user)
read should be 0644 like every other file we write, i.e. 0666 less the process umask.
"""

from __future__ import annotations

import os

from safetensors.torch import save_file


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())
