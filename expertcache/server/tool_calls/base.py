"""What a tool-call format is: how to find it in a chat template, parse a model's output into
content / reasoning / tool calls, and (for tool_choice 'required' or a named function) the Lark
grammar that forces a call.

A format's `parse(text, final)` sees the whole completion so far, decoded *with* special tokens.
With final=False it returns only what can no longer change: content that cannot be the start of
a tool-call marker, and calls whose closing marker has arrived; `StreamDiff` turns successive
parses into OpenAI stream deltas (a call is sent whole, name and arguments in one delta, once
it is complete).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text

    def openai(self, call_id: str) -> dict:
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolFormat:
    name = ""
    always = False  # parse every completion (channels), not only when tools are on

    def detect(self, template: str) -> bool:
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def grammar(self, tools: list[dict], parallel: bool, marker) -> str:
        """Lark grammar forcing one (or, when parallel, one or more) call of `tools` (OpenAI
        function objects, already narrowed to the named one); marker(s) -> the grammar atom of a
        marker string (a special-token reference when the tokenizer has it as one token)."""
        raise NotImplementedError


def call_schema(tools: list[dict]) -> dict:
    """JSON schema of {"name": ..., "arguments": {...}} for any of `tools`."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                         "arguments": arguments_schema(t)},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


def arguments_schema(tool: dict) -> dict:
    return tool.get("parameters") or {"type": "object"}


def lark_json(schema: dict) -> str:
    """A JSON-schema rule for llguidance's Lark, compact (no free whitespace: a model that never
    stops writing spaces cannot loop inside it)."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a marker (may still become one)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def json_args(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class StreamDiff:
    """Successive parses of a growing completion -> delta dicts for chat.completion.chunk."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.content = ""
        self.reasoning = ""
        self.calls = 0
        self.ids: list[str] = []

    def step(self, text: str, final: bool) -> list[dict]:
        p = self.fmt.parse(text, final)
        out = []
        if p.reasoning.startswith(self.reasoning) and len(p.reasoning) > len(self.reasoning):
            out.append({"reasoning_content": p.reasoning[len(self.reasoning):]})
            self.reasoning = p.reasoning
        if p.content.startswith(self.content) and len(p.content) > len(self.content):
            out.append({"content": p.content[len(self.content):]})
            self.content = p.content
        for i in range(self.calls, len(p.calls)):
            self.ids.append(new_call_id())
            call = p.calls[i].openai(self.ids[-1])
            out.append({"tool_calls": [{"index": i, **call}]})
        self.calls = len(p.calls)
        return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
