"""The embedding table on disk under --low-memory (loader/rows.py, models/embedding.py).

Rows read by RowReader equal safetensors' own loader's; a low-memory model whose untied table stays on
disk gives bitwise the logits and greedy tokens of the same model holding the table; a tied table stays
in memory (lm_head is it); the device plan's dense term drops by exactly V x H x itemsize and still
equals what the engine allocates; a NaN/inf row is refused naming the token id, the tensor and the
file when that token is used (the load no longer scans the table).
"""

from __future__ import annotations

import json
import os

import checkpoints as C
import gpt_oss_checkpoints as G
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from expertcache import LLM, SamplingParams
from expertcache.build import fill
from expertcache.build.plan import dense_bytes
from expertcache.cli import main
from expertcache.errors import CheckpointError
from expertcache.loader.rows import RowReader, readable
from expertcache.loader.safetensors_index import TensorIndex
from expertcache.models import embedding
from expertcache.units import fmt_bytes

EMBED = "model.embed_tokens.weight"
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# repeats, runs of consecutive ids (one read each), ids out of order, the first and a high id
PROMPTS = [[5, 6, 7, 7, 3, 200, 201, 202, 5, 0, 9, 9, 9, 150], [100, 101, 102], [42] * 6]
LOW = dict(low_memory=True, device_memory="25%", host_memory="0")


# -- RowReader against safetensors' own reader --------------------------------------------------------


