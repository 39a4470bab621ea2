"""Tool-call parsing per format on canned model outputs (whole and streamed token by token), format
detection from chat templates, and the forcing grammars accepting the canned calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from expertcache.server.tool_calls import FORMATS, StreamDiff, format_for
from expertcache.server.tool_calls.deepseek import DeepSeekFormat
from expertcache.server.tool_calls.glm import GlmFormat
from expertcache.server.tool_calls.harmony import HarmonyFormat
from expertcache.server.tool_calls.qwen import QwenFormat

WEATHER = {
    "name": "get_weather",
    "description": "weather now",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"tz": {"type": "string"}},
        "required": ["tz"],
        "additionalProperties": False,
    },
}

# (format, completion text with special tokens, content, reasoning, [(name, arguments)])
CANNED = [
    (
        QwenFormat(),
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
        "Let me check.",
        "",
        [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})],
    ),
    (QwenFormat(), "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", "", []),
    (
        QwenFormat(),
        '<tool_call>\n{"name": broken}\n</tool_call>',
        '<tool_call>\n{"name": broken}\n</tool_call>',
        "",
        [],
    ),
    (
        HarmonyFormat(),
        "<|channel|>analysis<|message|>User wants weather in Paris.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris", "days": 2}<|call|>',
        "",
        "User wants weather in Paris.",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    (
        HarmonyFormat(),
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
        "It is 4.<|return|>",
        "It is 4.",
        "Easy.",
        [],
    ),
    (
        HarmonyFormat(),
        "<|channel|>analysis<|message|>hm<|end|><|start|>assistant to=functions.get_time"
        '<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>',
        "",
        "hm",
        [("get_time", {"tz": "UTC"})],
    ),
    (
        DeepSeekFormat(),
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
        '<｜tool▁sep｜>get_time\n```json\n{"tz": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Checking.",
        "",
        [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})],
    ),
    (
        DeepSeekFormat(),
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "CET"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        "",
        [("get_time", {"tz": "CET"})],
    ),
    (
        GlmFormat(),
        "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        "Sure.",
        "",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
]


@pytest.mark.parametrize("fmt,text,content,reasoning,calls", CANNED, ids=lambda x: getattr(x, "name", None))
def test_parse_whole(fmt, text, content, reasoning, calls):
    p = fmt.parse(text, final=True)
    assert p.content == content
    assert p.reasoning == reasoning
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == calls


@pytest.mark.parametrize("fmt,text,content,reasoning,calls", CANNED, ids=lambda x: getattr(x, "name", None))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_parse_streamed(fmt, text, content, reasoning, calls, step):
    diff = StreamDiff(fmt)
    deltas = []
    for end in range(step, len(text) + step, step):
        deltas += diff.step(text[:end], final=False)
    deltas += diff.step(text, final=True)
    got_content = "".join(d.get("content", "") for d in deltas)
    got_reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    got_calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert got_content.strip() == content
    assert got_reasoning == reasoning
    assert [c["index"] for c in got_calls] == list(range(len(calls)))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in got_calls)
    # no marker text ever leaks into streamed content
    assert "<tool_call" not in got_content or not calls


def test_format_detection():
    assert isinstance(format_for("{% for t in tools %}<tool_call>{% endfor %}"), QwenFormat)
    assert isinstance(format_for("<tool_call>{{ name }}<arg_key>k</arg_key>"), GlmFormat)
    assert isinstance(format_for("<|start|>assistant<|channel|>final<|message|>"), HarmonyFormat)
    assert isinstance(format_for("<｜tool▁calls▁begin｜>"), DeepSeekFormat)
    assert format_for("{{ messages }}") is None and format_for(None) is None


def _accepts(grammars, lark: str, text: str) -> bool:
    """Does the grammar accept `text` as a whole (token by token, then EOS)?"""
    g = grammars.lark(lark)
    m = g.matcher()
    tok = grammars.tokenizer
    for t in tok.tokenize_str(text):
        if not m.accept(t):
            return False
    return m.m.is_accepting()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_forcing_grammar_accepts_the_canned_call(fmt, qwen3_llm):
    grammars = qwen3_llm.grammars

    def marker(s):
        return json.dumps(s)

    canned = {
        "qwen": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","days":2}}\n</tool_call>',
        "harmony": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Paris","days":2}<|call|>',
        "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city":"Paris","days":2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days"
        "</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
    }[fmt.name]
    lark = fmt.grammar([WEATHER, TIME], parallel=False, marker=marker)
    assert _accepts(grammars, lark, canned)
    assert not _accepts(grammars, lark, canned.replace("get_weather", "get_wether"))
    p = fmt.parse(canned, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]


def test_real_templates_detect_their_format(qwen3_tokenizer_dir):
    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    assert isinstance(format_for((fixtures / "gpt_oss_chat_template.jinja").read_text()), HarmonyFormat)
    assert isinstance(format_for((fixtures / "deepseek_v3_chat_template.jinja").read_text()), DeepSeekFormat)
    qwen3 = json.loads((qwen3_tokenizer_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert isinstance(format_for(qwen3), QwenFormat)


# formats that settle after each complete call or message (DeepSeek's one calls block is parsed whole, in linear time)
SETTLING = [c for c in CANNED if c[4] and not isinstance(c[0], DeepSeekFormat)]


@pytest.mark.parametrize("fmt,text,content,reasoning,calls", SETTLING, ids=lambda x: getattr(x, "name", None))
def test_stream_parses_only_the_unsettled_text(fmt, text, content, reasoning, calls):
    """After many complete calls (or messages), a streamed step parses the text after the last one
    only: the parse cost per token does not grow with the completion. Deltas still add up to the
    whole parse."""
    seen = []

    class Recording(type(fmt)):
        def parse(self, t, final, strip=True):
            seen.append(len(t))
            return super().parse(t, final, strip)

    long = text * 20
    diff = StreamDiff(Recording())
    deltas = []
    for end in range(1, len(long) + 1):
        deltas += diff.step(long[:end], final=False)
    deltas += diff.step(long, final=True)
    assert max(seen) <= len(text) + 1, (max(seen), len(text))
    whole = fmt.parse(long, final=True)
    got_calls = [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d]
    assert [(c["name"], c["arguments"]) for c in got_calls] == [(c.name, c.arguments) for c in whole.calls]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.reasoning


@pytest.mark.parametrize("fmt", [QwenFormat(), GlmFormat(), DeepSeekFormat()], ids=lambda f: f.name)
def test_many_open_markers_parse_like_the_regex(fmt):
    """Thousands of open markers without a close, then one complete call: the find-based parse gives
    what the lazy regex of the format's markers gives (reference: re.finditer)."""
    import re

    if isinstance(fmt, DeepSeekFormat):
        op, cl = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
        call = "<｜tool▁calls▁begin｜>" + op + 'get_time<｜tool▁sep｜>{"tz": "CET"}' + cl
        text = call + (op + "x") * 4000
    else:
        op, cl = "<tool_call>", "</tool_call>"
        body = (
            '\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
            if isinstance(fmt, QwenFormat)
            else "get_time\n<arg_key>tz</arg_key>\n<arg_value>CET</arg_value>\n"
        )
        text = "hi " + op + body + cl + (op + " x") * 4000
    from expertcache.server.tool_calls.base import blocks

    want = [
        (m.start(), m.end(), m.group(1))
        for m in re.finditer(re.escape(op) + "(.*?)" + re.escape(cl), text, re.S)
    ]
    assert list(blocks(text, op, cl)) == want and len(want) == 1
    p = fmt.parse(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in p.calls] == [("get_time", {"tz": "CET"})]
