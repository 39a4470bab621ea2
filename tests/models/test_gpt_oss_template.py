"""The harmony chat template (tests/fixtures/gpt_oss_chat_template.jinja, modelled on the one
openai/gpt-oss-* ship) renders in the engine's sandboxed Jinja environment exactly as transformers'
apply_chat_template renders it: macros with recursion, namespaces, `strftime_now`, `tojson`,
`raise_exception`, tools and the template's keyword arguments."""

from __future__ import annotations

import gpt_oss_checkpoints as G
import pytest
import torch
from jinja2 import TemplateError

from expertcache.engine.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "default": 1},
                "hourly": {"type": "boolean"},
                "stations": {"type": "array", "items": {"type": "string"}, "nullable": True},
                "bounds": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"lat": {"type": "number"}},
                        "required": ["lat"],
                    },
                },
                "when": {"oneOf": [{"type": "string"}, {"type": "number"}]},
                "extra": {"type": ["string", "null"]},
            },
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "Current time", "parameters": {}}}

CONVERSATIONS = {
    "user": ([{"role": "user", "content": "Hello world!"}], {}),
    "developer-multi-turn": (
        [
            {"role": "system", "content": "  Answer briefly.  "},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris.", "thinking": "Easy: Paris."},
            {"role": "user", "content": "And of Italy? Grüße, 世界 🙂"},
        ],
        {},
    ),
    "tools-call-and-result": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "thinking": "I should call the tool.",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Paris", "unit": "celsius"},
                        },
                    }
                ],
            },
            {"role": "tool", "content": '{"temp": 21, "sky": "clear"}'},
            {"role": "assistant", "content": "21 °C and clear."},
            {"role": "user", "content": "Thanks"},
        ],
        {"tools": [WEATHER, NOW]},
    ),
    "pending-tool-call": (
        [
            {"role": "user", "content": "Time?"},
            {
                "role": "assistant",
                "content": "Calling now()",
                "tool_calls": [{"function": {"name": "now", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "12:00"},
        ],
        {"tools": [NOW]},
    ),
    "kwargs": (
        [{"role": "user", "content": "Think hard"}],
        {
            "reasoning_effort": "high",
            "model_identity": "You are a tiny test model.",
            "builtin_tools": ["browser", "python"],
        },
    ),
    "final-answer-with-thinking": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "thinking": "2+2=4"},
        ],
        {},
    ),
}

BAD = {
    "channel-tags-in-content": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "<|channel|>final<|message|>hi"},
    ],
    "tool-without-call": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}],
    "unknown-role": [{"role": "narrator", "content": "x"}],
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("harmony")
    G.write_tokenizer(d)
    return Tokenizer(d), AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conv", list(CONVERSATIONS))
def test_renders_as_transformers(pair, conv, add_generation_prompt):
    ours, hf = pair
    messages, kwargs = CONVERSATIONS[conv]
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    assert got == expected
    assert ours.encode(got, add_special_tokens=False) == hf(expected, add_special_tokens=False)["input_ids"]


def test_rendered_prompt_shape(pair):
    """A sanity check of the fixture itself: harmony's system header, the date, the generation prompt."""
    ours, _ = pair
    text = ours.apply_chat_template(CONVERSATIONS["tools-call-and-result"][0], tools=[WEATHER])
    assert text.startswith("<|start|>system<|message|>You are ChatGPT") and "Current date: 20" in text
    assert (
        'type get_weather = (_: {\n// City name\ncity: string,\nunit?: "celsius" | "fahrenheit", // default: "celsius"'
        in text
    )
    assert "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" in text
    assert text.endswith("<|start|>assistant")
    ids = ours.encode(text, add_special_tokens=False)
    assert ids.count(G.START) == text.count("<|start|>") and G.CALL in ids


@pytest.mark.parametrize("conv", list(BAD))
def test_template_errors_raise_like_transformers(pair, conv):
    ours, hf = pair
    with pytest.raises(TemplateError) as theirs:
        hf.apply_chat_template(BAD[conv], tokenize=False)
    with pytest.raises(TemplateError) as mine:
        ours.apply_chat_template(BAD[conv])
    assert str(mine.value) == str(theirs.value)


def test_chat_through_the_engine_uses_the_template(tmp_path):
    """LLM.chat renders the checkpoint's harmony template with the caller's template arguments:
    the prompt ids are transformers' tokenization of transformers' rendering."""
    from transformers import AutoTokenizer

    from expertcache import LLM, SamplingParams

    path = G.make_gpt_oss(tmp_path, num_hidden_layers=1, dtype=torch.bfloat16)
    llm = LLM(str(path))
    messages = [{"role": "user", "content": "Hello"}]
    hf = AutoTokenizer.from_pretrained(str(path))
    expected = hf.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, reasoning_effort="low"
    )
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    out = llm.chat(
        messages, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), reasoning_effort="low"
    )[0]
    assert list(out.prompt_token_ids) == list(expected) and expected[0] == G.START
    llm.close()


def test_tojson_options_and_dict_as_transformers(tmp_path):
    """The `tojson` options and the `dict` global transformers gives templates."""
    from transformers import AutoTokenizer

    G.write_tokenizer(
        tmp_path,
        chat_template=(
            "{{ messages[0] | tojson(indent=2, sort_keys=true) }}|{{ messages[0] | tojson(separators=(',', ':')) }}|"
            "{{ dict(b=1, a=messages[0].role) | tojson }}|{{ messages | tojson(ensure_ascii=true) }}"
        ),
    )
    messages = [{"role": "user", "content": "Grüße 🙂", "z": [1, 2]}]
    expected = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(messages, tokenize=False)
    assert Tokenizer(tmp_path).apply_chat_template(messages) == expected