def _table_file(tmp_path, dtype, nan_row=None, inf_row=None):
    """A safetensors file whose table is neither its first tensor nor at the data section's start."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 24, generator=g).to(dtype)
    if nan_row is not None:
        table[nan_row, 3] = float("nan")
    if inf_row is not None:
        table[inf_row, 0] = float("-inf")
    path = tmp_path / "model.safetensors"
    save_file(
        {"a.weight": torch.randn(3, 5, generator=g), "b.table": table, "z.bias": torch.randn(7, generator=g)},
        str(path),
    )
    return path, TensorIndex(tmp_path).info("b.table")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_equal_safetensors_reads(tmp_path, monkeypatch, dtype):
    path, info = _table_file(tmp_path, dtype)
    reads = []
    real = os.preadv

    def preadv(fd, bufs, offset):
        reads.append(offset)
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    reader = RowReader(info)
    ids = torch.tensor([[7, 3, 3, 4], [5, 49, 0, 7]])
    with safe_open(str(path), "pt") as f:
        expected = f.get_tensor("b.table")[ids]  # [2, 4, 24]
    got = reader.rows(ids)
    assert got.dtype == dtype and torch.equal(got, expected)
    # distinct ids {0, 3, 4, 5, 7, 49}: each read once, consecutive ones together (4 reads)
    row = 24 * dtype.itemsize
    assert reader.bytes_read == 6 * row
    assert reads == [info.offset + r * row for r in (0, 3, 7, 49)]
    assert reader.rows(torch.tensor([], dtype=torch.long)).shape == (0, 24)
    reader.close()


def test_rows_out_of_range_and_unreadable(tmp_path):
    _, info = _table_file(tmp_path, torch.bfloat16)
    reader = RowReader(info)
    for bad in (-1, 50):
        with pytest.raises(
            ValueError, match=f"token id {bad} is outside the vocabulary \\[0, 50\\) of tensor b.table"
        ):
            reader.rows(torch.tensor([3, bad, 4]))
    assert reader.bytes_read == 0  # refused before any read
    index = TensorIndex(tmp_path)
    assert not readable(index.info("z.bias"))  # 1-D
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    save_file(
        {"t": torch.zeros(4, 8).to(torch.float8_e4m3fn), "i": torch.zeros(4, 8, dtype=torch.int32)},
        str(fp8 / "model.safetensors"),
    )
    for name in ("t", "i"):
        info = TensorIndex(fp8).info(name)
        assert not readable(info)
        with pytest.raises(ValueError, match=f"tensor {name} .* not a plain 2-D float tensor"):
            RowReader(info)


def test_nonfinite_row_named_when_read(tmp_path):
    path, info = _table_file(tmp_path, torch.bfloat16, nan_row=9, inf_row=30)
    reader = RowReader(info)
    with safe_open(str(path), "pt") as f:
        table = f.get_tensor("b.table")
    assert torch.equal(reader.rows(torch.tensor([1, 2, 10])), table[[1, 2, 10]])  # good rows read fine
    for bad in (9, 30):
        with pytest.raises(
            CheckpointError,
            match=f"model.safetensors: tensor b.table row {bad} \\(token id {bad}\\) holds non-finite values",
        ):
            reader.rows(torch.tensor([1, bad, 2]))
    unchecked = RowReader(info, check_finite=False).rows(torch.tensor([9]))
    assert torch.isnan(unchecked).sum() == 1 and torch.isnan(table[9]).sum() == 1


# -- the model: rows on disk vs the table held ------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss_bf16(tmp_path_factory):
    return G.make_gpt_oss(tmp_path_factory.mktemp("gpt-oss-rows"), dtype=torch.bfloat16, num_local_experts=16)


def _path(name, checkpoint, request, tmp_path_factory):
    if name == "gpt_oss":
        return request.getfixturevalue("gpt_oss_bf16")
    if name == "gpt_oss_mxfp4":
        src = request.getfixturevalue("gpt_oss_bf16")
        return G.to_shipped_mxfp4(src, tmp_path_factory.mktemp("gpt-oss-rows-mxfp4") / "model")
    if name == "deepseek_v3":  # MLA, float32 storage: the table converted after the gather
        return checkpoint("deepseek_v3")
    return checkpoint(name, dtype=torch.bfloat16, num_experts=16)


def _run(path, **kw):
    llm = LLM(str(path), **kw)
    try:
        logits = llm.logits(PROMPTS[0])
        toks = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        V, H = llm.cfg.vocab_size, llm.cfg.hidden_size
        held = (getattr(llm.model.embed, "table", None), llm.model.lm_head)  # the model's [V, H] tables
        tables = len({id(t) for t in held if isinstance(t, torch.Tensor) and tuple(t.shape) == (V, H)})
        read = getattr(llm.model.embed, "bytes_read", None)
        return logits, toks, tables, read
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gpt_oss_mxfp4", "mixtral", "deepseek_v3"])
def test_rows_on_disk_give_the_held_tables_output(family, checkpoint, request, tmp_path_factory, monkeypatch):
    """Bitwise: the same low-memory model, once with its table held (models/embedding.on_disk turned off
    where the dense weights are read, build/fill.py) and once reading rows; the on-disk one holds lm_head as its only [V, H] tensor."""
    path = _path(family, checkpoint, request, tmp_path_factory)
    logits, toks, tables, read = _run(path, **LOW)
    with monkeypatch.context() as m:
        m.setattr(fill, "on_disk", lambda *a: False)
        held_logits, held_toks, held_tables, _ = _run(path, **LOW)
    assert torch.equal(logits, held_logits) and toks == held_toks
    assert (tables, held_tables) == (1, 2)
    assert read > 0


def test_tied_table_stays_in_memory(checkpoint):
    """lm_head is the table: under low memory it stays held, and the logits are transformers'."""
    path = checkpoint("qwen3_moe", dtype=torch.bfloat16, tie_word_embeddings=True)
    assert "lm_head.weight" not in C.read_tensors(path)
    llm = LLM(str(path), **LOW)
    try:
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            stored = f.get_tensor(EMBED)
        assert llm.model.lm_head is llm.model.embed.table and torch.equal(llm.model.embed.table, stored)
        assert llm.ledger.terms["dense"] == llm.device_plan.terms["dense"]
        ids = PROMPTS[0]
        ref = C.reference_logits(C.load_reference(path), ids)
        torch.testing.assert_close(llm.logits(ids), ref, atol=1e-4, rtol=1e-4)
    finally:
        llm.close()


