"""GPT-OSS from GGUF: biases, sinks, the sliding window, the clamped SwiGLU and YaRN rebuilt from the
metadata; experts split by the converter into gate/up/down stacks (MXFP4 or F32) served as one
gate_up per expert (gate rows, then up rows) in their file bytes. Logits equal transformers' on the
weights the `gguf` package dequantizes from the file (rel < 1e-3); MXFP4 decodes the greedy tokens
of the same weights shipped as MXFP4 safetensors."""

import json

import pytest

gguf = pytest.importorskip("gguf")

import checkpoints as C
import gpt_oss_checkpoints as G
from gguf_files import (
    default_types,
    gpt_oss_metadata,
    gpt_oss_names,
    gpt_oss_state,
    tokenizer_metadata,
    write_gguf,
)

from expertcache import LLM, SamplingParams

PROMPT = [1, 12, 50, 99, 150, 7, 33, 21, 40, 11]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-gpt-oss")
    ckpt = G.make_gpt_oss(root)
    cfg = json.loads((ckpt / "config.json").read_text())
    arrays = gpt_oss_names(C.read_tensors(ckpt))
    meta = gpt_oss_metadata(cfg) + tokenizer_metadata(
        ckpt / "tokenizer.json", "gpt-4o", cfg["vocab_size"], eos="<|return|>"
    )
    files = {
        t: write_gguf(root / f"g-{t}.gguf", "gpt-oss", arrays, meta, default_types(t, "F32"))
        for t in ("F32", "MXFP4")
    }
    return ckpt, files


@pytest.mark.parametrize("type_name", ["F32", "MXFP4"])
def test_logits_equal_transformers_on_the_dequantized_weights(gpt_oss, type_name):
    ckpt, files = gpt_oss
    ref_model = C.load_reference(ckpt)
    ref_model.load_state_dict(gpt_oss_state(files[type_name]))
    expected = C.reference_logits(ref_model, PROMPT)
    llm = LLM(str(files[type_name]))
    try:
        cfg = llm.cfg
        assert cfg.attn_sinks and cfg.expert_bias and cfg.router_bias and cfg.swiglu_limit == 7.0
        assert cfg.sliding_window == (4, None, 4) and cfg.rope["rope_type"] == "yarn"
        assert (llm.source.method.name if llm.source.method else None) == (
            "gguf-mxfp4" if type_name == "MXFP4" else None
        )
        got = llm.logits(PROMPT)
    finally:
        llm.close()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-3


def test_gate_up_is_the_gate_then_the_up_stacks_bytes(gpt_oss):
    _, files = gpt_oss
    path = files["MXFP4"]
    t = {x.name: x for x in gguf.GGUFReader(str(path)).tensors}
    data = path.read_bytes()
    llm = LLM(str(path))
    try:
        ranges = llm.source.ranges(1, 3)
        got = b"".join(data[o : o + n] for _, o, n in ranges["gate_up.weight"])
        assert (
            got
            == t["blk.1.ffn_gate_exps.weight"].data[3].tobytes()
            + t["blk.1.ffn_up_exps.weight"].data[3].tobytes()
        )
        got = b"".join(data[o : o + n] for _, o, n in ranges["gate_up_bias"])
        assert (
            got
            == t["blk.1.ffn_gate_exps.bias"].data[3].tobytes() + t["blk.1.ffn_up_exps.bias"].data[3].tobytes()
        )
    finally:
        llm.close()


def test_mxfp4_greedy_equals_the_shipped_mxfp4_twin(gpt_oss, tmp_path):
    ckpt, files = gpt_oss
    twin = G.to_shipped_mxfp4(ckpt, tmp_path / "mxfp4")
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = []
    for model in (twin, files["MXFP4"]):
        llm = LLM(str(model))
        try:
            outs.append(llm.generate([PROMPT], params)[0].token_ids)
        finally:
            llm.close()
    assert outs[0] == outs[1]
