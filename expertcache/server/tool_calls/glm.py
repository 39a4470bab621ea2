"""GLM-4.5: <tool_call>NAME\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n...</tool_call>;
a value is JSON when it parses as JSON, else a string (as the GLM-4.5 template writes them)."""

from __future__ import annotations

import json
import re

from .base import Parsed, ToolCall, ToolFormat, arguments_schema, blocks, held_back, json_args

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class GlmFormat(ToolFormat):
    name = "glm45"

    def detect(self, template: str) -> bool:
        return "<arg_key>" in template

    def parse(self, text: str, final: bool, strip: bool = True) -> Parsed:
        out = Parsed()
        pos = 0
        for start, end, body in blocks(text, OPEN, CLOSE):
            name = body.split("<arg_key>", 1)[0].strip()
            if not name:
                continue
            args = {}
            for k, v in ARG.findall(body):
                try:
                    args[k.strip()] = json.loads(v)
                except json.JSONDecodeError:
                    args[k.strip()] = v
            out.content += text[pos:start]
            out.calls.append(ToolCall(name, json_args(args)))
            pos = end
            out.settle(pos)
        rest = text[pos:]
        if not final:
            start = rest.find(OPEN)
            rest = rest[:start] if start >= 0 else rest[: len(rest) - held_back(rest, (OPEN,))]
        out.content += rest
        if out.calls and strip:
            out.content = out.content.strip()
        return out

    def grammar(self, tools: list[dict], parallel: bool, marker) -> str:
        # one alternative per tool: its name, then its parameters as key/value pairs (any order is
        # allowed by the format; the grammar asks for the schema's properties in declared order)
        rules, alts = [], []
        for i, t in enumerate(tools):
            props = arguments_schema(t).get("properties", {})
            pairs = " ".join(
                f'"\\n<arg_key>{k}</arg_key>\\n<arg_value>" v{i}_{j} "</arg_value>"'
                for j, k in enumerate(props)
            )
            for j, (k, sch) in enumerate(props.items()):
                if sch.get("type") == "string":
                    rules.append(f"v{i}_{j}: /[^<]*/")
                else:
                    rules.append(f"v{i}_{j}: %json {json.dumps(sch)}")
            alts.append(f'{marker(OPEN)} "{t["name"]}" {pairs} "\\n" {marker(CLOSE)}')
        head = 'start: call ("\\n" call)*\n' if parallel else "start: call\n"
        return head + "call: " + " | ".join(alts) + "\n" + "\n".join(rules)
