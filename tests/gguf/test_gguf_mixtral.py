"""Mixtral from GGUF (arch `llama` with experts): q/k rows un-permuted (the converter permutes them for
ggml's rope), experts stacked (`ffn_*_exps`) or one tensor per expert (older files). Logits equal
transformers' on the weights the `gguf` package dequantizes; Q8_0 decodes the safetensors twin's
greedy tokens."""

import json
import re

import pytest

gguf = pytest.importorskip("gguf")

import checkpoints as C
from gguf_files import (
    default_types,
    mixtral_metadata,
    mixtral_names,
    mixtral_state,
    reference_with,
    tokenizer_metadata,
    write_gguf,
)

from expertcache import LLM, SamplingParams
from expertcache.errors import CheckpointError

PROMPT = [1, 12, 50, 99, 150, 7, 33, 21, 40, 11]


@pytest.fixture(scope="module")
def mixtral(checkpoint):
    ckpt = checkpoint("mixtral")
    cfg = json.loads((ckpt / "config.json").read_text())
    meta = mixtral_metadata(cfg) + tokenizer_metadata(
        ckpt / "tokenizer.json", "qwen2", cfg["vocab_size"], eos="<|im_end|>"
    )
    return ckpt, cfg, meta


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_logits_equal_transformers_on_the_dequantized_weights(mixtral, tmp_path, stacked, type_name):
    ckpt, cfg, meta = mixtral
    path = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        mixtral_names(C.read_tensors(ckpt), cfg, stacked),
        meta,
        default_types(type_name, type_name),
    )
    expected = C.reference_logits(reference_with(C.load_reference(ckpt), mixtral_state(path, cfg)), PROMPT)
    llm = LLM(str(path))
    try:
        assert llm.cfg.family == "mixtral"
        got = llm.logits(PROMPT)
        if type_name == "Q8_0":
            assert llm.source.method.name == "gguf-q8_0"
            greedy = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-3
    if type_name == "Q8_0":
        twin = LLM(str(ckpt))
        try:
            ref = twin.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        finally:
            twin.close()
        assert greedy[0].token_ids == ref[0].token_ids


def test_a_dense_llama_is_refused(mixtral, tmp_path):
    ckpt, cfg, meta = mixtral
    dense = [m for m in meta if not m[0].startswith("llama.expert_")]
    path = write_gguf(tmp_path / "d.gguf", "llama", mixtral_names(C.read_tensors(ckpt), cfg), dense)
    with pytest.raises(CheckpointError, match="a dense llama model"):
        LLM(str(path))


@pytest.mark.parametrize("stacked", [True, False])
def test_down_experts_in_a_different_type_per_layer(mixtral, tmp_path, stacked):
    """Down experts Q4_0 in layer 1, Q8_0 in layer 0 (gguf-layers), stacked or one tensor per expert."""
    ckpt, cfg, meta = mixtral

    def types(name, arr):
        if not re.match(r"^blk\.\d+\.ffn_(gate|up|down)(_exps|\.\d+)\.weight$", name):
            return "F32"  # dense, norms, router
        return "Q4_0" if name.startswith("blk.1.ffn_down") else "Q8_0"

    path = write_gguf(
        tmp_path / "m.gguf", "llama", mixtral_names(C.read_tensors(ckpt), cfg, stacked), meta, types
    )
    expected = C.reference_logits(reference_with(C.load_reference(ckpt), mixtral_state(path, cfg)), PROMPT)
    llm = LLM(str(path))
    tiered = LLM(str(path), device_memory="25%", prefetch=False)
    try:
        assert llm.source.method.name == "gguf-layers"
        assert [p.name for p in llm.source.layer_parts(1)] == ["gate.q8_0", "up.q8_0", "down.q4_0"]
        got = llm.logits(PROMPT)
        assert ((tiered.logits(PROMPT) - got).abs().max() / got.abs().max()).item() < 1e-5
        tiered.experts.check(contents=True)
    finally:
        llm.close()
        tiered.close()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-3
