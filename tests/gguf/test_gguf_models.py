"""Whole tiny models from GGUF files: the same random weights saved by transformers and written as
GGUF the way llama.cpp's converter lays them out. Logits in exact math equal transformers' on the
weights the `gguf` package dequantizes from the file (the oracle); Q8_0 decodes the safetensors twin's
greedy tokens; each expert is served as exactly its bytes in the file."""

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
    reference_with,
    tokenizer_metadata,
    write_gguf,
)

from expertcache import LLM, SamplingParams
from expertcache.errors import CheckpointError

PROMPT = [1, 5, 9, 33, 100, 7, 250, 3]


def _meta(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    return cfg, qwen3moe_metadata(cfg) + tokenizer_metadata(
        ckpt / "tokenizer.json", "qwen2", cfg["vocab_size"], eos="<|im_end|>", chat_template=C.CHAT_TEMPLATE
    )


@pytest.fixture(scope="module")
def qwen3_gguf(qwen3_checkpoint, tmp_path_factory):
    """type -> a .gguf file of the tiny Qwen3-MoE checkpoint's weights (experts and 2-D dense in that type)."""
    root = tmp_path_factory.mktemp("gguf")
    arrays = gguf_names(C.read_tensors(qwen3_checkpoint))
    _, meta = _meta(qwen3_checkpoint)
    files = {}

    def get(t: str):
        if t not in files:
            files[t] = write_gguf(root / f"m-{t}.gguf", "qwen3moe", arrays, meta, default_types(t, t))
        return files[t]

    return get


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
def test_logits_equal_transformers_on_the_dequantized_weights(qwen3_checkpoint, qwen3_gguf, type_name):
    path = qwen3_gguf(type_name)
    ref_model = reference_with(C.load_reference(qwen3_checkpoint), dequantized_tensors(path))
    expected = C.reference_logits(ref_model, PROMPT)
    llm = LLM(str(path))
    try:
        assert (
            llm.source.method is None
            if type_name in ("F32", "F16", "BF16")
            else llm.source.method.name == f"gguf-{type_name.lower()}"
        )
        got = llm.logits(PROMPT)
    finally:
        llm.close()
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel < 1e-3, rel


def test_q8_0_decodes_the_safetensors_twins_greedy_tokens(qwen3_checkpoint, qwen3_gguf):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for model in (qwen3_checkpoint, qwen3_gguf("Q8_0")):
        llm = LLM(str(model))
        try:
            outs.append(llm.generate([PROMPT], params)[0].token_ids)
        finally:
            llm.close()
    assert outs[0] == outs[1]


def test_each_expert_is_its_bytes_in_the_file_in_every_tier(qwen3_gguf):
    path = qwen3_gguf("Q4_0")
    gf = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    data = path.read_bytes()
    resident = LLM(str(path))
    tiered = LLM(str(path), device_memory="25%", prefetch=False)  # 2 of 8 slots per layer: disk reads
    try:
        src = resident.source
        for layer in (0, 1):
            for j in (0, 5):
                ranges = src.ranges(layer, j)
                for proj in ("gate", "up", "down"):
                    t = gf[f"blk.{layer}.ffn_{proj}_exps.weight"]
                    per = t.n_bytes // 8
                    ((_file, off, n),) = ranges[f"{proj}.weight"]
                    assert (off, n) == (t.data_offset + j * per, per)
                    assert data[off : off + n] == t.data[j].tobytes()
        assert src.expert_nbytes == sum(
            gf[f"blk.0.ffn_{p}_exps.weight"].n_bytes // 8 for p in ("gate", "up", "down")
        )
        torch.testing.assert_close(tiered.logits(PROMPT), resident.logits(PROMPT), rtol=1e-5, atol=1e-5)
    finally:
        resident.close()
        tiered.close()


def test_text_in_and_out_through_the_files_tokenizer(qwen3_gguf, qwen3_checkpoint):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    texts = []
    for model in (qwen3_checkpoint, qwen3_gguf("F32")):
        llm = LLM(str(model))
        try:
            out = llm.chat([{"role": "user", "content": "hello world"}], params)[0]
            texts.append((out.prompt_token_ids, out.token_ids, out.text))
            assert llm.tokenizer.eos_token == "<|im_end|>"
        finally:
            llm.close()
    assert texts[0] == texts[1]


def test_missing_tensor_and_wrong_shape_are_refused_naming_them(qwen3_checkpoint, tmp_path):
    arrays = gguf_names(C.read_tensors(qwen3_checkpoint))
    _cfg, meta = _meta(qwen3_checkpoint)
    less = {k: v for k, v in arrays.items() if k != "blk.1.attn_k.weight"}
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor blk\.1\.attn_k\.weight \(model\.layers\.1\.self_attn\.k_proj\.weight\)",
    ):
        LLM(str(write_gguf(tmp_path / "less.gguf", "qwen3moe", less, meta)))
    wrong = [(k, 1 if k.endswith("head_count_kv") else v, kind) for k, v, kind in meta]
    with pytest.raises(
        CheckpointError,
        match=r"tensor blk\.0\.attn_k\.weight .* has shape \[32, 64\], the config "
        r"implies \[16, 64\]",
    ):
        LLM(str(write_gguf(tmp_path / "wrong.gguf", "qwen3moe", arrays, wrong)))
    no_arch = [(k.replace("qwen3moe.", "foo."), v, kind) for k, v, kind in meta]
    with pytest.raises(CheckpointError, match="GGUF architecture 'foo' is not supported"):
        LLM(str(write_gguf(tmp_path / "foo.gguf", "foo", arrays, no_arch)))
    no_key = [m for m in meta if m[0] != "qwen3moe.expert_count"]
    with pytest.raises(CheckpointError, match="missing metadata qwen3moe.expert_count"):
        LLM(str(write_gguf(tmp_path / "nokey.gguf", "qwen3moe", arrays, no_key)))


