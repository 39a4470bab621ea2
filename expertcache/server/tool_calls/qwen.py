"""Qwen2.5 / Qwen3 (Hermes style): <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>."""

from __future__ import annotations

import json

from .base import Parsed, ToolCall, ToolFormat, blocks, call_schema, held_back, json_args, lark_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class QwenFormat(ToolFormat):
    name = "qwen"

    def detect(self, template: str) -> bool:
        return OPEN in template and "<arg_key>" not in template

    def parse(self, text: str, final: bool, strip: bool = True) -> Parsed:
        out = Parsed()
        pos = 0
        for start, end, body in blocks(text, OPEN, CLOSE):
            call = _call(body.strip())
            if call is None:  # not a valid call: leave it as text
                continue
            out.content += text[pos:start]
            out.calls.append(call)
            pos = end
            out.settle(pos)
        rest = text[pos:]
        if not final:
            start = rest.find(OPEN)
            if start >= 0:  # an unfinished call
                rest = rest[:start]
            else:
                rest = rest[: len(rest) - held_back(rest, (OPEN,))]
        out.content += rest
        if out.calls and strip:
            out.content = out.content.strip()
        return out

    def grammar(self, tools: list[dict], parallel: bool, marker) -> str:
        call = f'call: {marker(OPEN)} "\\n" body "\\n" {marker(CLOSE)}\nbody: {lark_json(call_schema(tools))}'
        return ('start: call ("\\n" call)*\n' if parallel else "start: call\n") + call


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models put the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], json_args(args))