def test_plan_dense_term_drops_by_the_table(gpt_oss_bf16, monkeypatch):
    """dense_bytes under low memory on the CPU leaves out exactly V x H x 2 (bf16), and the engine
    allocates what the plan says, term by term."""
    llm = LLM(str(gpt_oss_bf16), **LOW)
    try:
        V, H = llm.cfg.vocab_size, llm.cfg.hidden_size
        args = (llm.index, llm.cfg, llm.family.names, torch.float32, torch.device("cpu"))
        on_disk = dense_bytes(*args, low_memory=True)
        with monkeypatch.context() as m:
            m.setattr(embedding, "on_disk", lambda *a: False)
            held = dense_bytes(*args, low_memory=True)
        assert held - on_disk == V * H * 2
        line = f"(the embedding table's {fmt_bytes(V * H * 2)} of them stay on disk"
        assert any(line in printed for printed in llm.plan_lines)
        assert llm.device_plan.terms["dense"] == on_disk
        assert {k: llm.ledger.terms.get(k, 0) for k in llm.device_plan.allocated} == llm.device_plan.allocated
    finally:
        llm.close()
    # not low memory: the table is held and counted
    assert dense_bytes(*args, low_memory=False) > on_disk


def test_plan_command_low_memory_is_the_engines(gpt_oss_bf16, capsys):
    """`expertcache plan --low-memory`: the dense term and the RAM line are what the engine allocates."""
    args = ["plan", str(gpt_oss_bf16), "--device-memory", "25%", "--host-memory", "0"]
    assert main([*args, "--low-memory", "--json"]) == 0
    terms = json.loads(capsys.readouterr().out)["device_plan"]["terms"]
    assert main([*args, "--low-memory"]) == 0
    text = capsys.readouterr().out
    llm = LLM(str(gpt_oss_bf16), **LOW)
    try:
        dense = llm.ledger.terms["dense"]
        assert terms["dense"] == dense == llm.device_plan.terms["dense"]
        assert f"RAM for weights: dense {fmt_bytes(dense)} + experts" in text
        V, H = llm.cfg.vocab_size, llm.cfg.hidden_size
    finally:
        llm.close()
    assert main([*args, "--json"]) == 1  # host_memory=0 needs --low-memory (the engine's own refusal)
    assert "host_memory=0" in json.loads(capsys.readouterr().out)["plan"]["error"]
    assert main(["plan", str(gpt_oss_bf16), "--device-memory", "25%", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device_plan"]["terms"]["dense"] >= dense + V * H * 2


def test_nonfinite_embedding_row_names_the_token(cache_checkpoint, tmp_path):
    path = C.copy_checkpoint(cache_checkpoint, tmp_path / "nan-row")

    def poison(t):
        t[EMBED][7, 5] = float("nan")
        t[EMBED][11, 0] = float("inf")
        return t

    C.rewrite_tensors(path, poison)
    with pytest.raises(CheckpointError, match=f"tensor {EMBED} holds non-finite values"):
        LLM(str(path))  # held: scanned at load
    llm = LLM(str(path), **LOW)  # on disk: each row checked when read
    try:
        good, bad = llm.generate([[5, 6, 8], [5, 7, 8]], GREEDY)
        assert good.finish_reason == "length" and len(good.token_ids) == 10
        assert (
            bad.finish_reason.startswith("error")
            and f"model.safetensors: tensor {EMBED} row 7 (token id 7) holds non-finite values"
            in bad.finish_reason
        )
        with pytest.raises(CheckpointError, match=r"row 11 \(token id 11\)"):
            llm.logits([3, 11])
        with pytest.raises(ValueError, match=f"token id {llm.cfg.vocab_size} is outside the vocabulary"):
            llm.logits([3, llm.cfg.vocab_size])
    finally:
        llm.close()
    llm = LLM(str(path), check_finite=False, **LOW)  # the check turned off: honoured
    try:
        out = llm.generate([[5, 7, 8]], GREEDY)[0]
        assert "non-finite logits" in out.finish_reason and "token id" not in out.finish_reason
    finally:
        llm.close()
