"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types) and their
mapping to SamplingParams.

Strict: a JSON string is never coerced to a number or a number to a bool, so a wrong type
is a 400 naming the parameter. Unknown fields are ignored (clients send many optional
ones); the OpenAI parameters this server cannot honour are listed in UNSUPPORTED and are a
400 naming them when set (README: the parameter table).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.params import ParamError, SamplingParams, check_context, context_room
from .errors import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


# parameter -> why it is refused when set (None / false / the default are accepted)
UNSUPPORTED = {
    "suffix": "'suffix' (insertion) is not supported by this server",
    "functions": "'functions' is not supported: send 'tools'",
    "function_call": "'function_call' is not supported: send 'tool_choice'",
    "audio": "'audio' output is not supported by this server",
    "prediction": "'prediction' (predicted outputs) is not supported by this server",
    "web_search_options": "'web_search_options' is not supported by this server",
    "verbosity": "'verbosity' is not supported by this server",
}
MAX_LOGPROBS_COMPLETIONS = 5


class JsonSchemaFormat(_Strict):
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs 'json_schema.schema'")
        return self


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM / transformers extension
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None  # vLLM extension
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None  # vLLM guided decoding
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark
    user: str | None = None  # accepted, not used

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any):
        if isinstance(data, dict):
            for name, why in UNSUPPORTED.items():
                if data.get(name) not in (None, "", False, [], {}):
                    raise ApiError(why, name)
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def samples(self) -> int:
        return 1 if self.n is None else self.n


class CompletionRequest(_Sampling):
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = 16  # OpenAI's and vLLM's default for /v1/completions
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts in order (a list of strings or of token lists is a batch)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns
    reasoning_content: str | None = None  # assistant turns (templates that keep reasoning)

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
        """The message as chat templates read it (transformers' convention: a tool call's
        arguments as a dict when they are a JSON object)."""
        text = (
            self.content
            if isinstance(self.content, str) or self.content is None
            else "".join(p.text for p in self.content)
        )
        d: dict = {"role": self.role, "content": text or ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        return d


def _json_or_text(s: str):
    try:
        v = json.loads(s)
    except json.JSONDecodeError:
        return s
    return v if isinstance(v, dict) else s


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    DEFAULT_MAX_TOKENS: ClassVar[int | None] = None  # chat: up to the context length
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # passed to the chat template
    modalities: list[Literal["text"]] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("'messages' must hold at least one message")
        return v


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _logprob_fields(req: _Sampling) -> tuple[int | None, int | None]:
    """-> (logprobs, prompt_logprobs) for SamplingParams (which checks their range)."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return ((req.top_logprobs or 0) if req.logprobs else None), None
    lp = getattr(req, "logprobs", None)
    if lp is not None and lp > MAX_LOGPROBS_COMPLETIONS:  # the endpoint's own limit, below the engine's
        raise ApiError(
            f"'logprobs' must be at most {MAX_LOGPROBS_COMPLETIONS} in /v1/completions, got {lp}", "logprobs"
        )
    return lp, (lp if lp is not None and getattr(req, "echo", False) else None)


def engine_samples(req: _Sampling) -> int:
    """How many samples the engine runs: n, or best_of (then the best n are returned); their range is
    SamplingParams' (checked when it is built)."""
    n = req.samples
    best_of = getattr(req, "best_of", None)
    if best_of is None:
        return n
    if best_of < n:
        raise ApiError(f"'best_of' ({best_of}) must be >= 'n' ({n})", "best_of")
    if best_of > 1 and req.stream:
        raise ApiError("'best_of' > 1 cannot be streamed", "best_of")
    return best_of


def _param(req: _Sampling, field: str, prompt_param: str) -> str:
    """The request's parameter that set SamplingParams' `field`."""
    if field == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    if field == "n" and getattr(req, "best_of", None) is not None:
        return "best_of"
    if field == "logprobs" and isinstance(req, ChatCompletionRequest):
        return "top_logprobs"
    if field in ("prompt", "prompt_logprobs"):
        return prompt_param if field == "prompt" else "logprobs"
    return field


def api_error(e: ParamError, req: _Sampling, prompt_param: str) -> ApiError:
    """SamplingParams' error as the 400 naming the request's parameter."""
    param = _param(req, e.field, prompt_param)
    return ApiError(f"'{param}' {e.reason}", param, code=e.code)


def sampling_params(
    req: _Sampling, prompt_len: int, max_model_len: int, prompt_param: str, structured=None
) -> SamplingParams:
    """The request's sampling fields as SamplingParams (which validates them), max_tokens defaulted to
    what the context leaves; -> SamplingParams or ApiError (400) naming the parameter."""
    try:
        max_tokens = getattr(req, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = req.max_tokens
        room = context_room(prompt_len, max_model_len)
        if max_tokens is None:
            max_tokens = room if req.DEFAULT_MAX_TOKENS is None else min(req.DEFAULT_MAX_TOKENS, room)
        logprobs, prompt_logprobs = _logprob_fields(req)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            n=engine_samples(req),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=req.logit_bias,
            min_tokens=req.min_tokens or 0,
            structured=structured,
        )
        check_context(prompt_len, params.max_tokens, max_model_len)
        return params
    except ParamError as e:
        raise api_error(e, req, prompt_param) from None
