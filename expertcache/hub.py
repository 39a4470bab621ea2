"""Model arguments as users write them: a directory, a Hugging Face hub id, or a hub-cache repo folder.

`resolve_model(spec, revision)` turns what a user typed into a checkpoint directory, the way the
Hugging Face tools find a model, without importing them:

1. an existing directory with config.json: itself; an existing `.gguf` file (llama.cpp's format, or
   the first file `-00001-of-0000N.gguf` of a split set): itself (gguf/ reads it);
2. an existing hub-cache repo folder (`models--ORG--NAME`, holding `refs/` and `snapshots/`):
   the snapshot `refs/<revision>` names (default `main`), or `snapshots/<revision>` for a commit;
3. `ORG/NAME` that is not an existing path: the same repo folder inside the hub cache, which is
   $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
   ~/.cache/huggingface/hub;
4. not in the cache: with download=True, huggingface_hub installed and $HF_HUB_OFFLINE unset, it
   is fetched (config, tokenizer and safetensors only) with `snapshot_download`; otherwise a
   CheckpointError gives the one command that fetches it.

Nothing is downloaded unless the caller passes download=True, which the CLI does only for the
model the user named. Every failure is a CheckpointError naming the argument and what was tried.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from .errors import CheckpointError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
PATTERNS = ("*.json", "*.safetensors", "*.jinja")  # what a checkpoint needs; no .bin/.pt/.gguf copies


def hub_cache_dir() -> Path:
    """The hub cache folder, as huggingface_hub computes it from the environment."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def fetch_command(repo_id: str, revision: str | None = None, installed: bool | None = None) -> str:
    if installed is None:
        installed = _hub_installed()
    rev = f" --revision {revision}" if revision else ""
    cmd = f"hf download {repo_id}{rev} --include " + " ".join(f"'{p}'" for p in PATTERNS)
    return cmd if installed else "pip install huggingface_hub && " + cmd


def _hub_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("huggingface_hub") is not None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _is_cache_repo(path: Path) -> bool:
    return (path / "snapshots").is_dir()


COMMIT = re.compile(r"[0-9a-f]{40}")
REVISION = re.compile(r"[\w.-]+(/[\w.-]+)*")  # a branch, tag, commit or refs/pr/N: no empty or absolute parts


def _check_revision(revision: str) -> str:
    """A revision must name something inside the repo's refs/ or snapshots/: no `..`, no absolute path."""
    if not REVISION.fullmatch(revision) or ".." in revision.split("/"):
        raise CheckpointError(
            f"--revision {revision!r} is not a branch, tag or commit name (letters, digits, "
            "'_', '-', '.' and '/' between parts; no '..'): it must stay inside the hub "
            "cache's refs/"
        )
    return revision


def _snapshot(repo: Path, revision: str | None, spec: str) -> Path | None:
    """The snapshot folder of a hub-cache repo for `revision`, None if that revision is not cached.
    The revision and what refs/<revision> holds are confined to the repo folder: a name with `..` or a
    ref that is not a commit hash is a CheckpointError, never a path elsewhere."""
    rev = _check_revision(revision or "main")
    ref = repo / "refs" / rev
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8", errors="replace").strip()
        if not COMMIT.fullmatch(commit):
            raise CheckpointError(
                f"model {spec}: {ref} holds {commit[:80]!r}, not a 40-hex commit hash (a damaged hub cache?)"
            )
    elif COMMIT.fullmatch(rev):
        commit = rev
    else:
        return None
    snap = repo / "snapshots" / commit
    return snap if snap.is_dir() else None


def _checked(path: Path, spec: str, hint: str = "") -> Path:
    if not (path / "config.json").is_file():
        raise CheckpointError(f"model {spec}: {path} has no config.json{hint}")
    return path


def resolve_model(
    spec: str | os.PathLike, revision: str | None = None, *, download: bool = False, progress: bool = True
) -> Path:
    """A checkpoint directory (or GGUF file) for `spec` (see the module docstring for the order)."""
    path = Path(spec).expanduser()
    text = str(spec)
    if path.exists():
        return _local_model(path, text, revision)
    if not HUB_ID.match(text):
        raise CheckpointError(f"model directory {text} does not exist")
    cache = hub_cache_dir()
    repo = cache / repo_folder(text)
    if repo.is_dir():
        snap = _snapshot(repo, revision, text)
        if snap is not None:
            return _checked(snap, text, f" (an interrupted download? rerun: {fetch_command(text, revision)})")
    installed = _hub_installed()
    where = f"{text} is neither a directory nor in the Hugging Face cache {cache}"
    if revision:
        where += f" at revision {revision}"
    if not download or not installed or _offline():
        why = "" if download or not installed else " (this command does not download)"
        if download and installed:
            why = " (HF_HUB_OFFLINE is set)"
        raise CheckpointError(
            f"model {where}{why}; fetch it with: {fetch_command(text, revision, installed)}"
        )
    return _download(text, revision, cache, where, progress)


def _local_model(path: Path, text: str, revision: str | None) -> Path:
    """An existing path: a checkpoint directory, a hub-cache repo folder or a GGUF file."""
    if path.is_dir():
        if _is_cache_repo(path) and not (path / "config.json").is_file():
            snap = _snapshot(path, revision, text)
            if snap is None:
                raise CheckpointError(
                    f"model {text}: revision {revision or 'main'} is not in this hub-cache "
                    f"folder (refs: {sorted(p.name for p in (path / 'refs').glob('*'))})"
                )
            return _checked(snap, text, " (an interrupted download?)")
        if revision:
            raise CheckpointError(
                f"--revision {revision}: {text} is a plain directory, not a hub id or "
                f"hub-cache folder, so it has no revisions"
            )
        return _checked(path, text)
    if path.is_file() and path.suffix == ".gguf":  # a GGUF file (the first of a split set): gguf/reader.py
        if revision:
            raise CheckpointError(f"--revision {revision}: {text} is a GGUF file, so it has no revisions")
        return path
    raise CheckpointError(f"model directory {text} is not a directory (nor a .gguf file)")


def _download(text: str, revision: str | None, cache: Path, where: str, progress: bool) -> Path:
    """Fetch hub id `text` into the hub cache with huggingface_hub (installed, not offline)."""
    from huggingface_hub import snapshot_download

    if progress:
        print(
            f"expertcache: {text} is not in {cache}; downloading it (config, tokenizer, safetensors)",
            file=sys.stderr,
            flush=True,
        )
    try:
        local = snapshot_download(
            text, revision=revision, allow_patterns=list(PATTERNS), cache_dir=str(cache)
        )
    except Exception as e:  # network, auth, missing repo: all reported the same way
        raise CheckpointError(
            f"model {where}, and downloading it failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); fetch it with: "
            f"{fetch_command(text, revision, True)}"
        ) from e
    return _checked(Path(local), text)
