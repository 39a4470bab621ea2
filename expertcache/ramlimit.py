"""How much RAM this process may still take: the kernel's MemAvailable, or less inside a memory cgroup.

A container (Docker `--memory`, Kubernetes limits, systemd `MemoryMax=`) puts the process in a memory
cgroup whose limit is often far below the machine's RAM; /proc/meminfo still reports the machine's.
An `auto` budget taken from MemAvailable alone would then plan for RAM the process cannot have, and the
kernel kills it mid-run. `available()` is the smaller of MemAvailable and the room left under every
memory cgroup limit on the way from this process's cgroup to the root:

    cgroup v2 (/sys/fs/cgroup/<path>/memory.max, memory.current, memory.stat `inactive_file`)
    cgroup v1 (/sys/fs/cgroup/memory/<path>/memory.limit_in_bytes, memory.usage_in_bytes,
               memory.stat `total_inactive_file`)

    room = limit - (usage - inactive file pages)

Inactive file pages (page cache nobody touched lately) are what the kernel reclaims first under the
limit, so they count as room. No limit set ("max", or v1's huge sentinel) imposes nothing.

    available() -> (bytes, why): why names the source ("MemAvailable" or the cgroup and its limit).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path("/sys/fs/cgroup")  # tests point it at a fake tree
PROC_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")
FALLBACK = 8 << 30  # no /proc/meminfo (not Linux): a guess, said as such
NO_LIMIT = 1 << 60  # v1 reports "no limit" as ~2^63 rounded to the page size


def mem_available() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def _paths() -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) of this process's cgroup, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(base: Path, path: str) -> list[Path]:
    """base/path, then each parent up to base itself."""
    rel = Path(path.lstrip("/"))
    out = [base / rel]
    while rel != Path("."):
        rel = rel.parent
        out.append(base / rel)
    return out


def cgroup_room() -> tuple[int, str] | None:
    """The least room left under any memory cgroup limit above this process, and which; None if none."""
    v2, v1 = _paths()
    best: tuple[int, str] | None = None
    candidates = []
    if v1 is not None:
        for d in _ancestors(ROOT / "memory", v1):
            candidates.append((d, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    if v2 is not None and (ROOT / "cgroup.controllers").exists():
        for d in _ancestors(ROOT, v2):
            candidates.append((d, "memory.max", "memory.current", "inactive_file"))
    for d, lim_name, use_name, inactive in candidates:
        limit = _int(d / lim_name)
        if limit is None or limit >= NO_LIMIT:
            continue
        usage = _int(d / use_name) or 0
        room = max(0, limit - max(0, usage - _stat(d / "memory.stat", inactive)))
        if best is None or room < best[0]:
            best = (room, f"memory cgroup {d} (limit {limit} B, {limit - room} B in use)")
    return best


def available() -> tuple[int, str]:
    """(bytes this process may still take, where that figure comes from)."""
    avail = mem_available()
    room = cgroup_room()
    if room is not None and (avail is None or room[0] < avail):
        return room
    if avail is None:
        return FALLBACK, f"no /proc/meminfo: assumed {FALLBACK} B"
    return avail, "MemAvailable"
