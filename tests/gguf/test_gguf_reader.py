"""The GGUF header reader (gguf/reader.py) and the index over it (gguf/index.py): metadata of every
value type, alignment, byte ranges, split sets, and the one-line refusals."""

import struct

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import random_blocks, write_gguf

from expertcache.errors import CheckpointError
from expertcache.gguf import names
from expertcache.gguf.families import Arch
from expertcache.gguf.index import GGUFIndex, GGUFInfo, dequantize
from expertcache.gguf.reader import read_gguf
from expertcache.hub import resolve_model

META = [
    ("t.u32", 7, "u32"),
    ("t.i32", -3, "i32"),
    ("t.f32", 0.5, "f32"),
    ("t.bool", True, "bool"),
    ("t.str", "héllo", "str"),
    ("t.ints", [1, 2, 3], "i32[]"),
    ("t.strs", ["a", "b c", ""], "str[]"),
]


def _file(tmp_path, name="m.gguf", alignment=None):
    rng = np.random.default_rng(0)
    arrays = {
        "a.weight": rng.standard_normal((3, 64)).astype(np.float32),
        "b.weight": rng.standard_normal((5,)).astype(np.float32),
    }
    raw = {"c.weight": ("Q4_K", random_blocks("Q4_K", 2, 512))}
    return write_gguf(tmp_path / name, "test", arrays, META, raw=raw, alignment=alignment), arrays, raw


@pytest.mark.parametrize("alignment", [None, 64])
def test_metadata_tensors_and_offsets_match_the_gguf_package(tmp_path, alignment):
    path, arrays, raw = _file(tmp_path, alignment=alignment)
    gf = read_gguf(path)
    assert gf.version == 3 and gf.metadata["general.architecture"] == "test"
    for key, value, _ in META:
        assert (
            gf.metadata[key] == pytest.approx(value)
            if isinstance(value, float)
            else gf.metadata[key] == value
        )
    if alignment:
        assert gf.metadata["general.alignment"] == alignment
    ref = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert set(gf.tensors) == set(ref)
    for name, t in gf.tensors.items():
        assert t.dims == tuple(int(d) for d in ref[name].shape), name
        assert t.offset == ref[name].data_offset and t.nbytes == ref[name].n_bytes, name
        assert t.offset % (alignment or 32) == 0
        assert t.type.id == int(ref[name].tensor_type)
    data = path.read_bytes()
    a = gf.tensors["a.weight"]
    np.testing.assert_array_equal(
        np.frombuffer(data[a.offset : a.offset + a.nbytes], np.float32).reshape(3, 64), arrays["a.weight"]
    )
    c = gf.tensors["c.weight"]
    assert data[c.offset : c.offset + c.nbytes] == raw["c.weight"][1].tobytes()
    assert c.shape == (2, 512) and c.type.name == "Q4_K"


def test_truncated_file_is_refused_naming_the_tensor(tmp_path):
    path, _, _ = _file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(
        CheckpointError, match=r"m\.gguf: truncated GGUF file \(tensor c\.weight ends at byte"
    ):
        read_gguf(path)
    path.write_bytes(data[:40])
    with pytest.raises(CheckpointError, match="truncated GGUF file .header ends inside"):
        read_gguf(path)


def test_unknown_type_id_is_refused_naming_the_tensor(tmp_path):
    path, _, _ = _file(tmp_path)
    data = bytearray(path.read_bytes())
    name = b"c.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="tensor c.weight has unknown ggml type id 99"):
        read_gguf(path)


def test_not_gguf_and_bad_version(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + bytes(30))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        read_gguf(p)
    p.write_bytes(b"GGUF" + struct.pack("<I", 9) + bytes(30))
    with pytest.raises(CheckpointError, match="GGUF version 9 is not supported"):
        read_gguf(p)


def test_split_set_reads_every_part_and_the_model_argument_resolves(tmp_path):
    rng = np.random.default_rng(1)
    first = write_gguf(
        tmp_path / "m-00001-of-00002.gguf",
        "test",
        {"a.weight": rng.standard_normal((2, 32), dtype=np.float32)},
        META,
    )
    write_gguf(tmp_path / "m-00002-of-00002.gguf", "test", {"b.weight": np.ones((4, 32), np.float32)}, [])
    gf = read_gguf(first)
    assert set(gf.tensors) == {"a.weight", "b.weight"} and gf.metadata["t.u32"] == 7
    assert gf.tensors["b.weight"].file.name == "m-00002-of-00002.gguf"
    assert resolve_model(str(first)) == first
    with pytest.raises(CheckpointError, match="part 2 of a split GGUF set; give the first part"):
        read_gguf(tmp_path / "m-00002-of-00002.gguf")
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(CheckpointError, match="lacks m-00002-of-00002.gguf"):
        read_gguf(first)
    with pytest.raises(CheckpointError, match="GGUF file, so it has no revisions"):
        resolve_model(str(first), revision="main")


def test_a_block_type_tensor_loads_dequantized_and_names_map_both_ways(tmp_path):
    path, _, raw = _file(tmp_path)
    arch = Arch("test", "X", lambda m: {})
    index = GGUFIndex(read_gguf(path), arch, ("gate_proj", "up_proj", "down_proj"))
    assert sorted(index.left_out) == ["a.weight", "b.weight", "c.weight"]  # no family reads these names
    t = read_gguf(path).tensors["c.weight"]
    info = GGUFInfo("c", t.file, torch.float32, t.shape, t.offset, t.nbytes, t.type, t.name)
    ref = gguf.quants.dequantize(raw["c.weight"][1], gguf.GGMLQuantizationType.Q4_K).reshape(2, 512)
    np.testing.assert_array_equal(dequantize(info).numpy(), ref)
    assert names.hf_name("blk.3.attn_q.weight", arch) == "model.layers.3.self_attn.q_proj.weight"
    assert names.gguf_name("model.layers.3.self_attn.q_proj.weight", arch) == "blk.3.attn_q.weight"
    assert (
        names.gguf_name("model.layers.3.mlp.experts.7.down_proj.weight", arch) == "blk.3.ffn_down_exps.weight"
    )
    assert names.hf_name("blk.3.exp_probs_b.bias", arch) == "model.layers.3.mlp.gate.e_score_correction_bias"


def test_a_string_array_cut_short_is_refused(tmp_path):
    path = write_gguf(
        tmp_path / "s.gguf", "test", {}, [("t.strs", [f"token{i}" for i in range(100)], "str[]")]
    )
    data = path.read_bytes()
    cut = data.index(b"token57") + 3
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=r"s\.gguf: truncated or corrupt GGUF header \(in t\.strs\)"):
        read_gguf(path)
