"""Byte sizes for command lines: "512MiB", "16GiB", "1.5GB", "4096", "64k".

Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB,
GB, TB) powers of 1000; a bare K/M/G/T (any case, optional trailing B omitted)
is binary. Result is an int number of bytes (rounded down); ValueError otherwise.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1,
          "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
          "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
          "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}
_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"byte size must be >= 0, got {text}")
        return text
    m = _RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"invalid byte size {text!r}; use e.g. 512MiB, 16GiB, 1.5GB or a plain number")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
