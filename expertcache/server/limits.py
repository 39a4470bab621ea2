"""What one request may cost the server before it is refused: body size, JSON shape, prompt length.

Invariants (each violation is a 4xx OpenAI error object, never a 5xx, and none blocks the event
loop for long, so /health keeps answering while a hostile request is refused):
- a body larger than `max_body_bytes` is refused with 413 from its Content-Length, before it
  is read, or as soon as the bytes read pass the limit (chunked bodies);
- JSON is parsed (on a worker thread) with standard constants only (no NaN/Infinity), integers
  of at most MAX_INT_DIGITS digits, floats of at most MAX_FLOAT_CHARS characters and at most
  MAX_DEPTH levels of nesting; strings must be valid Unicode (no lone surrogates). Each gives a
  400 naming the parameter where the path is known;
- a text prompt is tokenized on a worker thread with the GIL released (tokenizers' batch call),
  and only as far as needed: a text far longer than the context can hold is judged on a prefix
  (`encode_bounded`), so its cost does not grow with the body.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .errors import ApiError

MAX_DEPTH = 64  # OpenAI bodies nest a few levels (tools' JSON schemas a dozen or so)
MAX_INT_DIGITS = 40  # a 128-bit integer has 39 digits
MAX_FLOAT_CHARS = 400
MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 32  # room for long tokens and \uXXXX escapes of the longest prompt
CHARS_PER_TOKEN_BOUND = 16  # a prefix this many chars per context token decides an over-long text


def default_body_limit(max_model_len: int) -> int:
    """Large enough for a prompt that fills the context, escaped as JSON; at least 1 MiB."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_STRINGS_CEILING = 64  # the most --max-stop-strings may allow (each token checks every stop string)
MAX_STOP_CHARS = 256  # characters per stop string (the text held back while it could still match)
MAX_STOP_CHARS_CEILING = 4096
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_LOGIT_BIAS_CEILING = 4096
RECORD_ROUTING_MAX_STEPS = 100_000  # serve --record-routing: engine steps kept in the trace


@dataclass
class Limits:
    """Every per-request limit of the server, with its `expertcache serve` flag (docs/limits.md)."""

    max_body_bytes: int | None = None  # None: default_body_limit(max_model_len) once the model is known
    max_concurrent_per_key: int = 0  # sequences in flight per API key (or per client without a key); 0 = off
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS
    max_logit_bias: int = MAX_LOGIT_BIAS
    record_routing_max_steps: int = RECORD_ROUTING_MAX_STEPS

    def __post_init__(self):
        from ..errors import ConfigError

        if self.max_body_bytes is not None and self.max_body_bytes < 1:
            raise ConfigError(f"--max-request-bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_concurrent_per_key < 0:
            raise ConfigError(f"--max-concurrent-per-key must be >= 0, got {self.max_concurrent_per_key}")
        for flag, value, ceiling in (
            ("--max-stop-strings", self.max_stop_strings, MAX_STOP_STRINGS_CEILING),
            ("--max-stop-chars", self.max_stop_chars, MAX_STOP_CHARS_CEILING),
            ("--max-logit-bias", self.max_logit_bias, MAX_LOGIT_BIAS_CEILING),
        ):
            if not 0 <= value <= ceiling:
                raise ConfigError(f"{flag} must be in [0, {ceiling}], got {value}")
        if self.record_routing_max_steps < 1:
            raise ConfigError(f"--record-routing-max-steps must be >= 1, got {self.record_routing_max_steps}")

    def body_limit(self, max_model_len: int | None) -> int:
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return default_body_limit(max_model_len or 4096)


def too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        f"the request body has {size if size >= 0 else 'more than ' + str(limit)} bytes, more than the "
        f"server's limit of {limit} bytes (--max-request-bytes)",
        status=413,
        code="request_too_large",
    )


def _int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise ApiError(
            f"a number in the request body has {len(s.lstrip('-'))} digits; at most {MAX_INT_DIGITS} "
            "are accepted"
        )
    return int(s)


def _float(s: str) -> float:
    if len(s) > MAX_FLOAT_CHARS:
        raise ApiError(
            f"a number in the request body is {len(s)} characters long; at most {MAX_FLOAT_CHARS} "
            "are accepted"
        )
    return float(s)


def _constant(s: str):
    raise ApiError(f"the request body is not valid JSON: {s} is not a JSON value")


def _path(parts: tuple) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else ("." if out else "") + str(p)
    return out


