"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types) and their
mapping to SamplingParams.

Strict: a JSON string is never coerced to a number or a number to a bool, so a wrong type
is a 400 naming the parameter. Unknown fields are ignored (clients send many optional
ones), except the few whose silent omission would change results (`logprobs`, `n` > 1),
which are rejected.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.params import SamplingParams
from .errors import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM / llama.cpp extension
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None  # null = 1, as OpenAI
    stream: bool | None = None  # null = false
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension (fixed-length benchmarks)
    logprobs: bool | int | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = 16  # OpenAI's and vLLM's default for /v1/completions
    prompt: str | list[int] | list[str] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(f"'prompt' holds {len(p)} prompts; this server takes one prompt per request",
                               "prompt")
            return p[0]
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(ROLES)}")
        return v

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and self.role != "assistant":  # assistant turns may carry only tool calls
            raise ValueError(f"a {self.role!r} message needs 'content'")
        return self

    def as_template_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) or self.content is None else "".join(
            p.text for p in self.content)
        d = {"role": self.role, "content": text or ""}
        if self.name is not None:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_Sampling):
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None  # chat: up to the context length
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("'messages' must hold at least one message")
        return v


def sampling_params(req: _Sampling, prompt_len: int, max_model_len: int, prompt_param: str) -> SamplingParams:
    """Validate the sampling fields against the prompt length; -> SamplingParams or ApiError (400)."""
    if req.n not in (None, 1):
        raise ApiError(f"'n' must be 1 on this server, got {req.n}", "n")
    if req.logprobs not in (None, False, 0):
        raise ApiError("'logprobs' is not supported by this server", "logprobs")
    max_tokens = getattr(req, "max_completion_tokens", None)
    param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = req.max_tokens, "max_tokens"
    room = max_model_len - prompt_len
    if room < 1:
        raise ApiError(f"the prompt has {prompt_len} tokens, which leaves no room to generate in the maximum "
                       f"context length of {max_model_len} tokens", prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = room if req.DEFAULT_MAX_TOKENS is None else min(req.DEFAULT_MAX_TOKENS, room)
    elif max_tokens < 1:
        raise ApiError(f"'{param}' must be at least 1, got {max_tokens}", param)
    elif max_tokens > room:
        raise ApiError(f"the prompt ({prompt_len} tokens) plus '{param}' ({max_tokens}) exceeds the maximum "
                       f"context length of {max_model_len} tokens", param, code="context_length_exceeded")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0 <= temperature <= 2:
        raise ApiError(f"'temperature' must be in [0, 2], got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise ApiError(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if req.top_k is None else req.top_k
    if top_k < -1:
        raise ApiError(f"'top_k' must be -1, 0 (off) or positive, got {top_k}", "top_k")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise ApiError(f"'seed' must fit in 64 bits, got {req.seed}", "seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise ApiError("'stop' strings must not be empty", "stop")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              seed=req.seed, stop=stop, ignore_eos=req.ignore_eos)
    except ValueError as e:  # the engine's own checks, should the ones above miss something
        raise ApiError(str(e)) from None
