"""GLM-4.5 from GGUF (arch glm4moe): sigmoid routing with the correction bias (exp_probs_b), shared
experts, the dense first layer, partial rotary from rope.dimension_count, and the trailing MTP layer
(counted in block_count) skipped as the safetensors path skips it. Logits equal transformers' on the
weights the `gguf` package dequantizes; Q8_0 decodes the safetensors twin's greedy tokens."""

import json

import pytest

gguf = pytest.importorskip("gguf")

import checkpoints as C
from gguf_files import (
    default_types,
    glm4moe_metadata,
    glm4moe_names,
    glm4moe_state,
    reference_with,
    tokenizer_metadata,
    write_gguf,
)

from expertcache import LLM, SamplingParams

PROMPT = [1, 12, 50, 99, 150, 7, 33, 21, 40, 11]


@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_logits_equal_transformers_on_the_dequantized_weights(checkpoint, tmp_path, type_name, capfd):
    ckpt = checkpoint("glm4_moe")
    cfg = json.loads((ckpt / "config.json").read_text())
    meta = glm4moe_metadata(cfg, nextn=1) + tokenizer_metadata(
        ckpt / "tokenizer.json", "glm4", cfg["vocab_size"], eos="<|im_end|>"
    )
    path = write_gguf(
        tmp_path / "g.gguf",
        "glm4moe",
        glm4moe_names(C.read_tensors(ckpt), mtp_layer=2),
        meta,
        default_types(type_name, type_name),
    )
    expected = C.reference_logits(reference_with(C.load_reference(ckpt), glm4moe_state(path, 2)), PROMPT)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path))
    try:
        c = llm.cfg
        assert (
            c.num_layers == 2
            and c.rotary_dim == 8
            and c.router.kind == "noaux_tc"
            and c.moe_layers == (False, True)
        )
        assert c.shared_expert_intermediate_size == 32 and c.router.scaling == 1.5
        got = llm.logits(PROMPT)
        greedy = llm.generate([PROMPT], params)[0].token_ids
    finally:
        llm.close()
    assert "multi-token-prediction layer(s) in the checkpoint: model.layers.{2}" in capfd.readouterr().err
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-3
    if type_name == "Q8_0":
        twin = LLM(str(ckpt))
        try:
            assert twin.generate([PROMPT], params)[0].token_ids == greedy
        finally:
            twin.close()


def test_down_experts_in_a_different_type_per_layer(checkpoint, tmp_path):
    """GLM-4.5-Air's Q4_K_M shape: expert rows that are not whole 256-blocks fall back to 32-blocks, the
    down experts Q8_0 in one MoE layer and Q5_0 in the other (gguf-layers); the dense first layer has none."""
    ckpt = checkpoint("glm4_moe", num_hidden_layers=3)
    cfg = json.loads((ckpt / "config.json").read_text())
    meta = glm4moe_metadata(cfg, nextn=1) + tokenizer_metadata(
        ckpt / "tokenizer.json", "glm4", cfg["vocab_size"], eos="<|im_end|>"
    )

    def types(name, arr):
        if "ffn_down_exps" in name:
            return "Q8_0" if name.startswith("blk.1.") else "Q5_0"
        return default_types("Q5_0", "Q8_0")(name, arr)

    path = write_gguf(
        tmp_path / "g.gguf", "glm4moe", glm4moe_names(C.read_tensors(ckpt), mtp_layer=3), meta, types
    )
    expected = C.reference_logits(reference_with(C.load_reference(ckpt), glm4moe_state(path, 3)), PROMPT)
    llm = LLM(str(path))
    try:
        assert llm.cfg.moe_layers == (False, True, True)
        assert llm.source.method.name == "gguf-layers"
        assert [p.name for p in llm.source.layer_parts(1)] == ["gate.q5_0", "up.q5_0", "down.q8_0"]
        assert [p.name for p in llm.source.layer_parts(2)] == ["gate.q5_0", "up.q5_0", "down.q5_0"]
        got = llm.logits(PROMPT)
    finally:
        llm.close()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-3
