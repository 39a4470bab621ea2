"""Engine-level sampling features against independent references: logprobs vs log_softmax of
LLM.logits (prompt and generated, with and without a prefix-cache hit), n > 1 sharing KV blocks and
matching single runs, penalties/biases vs a per-token loop, grammar-constrained JSON on a random model."""

from __future__ import annotations

import json
import random

import pytest
import torch

from expertcache import LLM, SamplingParams
from expertcache.engine.logits_processors import apply_penalties
from expertcache.engine.params import ParamError
from expertcache.engine.sequence import Sequence

ATOL = 2e-4


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _check_entry(entry, ref_row: torch.Tensor, tok: int, k: int):
    got_tok, got_lp, alts = entry
    assert got_tok == tok
    assert abs(got_lp - float(ref_row[tok])) < ATOL
    top = torch.topk(ref_row, k)
    assert [a for a, _ in alts] == top.indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in alts]), top.values, atol=ATOL)


def test_logprobs_equal_log_softmax_of_logits(qwen3_llm):
    llm = qwen3_llm
    prompt = _prompt(40, seed=11)
    p = SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    first = llm.generate([prompt], p)[0]
    ref = torch.log_softmax(llm.logits(prompt + first.token_ids), dim=-1)
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        _check_entry(first.prompt_logprobs[i], ref[i - 1], prompt[i], 2)
    assert len(first.logprobs) == len(first.token_ids)
    for j, tok in enumerate(first.token_ids):
        _check_entry(first.logprobs[j], ref[len(prompt) - 1 + j], tok, 3)
    assert abs(first.cumulative_logprob - sum(e[1] for e in first.logprobs)) < 1e-5

    # the same prompt again: its full blocks are cached now. Prompt logprobs recompute the prompt
    # (no cache use); without them the cache is used and generated logprobs are still the model's.
    again = llm.generate([prompt], p)[0]
    assert again.num_cached_tokens == 0
    assert [e[1] for e in again.prompt_logprobs[1:]] == pytest.approx(
        [e[1] for e in first.prompt_logprobs[1:]], abs=ATOL
    )
    cached = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True))[
        0
    ]
    assert cached.num_cached_tokens == 32
    assert cached.token_ids == first.token_ids
    for j, tok in enumerate(cached.token_ids):
        _check_entry(cached.logprobs[j], ref[len(prompt) - 1 + j], tok, 1)


def test_logprobs_come_before_penalties_biases_and_temperature(qwen3_llm):
    """With a frequency penalty, a large logit bias and a sampling temperature, each chosen token's
    logprob (and the top alternatives) is still the model's own log_softmax of the unmodified logits
    (README: "before penalties, biases, grammar masks and temperature"), while the choice itself is
    steered: the biased token is the first one chosen."""
    llm = qwen3_llm
    prompt = _prompt(20, seed=5)
    plain = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    biased_tok = next(t for t in range(3, 300) if t != plain)
    p = SamplingParams(
        max_tokens=5,
        temperature=0.8,
        seed=3,
        logprobs=2,
        ignore_eos=True,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        logit_bias={biased_tok: 100.0},
    )
    out = llm.generate([prompt], p)[0]
    assert out.token_ids[0] == biased_tok  # the bias reached the choice ...
    ref = torch.log_softmax(llm.logits(prompt + out.token_ids), dim=-1)
    for j, tok in enumerate(out.token_ids):  # ... but not the reported logprobs
        _check_entry(out.logprobs[j], ref[len(prompt) - 1 + j], tok, 2)


def test_prompt_logprobs_across_prefill_chunks(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), max_num_batched_tokens=16, max_model_len=128)
    prompt = _prompt(45, seed=3)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    ref = torch.log_softmax(llm.logits(prompt), dim=-1)
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][1] - float(ref[i - 1, prompt[i]])) < ATOL
        assert out.prompt_logprobs[i][2] == []


def test_n_samples_share_prompt_blocks_and_match_single_runs(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint), block_size=16, prefix_caching=False, max_model_len=128)
    prompt = _prompt(40, seed=5)  # 2 full blocks + a partial one
    p = SamplingParams(n=4, seed=7, temperature=1.0, max_tokens=4, ignore_eos=True)
    eng = llm.engine
    eng.add_request(prompt, p, "grp")
    used = []
    while eng.has_unfinished():
        eng.step()
        used.append(llm.kv.num_blocks - llm.kv.num_free)
    # 4 separate requests would hold 4 x 3 = 12 blocks; forks share the 2 full prompt blocks and
    # copy the partial one on their first write: 2 + 4 = 6
    assert max(used) == 6
    assert llm.kv.num_free == llm.kv.num_blocks

    outs = llm.generate([prompt], p)
    assert [o.index for o in outs] == [0, 1, 2, 3]
    for o in outs:
        alone = llm.generate(
            [prompt], SamplingParams(seed=7 + o.index, temperature=1.0, max_tokens=4, ignore_eos=True)
        )[0]
        assert o.token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the samples differ


