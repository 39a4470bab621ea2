"""Writing safetensors files with ordinary permissions.

safetensors' `save_file` creates files 0600; a checkpoint others on the machine (or a server user)
read should be 0644 like every other file we write, i.e. 0666 less the process umask. The umask is
read from /proc/self/status (Linux), else from the mode the kernel gives a probe file created 0666:
never by setting it, because `os.umask` is process-wide and another thread creating a file in
between would get the wrong mode.
"""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import save_file


def current_umask(probe_dir: str | os.PathLike = ".") -> int:
    """The process umask, without changing it (where /proc is absent: its read/write bits, from a probe
    file created 0666 in `probe_dir`)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    probe = Path(probe_dir) / f".umask-probe-{os.getpid()}-{id(probe_dir)}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return 0o666 & ~os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()


def write_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask(Path(path).parent))
