"""Qwen3.5/3.6-MoE from GGUF (arch qwen35moe): Gated DeltaNet layers (v heads tiled by the converter,
A_log stored as -exp(A_log), conv1d squeezed), gated full attention with partial rotary, zero-centred
norms stored + 1, the sigmoid-gated shared expert, the trailing MTP layer skipped. Logits equal
transformers' on the weights the `gguf` package dequantizes (files written here as the converter writes
them, and, where llama.cpp's converter is present, by that converter itself)."""

import json
import os
import re
import subprocess
import sys

import pytest

gguf = pytest.importorskip("gguf")

import checkpoints as C
import torch
from fixture_paths import QWEN3_TOKENIZER_DIR
from gguf_files import default_types, reference_with, tokenizer_metadata, write_gguf
from gguf_qwen35_files import qwen35_metadata, qwen35_names, qwen35_state
from test_gguf_converter import CONVERTER, LLAMA_CPP

from expertcache import LLM
from expertcache.errors import CheckpointError

PROMPT = [1, 12, 50, 99, 150, 7, 33, 21, 40, 11]


def _write(ckpt, path, types, meta_edit=None, drop=(), edit=None):
    cfg = json.loads((ckpt / "config.json").read_text())
    meta = qwen35_metadata(cfg, nextn=1) + tokenizer_metadata(
        ckpt / "tokenizer.json", "qwen35", cfg["vocab_size"], eos="<|im_end|>"
    )
    meta = [m for m in meta if m[0] not in (meta_edit or ())]
    arrays = qwen35_names(C.read_tensors(ckpt), cfg, mtp_layer=cfg["num_hidden_layers"])
    arrays = {k: edit(k, v) for k, v in arrays.items()} if edit else arrays
    return write_gguf(path, "qwen35moe", {k: v for k, v in arrays.items() if k not in drop}, meta, types), cfg


def _rel(got, expected) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("expert,dense", [("F32", "F32"), ("Q8_0", "F32"), ("Q8_0", "Q8_0")])
def test_logits_equal_transformers_on_the_dequantized_weights(checkpoint, tmp_path, expert, dense, capfd):
    ckpt = checkpoint("qwen3_5_moe")
    path, cfg = _write(ckpt, tmp_path / "q.gguf", default_types(expert, dense))
    state = qwen35_state(path, cfg)
    if dense == "F32":  # the oracle's inverse of the converter's steps gives back the checkpoint's tensors
        source = C.read_tensors(ckpt)
        for name, w in state.items():
            if ".experts." not in name:
                torch.testing.assert_close(w, source[name].float(), rtol=1e-6, atol=1e-6, msg=name)
    expected = C.reference_logits(reference_with(C.load_reference(ckpt), state), PROMPT)
    llm = LLM(str(path))
    try:
        c = llm.cfg
        assert c.family == "qwen3_5_moe" and c.num_layers == 4 and c.rotary_dim == 4
        assert c.linear_attn.layers == (True, True, True, False) and c.linear_attn.v_head_dim == 8
        assert c.shared_expert_intermediate_size == 48 and c.norm_topk_prob
        got = llm.logits(PROMPT)
    finally:
        llm.close()
    assert "multi-token-prediction layer(s) in the checkpoint: model.layers.{4}" in capfd.readouterr().err
    assert _rel(got, expected) < 1e-3


@pytest.mark.parametrize(
    "drop,named",
    [
        ("blk.0.ssm_a", "blk.0.ssm_a (model.layers.0.linear_attn.A_log)"),
        ("blk.1.attn_qkv.weight", "blk.1.attn_qkv.weight (model.layers.1.linear_attn.in_proj_qkv.weight)"),
        ("blk.3.attn_q.weight", "blk.3.attn_q.weight (model.layers.3.self_attn.q_proj.weight)"),
    ],
)
def test_a_missing_tensor_is_refused_by_name(checkpoint, tmp_path, drop, named):
    ckpt = checkpoint("qwen3_5_moe")
    path, _ = _write(ckpt, tmp_path / "q.gguf", default_types(), drop=(drop,))
    with pytest.raises(CheckpointError, match=re.escape(f"missing tensor {named}")):
        LLM(str(path))


