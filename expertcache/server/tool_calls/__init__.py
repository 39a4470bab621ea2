"""Tool-call formats by chat template: `format_for(template)` -> the ToolFormat whose markers the
template uses, or None (then a request with tools is a 400). Order matters: GLM-4.5 also uses
<tool_call>, so it is tried before Qwen."""

from __future__ import annotations

from .base import Parsed, StreamDiff, ToolCall, ToolFormat, new_call_id
from .deepseek import DeepSeekFormat
from .glm import GlmFormat
from .harmony import HarmonyFormat
from .qwen import QwenFormat

FORMATS: list[ToolFormat] = [HarmonyFormat(), DeepSeekFormat(), GlmFormat(), QwenFormat()]


def format_for(template: str | None) -> ToolFormat | None:
    if not template:
        return None
    return next((f for f in FORMATS if f.detect(template)), None)


__all__ = ["FORMATS", "Parsed", "StreamDiff", "ToolCall", "ToolFormat", "format_for", "new_call_id"]
