"""DeepSeek-V3 / R1 and V3.1 tool calls:

V3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
"""

from __future__ import annotations

import json
import re

from .base import Parsed, ToolCall, ToolFormat, arguments_schema, blocks, held_back, json_args, lark_json

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCED = re.compile(r"^\s*(\S+)\s*\n```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)


class DeepSeekFormat(ToolFormat):
    name = "deepseek_v3"

    def detect(self, template: str) -> bool:
        return "tool▁calls▁begin" in template

    def parse(self, text: str, final: bool, strip: bool = True) -> Parsed:
        out = Parsed()
        start = text.find(CALLS_BEGIN)
        if start < 0:
            out.content = text if final else text[: len(text) - held_back(text, (CALLS_BEGIN,))]
            return out
        out.content = text[:start].strip()
        for _, _, body in blocks(text, CALL_BEGIN, CALL_END, start):
            kind, sep, rest = body.partition(SEP)
            if not sep:
                continue
            call = _call(kind.strip(), rest)
            if call is not None:
                out.calls.append(call)
        return out

    def grammar(self, tools: list[dict], parallel: bool, marker) -> str:
        alts = [
            f'{marker(CALL_BEGIN)} "function" {marker(SEP)} "{t["name"]}\\n```json\\n" '
            f'{lark_json(arguments_schema(t))} "\\n```" {marker(CALL_END)}'
            for t in tools
        ]
        calls = "call+" if parallel else "call"
        return f"start: {marker(CALLS_BEGIN)} {calls} {marker(CALLS_END)}\ncall: " + " | ".join(alts)


def _call(kind: str, rest: str) -> ToolCall | None:
    if kind == "function":  # V3: NAME, then the arguments in a ```json fence
        m = FENCED.match(rest)
        if m is None:
            return None
        name, args = m.group(1), m.group(2)
    else:  # V3.1: the name before the separator
        name, args = kind, rest
    try:
        return ToolCall(name, json_args(json.loads(args)))
    except json.JSONDecodeError:
        return None
