"""The engine step outside the big kernels, against plain references:

- the whole step (forward, finite check, sampling) runs in kernels.cpu_threads' arrangement (torch
  one thread, the kernels torch's count), restored afterwards, also when the step raises;
- sample_batch: greedy tokens are the argmax, each chosen logprob equals a float64 log-softmax, top
  logprobs only for the rows that ask (mixed batches), rows given twice (n > 1 forks);
- the engine's finite check fails exactly the rows holding a NaN, +inf or -inf;
- the first non-finite layer is named the same whether the forward keeps its layers' outputs
  (small steps) or checks its rows after every layer (big ones);
- build_batch against a plain per-token construction.
"""

from __future__ import annotations

import types

import pytest
import torch

from expertcache import kernels
from expertcache.engine import llm_engine
from expertcache.engine.params import SamplingParams
from expertcache.engine.runner import build_batch
from expertcache.engine.sampler import row_stats, sample_batch
from expertcache.models import transformer

needs_cpp = pytest.mark.skipif(kernels.backend() != "cpp", reason="the C++ kernels are not built here")


@needs_cpp
def test_whole_step_runs_with_torch_on_one_thread_and_is_restored(qwen3_llm, monkeypatch):
    ext, before = kernels.extension(), torch.get_num_threads()
    seen = []
    real = llm_engine.sample_batch

    def spy(*a, **k):
        seen.append((torch.get_num_threads(), ext.get_threads()))
        return real(*a, **k)

    monkeypatch.setattr(llm_engine, "sample_batch", spy)
    try:
        torch.set_num_threads(2)
        out = qwen3_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[
            0
        ]
        assert len(out.token_ids) == 3
        assert seen == [(1, 2)] * 3
        assert (torch.get_num_threads(), ext.get_threads()) == (2, 0)
        monkeypatch.setattr(qwen3_llm.engine.scheduler, "schedule", lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            qwen3_llm.engine.step()
        assert (torch.get_num_threads(), ext.get_threads()) == (2, 0)
    finally:
        torch.set_num_threads(before)


def _seq(**params):
    return types.SimpleNamespace(
        params=SamplingParams(**params), matcher=None, generator=torch.Generator().manual_seed(0)
    )


@pytest.mark.parametrize("torch_path", [False, True])
def test_sample_batch_logprobs_against_float64(torch_path, monkeypatch):
    if torch_path:
        from expertcache.kernels import build

        monkeypatch.setattr(build, "_state", {"mod": None, "why": "disabled by the test"})
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5000, generator=g) * 5
    logits[2, 17] = logits[2].max() + 0.0  # a repeated maximum: the first one is chosen
    seqs = [
        _seq(temperature=0.0),
        _seq(temperature=0.0, logprobs=3),
        _seq(temperature=0.0),
        _seq(temperature=0.7, seed=1, logprobs=1),
    ]
    toks, entries = sample_batch(logits, seqs, set())
    ref = torch.log_softmax(logits.double(), -1)
    assert toks[:3] == logits[:3].argmax(-1).tolist()
    for b, (tok, lp, alts) in enumerate(entries):
        assert tok == toks[b] and abs(lp - ref[b, tok].item()) <= 1e-5
        want = seqs[b].params.logprobs or 0
        assert len(alts) == want
        top = torch.topk(ref[b], want)
        assert [a for a, _ in alts] == top.indices.tolist()
        assert all(abs(v - w) <= 1e-5 for (_, v), w in zip(alts, top.values.tolist()))
        if want:
            assert lp == dict(alts).get(tok, lp)  # the chosen entry agrees with its alternatives
    # the engine passes the stats of repeated rows (forks): the same answers
    rows = logits[torch.tensor([1, 1, 0])]
    stats = tuple(t[torch.tensor([1, 1, 0])] for t in row_stats(logits))
    again = sample_batch(rows, [seqs[1], seqs[1], seqs[0]], set(), stats)
    assert again[1] == [entries[1], entries[1], entries[0]]
    # an all-greedy batch takes its logprobs from the row max: the same doubles as the general path,
    # and against float64
    greedy = [_seq(temperature=0.0), _seq(temperature=0.0), _seq(top_k=1, temperature=0.9)]
    toks3, entries3 = sample_batch(logits[:3], greedy, set())
    assert toks3 == logits[:3].argmax(-1).tolist()
    mixed = sample_batch(logits, greedy + [seqs[3]], set())[1][:3]  # one sampled row: the general path
    assert [e[1] for e in entries3] == [e[1] for e in mixed]
    assert all(abs(e[1] - ref[b, e[0]].item()) <= 1e-5 for b, e in enumerate(entries3))


