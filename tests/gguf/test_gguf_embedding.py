"""A GGUF token embedding in a block type held as the file's blocks on the CPU (models/embedding.py
`BlockTable`), the looked-up rows decoded per step. The oracle is the same model whose token_embd is the
`gguf` package's dequantization of those blocks written as F32: logits and greedy tokens equal it, the
held table is the file's bytes (uint8), and the plan's dense term is smaller by exactly V x H x 4 less
the blocks' bytes and equals what the ledger counted. Tied (no output.weight), lm_head reads the same
blocks where a kernel reads the type; under --low-memory the rows of blocks are read from the file."""

import json

import pytest
import torch

gguf = pytest.importorskip("gguf")

import checkpoints as C
from gguf_files import (
    Q,
    dequantized_tensors,
    gguf_names,
    qwen3moe_metadata,
    random_blocks,
    reference_with,
    tokenizer_metadata,
    write_gguf,
)

from expertcache import LLM, SamplingParams
from expertcache.layers.basic import QuantizedWeight
from expertcache.loader.rows import RowReader
from expertcache.models.embedding import BlockTable, Table

PROMPT = [1, 5, 9, 33, 100, 7, 250, 3]
PROMPTS = [PROMPT, [42, 42, 0, 319], [200, 201, 202]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
H = 256  # K-quant rows: whole 256-blocks


@pytest.fixture(scope="module")
def k_checkpoint(checkpoint):
    return checkpoint("qwen3_moe", hidden_size=H, num_hidden_layers=2)


@pytest.fixture(scope="module")
def embd_gguf(k_checkpoint, tmp_path_factory):
    """(type, tied) -> (a .gguf whose token_embd is valid random blocks of that type, the same model with
    token_embd the gguf package's dequantization of them in F32); everything else F32; tied: no
    output.weight."""
    root = tmp_path_factory.mktemp("gguf-embd")
    cfg = json.loads((k_checkpoint / "config.json").read_text())
    meta = qwen3moe_metadata(cfg) + tokenizer_metadata(
        k_checkpoint / "tokenizer.json", "qwen2", cfg["vocab_size"], eos="<|im_end|>"
    )
    files = {}

    def get(type_name: str, tied: bool = False):
        if (type_name, tied) not in files:
            arrays = gguf_names(C.read_tensors(k_checkpoint))
            rows, cols = arrays.pop("token_embd.weight").shape
            if tied:
                del arrays["output.weight"]
            blocks = random_blocks(type_name, rows, cols, seed=7)
            stem = f"{type_name}{'-tied' if tied else ''}"
            path = write_gguf(
                root / f"{stem}.gguf",
                "qwen3moe",
                arrays,
                meta,
                raw={"token_embd.weight": (type_name, blocks)},
            )
            table = gguf.quants.dequantize(blocks, Q[type_name]).reshape(rows, cols)
            oracle = write_gguf(
                root / f"{stem}-f32.gguf", "qwen3moe", {**arrays, "token_embd.weight": table}, meta
            )
            files[type_name, tied] = (path, oracle)
        return files[type_name, tied]

    return get


def _file_tensor(path, name="token_embd.weight"):
    return next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)


def _run(path, **kw):
    """(logits [T, V], greedy tokens, the model's embedding, its lm_head, plan dense, ledger dense)."""
    llm = LLM(str(path), cpu_math="exact", **kw)
    try:
        logits = llm.logits(PROMPT)
        toks = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        return (
            logits,
            toks,
            llm.model.embed,
            llm.model.lm_head,
            llm.device_plan.terms["dense"],
            llm.ledger.terms["dense"],
        )
    finally:
        llm.close()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q2_K"])
