"""DeepSeek-V2 / V3 from GGUF (arch deepseek2): MLA dims from key_length_mla / value_length_mla /
kv_lora_rank (the converter writes MQA: head_count_kv 1), kv_b_proj whole (attn_kv_b, older files) or
split into attn_k_b (transposed) + attn_v_b (newer), softmax routing (V2) or sigmoid + exp_probs_b with
groups (V3), shared experts, the dense first layer. Logits equal transformers' on the weights the
`gguf` package dequantizes, and so do the greedy tokens."""

import json

import pytest

gguf = pytest.importorskip("gguf")

import checkpoints as C
from gguf_files import (
    deepseek_metadata,
    deepseek_names,
    deepseek_state,
    default_types,
    reference_with,
    tokenizer_metadata,
    write_gguf,
)

from expertcache import LLM, SamplingParams

PROMPT = [1, 12, 50, 99, 150, 7, 33, 21, 40, 11]


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("split_kv_b", [True, False])
@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_logits_equal_transformers_on_the_dequantized_weights(
    checkpoint, tmp_path, family, split_kv_b, type_name
):
    ckpt = checkpoint(family)
    cfg = json.loads((ckpt / "config.json").read_text())
    meta = deepseek_metadata(cfg) + tokenizer_metadata(
        ckpt / "tokenizer.json", "deepseek-v3", cfg["vocab_size"], eos="<|im_end|>"
    )
    path = write_gguf(
        tmp_path / "d.gguf",
        "deepseek2",
        deepseek_names(C.read_tensors(ckpt), cfg, split_kv_b),
        meta,
        default_types(type_name, type_name),
    )
    ref_model = reference_with(C.load_reference(ckpt), deepseek_state(path, cfg))
    expected = C.reference_logits(ref_model, PROMPT)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path))
    try:
        c = llm.cfg
        assert c.family == family and c.mla is not None and c.mla.kv_lora_rank == 16
        assert c.router.kind == ("noaux_tc" if family == "deepseek_v3" else "softmax")
        got = llm.logits(PROMPT)
        greedy = llm.generate([PROMPT], params)[0].token_ids
    finally:
        llm.close()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-3
    # (against transformers on the file's weights: Q8_0's rounding moves a near-tie of this tiny random
    # model away from the float twin's choice at the 5th token)
    assert greedy == C.reference_greedy(ref_model, PROMPT, 10)
