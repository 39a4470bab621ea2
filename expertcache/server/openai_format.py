"""Response objects of the OpenAI API (completions and chat, whole and streamed), built from
choice dicts and the engine's Final items. Pure functions: no I/O, no engine access.

Streaming follows OpenAI: every chunk carries the same id/created/model; chat opens with a
`{"role": "assistant"}` delta per choice; a chunk with `finish_reason` also carries llama.cpp-style
`timings`; with `stream_options.include_usage` every chunk has `"usage": null` and one last
chunk with `"choices": []` carries the usage; the stream ends with `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from .async_engine import Final

DONE = "data: [DONE]\n\n"


def usage(prompt_finals: list[Final], finals: list[Final]) -> dict:
    """prompt_finals: one Final per prompt (its prompt counted once); finals: one per returned choice."""
    prompt = sum(f.prompt_tokens for f in prompt_finals)
    completion = sum(f.completion_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in prompt_finals)},
    }


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class Shape:
    """Ids and kind of one response; chat=True for /v1/chat/completions."""

    request_id: str
    model: str
    chat: bool
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def full(self, choices: list[dict], usage_obj: dict, timings: dict | None) -> dict:
        out = self.head("chat.completion" if self.chat else "text_completion")
        out.update(choices=choices, usage=usage_obj)
        if timings is not None:
            out["timings"] = timings
        return out

    def chunk(self, choice: dict, timings: dict | None = None) -> str:
        """One choice's delta (chat: {"index", "delta", "logprobs", "finish_reason"}; completions:
        {"index", "text", "logprobs", "finish_reason"})."""
        out = self.head(self.chunk_object)
        out["choices"] = [choice]
        if self.include_usage:
            out["usage"] = None
        if timings is not None:
            out["timings"] = timings
        return sse(out)

    def usage_chunk(self, usage_obj: dict) -> str:
        out = self.head(self.chunk_object)
        out.update(choices=[], usage=usage_obj)
        return sse(out)


def error_event(message: str, type: str = "server_error") -> str:
    return sse({"error": {"message": message, "type": type, "param": None, "code": None}})
