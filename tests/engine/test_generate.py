"""generate(): batching, sampling, stop conditions, on the tiny Qwen3-MoE checkpoint."""

from __future__ import annotations

import json

import checkpoints as C
import pytest
import torch

PROMPTS = [
    [7],
    [11, 200, 35, 4, 90],
    [5, 17, 200, 3, 44, 99, 120, 7, 8, 250, 31, 64],
    list(range(40, 73)),
]


@pytest.fixture(scope="module")
def api(expertcache_api):
    return expertcache_api


@pytest.fixture(scope="module")
def llm(qwen3_llm):
    return qwen3_llm


def greedy(api, n=16, **kw):
    return api.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_batch_equals_single(llm, api):
    params = greedy(api, 16)
    batch = llm.generate(PROMPTS, params)
    assert len(batch) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, batch):
        alone = llm.generate([prompt], params)[0]
        assert list(out.prompt_token_ids) == prompt
        assert list(out.token_ids) == list(alone.token_ids), f"prompt of length {len(prompt)}"
        assert len(out.token_ids) == 16
        assert out.finish_reason == "length"


def test_batch_matches_transformers(llm, api, qwen3_reference):
    outs = llm.generate(PROMPTS, greedy(api, 12))
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.token_ids) == C.reference_greedy(qwen3_reference, prompt, 12), f"len {len(prompt)}"


def test_prompt_forms(llm, api):
    """str, list[str] and list[list[int]] prompts; a str prompt is encoded by llm.tokenizer."""
    text = "Hello world! The quick brown fox"
    ids = llm.tokenizer.encode(text)
    params = greedy(api, 8)
    one = llm.generate(text, params)
    assert len(one) == 1
    many = llm.generate([text, "Stop here."], params)
    assert len(many) == 2
    by_ids = llm.generate([ids], params)
    assert list(one[0].prompt_token_ids) == ids
    assert list(many[0].prompt_token_ids) == ids
    assert list(one[0].token_ids) == list(many[0].token_ids) == list(by_ids[0].token_ids)
    assert list(many[1].prompt_token_ids) == llm.tokenizer.encode("Stop here.")


def test_text_is_decoded_tokens(llm, api):
    out = llm.generate([PROMPTS[2]], greedy(api, 16))[0]
    # this prompt's 16 greedy tokens hold no special token (checked, so a changed model fails loudly
    # here rather than turning the comparison off)
    assert not set(out.token_ids) & {C.ENDOFTEXT_ID, C.IM_START_ID, C.IM_END_ID}, out.token_ids
    assert out.text == llm.tokenizer.decode(list(out.token_ids))


def test_seeded_sampling_reproducible(llm, api):
    def sample(seed):
        p = api.SamplingParams(max_tokens=16, temperature=1.5, seed=seed, ignore_eos=True)
        return list(llm.generate([PROMPTS[2]], p)[0].token_ids)

    a, b, c = sample(7), sample(7), sample(8)
    assert a == b, "same seed, different tokens"
    assert a != c, "different seeds gave identical samples"
    assert len(a) == 16


def test_sampling_differs_from_greedy(llm, api):
    g = list(llm.generate([PROMPTS[2]], greedy(api, 16))[0].token_ids)
    samples = {
        tuple(
            llm.generate(
                [PROMPTS[2]], api.SamplingParams(max_tokens=16, temperature=2.0, seed=s, ignore_eos=True)
            )[0].token_ids
        )
        for s in range(3)
    }
    assert any(s != tuple(g) for s in samples), "temperature 2.0 sampling always equals greedy"


def test_top_k_1_equals_greedy(llm, api):
    g = llm.generate(PROMPTS, greedy(api, 16))
    k1 = llm.generate(
        PROMPTS, api.SamplingParams(max_tokens=16, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    )
    for a, b in zip(g, k1):
        assert list(a.token_ids) == list(b.token_ids)


def test_tiny_top_p_equals_greedy(llm, api):
    g = llm.generate([PROMPTS[1]], greedy(api, 16))[0]
    p = llm.generate(
        [PROMPTS[1]], api.SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6, seed=5, ignore_eos=True)
    )[0]
    assert list(p.token_ids) == list(g.token_ids)


def test_max_tokens_gives_length(llm, api):
    for n in (1, 5):
        out = llm.generate([PROMPTS[1]], greedy(api, n))[0]
        assert len(out.token_ids) == n
        assert out.finish_reason == "length"


def _ascii_stop_string(text: str) -> str:
    """A 3-character printable-ASCII piece of text, not at its start."""
    for i in range(2, len(text) - 3):
        s = text[i : i + 3]
        if all(32 < ord(ch) < 127 for ch in s):
            return s
    raise AssertionError(f"no ASCII stop string in {text!r}: pick another prompt for this model")


