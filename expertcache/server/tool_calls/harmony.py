"""GPT-OSS harmony: the completion is a run of messages
    [<|start|>assistant[ to=RECIPIENT]]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY(<|end|>|<|call|>|<|return|>)
(the first one's role header is in the prompt). Channel 'analysis' is reasoning
(reasoning_content), a message to 'functions.NAME' is a tool call with BODY as its arguments,
'final' (and commentary without a recipient) is content."""

from __future__ import annotations

import json
import re

from .base import Parsed, ToolCall, ToolFormat, arguments_schema, held_back, lark_json

CHANNEL, MESSAGE, CONSTRAIN = "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
RECIPIENT = re.compile(r"to=([^\s<]+)")
END = re.compile("|".join(re.escape(e) for e in ENDS))


class HarmonyFormat(ToolFormat):
    name = "harmony"
    always = True

    def detect(self, template: str) -> bool:
        return CHANNEL in template and MESSAGE in template

    def parse(self, text: str, final: bool, strip: bool = True) -> Parsed:
        out = Parsed()
        pos = 0
        while pos < len(text):
            head_end = text.find(MESSAGE, pos)
            if head_end < 0:
                break  # a header still arriving
            header = text[pos:head_end]
            m = END.search(text, head_end)
            closed = m is not None
            body = text[head_end + len(MESSAGE) : m.start() if closed else len(text)]
            pos = m.end() if closed else len(text)
            if not closed and not final:  # a marker may be arriving
                body = body[: len(body) - held_back(body, ENDS + ("<|start|>", CHANNEL))]
            channel = header.split(CHANNEL, 1)[1].split()[0] if CHANNEL in header else ""
            channel = channel.split(CONSTRAIN)[0]
            r = RECIPIENT.search(header)
            recipient = r.group(1) if r else None
            if recipient and recipient.startswith("functions."):
                if closed or final:
                    try:
                        args = json.dumps(json.loads(body), ensure_ascii=False)
                    except json.JSONDecodeError:
                        args = body
                    out.calls.append(ToolCall(recipient[len("functions.") :], args))
            elif channel == "analysis":
                out.reasoning += body
            elif recipient is None:
                out.content += body
            if closed:
                out.settle(pos)
        return out

    def grammar(self, tools: list[dict], parallel: bool, marker) -> str:
        alts = [
            f'"functions.{t["name"]} " {marker(CONSTRAIN)} "json" {marker(MESSAGE)} '
            f"{lark_json(arguments_schema(t))}"
            for t in tools
        ]
        return f'start: {marker(CHANNEL)} "commentary to=" call {marker("<|call|>")}\ncall: ' + " | ".join(
            alts
        )
