"""What a tool-call format is: how to find it in a chat template, parse a model's output into
content / reasoning / tool calls, and (for tool_choice 'required' or a named function) the Lark
grammar that forces a call.

A format's `parse(text, final)` sees the completion (or, streaming, its part after the last settled
point), decoded *with* special tokens, in time linear in the text (markers found with str.find, no
lazy regex run from every open marker). With final=False it returns only what can no longer
change: content that cannot be the start of a tool-call marker, and calls whose closing marker
has arrived, and `settled`: an offset after which a fresh parse can start (the end of the last
complete call or message), with how much of its content / reasoning / calls lie before it.
`StreamDiff` turns successive parses into OpenAI stream deltas, parsing only the text after the
settled point (a call is sent whole, name and arguments in one delta, once it is complete).
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
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Parsed:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    settled: int = 0  # text[:settled] parses the same whatever follows; a parse may restart there
    settled_content: int = 0  # len of content, reasoning, calls that come from text[:settled]
    settled_reasoning: int = 0
    settled_calls: int = 0

    def settle(self, at: int) -> None:
        self.settled, self.settled_content = at, len(self.content)
        self.settled_reasoning, self.settled_calls = len(self.reasoning), len(self.calls)


class ToolFormat:
    name = ""
    always = False  # parse every completion (channels), not only when tools are on

    def detect(self, template: str) -> bool:
        raise NotImplementedError

    def parse(self, text: str, final: bool, strip: bool = True) -> Parsed:
        """strip=False (streaming): content around calls is not stripped, so it only grows."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], parallel: bool, marker) -> str:
        """Lark grammar forcing one (or, when parallel, one or more) call of `tools` (OpenAI
        function objects, already narrowed to the named one); marker(s) -> the grammar atom of a
        marker string (a special-token reference when the tokenizer has it as one token)."""
        raise NotImplementedError


def call_schema(tools: list[dict]) -> dict:
    """JSON schema of {"name": ..., "arguments": {...}} for any of `tools`."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t["name"]}, "arguments": arguments_schema(t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }


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


def blocks(text: str, open_marker: str, close_marker: str, start: int = 0):
    """-> (start, end, body) of each open_marker ... close_marker block from `start`, the first close
    after each open (as a lazy regex would match), in one pass over the text: no block can follow an
    open marker with no close after it, so the search ends there."""
    while True:
        o = text.find(open_marker, start)
        if o < 0:
            return
        c = text.find(close_marker, o + len(open_marker))
        if c < 0:
            return
        start = c + len(close_marker)
        yield o, start, text[o + len(open_marker) : c]


def json_args(value) -> str:
    return json.dumps(value, ensure_ascii=False)


class StreamDiff:
    """Successive parses of a growing completion -> delta dicts for chat.completion.chunk. Each step
    parses only the text after the settled point of the previous ones."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.content = ""  # sent so far
        self.reasoning = ""
        self.calls = 0
        self.ids: list[str] = []
        self.base = 0  # offset of the unsettled text
        self.done = Parsed()  # what text[:base] parsed to

    def step(self, text: str, final: bool) -> list[dict]:
        p = self.fmt.parse(text[self.base :], final, strip=False)
        d = self.done
        content, reasoning, calls = d.content + p.content, d.reasoning + p.reasoning, d.calls + p.calls
        out = []
        if reasoning.startswith(self.reasoning) and len(reasoning) > len(self.reasoning):
            out.append({"reasoning_content": reasoning[len(self.reasoning) :]})
            self.reasoning = reasoning
        if content.startswith(self.content) and len(content) > len(self.content):
            out.append({"content": content[len(self.content) :]})
            self.content = content
        for i in range(self.calls, len(calls)):
            self.ids.append(new_call_id())
            call = calls[i].openai(self.ids[-1])
            out.append({"tool_calls": [{"index": i, **call}]})
        self.calls = len(calls)
        if p.settled:
            d.content += p.content[: p.settled_content]
            d.reasoning += p.reasoning[: p.settled_reasoning]
            d.calls += p.calls[: p.settled_calls]
            self.base += p.settled
        return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
