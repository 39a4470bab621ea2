"""Local files an engine reads or writes: written with the umask's mode (never by setting the umask),
shard names and revisions confined to the checkpoint and hub-cache folders, config numbers checked."""

from __future__ import annotations

import json
import os
import re
import stat
import threading

import checkpoints as C
import pytest
import torch
from safetensors import safe_open
from test_hub import C1, add_snapshot

from expertcache import hub
from expertcache.errors import CheckpointError, ConfigError
from expertcache.loader import writer
from expertcache.loader.safetensors_index import TensorIndex


# -- writer ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_written_files_take_the_umask_mode_without_setting_the_umask(tmp_path, monkeypatch, mask):
    old = os.umask(mask)
    try:

        def no_umask(_):
            raise AssertionError("os.umask changed the process-wide umask while writing")

        monkeypatch.setattr(writer.os, "umask", no_umask)
        t = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
        writer.write_safetensors(t, tmp_path / "x.safetensors")
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.safetensors").stat().st_mode) == 0o666 & ~mask
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("a"), t["a"])


def test_umask_from_a_probe_file_where_proc_is_absent(tmp_path, monkeypatch):
    old = os.umask(0o027)
    try:
        real = writer.Path.read_text

        def no_proc(self, *a, **k):
            if str(self) == "/proc/self/status":
                raise FileNotFoundError(self)
            return real(self, *a, **k)

        monkeypatch.setattr(writer.Path, "read_text", no_proc)
        assert writer.current_umask(tmp_path) == 0o027 & 0o666  # the probe shows the read/write bits
        assert list(tmp_path.iterdir()) == []  # the probe is gone
    finally:
        os.umask(old)


def test_umask_unchanged_for_other_threads_while_writing(tmp_path):
    """Files another thread creates during many writes keep the process umask's mode."""
    old = os.umask(0o022)
    stop, modes = threading.Event(), set()

    def create():
        i = 0
        while not stop.is_set():
            p = tmp_path / f"other-{i}"
            fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o666)
            modes.add(stat.S_IMODE(os.fstat(fd).st_mode))
            os.close(fd)
            p.unlink()
            i += 1

    th = threading.Thread(target=create)
    th.start()
    try:
        for i in range(200):
            writer.write_safetensors({"a": torch.zeros(1)}, tmp_path / f"w{i}.safetensors")
    finally:
        stop.set()
        th.join()
        os.umask(old)
    assert modes == {0o644}


# -- shard names ------------------------------------------------------------------------------------------
@pytest.fixture
def sharded(checkpoint, tmp_path):
    return C.copy_checkpoint(checkpoint("qwen3_moe", max_shard_size="100KB"), tmp_path / "sharded")


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", ""])
def test_shard_names_outside_the_checkpoint_are_refused(sharded, bad):
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = bad
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as info:
        TensorIndex(sharded)
    assert str(index) in str(info.value) and repr(bad) in str(info.value)


def test_weight_map_of_the_wrong_type_is_refused(sharded):
    index = sharded / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": ["model-00001.safetensors"]}))
    with pytest.raises(CheckpointError, match="weight_map must be an object"):
        TensorIndex(sharded)


def test_a_shard_name_that_is_not_a_string_is_refused(sharded):
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = None
    index.write_text(json.dumps(data))
    with pytest.raises(
        CheckpointError, match=re.escape(f"weight_map[{first!r}] is None, not a shard file name")
    ):
        TensorIndex(sharded)


def test_plain_shard_names_still_load(sharded):
    idx = TensorIndex(sharded)
    data = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert {t.file.name for t in idx.tensors.values()} == set(data["weight_map"].values())


# -- revisions ------------------------------------------------------------------------------------------------
@pytest.fixture
def hub_repo(tmp_path, monkeypatch, qwen3_checkpoint):
    cache = tmp_path / "hub"
    snap = add_snapshot(cache, "acme/tiny-moe", qwen3_checkpoint, C1, refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache / "models--acme--tiny-moe", snap


@pytest.mark.parametrize("rev", ["../../../outside", "../snapshots/" + C1, "/etc", "main/../main", "a//b"])
def test_revisions_leaving_the_repo_folder_are_refused(hub_repo, tmp_path, rev):
    repo, _ = hub_repo
    outside = tmp_path / "outside"
    outside.write_text(C1)  # what a ref outside refs/ could point at
    for spec in ("acme/tiny-moe", repo):
        with pytest.raises(CheckpointError, match="is not a branch, tag or commit name"):
            hub.resolve_model(spec, rev)


def test_pr_refs_still_resolve(hub_repo):
    repo, snap = hub_repo
    (repo / "refs" / "refs" / "pr").mkdir(parents=True)
    (repo / "refs" / "refs" / "pr" / "1").write_text(C1)
    assert hub.resolve_model("acme/tiny-moe", "refs/pr/1") == snap


@pytest.mark.parametrize("content", ["../../../../etc", "/tmp", "main", "1" * 39])
def test_a_ref_that_is_not_a_commit_hash_is_refused(hub_repo, content):
    repo, _ = hub_repo
    (repo / "refs" / "main").write_text(content)
    with pytest.raises(CheckpointError, match="not a 40-hex commit hash") as info:
        hub.resolve_model("acme/tiny-moe")
    assert str(repo / "refs" / "main") in str(info.value)


# -- config numbers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("rms_norm_eps", "tiny", "rms_norm_eps must be a finite number, got 'tiny'"),
        ("rms_norm_eps", True, "rms_norm_eps must be a finite number, got True"),
        ("rms_norm_eps", -1e-6, "rms_norm_eps must be > 0"),
        ("rms_norm_eps", [1e-6], "rms_norm_eps must be a finite number"),
        ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false, got 'false'"),
    ],
)
def test_bad_config_numbers_name_the_field_and_file(qwen3_checkpoint, tmp_path, field, value, needle):
    from expertcache.models.registry import read_config

    broken = C.copy_checkpoint(qwen3_checkpoint, tmp_path / "model")
    C.edit_config(broken, **{field: value})
    with pytest.raises(ConfigError) as info:
        read_config(broken)
    assert needle in str(info.value) and "config.json" in str(info.value)


def test_integer_eps_is_a_number(qwen3_checkpoint, tmp_path):
    from expertcache.models.registry import read_config

    broken = C.copy_checkpoint(qwen3_checkpoint, tmp_path / "model")
    C.edit_config(broken, rms_norm_eps=1)
    assert read_config(broken)[1].rms_norm_eps == 1.0


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("routed_scaling_factor", "2.5x", "routed_scaling_factor must be a finite number, got '2.5x'"),
        ("routed_scaling_factor", 0, "routed_scaling_factor must be > 0"),
    ],
)
def test_bad_deepseek_numbers_name_the_field(tmp_path, field, value, needle):
    from expertcache.models.registry import read_config

    ckpt = C.make_checkpoint(tmp_path / "src", "deepseek_v3")
    broken = C.copy_checkpoint(ckpt, tmp_path / "model")
    C.edit_config(broken, **{field: value})
    with pytest.raises(ConfigError) as info:
        read_config(broken)
    assert needle in str(info.value) and "config.json" in str(info.value)