# -- penalties --------------------------------------------------------------------------------------


def _reference_penalties(row: torch.Tensor, seq: Sequence, eos: set[int]) -> torch.Tensor:
    """The definitions, one token at a time."""
    p, out = seq.params, row.clone()
    for t in set(seq.tokens):
        if p.repetition_penalty != 1:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(seq.generated):
        c = seq.generated.count(t)
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    for t, v in p.logit_bias.items():
        out[t] += v
    if len(seq.generated) < p.min_tokens:
        for t in set(p.stop_token_ids) | eos:
            out[t] = float("-inf")
    return out


def test_penalties_match_reference():
    torch.manual_seed(0)
    rng = random.Random(0)
    V, eos = 50, {0, 1}
    seqs = []
    for b in range(6):
        p = SamplingParams(
            max_tokens=20,
            presence_penalty=rng.choice([0, 0.5, -1.2]),
            frequency_penalty=rng.choice([0, 0.7, 2.0]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
            logit_bias={rng.randrange(V): rng.uniform(-100, 100) for _ in range(b % 3)},
            min_tokens=rng.choice([0, 5]),
            stop_token_ids=[7] if b % 2 else [],
        )
        s = Sequence([rng.randrange(V) for _ in range(8)], p)
        s.tokens += [rng.randrange(V) for _ in range(rng.randrange(0, 9))]
        seqs.append(s)
    seqs.append(Sequence([3, 4], SamplingParams(max_tokens=4)))  # neutral row
    logits = torch.randn(len(seqs), V) * 3
    got = logits.clone()
    apply_penalties(got, seqs, eos)
    for b, s in enumerate(seqs):
        assert torch.allclose(got[b], _reference_penalties(logits[b], s, eos), atol=1e-5), b


def test_greedy_with_penalties_follows_reference(qwen3_llm):
    llm = qwen3_llm
    prompt = _prompt(12, seed=9)
    p = SamplingParams(
        max_tokens=6,
        temperature=0,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={5: 3.0},
        ignore_eos=True,
    )
    got = llm.generate([prompt], p)[0].token_ids
    seq = Sequence(prompt, p)
    for _ in range(6):  # reference: full logits, the per-token definitions, argmax
        row = llm.logits(seq.tokens)[-1]
        seq.tokens.append(int(torch.argmax(_reference_penalties(row, seq, set()))))
    assert got == seq.generated


def test_min_tokens_blocks_eos(qwen3_llm):
    prompt = _prompt(6, seed=2)
    eos = sorted(qwen3_llm.engine.eos)
    out = qwen3_llm.generate(
        [prompt], SamplingParams(max_tokens=5, min_tokens=5, temperature=0, logit_bias={eos[0]: 100.0})
    )[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    out = qwen3_llm.generate(
        [prompt], SamplingParams(max_tokens=5, min_tokens=2, temperature=0, logit_bias={eos[0]: 100.0})
    )[0]
    assert out.token_ids[-1] == eos[0] and len(out.token_ids) == 3 and out.finish_reason == "stop"


# each field just outside its range (engine/params.py's table) -> the ParamError naming that field
OUT_OF_RANGE = [
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 2.0}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": 2.01}),
    ("temperature", {"temperature": float("inf")}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.01}),
    ("top_k", {"top_k": -2}),
    ("seed", {"seed": 2**63}),
    ("seed", {"seed": -(2**63) - 1}),
    ("seed", {"seed": 1.5}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": ["a", 3]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("n", {"n": 0}),
    ("n", {"n": 129}),
    ("logprobs", {"logprobs": 21}),
    ("prompt_logprobs", {"prompt_logprobs": -1}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("logit_bias", {"logit_bias": {1: 101}}),
    ("logit_bias", {"logit_bias": {"x": 1}}),
    ("min_tokens", {"min_tokens": 17}),
    ("min_tokens", {"min_tokens": -1}),
]


@pytest.mark.parametrize("field,kw", OUT_OF_RANGE)
def test_each_field_out_of_range_names_it(field, kw):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{"max_tokens": 16, **kw})
    assert e.value.field == field and str(e.value) == f"{field} {e.value.reason}"


def test_range_ends_are_accepted_and_normalised():
    p = SamplingParams(
        max_tokens=1,
        temperature=2,
        top_p=1,
        top_k=-1,
        seed=-(2**63),
        stop="end",
        n=128,
        logprobs=20,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={"7": 100, 8: -100},
    )
    assert (p.top_k, p.stop, p.logit_bias) == (0, ["end"], {7: 100.0, 8: -100.0})
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


def test_engine_checks_context_and_batch_once(qwen3_llm):
    """prompt + max_tokens against the context and n against max_num_seqs: add_request's ParamError
    names the field (the server and the CLI call the same check_context / check_batch)."""
    eng = qwen3_llm.engine
    cases = [
        (_prompt(4), SamplingParams(max_tokens=eng.max_model_len - 3), "max_tokens"),
        (_prompt(eng.max_model_len), SamplingParams(max_tokens=1), "prompt"),
        (_prompt(4), SamplingParams(n=eng.scheduler.max_num_seqs + 1), "n"),
        (_prompt(4), SamplingParams(logit_bias={qwen3_llm.cfg.vocab_size: 1.0}), "logit_bias"),
    ]
    for ids, params, field in cases:
        with pytest.raises(ParamError) as e:
            eng.add_request(ids, params)
        assert e.value.field == field, e.value
    assert not eng.has_unfinished()
    eng.add_request(
        _prompt(4), SamplingParams(max_tokens=eng.max_model_len - 4, n=eng.scheduler.max_num_seqs)
    )
    eng.abort(next(iter(eng.seqs)))


# -- structured output ------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "color"],
    "additionalProperties": False,
}


