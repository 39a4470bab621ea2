"""Model ids as users write them: hub ids found in a Hugging Face cache laid out as huggingface_hub
lays it out (blobs + symlinked snapshots + refs), hub-cache folders, --revision, and the download
path (a stand-in huggingface_hub, never the network)."""

from __future__ import annotations

import hashlib
import os
import sys
import types
from pathlib import Path

import pytest

from expertcache import hub
from expertcache.cli import main
from expertcache.errors import CheckpointError


def add_snapshot(cache: Path, repo_id: str, src: Path, commit: str, refs=("main",)) -> Path:
    """Copy checkpoint `src` into cache/models--ORG--NAME as a symlinked snapshot `commit`."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    for r in refs:
        (repo / "refs" / r).write_text(commit)  # huggingface_hub writes the hash without a newline
    return snap


C1, C2 = "1" * 40, "2" * 40


@pytest.fixture
def fake_cache(tmp_path, monkeypatch, qwen3_checkpoint):
    cache = tmp_path / "hub"
    s1 = add_snapshot(cache, "acme/tiny-moe", qwen3_checkpoint, C1, refs=("main",))
    s2 = add_snapshot(cache, "acme/tiny-moe", qwen3_checkpoint, C2, refs=("v2",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: nothing here may reach the network
    return cache, s1, s2


def test_hub_id_resolves_from_the_cache(fake_cache):
    cache, s1, s2 = fake_cache
    assert hub.resolve_model("acme/tiny-moe") == s1
    assert (s1 / "config.json").is_symlink()
    assert hub.resolve_model("acme/tiny-moe", "v2") == s2  # a ref
    assert hub.resolve_model("acme/tiny-moe", C2) == s2  # a commit
    repo = cache / "models--acme--tiny-moe"
    assert hub.resolve_model(repo) == s1  # the repo folder of the cache
    assert hub.resolve_model(repo, "v2") == s2
    assert hub.resolve_model(s1) == s1  # a plain directory is itself
    with pytest.raises(CheckpointError, match="revision nope"):
        hub.resolve_model(repo, "nope")
    with pytest.raises(CheckpointError, match="--revision v2: .* plain directory"):
        hub.resolve_model(s1, "v2")


def test_cache_location_follows_the_environment(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub.hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert hub.hub_cache_dir() == tmp_path / "hfhome" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub.hub_cache_dir() == tmp_path / "c"


def test_missing_model_prints_the_fetch_command(fake_cache, monkeypatch, tmp_path):
    with pytest.raises(CheckpointError, match=r"fetch it with: hf download acme/other --include"):
        hub.resolve_model("acme/other", download=False)
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE"):
        hub.resolve_model("acme/other", download=True)
    monkeypatch.setattr(hub, "_hub_installed", lambda: False)
    with pytest.raises(
        CheckpointError, match=r"pip install huggingface_hub && hf download acme/other --revision r1"
    ):
        hub.resolve_model("acme/other", "r1", download=True)
    with pytest.raises(CheckpointError, match="model directory ./nowhere does not exist"):
        hub.resolve_model("./nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        hub.resolve_model(tmp_path / "file")


def test_download_through_huggingface_hub_when_asked(fake_cache, monkeypatch, qwen3_checkpoint):
    cache, _, _ = fake_cache
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, cache_dir=None):
        calls.append((repo_id, revision, tuple(allow_patterns), cache_dir))
        return str(add_snapshot(Path(cache_dir), repo_id, qwen3_checkpoint, C1))

    monkeypatch.setitem(
        sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download)
    )
    monkeypatch.setattr(hub, "_hub_installed", lambda: True)
    with pytest.raises(CheckpointError, match="fetch it with"):  # not asked: nothing downloaded
        hub.resolve_model("acme/new", download=False)
    assert calls == []
    got = hub.resolve_model("acme/new", download=True, progress=False)
    assert got == cache / "models--acme--new" / "snapshots" / C1 and (got / "config.json").is_file()
    assert calls == [("acme/new", None, hub.PATTERNS, str(cache))]
    assert hub.resolve_model("acme/new") == got  # now cached: no second download
    assert len(calls) == 1

    def failing(*a, **kw):
        raise OSError("network is unreachable")

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=failing))
    with pytest.raises(CheckpointError, match="downloading it failed .*unreachable.*fetch it with"):
        hub.resolve_model("acme/gone", download=True, progress=False)


def test_cli_generate_and_plan_take_hub_ids(fake_cache, capsys):
    assert main(["generate", "acme/tiny-moe", "--prompt", "hello", "--max-tokens", "2"]) == 0
    assert "generated tokens 2" in capsys.readouterr().err
    assert main(["plan", "acme/tiny-moe", "--revision", "v2", "--json"]) == 0
    assert C2 in capsys.readouterr().out
    rc = main(["plan", "acme/absent"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "hf download acme/absent" in err
