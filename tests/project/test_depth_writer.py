"""bench/depth_writer.py at toy sizes: the int4 checkpoint it writes layer by layer is byte for byte what
`expertcache quantize` makes of bench/real_scale.py's bf16 checkpoint, and the GGUF it writes at 3 layers
from a 1-layer template holds each layer tensor as the `gguf` package quantizes the bf16 checkpoint's
(an independent implementation of ggml's reference rounding), in the template's types, with the
template's metadata and block_count = 3. No llama.cpp here: the template is written by the tests' own
GGUF writer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import checkpoints as C
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf_files import gguf_names, qwen3moe_metadata, write_gguf  # noqa: E402

from expertcache.quantize.rewrite import quantize_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import depth_writer as W  # noqa: E402
import real_scale as R  # noqa: E402

TOY = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    bos_token_id=1,
    eos_token_id=2,
)
MODEL = "qwen3-30b-a3b"


def types(name: str, arr: np.ndarray) -> str:
    """llama-quantize's Q4_0 with --output-tensor-type q8_0, as the template's choice of types."""
    if arr.ndim == 1 or "ffn_gate_inp" in name:
        return "F32"
    return "Q8_0" if name == "output.weight" else "Q4_0"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("depth")
    tok = tmp / "tok"
    tok.mkdir()
    C.write_tokenizer(tok)
    toy = dict(TOY, vocab_size=-(-C.tokenizer_vocab_size() // 64) * 64)
    one = R.write_checkpoint(MODEL, tmp / "one", 1, tok, **toy)
    cfg1 = json.loads((one / "config.json").read_text())
    meta = [*qwen3moe_metadata(cfg1), ("general.name", "toy", "str")]
    template = write_gguf(tmp / "one.gguf", "qwen3moe", gguf_names(C.read_tensors(one)), meta, types)
    bf16 = R.write_checkpoint(MODEL, tmp / "bf16", 3, tok, **toy)
    ckpt, out = W.write_both(gguf, MODEL, 3, tok, template, tmp / "int4-direct", tmp / "direct.gguf", **toy)
    return dict(tmp=tmp, template=template, bf16=bf16, ckpt=ckpt, gguf=out)


def test_int4_checkpoint_is_expertcache_quantize_of_the_bf16_one(files):
    ref = quantize_checkpoint(files["bf16"], files["tmp"] / "int4-ref", "int4")
    mine, theirs = C.read_tensors(files["ckpt"]), C.read_tensors(ref)
    assert set(mine) == set(theirs)
    for name, t in theirs.items():
        assert mine[name].dtype == t.dtype and mine[name].equal(t), name
    a = json.loads((ref / "config.json").read_text())
    assert json.loads((files["ckpt"] / "config.json").read_text()) == a


def test_gguf_layers_are_the_gguf_packages_quantization_of_the_bf16_weights(files):
    want = gguf_names(C.read_tensors(files["bf16"]))
    got = {t.name: t for t in gguf.GGUFReader(str(files["gguf"])).tensors}
    assert set(got) == set(want)
    for name, arr in want.items():
        t = got[name]
        if not name.startswith("blk."):
            continue  # copied from the template (its 1-layer checkpoint drew the same embeddings)
        qtype = gguf.GGMLQuantizationType[types(name, arr)]
        assert t.tensor_type == qtype, name
        ref = arr if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(arr, qtype)
        assert np.array_equal(np.asarray(t.data).reshape(ref.shape).view(np.uint8), ref.view(np.uint8)), name
    template = {t.name: t for t in gguf.GGUFReader(str(files["template"])).tensors}
    for name in ("token_embd.weight", "output.weight", "output_norm.weight"):
        assert np.array_equal(np.asarray(got[name].data), np.asarray(template[name].data)), name


def test_gguf_metadata_is_the_templates_at_full_depth(files):
    mine, theirs = gguf.GGUFReader(str(files["gguf"])).fields, gguf.GGUFReader(str(files["template"])).fields
    assert mine["qwen3moe.block_count"].contents() == 3
    skip = {"qwen3moe.block_count", "GGUF.tensor_count"}
    for key, f in theirs.items():
        if key not in skip:
            assert mine[key].contents() == f.contents(), key


def test_a_template_without_a_layer_tensor_is_refused(files, tmp_path):
    arrays = gguf_names(C.read_tensors(files["bf16"].parent / "one"))
    del arrays["blk.0.attn_k_norm.weight"]
    cfg1 = json.loads((files["bf16"].parent / "one" / "config.json").read_text())
    bad = write_gguf(tmp_path / "bad.gguf", "qwen3moe", arrays, qwen3moe_metadata(cfg1), types)
    toy = json.loads((files["bf16"] / "manifest.json").read_text())
    toy = {k: v for k, v in toy.items() if k not in ("model", "layers", "seed", "version")}
    with pytest.raises(SystemExit, match="attn_k_norm"):
        W.write_both(gguf, MODEL, 2, files["tmp"] / "tok", bad, None, tmp_path / "x.gguf", **toy)
