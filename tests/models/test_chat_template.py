"""Tokenizer and chat template: the engine renders exactly what transformers renders.

Two tokenizers: the tiny BPE + ChatML template of the test checkpoints, and the real Qwen3
tokenizer/template (tests/fixtures/qwen3-tokenizer, paired with a 1-layer random Qwen3-MoE of
vocab 151936).
"""

from __future__ import annotations

import json
import shutil

import checkpoints as C
import pytest

CONVERSATIONS = {
    "single-user": [{"role": "user", "content": "Hello world!"}],
    "system+multi-turn": [
        {"role": "system", "content": "  You are a helpful assistant.  "},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?\nAnswer briefly."},
    ],
    "multi-turn-no-system": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How are you today?"},
        {"role": "user", "content": "Fine, thank you. Numbers: 1 2 3 42"},
    ],
    "unicode": [{"role": "user", "content": "Grüße, 世界! ½ → ∞ 🙂"}],
}

TEXTS = [
    "Hello world",
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttab",
    "Grüße, 世界! ½ → ∞ 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


@pytest.fixture(scope="module")
def tiny(qwen3_llm, qwen3_checkpoint):
    from transformers import AutoTokenizer

    return qwen3_llm, AutoTokenizer.from_pretrained(str(qwen3_checkpoint))


@pytest.fixture(scope="module")
def real_qwen3(qwen3_tokenizer_dir, checkpoint, expertcache_api, tmp_path_factory):
    """A 1-layer random Qwen3-MoE with vocab 151936 and the real Qwen3 tokenizer files."""
    from transformers import AutoTokenizer

    base = checkpoint(
        "qwen3_moe",
        tokenizer=False,
        vocab_size=151936,
        num_hidden_layers=1,
        tie_word_embeddings=True,
        eos_token_id=151645,
    )
    path = C.copy_checkpoint(base, tmp_path_factory.mktemp("qwen3-real-tok") / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir / name, path / name)
    C.write_generation_config(path, eos_token_id=[151645, 151643])
    llm = expertcache_api.LLM(str(path), device="cpu")
    return llm, AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(params=["tiny", "real_qwen3"])
def pair(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", list(CONVERSATIONS), ids=list(CONVERSATIONS))
def test_chat_template_matches_transformers(pair, conv, add_generation_prompt):
    llm, hf = pair
    messages = CONVERSATIONS[conv]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == expected


def test_qwen3_template_kwargs_and_tools(real_qwen3):
    """enable_thinking=False, tools and tool calls (tojson) render as transformers renders them."""
    llm, hf = real_qwen3
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "description": "Città"}},
                    "required": ["city"],
                },
            },
        }
    ]
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "<think>\nIt is mild.\n</think>\n\nIt is 21 °C."},
        {"role": "user", "content": "Thanks"},
    ]
    for kwargs in ({"enable_thinking": False}, {"tools": tools}, {"tools": tools, "enable_thinking": False}):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        got = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
        assert got == expected, kwargs


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text):
    llm, hf = pair
    ids = llm.tokenizer.encode(text)
    assert ids == hf.encode(text, add_special_tokens=True)
    assert llm.tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_real_qwen3_known_ids(real_qwen3):
    llm, _ = real_qwen3
    assert llm.tokenizer.encode("Hello world") == [9707, 1879]
    assert llm.tokenizer.encode("<|im_start|>") == [151644]


def test_chat_uses_template(pair, expertcache_api):
    """llm.chat == generate(tokens of the rendered template); one output per conversation."""
    llm, hf = pair
    convs = [CONVERSATIONS["system+multi-turn"], CONVERSATIONS["single-user"]]
    params = expertcache_api.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.chat(convs, params)
    assert len(outs) == 2
    for conv, out in zip(convs, outs):
        rendered = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        expected_ids = hf.encode(rendered, add_special_tokens=False)
        assert list(out.prompt_token_ids) == expected_ids
        assert list(out.token_ids) == list(llm.generate([expected_ids], params)[0].token_ids)
    single = llm.chat(convs[1], params)
    assert len(single) == 1 and list(single[0].token_ids) == list(outs[1].token_ids)


# ---------------------------------------------------------------------------
# sandbox

HOSTILE_TEMPLATES = {
    "mro": "{{ ''.__class__.__mro__ }}",
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals": "{{ cycler.__init__.__globals__.os.popen('echo pwned').read() }}",
    "mutate-input": "{% set _ = messages.append({'role': 'x', 'content': 'y'}) %}{{ messages | length }}",
}


def test_template_format_cannot_reach_internals(hostile_dir, expertcache_api):
    """str.format goes through the sandbox too: the unsafe field renders empty, nothing leaks."""
    cfg_path = hostile_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "[{{ '{0.__class__}'.format(messages) }}]"
    cfg_path.write_text(json.dumps(cfg))
    llm = expertcache_api.LLM(str(hostile_dir), device="cpu")
    try:
        rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    except Exception as e:  # raising is fine too
        assert "unsafe" in str(e) or type(e).__name__ == "SecurityError", e
    else:
        assert "class" not in rendered, rendered


@pytest.fixture(scope="module")
def hostile_dir(qwen3_checkpoint, tmp_path_factory):
    return C.copy_checkpoint(qwen3_checkpoint, tmp_path_factory.mktemp("hostile") / "model")


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_template_is_sandboxed(hostile_dir, expertcache_api, name):
    cfg_path = hostile_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = HOSTILE_TEMPLATES[name]
    cfg_path.write_text(json.dumps(cfg))
    llm = expertcache_api.LLM(str(hostile_dir), device="cpu")
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(Exception) as info:
        rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        pytest.fail(f"hostile template rendered: {rendered!r}")
    msg = str(info.value)
    assert "unsafe" in msg or "immutable" in msg or type(info.value).__name__ == "SecurityError", msg
    assert messages == [{"role": "user", "content": "hi"}]
