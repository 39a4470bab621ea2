"""bench/real_scale.py's checkpoint writer at toy sizes (the real config.json fields, the shipped
layouts) read by the engine and compared with transformers on the same weights, and its summary
line against hand-computed figures. No llama.cpp here: the benchmark itself is not part of CI."""

from __future__ import annotations

import json
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


def test_ours_from_and_cpu_math_parse_and_refuse():
    a = R.parse_args([])
    assert (a.ours_from, a.cpu_math, a.layers, a.format, a.peer) == (
        ["safetensors"],
        ["auto"],
        24,
        "mxfp4",
        "MXFP4",
    )
    a = R.parse_args(["--ours-from", "safetensors", "gguf", "gguf", "--cpu-math", "auto", "fast"])
    assert R.engines(a) == [
        ("auto", "safetensors"),
        ("fast", "safetensors"),
        ("auto", "gguf"),
        ("fast", "gguf"),
    ]
    a = R.parse_args(
        ["--model", "qwen3-30b-a3b", "--format", "q4_k_m", "--ours-from", "gguf", "--layers", "4"]
    )
    assert (a.peer, a.layers) == ("Q4_K_M", 4)
    with pytest.raises(SystemExit, match="--ours-from gguf"):
        R.parse_args(["--model", "qwen3-30b-a3b", "--format", "q4_k_m"])
    with pytest.raises(SystemExit, match="only with --write-only"):
        R.parse_args(["--gguf"])
    with pytest.raises(SystemExit, match="--llama-output"):
        R.parse_args(["--llama-output", "q8_0"])
    with pytest.raises(SystemExit):  # argparse: not a source
        R.parse_args(["--ours-from", "bin"])


def test_resident_part_gives_each_source_its_own_engine_and_limit(tmp_path, monkeypatch, capsys):
    """--ours-from safetensors gguf: one engine per source, each started on its own path, each figure
    beside its own bytes per token x the round's read probe (fakes for llama-bench, the probe and the
    expertcache process: plumbing only)."""
    import kernel_bench
    import llama_cpp_bench

    ckpt, gguf = tmp_path / "ckpt", tmp_path / "m.gguf"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"\0" * 1000)
    gguf.write_bytes(b"\0" * 600)
    started = []

    class FakeWorker:
        def __init__(self, model, prompt, gen, threads, options, warm=()):
            started.append((Path(model), options["cpu_math"]))
            gb = 2.0 if Path(model).suffix == ".gguf" else 4.0
            resident = Path(model).suffix != ".gguf"  # as if the budget held fewer of the GGUF's experts
            self.info = {"bytes_per_token": gb * 1e9, "cpu_math": "fast", "experts_resident": resident}
            self.tg = 1.0 if Path(model).suffix == ".gguf" else 2.0

        def measure(self, prompt, gen):
            return {"pp": 10.0, "tg": self.tg}

        def close(self):
            pass

    rows = [{"n_prompt": 8, "n_gen": 0, "avg_ts": 5.0}, {"n_prompt": 0, "n_gen": 2, "avg_ts": 0.5}]
    monkeypatch.setattr(llama_cpp_bench, "Worker", FakeWorker)
    monkeypatch.setattr(llama_cpp_bench, "llama_bench_rows", lambda *a, **k: rows)
    monkeypatch.setattr(kernel_bench, "read_bandwidth", lambda: 20.0)
    args = R.parse_args(
        ["--ours-from", "safetensors", "gguf", "--rounds", "2", "--prompts", "8", "--gen", "2"]
        + ["--fresh-workers"]
    )
    R.resident_part(args, "model=toy", {"safetensors": ckpt, "gguf": gguf}, tmp_path, "8")
    # fresh workers: every engine started in every round, on its own source
    assert started == [(ckpt, "auto"), (gguf, "auto")] * 2
    out = capsys.readouterr().out.splitlines()
    fields = [dict(re.findall(r"(\w+)=([^\s]+)", x)) for x in out]
    summary = {f["engine"]: f for f, x in zip(fields, out) if x.startswith("summary:") and f["test"] == "tg2"}
    assert sorted(summary) == ["auto:gguf", "auto:safetensors"]
    # gguf: 2 GB/token x 20 GB/s = 10 tok/s, reached 1.0 (10%); safetensors: 4 GB x 20 -> 5 tok/s, 2.0 (40%)
    assert (summary["auto:gguf"]["limit_tok_s"], summary["auto:gguf"]["expertcache_share_of_limit"]) == (
        "10.00",
        "10%",
    )
    assert (summary["auto:safetensors"]["limit_tok_s"], summary["auto:safetensors"]["ratio"]) == (
        "5.00",
        "4.00",
    )
    assert summary["auto:gguf"]["cpu_math"] == "fast"  # the math the engine resolved auto to
    assert "weights_GB=0.00" in out[0] and "safetensors, gguf" in out[0]
    held = {
        f["engine"]: f["experts"] for f, x in zip(fields, out) if x.startswith("round:") and "experts" in f
    }
    assert held == {"auto:safetensors": "resident", "auto:gguf": "CACHED"}
    assert [x for x in out if x.startswith("note:")] == [
        next(x for x in out if x.startswith("note: engine=auto:gguf held fewer"))
    ]


def test_worker_on_a_gguf_file_counts_the_files_bytes_per_token(tmp_path):
    """The limit beside an `auto:gguf` figure is the worker's bytes per token: for a GGUF source they must
    be the file's own (top_k of E experts per layer, the attention, the router, the output matrix), counted
    here independently by the `gguf` package's reader."""
    gguf = pytest.importorskip("gguf")
    from gguf_files import default_types, gguf_names, qwen3moe_metadata, tokenizer_metadata, write_gguf
    from llama_cpp_bench import Worker

    # the worker's prompts are token ids up to 2000 and its context at least 512
    ckpt = C.make_checkpoint(tmp_path, "qwen3_moe", name="q", max_position_embeddings=1024, vocab_size=2048)
    cfg = json.loads((ckpt / "config.json").read_text())
    meta = qwen3moe_metadata(cfg) + tokenizer_metadata(
        ckpt / "tokenizer.json", "qwen2", cfg["vocab_size"], eos="<|im_end|>"
    )
    path = write_gguf(
        tmp_path / "m.gguf", "qwen3moe", gguf_names(C.read_tensors(ckpt)), meta, default_types("Q8_0", "F32")
    )
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
    read = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_gate_inp")
    expected = (
        sum(n for name, n in tensors.items() if "_exps." in name) * k // E
        + sum(n for name, n in tensors.items() if name.startswith("blk.") and name.split(".")[2] in read)
        + tensors["output.weight"]
    )
    w = Worker(path, 8, 2, 1, {"cpu_math": "exact"})
    try:
        assert w.info["bytes_per_token"] == expected
        assert w.info["experts_resident"] and w.info["cpu_math"] == "exact"
        assert w.measure(8, 2)["tg"] > 0
    finally:
        w.close()
