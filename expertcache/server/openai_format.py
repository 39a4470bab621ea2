"""Response objects of the OpenAI API (completions and chat, whole and streamed), built from
the engine's Delta/Final items. Pure functions: no I/O, no engine access.

Streaming follows OpenAI: every chunk carries the same id/created/model; chat opens with a
`{"role": "assistant"}` delta; the chunk with `finish_reason` also carries llama.cpp-style
`timings`; with `stream_options.include_usage` every chunk has `"usage": null` and one last
chunk with `"choices": []` carries the usage; the stream ends with `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from .async_engine import Final

DONE = "data: [DONE]\n\n"


def usage(final: Final) -> dict:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


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

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    # -- whole responses --
    def full(self, text: str, finish_reason: str, final: Final) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            out = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            out = self._head("text_completion")
        out.update(choices=[choice], usage=usage(final), timings=final.timings)
        return out

    # -- stream chunks --
    def chunk(self, text: str | None, finish_reason: str | None = None, final: Final | None = None,
              role: bool = False) -> str:
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            out = self._head("text_completion")
        out["choices"] = [choice]
        if self.include_usage:
            out["usage"] = None
        if final is not None:
            out["timings"] = final.timings
        return sse(out)

    def usage_chunk(self, final: Final) -> str:
        out = self._head("chat.completion.chunk" if self.chat else "text_completion")
        out.update(choices=[], usage=usage(final))
        return sse(out)


def error_event(message: str, type: str = "server_error") -> str:
    return sse({"error": {"message": message, "type": type, "param": None, "code": None}})
