"""bench/real_scale.py's checkpoint writer at toy sizes (the real config.json fields, the shipped
layouts) read by the engine and compared with transformers on the same weights, and its summary
line against hand-computed figures. No llama.cpp here: the benchmark itself is not part of CI."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import checkpoints as C
import pytest
import torch

from expertcache import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import real_scale as R  # noqa: E402

TOY = {
    "gpt-oss-20b": dict(
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        eos_token_id=2,
        pad_token_id=1,
    ),
    "qwen3-30b-a3b": dict(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]
NEW = 8


def write(tmp_path: Path, model: str) -> Path:
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    C.write_tokenizer(tok)
    vocab = -(-C.tokenizer_vocab_size() // 64) * 64
    return R.write_checkpoint(model, tmp_path / model, 3, tok, vocab_size=vocab, **TOY[model])


def transformers_on(path: Path):
    """transformers' model for the checkpoint's config.json, fp32, MXFP4 experts dequantized by
    transformers' own converter (integrations.mxfp4.convert_moe_packed_tensors)."""
    from gpt_oss_checkpoints import dequantized_state
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    state = dequantized_state(C.read_tensors(path))
    model.load_state_dict(
        C.fuse_experts(state), strict=True
    )  # per-expert Qwen3 tensors as transformers holds them
    return model


@pytest.mark.parametrize("model", sorted(TOY))
def test_written_checkpoint_runs_as_transformers_does(tmp_path, model):
    path = write(tmp_path, model)
    names = set(C.read_tensors(path))
    if model == "gpt-oss-20b":  # shipped MXFP4 layout: [E, out, in/32, 16] codes, [E, out, in/32] e8m0 scales
        t = C.read_tensors(path)
        assert t["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (32, 128, 2, 16)
        assert t["model.layers.0.mlp.experts.down_proj_scales"].shape == (32, 64, 2)
        assert "model.layers.2.self_attn.sinks" in names
    else:
        assert "model.layers.2.mlp.experts.7.down_proj.weight" in names
    llm = LLM(str(path), max_model_len=64, kv_cache_memory="4MiB", cpu_math="exact")
    got = list(
        llm.generate([PROMPT], SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))[0].token_ids
    )
    assert got == C.reference_greedy(transformers_on(path), PROMPT, NEW)


def test_layout_counts_the_bytes_safetensors_holds(tmp_path):
    path = write(tmp_path, "gpt-oss-20b")
    lay = R.layout(path)
    t = C.read_tensors(path)
    experts0 = sum(
        v.numel() * v.element_size() for k, v in t.items() if k.startswith("model.layers.0.mlp.experts.")
    )
    outside = sum(v.numel() * v.element_size() for k, v in t.items() if not k.startswith("model.layers."))
    assert lay["layers"][0]["experts"] == experts0 and lay["outside"] == outside
    assert sorted(lay["layers"]) == [0, 1, 2]


def test_summary_line(capsys):
    res = {
        "llama.cpp": [
            {"tg16": 2.0, "pp128": 10.0},
            {"tg16": 4.0, "pp128": 20.0},
            {"tg16": 3.0, "pp128": 30.0},
        ],
        "fast": [{"tg16": 3.0, "pp128": 30.0}, {"tg16": 4.0, "pp128": 20.0}, {"tg16": 9.0, "pp128": 60.0}],
    }
    R.summarize("model=m", res, {"tg16": (8.0, "x")})
    lines = capsys.readouterr().out.splitlines()
    fields = [dict(re.findall(r"(\w+)=([^\s]+)", line)) for line in lines]
    tg = next(f for f in fields if f["test"] == "tg16")
    # medians 3.0 and 4.0; per-round ratios 1.5, 1.0, 3.0
    assert (tg["llama_tok_s"], tg["expertcache_tok_s"], tg["ratio"]) == ("3.00", "4.00", "1.33")
    assert (tg["round_ratio_median"], tg["round_ratio_range"]) == ("1.50", "1.00-3.00")
    assert (tg["limit_tok_s"], tg["expertcache_share_of_limit"]) == ("8.00", "50%")
    pp = next(f for f in fields if f["test"] == "pp128")
    assert (pp["ratio"], pp["limit"]) == ("1.50", "n/a")


def test_cgroup_limit_keeps_the_full_models_memory_per_layer():
    lay = {"layers": {0: {"experts": 400, "dense": 100}, 1: {"experts": 400, "dense": 100}}, "outside": 1000}
    # all 4 layers written: 45% of 3000 bytes
    full = {"layers": {i: {"experts": 400, "dense": 100} for i in range(4)}, "outside": 1000}
    assert R.cgroup_bytes(full, 0.45, 4) == 1350
    # 2 of 4 written: the outside 1000 bytes plus half of the 350 the 4 layers had
    assert R.cgroup_bytes(lay, 0.45, 4) == 1175
    with pytest.raises(SystemExit, match="outside the layers"):
        R.cgroup_bytes(lay, 0.3, 4)