def test_experts_whose_types_differ_by_layer_or_projection_load(qwen3_checkpoint, tmp_path):
    """Down experts Q8_0 in layer 0, Q4_0 in layer 1: gguf-layers (K-quant mixes: test_gguf_layers.py);
    down Q4_0 under Q8_0 gate/up in every layer: the per-projection method."""
    arrays = gguf_names(C.read_tensors(qwen3_checkpoint))
    _, meta = _meta(qwen3_checkpoint)

    def layer_mixed(name, arr):
        if "ffn_down_exps" in name:
            return "Q8_0" if name.startswith("blk.0.") else "Q4_0"
        return default_types("Q8_0", "F32")(name, arr)

    def proj_mixed(name, arr):
        return "Q4_0" if "ffn_down_exps" in name else default_types("Q8_0", "F32")(name, arr)

    for name, types, method in (
        ("layers", layer_mixed, "gguf-layers"),
        ("proj", proj_mixed, "gguf-mixed:q8_0,q8_0,q4_0"),
    ):
        path = write_gguf(tmp_path / f"{name}.gguf", "qwen3moe", arrays, meta, types)
        ref_model = reference_with(C.load_reference(qwen3_checkpoint), dequantized_tensors(path))
        llm = LLM(str(path))
        try:
            assert llm.source.method.name == method
            expected = C.reference_logits(ref_model, PROMPT)
            got = llm.logits(PROMPT)
        finally:
            llm.close()
        assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-3


def test_plan_sizes_a_gguf_file_from_its_header(qwen3_gguf, capsys):
    from expertcache.cli import main

    main(["plan", str(qwen3_gguf("Q4_0"))])
    out = capsys.readouterr().out
    # gate and up [32, 64] = 32 rows x 2 Q4_0 blocks of 18 bytes each; down [64, 32] = 64 rows x 1 block
    per_expert = 2 * 32 * 2 * 18 + 64 * 18
    assert per_expert == 3456
    assert "one expert: 3.38 KiB stored (gguf-q4_0)" in out and "Qwen3MoeForCausalLM" in out