def test_json_schema_output_valid_on_random_model(qwen3_llm):
    g = qwen3_llm.grammars.json_schema(SCHEMA)
    outs = qwen3_llm.generate(
        [_prompt(5, seed=s) for s in range(3)],
        SamplingParams(max_tokens=60, temperature=1.0, seed=1, structured=g),
    )
    for o in outs:
        assert o.finish_reason == "stop", o.text
        doc = json.loads(o.text)
        assert set(doc) == {"ok", "n", "color"}
        assert isinstance(doc["ok"], bool) and isinstance(doc["n"], int) and 0 <= doc["n"] <= 99
        assert doc["color"] in ("red", "green", "blue")


def test_regex_and_choice_grammars(qwen3_llm):
    import re

    g = qwen3_llm.grammars.regex(r"[a-c]{3}-[0-9]{2}")
    out = qwen3_llm.generate(
        [_prompt(4)], SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured=g)
    )[0]
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", out.text), out.text
    g = qwen3_llm.grammars.choice(["yes", "no", "maybe"])
    out = qwen3_llm.generate(
        [_prompt(4)], SamplingParams(max_tokens=20, temperature=1.0, seed=4, structured=g)
    )[0]
    assert out.text in ("yes", "no", "maybe")
    with pytest.raises(ValueError):
        qwen3_llm.grammars.lark("start: (")


def test_logprobs_come_before_the_grammar_mask(qwen3_llm):
    """Under a regex grammar the chosen tokens follow the grammar, and their logprobs are still the
    model's log_softmax of the unmasked logits (a masked row would give the allowed tokens more mass)."""
    import re

    prompt = _prompt(6, seed=9)
    g = qwen3_llm.grammars.regex(r"[a-c]{3}-[0-9]{2}")
    out = qwen3_llm.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, logprobs=2, structured=g)
    )[0]
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", out.text), out.text
    ref = torch.log_softmax(qwen3_llm.logits(prompt + out.token_ids), dim=-1)
    masked = 0
    for j, tok in enumerate(out.token_ids):
        _check_entry(out.logprobs[j], ref[len(prompt) - 1 + j], tok, 2)
        masked += tok != int(ref[len(prompt) - 1 + j].argmax())
    assert masked > 0  # the grammar overrode the model's own choice at least once: the mask was active


def test_json_object_output_parses(qwen3_llm):
    g = qwen3_llm.grammars.json_object()
    outs = qwen3_llm.generate(
        [_prompt(5, seed=s) for s in range(4)],
        SamplingParams(max_tokens=100, temperature=1.0, seed=2, structured=g),
    )
    # any object is allowed, so a random model may write one long string until max_tokens; every
    # output that finished is one JSON object
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(o.text), dict) for o in done)
    assert all(o.text.startswith("{") for o in outs)