def test_engine_fails_exactly_the_nonfinite_rows(qwen3_llm, monkeypatch):
    """NaN, +inf or -inf anywhere in a sequence's logits ends it with the non-finite error; the
    sequences with finite logits (a huge finite value included) go on."""
    runner = qwen3_llm.engine.runner
    real = runner.run_rows
    poison = {0: float("nan"), 1: float("inf"), 2: float("-inf"), 3: 3e38}

    def run_rows(work, full):
        logits, spans = real(work, full)
        logits = logits.clone()
        for b, (seq, _) in enumerate(work):
            if seq.generated:  # after one good token
                logits[spans[b].stop - 1, 11] = poison[which[seq.request_id]]
        return logits, spans

    monkeypatch.setattr(runner, "run_rows", run_rows)
    seqs = [
        qwen3_llm.engine.add_request(
            [7 + i, 8, 9], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        )
        for i in range(4)
    ]
    which = {seq.request_id: i for i, seq in enumerate(seqs)}
    while qwen3_llm.engine.has_unfinished():
        qwen3_llm.engine.step()
    for seq in seqs[:3]:
        assert seq.finish_reason.startswith("error: ") and "non-finite logits" in seq.finish_reason
        assert len(seq.generated) == 1
    assert seqs[3].finish_reason == "length" and seqs[3].generated[1:] == [11, 11]  # 3e38 wins greedy


@pytest.mark.parametrize("keep", [True, False])
def test_first_nonfinite_layer_named_on_both_paths(qwen3_llm, monkeypatch, keep):
    """Layer 1's attention turns one sequence's hidden state NaN: finite_after says layer 1 for that
    row only, whether the forward kept its layers' outputs or checked them per layer."""
    if not keep:
        monkeypatch.setattr(transformer, "KEEP_LAYER_OUTPUTS", 0)
    model = qwen3_llm.model
    attn = model.layers[1]["attn"]
    victim = {}

    class Poisoned:
        def __call__(self, x, batch, *kv):
            out = attn(x, batch, *kv)
            if "row" in victim:
                out = out.clone()
                out[batch.seq_of_token == victim["row"]] = float("nan")
            return out

    monkeypatch.setitem(model.layers[1], "attn", Poisoned())
    seqs = [
        qwen3_llm.engine.add_request(
            [20 + i, 21, 22], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )
        for i in range(3)
    ]
    qwen3_llm.engine.step()  # prefill: all fine
    victim["row"] = 1
    qwen3_llm.engine.step()
    after = model.finite_after
    assert after.shape == (len(model.layers), 3)
    assert after[:, [0, 2]].all() and after[0, 1] and not after[1:, 1].any()
    assert seqs[1].finish_reason is not None and "first became non-finite in layer 1" in seqs[1].finish_reason
    victim.clear()
    while qwen3_llm.engine.has_unfinished():
        qwen3_llm.engine.step()
    assert [s.finish_reason for s in (seqs[0], seqs[2])] == ["length", "length"]


def _reference_batch(work, block_size):
    ids, pos, slots, seq_of, row_of, last = [], [], [], [], [], []
    for b, (seq, n) in enumerate(work):
        for j in range(n):
            p = seq.num_computed + j
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append(seq.block_ids[p // block_size] * block_size + p % block_size)
            seq_of.append(b)
            row_of.append(j)
        last.append(len(ids) - 1)
    max_q, max_b = max(n for _, n in work), max(len(s.block_ids) for s, _ in work)
    tables = torch.zeros(len(work), max_b, dtype=torch.int64)
    qpos = torch.zeros(len(work), max_q, dtype=torch.int64)
    for b, (seq, n) in enumerate(work):
        tables[b, : len(seq.block_ids)] = torch.tensor(seq.block_ids)
        qpos[b, :n] = torch.arange(seq.num_computed, seq.num_computed + n)
    return ids, pos, slots, seq_of, row_of, last, max_q, tables, qpos


def test_build_batch_against_a_per_token_reference():
    def seq(computed, total, blocks):
        return types.SimpleNamespace(
            num_computed=computed, tokens=list(range(100, 100 + total)), block_ids=blocks
        )

    work = [
        (seq(5, 6, [3]), 1),
        (seq(0, 37, [9, 2, 7]), 37),
        (seq(16, 19, [4, 8]), 3),
        (seq(33, 34, [1, 5, 6]), 1),
    ]
    ids, batch, last = build_batch(work, 16, torch.device("cpu"))
    ref = _reference_batch(work, 16)
    assert ids.tolist() == ref[0] and last.tolist() == ref[5]
    assert batch.positions.tolist() == ref[1] and batch.slot_mapping.tolist() == ref[2]
    assert batch.seq_of_token.tolist() == ref[3] and batch.row_of_token.tolist() == ref[4]
    assert batch.max_q == ref[6]
    assert torch.equal(batch.block_tables, ref[7]) and torch.equal(batch.query_pos, ref[8])
    assert all(t.dtype == torch.int64 for t in (ids, last, batch.positions, batch.block_tables))