@pytest.mark.parametrize("type_name", ["F32", "Q8_0"])
def test_gate_up_in_one_stack(qwen3_checkpoint, tmp_path, type_name):
    """blk.N.ffn_gate_up_exps [in, 2I, E] (gate rows first): served as experts.gate_up_proj, each expert
    one byte range."""
    _, meta = _meta(qwen3_checkpoint)
    arrays = gguf_names(C.read_tensors(qwen3_checkpoint), gate_up=True)
    path = write_gguf(tmp_path / "gu.gguf", "qwen3moe", arrays, meta, default_types(type_name, type_name))
    expected = C.reference_logits(
        reference_with(C.load_reference(qwen3_checkpoint), dequantized_tensors(path)), PROMPT
    )
    llm = LLM(str(path))
    try:
        t = {x.name: x for x in gguf.GGUFReader(str(path)).tensors}["blk.0.ffn_gate_up_exps.weight"]
        key = "gate_up.weight" if type_name == "Q8_0" else "gate_up"
        ((_, off, n),) = llm.source.ranges(0, 5)[key]
        assert (off, n) == (t.data_offset + 5 * (t.n_bytes // 8), t.n_bytes // 8)
        got = llm.logits(PROMPT)
    finally:
        llm.close()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-3


def test_low_memory_reads_embedding_rows_from_the_file(qwen3_gguf):
    """Under --low-memory on the CPU an untied embedding stays in the GGUF file, a float one or one in
    blocks (its rows read per step, blocks decoded after the read); without it a block-type one is held
    as its blocks."""
    for type_name, held in (("F32", "Table"), ("Q8_0", "BlockTable")):
        path = qwen3_gguf(type_name)
        full, low = LLM(str(path)), LLM(str(path), low_memory=True)
        try:
            assert type(low.model.embed).__name__ == "RowReader"
            assert type(full.model.embed).__name__ == held
            torch.testing.assert_close(low.logits(PROMPT), full.logits(PROMPT), rtol=0, atol=0)
        finally:
            full.close()
            low.close()


def test_expert_parallel_ranks_read_the_gguf_file_and_equal_one_process(qwen3_gguf):
    path = qwen3_gguf("Q8_0")
    one = LLM(str(path))
    try:
        want = one.logits(PROMPT)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        tokens = one.generate([PROMPT], params)[0].token_ids
    finally:
        one.close()
    ep = LLM(str(path), expert_parallel=2)
    try:
        assert ep.expert_stats()["expert_parallel"]["world_size"] == 2
        assert torch.allclose(ep.logits(PROMPT), want, rtol=1e-4, atol=1e-4)
        assert ep.generate([PROMPT], params)[0].token_ids == tokens
        assert sum(ep.expert_stats()["expert_parallel"]["pairs_per_rank_last_step"]) > 0
    finally:
        ep.close()


def test_streamed_experts_are_freed_after_their_miss_is_computed(qwen3_gguf):
    """--low-memory with no host tier: a miss is read into a scratch pool and computed from it; the
    kernels' spec cache must not keep that pool (each round leaked every miss's bytes: 2.5 MiB an expert
    of Qwen3-30B-A3B's Q4_0, killed in a memory cgroup after a few requests)."""
    import gc

    from expertcache import kernels

    if kernels.extension() is None:
        pytest.skip("needs the C++ kernels")
    llm = LLM(str(qwen3_gguf("Q4_0")), low_memory=True, device_memory="25%", host_memory="0")
    try:
        sizes = []
        for _ in range(4):
            llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            gc.collect()
            sizes.append(len(kernels._SPECS))
        disk = llm.expert_stats()["per_tier"]["disk"]["bytes_read"]
    finally:
        llm.close()
    assert disk > 0  # misses were streamed from the file
    assert sizes[-1] == sizes[1], sizes  # no entry per miss