@pytest.mark.parametrize(
    "keys",
    [
        ("qwen35moe.ssm.group_count",),
        ("qwen35moe.ssm.inner_size",),
        ("qwen35moe.rope.dimension_count",),
        ("qwen35moe.expert_shared_feed_forward_length",),
        ("qwen35moe.attention.recurrent_layers", "qwen35moe.full_attention_interval"),
    ],
)
def test_a_missing_key_is_refused_by_name(checkpoint, tmp_path, keys):
    path, _ = _write(checkpoint("qwen3_5_moe"), tmp_path / "q.gguf", default_types(), meta_edit=keys)
    with pytest.raises(CheckpointError) as e:
        LLM(str(path))
    assert str(e.value) == f"{path}: missing metadata {keys[-1]} (needed for the qwen35moe config)"


def test_layer_types_from_the_interval_without_the_list(checkpoint, tmp_path):
    """attention.recurrent_layers absent: every full_attention_interval-th layer is full attention."""
    ckpt = checkpoint("qwen3_5_moe")
    path, cfg = _write(
        ckpt, tmp_path / "q.gguf", default_types(), meta_edit=("qwen35moe.attention.recurrent_layers",)
    )
    llm = LLM(str(path))
    try:
        assert llm.cfg.linear_attn.layers == (True, True, True, False)
    finally:
        llm.close()


def test_a_one_dimensional_shared_expert_gate(checkpoint, tmp_path):
    """ffn_gate_inp_shexp as llama.cpp declares it ([H]) rather than as the converter writes it ([1, H])."""
    ckpt = checkpoint("qwen3_5_moe")
    logits = []
    for flat in (False, True):
        path, _ = _write(
            ckpt,
            tmp_path / f"q{flat}.gguf",
            default_types(),
            edit=lambda k, v, flat=flat: v.reshape(-1) if flat and "ffn_gate_inp_shexp" in k else v,
        )
        dims = {t.name: len(t.shape) for t in gguf.GGUFReader(str(path)).tensors}
        assert dims["blk.0.ffn_gate_inp_shexp.weight"] == (1 if flat else 2)
        llm = LLM(str(path))
        try:
            logits.append(llm.logits(PROMPT))
        finally:
            llm.close()
    assert torch.equal(logits[0], logits[1])


@pytest.mark.skipif(
    not CONVERTER.is_file(), reason="llama.cpp's converter absent (bench/peers: EXPERTCACHE_LLAMA_CPP)"
)
@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_llama_cpp_converter_output_loads(tmp_path, outtype):
    """The converter's own file from a checkpoint with Qwen3.5's MTP head (mtp.*, as the hub's carry; the
    converter requires it unless --no-mtp): f32 gives the checkpoint's own logits, q8_0 (every matrix
    with whole 32-blocks in Q8_0, the linear-attention ones reordered first) those of its dequantized
    weights."""
    ckpt = C.make_checkpoint(tmp_path, "qwen3_5_moe", name="q", tokenizer=False, vocab_size=151936)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / f).write_bytes((QWEN3_TOKENIZER_DIR / f).read_bytes())
    source = C.read_tensors(ckpt)
    C.rewrite_tensors(ckpt, _with_mtp)
    C.edit_config(ckpt, mtp_num_hidden_layers=1)
    out = tmp_path / f"q-{outtype}.gguf"
    r = subprocess.run(
        [sys.executable, str(CONVERTER), str(ckpt), "--outfile", str(out), "--outtype", outtype],
        check=False,
        env={**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((ckpt / "config.json").read_text())
    llm = LLM(str(out))
    try:
        ids = llm.tokenizer.encode("Hello world, def f(x): return x ** 2")
        got = llm.logits(ids)
    finally:
        llm.close()
    weights = source if outtype == "f32" else qwen35_state(out, cfg)
    if outtype == "q8_0":
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
        assert types["blk.0.attn_qkv.weight"] == types["blk.0.ssm_out.weight"] == "Q8_0"
    expected = C.reference_logits(reference_with(C.load_reference(ckpt), weights), ids)
    assert _rel(got, expected) < 1e-3


def _with_mtp(tensors: dict) -> dict:
    """The checkpoint plus Qwen3.5's MTP head: mtp.layers.0 a copy of the last (full-attention) layer,
    mtp.fc [H, 2H] and its norms."""
    out, g = dict(tensors), torch.Generator().manual_seed(1)
    H = tensors["model.norm.weight"].shape[0]
    for k, v in tensors.items():
        if k.startswith("model.layers.3."):
            out["mtp.layers.0." + k.removeprefix("model.layers.3.")] = v.clone()
    out["mtp.fc.weight"] = 0.1 * torch.randn(H, 2 * H, generator=g)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = 0.1 * torch.randn(H, generator=g)
    return out
