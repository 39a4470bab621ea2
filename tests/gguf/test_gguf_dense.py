"""A GGUF file's dense matrices held in their file bytes on the CPU: the lm_head and the attention
projections in Q8_0, Q4_K or Q6_K blocks computed by the block kernels. Logits in exact math equal
transformers' on the weights the `gguf` package dequantizes from the file; the held lm_head is the
file's bytes; the plan's dense term equals what the ledger counted; `--dense` / `--lm-head` still
requantize."""

import json

import pytest
import torch

gguf = pytest.importorskip("gguf")

import checkpoints as C
from gguf_files import (
    default_types,
    dequantized_tensors,
    gguf_names,
    qwen3moe_metadata,
    random_blocks,
    reference_with,
    tokenizer_metadata,
    write_gguf,
)
from test_attn_block import _both_paths
from test_fast_math import needs_fast

from expertcache import LLM
from expertcache.layers.basic import QuantizedWeight

PROMPT = [1, 5, 9, 33, 100, 7, 250, 3]
H = 256  # K-quant rows: whole 256-blocks (4 heads x 64 = the o projection's input too)
DENSE = ("attn_q", "attn_k", "attn_v", "attn_output")


@pytest.fixture(scope="module")
def k_checkpoint(checkpoint):
    return checkpoint("qwen3_moe", hidden_size=H, num_hidden_layers=2)


@pytest.fixture(scope="module")
def dense_gguf(k_checkpoint, tmp_path_factory):
    """type -> a .gguf whose lm_head and attention projections are in that type (Q8_0: the gguf package's
    quantiser of the checkpoint's weights; K types: valid random blocks, layer 1's attn_v in Q6_K as
    llama-quantize's Q4_K_M writes it), experts and the embedding F32."""
    root = tmp_path_factory.mktemp("gguf-dense")
    cfg = json.loads((k_checkpoint / "config.json").read_text())
    meta = qwen3moe_metadata(cfg) + tokenizer_metadata(
        k_checkpoint / "tokenizer.json", "qwen2", cfg["vocab_size"], eos="<|im_end|>"
    )
    arrays = gguf_names(C.read_tensors(k_checkpoint))
    files = {}

    def get(t: str):
        if t in files:
            return files[t]
        if t == "Q8_0":
            pick = default_types("F32", "Q8_0")

            def types(name, arr):
                return "F32" if name == "token_embd.weight" else pick(name, arr)

            files[t] = write_gguf(root / f"{t}.gguf", "qwen3moe", arrays, meta, types)
            return files[t]
        raw, floats = {}, dict(arrays)
        for n, name in enumerate(
            [f"blk.{i}.{d}.weight" for i in range(2) for d in DENSE] + ["output.weight"]
        ):
            rows, cols = floats.pop(name).shape
            kind = "Q6_K" if name == "blk.1.attn_v.weight" else t
            raw[name] = (kind, random_blocks(kind, rows, cols, seed=n))
        files[t] = write_gguf(root / f"{t}.gguf", "qwen3moe", floats, meta, raw=raw)
        return files[t]

    return get


def _rel(got, expected) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K"])
def test_logits_equal_transformers_with_the_dense_matrices_in_their_blocks(
    k_checkpoint, dense_gguf, type_name, capfd
):
    path = dense_gguf(type_name)
    expected = C.reference_logits(
        reference_with(C.load_reference(k_checkpoint), dequantized_tensors(path)), PROMPT
    )
    llm = LLM(str(path), cpu_math="exact")
    try:
        method = f"gguf-{type_name.lower()}"
        head = llm.model.lm_head
        assert isinstance(head, QuantizedWeight) and head.method.name == method
        w0, w1 = (llm.model.layers[i]["attn"].w for i in (0, 1))
        assert w0["qkv_proj.weight"].method.name == method  # one type: q/k/v fused by row
        assert w0["o_proj.weight"].method.name == method
        if type_name.endswith("_K") and type_name != "Q6_K":  # layer 1's v Q6_K beside q/k: three matrices
            assert "qkv_proj.weight" not in w1
            assert w1["v_proj.weight"].method.name == "gguf-q6_k"
            assert w1["q_proj.weight"].method.name == method
        else:
            assert w1["qkv_proj.weight"].method.name == method
        got = llm.logits(PROMPT)
        plan, ledger = llm.device_plan, llm.ledger
        assert ledger.terms["dense"] == plan.allocated["dense"]  # the plan counts the file's bytes
    finally:
        llm.close()
    err = capfd.readouterr().err
    assert "dense matrices" in err and "stay in their file bytes" in err and "the lm_head" in err
    assert torch.isfinite(expected).all()
    assert _rel(got, expected) < 1e-3


def test_the_held_lm_head_is_the_files_bytes(dense_gguf):
    path = dense_gguf("Q6_K")
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "output.weight")
    llm = LLM(str(path))
    try:
        parts = llm.model.lm_head.parts
        assert list(parts) == ["w.weight"]
        assert parts["w.weight"].dtype == torch.uint8 and parts["w.weight"].shape == t.data.shape
        assert parts["w.weight"].numpy().tobytes() == t.data.tobytes()
        assert llm.model.lm_head.nbytes == t.n_bytes
    finally:
        llm.close()


def test_explicit_formats_still_requantize(dense_gguf):
    path = dense_gguf("Q8_0")
    llm = LLM(str(path), lm_head="int8", dense="int8")
    try:
        assert llm.model.lm_head.method.name == "int8"
        assert llm.model.layers[0]["attn"].w["qkv_proj.weight"].method.name == "int8"
        assert llm.ledger.terms["dense"] == llm.device_plan.allocated["dense"]
    finally:
        llm.close()
    llm = LLM(str(path), lm_head="int8")  # the attention stays in the file's Q8_0 blocks
    try:
        assert llm.model.lm_head.method.name == "int8"
        assert llm.model.layers[0]["attn"].w["qkv_proj.weight"].method.name == "gguf-q8_0"
        assert llm.ledger.terms["dense"] == llm.device_plan.allocated["dense"]
    finally:
        llm.close()


@pytest.mark.parametrize("math", ["exact", pytest.param("fast", marks=needs_fast)])
def test_every_layer_runs_in_one_call_and_equals_the_python_path(dense_gguf, math):
    """The float32 router (as every GGUF file stores it) and layer 1's q/k/v in two types still give each
    layer its one-call block (layers/block.py: q, k and v as three projections), and the block is the
    layer's Python path bit for bit."""
    llm = LLM(str(dense_gguf("Q4_K")), cpu_math=math)
    try:
        blocks = llm.model.blocks
        assert all(b is not None for b in blocks) and llm.model.stack is not None
        assert isinstance(blocks[0].qkv, tuple) and [len(p) for p in blocks[1].qkv] == [4, 4, 4]
        (a, da), (b, db) = _both_paths(llm)
    finally:
        llm.close()
    assert torch.equal(a, b) and da == db