def test_stop_string_truncates(llm, api):
    prompt = "Hello world! The quick brown fox"
    full = llm.generate(prompt, greedy(api, 24))[0]
    stop = _ascii_stop_string(full.text)
    cut = full.text.index(stop)
    out = llm.generate(prompt, greedy(api, 24, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut], f"stop={stop!r} full={full.text!r}"
    assert stop not in out.text
    assert len(out.token_ids) < len(full.token_ids)
    assert list(out.token_ids) == list(full.token_ids)[: len(out.token_ids)]


def test_stop_string_only_in_prompt_does_not_stop(llm, api):
    prompt = "Hello world! The quick brown fox"
    full = llm.generate(prompt, greedy(api, 12))[0]
    assert "quick" not in full.text
    out = llm.generate(prompt, greedy(api, 12, stop=["quick", "brown"]))[0]
    assert out.finish_reason == "length"
    assert list(out.token_ids) == list(full.token_ids)


def test_stop_token_ids(llm, api):
    full = list(llm.generate([PROMPTS[2]], greedy(api, 16))[0].token_ids)
    k = next(i for i in range(2, 16) if full[i] not in full[:i])
    out = llm.generate([PROMPTS[2]], greedy(api, 16, stop_token_ids=[full[k]]))[0]
    assert out.finish_reason == "stop"
    assert list(out.token_ids) == full[: k + 1]  # the stop token is returned in token_ids (as vLLM does)
    assert out.text == llm.tokenizer.decode(full[:k])  # and left out of the text


@pytest.fixture(scope="module")
def eos_checkpoint(qwen3_checkpoint, qwen3_llm, expertcache_api, tmp_path_factory):
    """The default checkpoint with generation_config.json's eos_token_id set to a token the
    model greedily emits at step k (config.json keeps eos_token_id=<|im_end|>)."""
    params = expertcache_api.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    full = list(qwen3_llm.generate([PROMPTS[2]], params)[0].token_ids)
    k = next(i for i in range(3, 16) if full[i] not in full[:i] and full[i] != C.IM_END_ID)
    path = C.copy_checkpoint(qwen3_checkpoint, tmp_path_factory.mktemp("eos") / "model")
    C.write_generation_config(path, eos_token_id=[full[k], C.IM_END_ID])
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == C.IM_END_ID
    return path, full, k


def test_eos_from_generation_config_stops(eos_checkpoint, api):
    path, full, k = eos_checkpoint
    llm = api.LLM(str(path), device="cpu")
    out = llm.generate([PROMPTS[2]], api.SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out.finish_reason == "stop"
    assert list(out.token_ids) == full[: k + 1], (out.token_ids, full, k)  # EOS included, as vLLM does
    again = llm.generate([PROMPTS[2]], api.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert list(again.token_ids) == full
    assert again.finish_reason == "length"


def test_logits_consistent_with_greedy(llm, api):
    """llm.logits' argmax at the last position is the first greedy token."""
    for prompt in PROMPTS:
        logits = llm.logits(prompt)
        assert tuple(logits.shape) == (len(prompt), C.tokenizer_vocab_size())
        first = llm.generate([prompt], greedy(api, 1))[0].token_ids[0]
        assert int(torch.argmax(logits[-1])) == first


def test_prefix_cache_same_tokens(llm, api, qwen3_checkpoint):
    """Prompts sharing a long prefix (cached KV blocks reused) give the tokens of an engine
    without prefix caching, alone and batched."""
    common = [(7 * i) % 300 + 3 for i in range(40)]
    prompts = [common + [100, 101], common + [200], common[:33] + [7, 8, 9], common + [100, 101]]
    fresh = api.LLM(str(qwen3_checkpoint), device="cpu", prefix_caching=False)
    params = greedy(api, 12)
    expected = [list(fresh.generate([p], params)[0].token_ids) for p in prompts]
    for p, e in zip(prompts, expected):
        assert list(llm.generate([p], params)[0].token_ids) == e
    assert [list(o.token_ids) for o in llm.generate(prompts, params)] == expected
    again = llm.generate([prompts[0]], params)[0]
    assert again.num_cached_tokens >= 32, "a repeated 42-token prompt reused no cached block"


def test_max_model_len(api, qwen3_checkpoint):
    llm = api.LLM(str(qwen3_checkpoint), device="cpu", max_model_len=32)
    prompt = PROMPTS[3][:16]
    out = llm.generate([prompt], greedy(api, 16))[0]
    assert len(out.token_ids) == 16
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[3]], greedy(api, 4))  # 33-token prompt > max_model_len
    with pytest.raises(ValueError):
        llm.logits(PROMPTS[3])
