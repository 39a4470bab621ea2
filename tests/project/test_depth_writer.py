"""bench/depth_writer.py at toy sizes: the int4 checkpoint and the GGUF it writes layer by layer load in
expertcache and give transformers' logits on their weights (int4 dequantized by its formula here, the GGUF
by the `gguf` package); the GGUF's dense layer tensors are the `gguf` package's quantization of the
checkpoint's bf16 ones (an independent implementation of ggml's reference rounding); the metadata is the
template's with block_count = 3; a template lacking a layer tensor is refused by name. Q4_K_M (hidden 256:
a K-quant row is 256 features): each tensor's type at 3 layers is llama-quantize's choice (attn_v and
ffn_down_exps Q6_K in layer 2 alone, stated here, not computed), the 2-layer template check passes, and the
file's logits are transformers' on the weights the `gguf` package dequantizes. No llama.cpp here: the
templates are written by the tests' own GGUF writer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import checkpoints as C
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    dequantized_tensors,
    gguf_names,
    qwen3moe_metadata,
    reference_with,
    tokenizer_metadata,
    write_gguf,
)

from expertcache import LLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import depth_writer as W  # noqa: E402
import real_scale as R  # noqa: E402

TOY = dict(
    hidden_size=128,
    moe_intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    bos_token_id=1,
    eos_token_id=2,
)
MODEL = "qwen3-30b-a3b"
PROMPT = [1, 5, 9, 33, 100, 7, 250, 3]


def types(name: str, arr: np.ndarray) -> str:
    """llama-quantize's Q4_0 with --output-tensor-type q8_0, as the template's choice of types."""
    if arr.ndim == 1 or "ffn_gate_inp" in name:
        return "F32"
    return "Q8_0" if name == "output.weight" else "Q4_0"


def _template(path: Path, one: Path, drop: str | None = None) -> Path:
    cfg = json.loads((one / "config.json").read_text())
    meta = qwen3moe_metadata(cfg) + tokenizer_metadata(one / "tokenizer.json", "qwen2", cfg["vocab_size"])
    arrays = gguf_names(C.read_tensors(one))
    arrays.pop(drop, None)
    return write_gguf(path, "qwen3moe", arrays, meta, types)


def _workdir(tmp_path_factory, name: str, toy: dict) -> tuple[Path, Path, dict]:
    """(a fresh directory, its tokenizer directory, the toy config with the tokenizer's vocabulary)."""
    tmp = tmp_path_factory.mktemp(name)
    tok = tmp / "tok"
    tok.mkdir()
    C.write_tokenizer(tok)
    return tmp, tok, dict(toy, vocab_size=-(-C.tokenizer_vocab_size() // 64) * 64)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp, tok, toy = _workdir(tmp_path_factory, "depth", TOY)
    one = R.write_checkpoint(MODEL, tmp / "one", 1, tok, **toy)
    template = _template(tmp / "one.gguf", one)
    bf16 = R.write_checkpoint(MODEL, tmp / "bf16", 3, tok, **toy)  # transformers' model of this config
    ckpt, out = W.write_both(gguf, MODEL, 3, tok, template, tmp / "int4", tmp / "direct.gguf", **toy)
    return dict(tmp=tmp, tok=tok, toy=toy, one=one, template=template, bf16=bf16, ckpt=ckpt, gguf=out)


def _int4_dequantized(ckpt: Path) -> dict[str, torch.Tensor]:
    """quant/int4.py's legend by hand: w = (code - zero) x scale, codes low nibble first, groups of 128."""
    t = C.read_tensors(ckpt)
    out = {k: v.float() for k, v in t.items() if not k.endswith(("_scale", "_zero")) and ".experts." not in k}
    for k in (k for k in t if ".experts." in k and k.endswith(".weight")):
        b = t[k]
        codes = torch.stack((b & 15, b >> 4), dim=-1).reshape(b.shape[0], -1).float()
        scale = t[k + "_scale"].repeat_interleave(W.INT4_GROUP, dim=1)[:, : codes.shape[1]]
        zero = t[k + "_zero"].float().repeat_interleave(W.INT4_GROUP, dim=1)[:, : codes.shape[1]]
        out[k] = (codes - zero) * scale
    return out


@pytest.mark.parametrize("source", ["ckpt", "gguf"])
def test_written_files_run_as_transformers_does_on_their_weights(files, source):
    weights = _int4_dequantized(files["ckpt"]) if source == "ckpt" else dequantized_tensors(files["gguf"])
    expected = C.reference_logits(reference_with(C.load_reference(files["bf16"]), weights), PROMPT)
    llm = LLM(str(files[source]), cpu_math="exact")
    try:
        got = llm.logits(PROMPT)
    finally:
        llm.close()
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel < 1e-3, rel


def test_gguf_dense_layer_tensors_are_the_gguf_packages_quantization(files):
    dense = {k: v for k, v in C.read_tensors(files["ckpt"]).items() if k.startswith("model.layers.")}
    want = gguf_names({k: v for k, v in dense.items() if ".experts." not in k})
    got = {t.name: t for t in gguf.GGUFReader(str(files["gguf"])).tensors}
    assert len(want) == 3 * 9
    for name, arr in want.items():
        qtype = gguf.GGMLQuantizationType[types(name, arr)]
        assert got[name].tensor_type == qtype, name
        ref = arr if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(arr, qtype)
        data = np.asarray(got[name].data).reshape(ref.shape).view(np.uint8)
        assert np.array_equal(data, ref.view(np.uint8)), name
    for i in range(3):
        assert got[f"blk.{i}.ffn_down_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0


def test_gguf_metadata_is_the_templates_at_full_depth(files):
    mine, theirs = gguf.GGUFReader(str(files["gguf"])).fields, gguf.GGUFReader(str(files["template"])).fields
    assert mine["qwen3moe.block_count"].contents() == 3
    for key, f in theirs.items():
        if key not in ("qwen3moe.block_count", "GGUF.tensor_count", "GGUF.kv_count"):
            assert mine[key].contents() == f.contents(), key


def test_the_one_layer_check_passes_and_a_template_without_a_layer_tensor_is_refused(files, tmp_path):
    W.check_against_template(gguf, MODEL, files["tok"], files["template"], tmp_path, **files["toy"])
    bad = _template(tmp_path / "bad.gguf", files["one"], drop="blk.0.attn_k_norm.weight")
    with pytest.raises(SystemExit, match="attn_k_norm"):
        W.write_both(gguf, MODEL, 2, files["tok"], bad, None, tmp_path / "x.gguf", **files["toy"])


# -- llama-quantize's Q4_K_M: K-quant rows need 256 features -------------------------------------------------
TOY_K = dict(TOY, hidden_size=256, moe_intermediate_size=256, head_dim=64)
K_RULE = ("attn_v.weight", "ffn_down_exps.weight")  # Q6_K in the layers use_more_bits picks, else Q4_K


def _k_template(path: Path, two: Path) -> Path:
    """A 2-layer Q4_K_M file as llama-quantize lays it out (general.file_type 15; layer 1's attn_v and
    ffn_down_exps Q6_K, the output matrix Q6_K, every other matrix Q4_K), K-quant tensors as random blocks."""
    from gguf_files import random_blocks

    cfg = json.loads((two / "config.json").read_text())
    meta = qwen3moe_metadata(cfg) + tokenizer_metadata(two / "tokenizer.json", "qwen2", cfg["vocab_size"])
    meta.append(("general.file_type", W.Q4_K_M_FILE, "u32"))
    floats, raw = {}, {}
    for name, arr in gguf_names(C.read_tensors(two)).items():
        if arr.ndim == 1 or "ffn_gate_inp" in name:
            floats[name] = arr
            continue
        kind = (
            "Q6_K"
            if name == "output.weight" or (name.startswith("blk.1.") and name.endswith(K_RULE))
            else "Q4_K"
        )
        rows = int(np.prod(arr.shape[:-1]))
        raw[name] = (kind, random_blocks(kind, rows, arr.shape[-1], seed=rows).reshape(*arr.shape[:-1], -1))
    return write_gguf(path, "qwen3moe", floats, meta, lambda n, a: "F32", raw=raw)


@pytest.fixture(scope="module")
def kfiles(tmp_path_factory):
    tmp, tok, toy = _workdir(tmp_path_factory, "depth-k", TOY_K)
    template = _k_template(tmp / "two.gguf", R.write_checkpoint(MODEL, tmp / "two", 2, tok, **toy))
    bf16 = R.write_checkpoint(MODEL, tmp / "bf16", 3, tok, **toy)
    ckpt, out = W.write_both(gguf, MODEL, 3, tok, template, None, tmp / "k.gguf", **toy)
    return dict(tmp=tmp, tok=tok, toy=toy, template=template, bf16=bf16, ckpt=ckpt, gguf=out)


def test_q4_k_m_types_follow_llama_quantize_at_the_written_depth(kfiles):
    """At 3 layers use_more_bits picks layer 2 alone (i >= 7 n / 8), where the template's 2 layers had layer 1."""
    assert kfiles["ckpt"] is None  # a Q4_K_M run has no int4 twin
    got = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(kfiles["gguf"])).tensors}
    for i in range(3):
        for key in K_RULE:
            assert got[f"blk.{i}.{key}"] == ("Q6_K" if i == 2 else "Q4_K"), (i, key)
        for key in (
            "attn_q.weight",
            "attn_k.weight",
            "attn_output.weight",
            "ffn_gate_exps.weight",
            "ffn_up_exps.weight",
        ):
            assert got[f"blk.{i}.{key}"] == "Q4_K", (i, key)
        assert got[f"blk.{i}.ffn_gate_inp.weight"] == "F32"
    assert (got["output.weight"], got["token_embd.weight"]) == ("Q6_K", "Q4_K")
    W.check_against_template(gguf, MODEL, kfiles["tok"], kfiles["template"], kfiles["tmp"], **kfiles["toy"])


def test_q4_k_m_written_file_runs_as_transformers_does_on_its_weights(kfiles):
    expected = C.reference_logits(
        reference_with(C.load_reference(kfiles["bf16"]), dequantized_tensors(kfiles["gguf"])), PROMPT
    )
    llm = LLM(str(kfiles["gguf"]), cpu_math="exact")
    try:
        got = llm.logits(PROMPT)
    finally:
        llm.close()
    assert torch.isfinite(got).all()
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel < 1e-3, rel