def check_shape(obj) -> None:
    """Depth and strings of a parsed body, iteratively (no recursion to exhaust)."""
    if isinstance(obj, str):
        _check_text(obj, ())
        return
    stack = [(obj, 1, ())]
    while stack:
        v, depth, path = stack.pop()
        if not isinstance(v, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise ApiError(f"the request body nests deeper than {MAX_DEPTH} levels", _path(path[:1]) or None)
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, child in items:
            if type(k) is str and not k.isascii():
                _check_text(k, path)
            if type(child) is str:  # the common leaf checked here: no stack entry per string
                if not child.isascii():
                    _check_text(child, path + (k,))
            elif isinstance(child, (dict, list)):
                stack.append((child, depth + 1, path + (k,)))


def _check_text(v: str, path: tuple) -> None:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        param = _path(path) or None
        raise ApiError(
            f"'{param or 'body'}' holds a lone surrogate ({v[e.start]!r} at character "
            f"{e.start}): not valid Unicode text",
            param,
        ) from None


_DIGIT_RUN = re.compile(rb"\d{%d}" % (MAX_INT_DIGITS + 1))  # the shortest number _int or _float could refuse
# the key in front of what the parser refused, found in the raw bytes (error path only)
_LONG_NUMBER = re.compile(rb'"([^"\\]{1,64})"\s*:\s*(?=[-+.\deE]{%d})' % (MAX_INT_DIGITS + 1))
_DEEP = re.compile(rb'"([^"\\]{1,64})"\s*:\s*(?=(?:[\[{]\s*){%d})' % MAX_DEPTH)


def _named(e: ApiError, raw: bytes, pattern: re.Pattern) -> ApiError:
    m = pattern.search(raw)
    if m is None or e.param is not None:
        return e
    param = m.group(1).decode("utf-8", "replace")
    return ApiError(f"'{param}': {e.message}", param, e.status, e.type, e.code)


def parse_body(raw: bytes) -> dict:
    """Bytes -> the JSON object of a request, or ApiError (400). Run it off the event loop."""
    try:
        if (
            _DIGIT_RUN.search(raw) is None
        ):  # no number can be too long: C parsing of numbers, no hook per number
            obj = json.loads(raw, parse_constant=_constant)
        else:
            obj = json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except RecursionError:
        raise _named(ApiError(f"the request body nests deeper than {MAX_DEPTH} levels"), raw, _DEEP) from None
    except ApiError as e:  # a number too long
        raise _named(e, raw, _LONG_NUMBER) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ApiError("the request body must be a JSON object")
    check_shape(obj)
    return obj


def encode_bounded(
    tokenizer, text: str, max_tokens: int, param: str, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of `text`, or ApiError (400, context_length_exceeded) when it cannot fit in
    max_tokens: a text longer than CHARS_PER_TOKEN_BOUND x max_tokens characters is first tokenized
    up to that length, and refused if that prefix alone is already too long (a prefix has at most
    one token fewer than the whole: a merge across the cut)."""
    bound = CHARS_PER_TOKEN_BOUND * max_tokens
    if len(text) > bound:
        head = tokenizer.encode(text[:bound], add_special_tokens=add_special_tokens)
        if len(head) > max_tokens + 1:
            raise ApiError(
                f"'{param}' has {len(text)} characters, which is more than {max_tokens} tokens, the "
                "maximum context length",
                param,
                code="context_length_exceeded",
            )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit()` bytes, from Content-Length before reading,
    else while reading (the handler's read raises ApiError, which the app turns into the 413)."""

    def __init__(self, app, limit):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        limit = self.limit()
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await too_large(int(length), limit).response()(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise too_large(-1, limit)
            return message

        return await self.app(scope, limited, send)


class ConcurrencyLimit:
    """At most `limit` sequences in flight per client identity (its API key, else its address): a
    request counts its prompts x samples (`Lease.grow`). Over the limit: 429 (retry later), or 400
    for one request that alone is larger than the limit. Event-loop only (no lock needed)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.active: dict[str, int] = {}

    def acquire(self, who: str, n: int = 1) -> None:
        if not self.limit or n <= 0:
            return
        have = self.active.get(who, 0)
        if have + n > self.limit:
            raise ApiError(
                f"this client already has {have} sequences in flight; {n} more would pass the server's "
                f"limit of {self.limit} per API key (--max-concurrent-per-key); retry when one finishes",
                status=429,
                type="rate_limit_error",
                code="rate_limit_exceeded",
            )
        self.active[who] = have + n

    def release(self, who: str, n: int = 1) -> None:
        if not self.limit or n <= 0:
            return
        left = self.active.get(who, 0) - n
        if left > 0:
            self.active[who] = left
        else:
            self.active.pop(who, None)


class Lease:
    """One request's share of a ConcurrencyLimit: one sequence when it arrives, grown to its real
    count once the body is read; `release` returns all of it (once)."""

    def __init__(self, limit: ConcurrencyLimit, who: str):
        self.limit, self.who, self.held = limit, who, 0
        limit.acquire(who)
        self.held = 1

    def grow(self, total: int, param: str | None = None) -> None:
        if total > self.held:
            if total > self.limit.limit > 0:
                raise ApiError(
                    f"this request runs {total} sequences (prompts x n), more than the server's limit "
                    f"of {self.limit.limit} per API key (--max-concurrent-per-key)",
                    param,
                )
            self.limit.acquire(self.who, total - self.held)
            self.held = total

    def release(self) -> None:
        self.limit.release(self.who, self.held)
        self.held = 0