def test_held_as_the_files_blocks_and_equal_to_the_dequantized_table(embd_gguf, type_name, capfd):
    path, oracle = embd_gguf(type_name)
    logits, toks, embed, _, plan_dense, ledger_dense = _run(path)
    err = capfd.readouterr().err
    want_logits, want_toks, want_embed, _, want_plan_dense, _ = _run(oracle)
    t = _file_tensor(path)
    V, H_ = t.shape[1], t.shape[0]
    assert isinstance(embed, BlockTable) and isinstance(want_embed, Table)
    assert embed.blocks.dtype == torch.uint8 and embed.blocks.numpy().tobytes() == t.data.tobytes()
    assert ledger_dense == plan_dense  # the plan counts what the engine holds
    assert want_plan_dense - plan_dense == V * H_ * 4 - t.n_bytes  # the table at its file bytes
    assert f"the token embedding ({type_name}, " in err and "stays in its file bytes" in err
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)  # the rows decode to the oracle's
    assert toks == want_toks
    ids = torch.tensor([[0, 319, 5], [5, 5, 100]])
    table = dequantized_tensors(path)["model.embed_tokens.weight"]
    torch.testing.assert_close(embed.rows(ids), table[ids], rtol=0, atol=0)
    assert embed.rows(torch.tensor([], dtype=torch.long)).shape == (0, H_)


def test_logits_equal_transformers_on_the_dequantized_weights(k_checkpoint, embd_gguf):
    path, _ = embd_gguf("Q4_K")
    expected = C.reference_logits(
        reference_with(C.load_reference(k_checkpoint), dequantized_tensors(path)), PROMPT
    )
    got = _run(path)[0]
    assert torch.isfinite(expected).all()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-3


@pytest.mark.parametrize("type_name", ["Q4_0", "Q6_K"])
def test_tied_lm_head_reads_the_same_blocks(embd_gguf, type_name, capfd):
    path, oracle = embd_gguf(type_name, tied=True)
    logits, toks, embed, head, plan_dense, ledger_dense = _run(path)
    err = capfd.readouterr().err
    want_logits, want_toks, _, want_head, want_plan_dense, _ = _run(oracle)
    t = _file_tensor(path)
    V, H_ = t.shape[1], t.shape[0]
    assert isinstance(embed, BlockTable) and isinstance(want_head, torch.Tensor)
    assert isinstance(head, QuantizedWeight) and head.method.name == f"gguf-{type_name.lower()}"
    assert head.parts["w.weight"] is embed.blocks  # one copy of the bytes serves both
    assert ledger_dense == plan_dense
    assert want_plan_dense - plan_dense == V * H_ * 4 - t.n_bytes
    assert "lm_head (tied) is computed from the same blocks" in err
    assert ((logits - want_logits).abs().max() / want_logits.abs().max()).item() < 1e-3
    assert toks == want_toks


def test_tied_without_a_kernel_keeps_a_float_table_unless_lm_head_is_packed(embd_gguf):
    path, oracle = embd_gguf("Q2_K", tied=True)  # no kernel reads Q2_K: lm_head needs the float table
    logits, toks, embed, head, plan_dense, ledger_dense = _run(path)
    want_logits, want_toks, *_ = _run(oracle)
    assert isinstance(embed, Table) and head is embed.table and ledger_dense == plan_dense
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    assert toks == want_toks
    _, _, embed, head, plan_dense, ledger_dense = _run(path, lm_head="int8")  # lm_head its own copy
    assert isinstance(embed, BlockTable) and head.method.name == "int8" and ledger_dense == plan_dense


def test_low_memory_reads_the_rows_of_blocks_from_the_file(embd_gguf):
    path, _ = embd_gguf("Q4_K")
    logits, toks, *_ = _run(path)
    llm = LLM(str(path), cpu_math="exact", low_memory=True)
    try:
        embed = llm.model.embed
        assert (
            isinstance(embed, RowReader) and llm.ledger.terms["dense"] == llm.device_plan.allocated["dense"]
        )
        torch.testing.assert_close(llm.logits(PROMPT), logits, rtol=0, atol=0)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == toks
        before = embed.bytes_read
        table = dequantized_tensors(path)["model.embed_tokens.weight"]
        ids = torch.tensor([7, 3, 3, 4])
        torch.testing.assert_close(embed.rows(ids), table[ids], rtol=0, atol=0)
        assert embed.bytes_read - before == 3 * (H // 256) * 144  # rows 3, 4, 7: each read once
        with pytest.raises(ValueError, match=r"is Q4_K blocks: RowReader needs their decoder"):
            RowReader(embed.info)
    finally:
        llm.close()
