"""SamplingParams (every field validated here, once), the request limits the engine checks against
its context and batch, and per-request outputs.

The one list of a request's ranges (the server's 400s and the CLI's flag errors are these, mapped):

| field | accepted |
|---|---|
| max_tokens | integer >= 1 (and prompt + max_tokens <= the context: `check_context`) |
| temperature | finite number in [0, 2] (OpenAI's range; 0 = greedy) |
| top_p | number in (0, 1] |
| top_k | integer: -1 or 0 (off), or >= 1 |
| seed | None or an integer in [-2**63, 2**63), signed 64 bits as vLLM (sample i: (seed + i) mod 2**63) |
| stop | None, a string or a list of strings, none empty (normalised to a list by `stop_list`) |
| stop_token_ids | None or a list of integers >= 0 |
| n | integer in [1, 128] (OpenAI's limit; and <= the engine's max_num_seqs: `check_batch`) |
| logprobs, prompt_logprobs | None or an integer in [0, 20] |
| presence_penalty, frequency_penalty | number in [-2, 2] |
| repetition_penalty | finite number > 0 |
| logit_bias | token id (an integer, or its decimal string) -> number in [-100, 100] |
| min_tokens | integer in [0, max_tokens] |

A value outside its range raises `ParamError`, whose `.field` is the field's name here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

from ..errors import ExpertCacheError

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI chat's limit)
MAX_SAMPLES = 128  # n (OpenAI's limit)
SEED_RANGE = (-(2**63), 2**63)  # a signed 64-bit integer
CONTEXT_CODE = "context_length_exceeded"  # ParamError.code when the context is what does not fit


class ParamError(ExpertCacheError, ValueError):
    """A request field out of its range: `.field` names it (a SamplingParams field, or "prompt"),
    `.reason` is the rest of the message (str(e) == f"{field} {reason}"), `.code` a machine-readable
    kind where one applies (CONTEXT_CODE)."""

    def __init__(self, field: str, reason: str, code: str | None = None):
        super().__init__(f"{field} {reason}")
        self.field, self.reason, self.code = field, reason, code


def _is_int(v) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _int(name: str, v, lo: int, hi: int | None = None, what: str | None = None) -> None:
    """v must be an integer in [lo, hi] (hi None: no upper bound); `what` words the range otherwise."""
    if not (_is_int(v) and lo <= v and (hi is None or v <= hi)):
        what = what or (f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}")
        raise ParamError(name, f"must be {what}, got {v!r}")


def _real(name: str, v, ok, what: str) -> None:
    if not (_is_real(v) and math.isfinite(v) and ok(v)):
        raise ParamError(name, f"must be {what}, got {v!r}")


def stop_list(stop) -> list[str]:
    """None | str | list[str] -> list[str] (the one normalisation of `stop`); empty strings refused."""
    out = [stop] if isinstance(stop, str) else list(stop or [])
    bad = next((s for s in out if not isinstance(s, str) or not s), None)
    if bad is not None:
        raise ParamError("stop", f"must be a string or a list of non-empty strings, got {bad!r} in the list")
    return out


def _token_id(k) -> int:
    if _is_int(k):
        return int(k)
    if isinstance(k, str) and k.strip().lstrip("-").isdigit():
        return int(k)
    raise ParamError("logit_bias", f"keys must be token ids, got {k!r}")


def context_room(prompt_len: int, max_model_len: int) -> int:
    """Tokens left to generate after the prompt; ParamError("prompt") when none."""
    room = max_model_len - prompt_len
    if room < 1:
        raise ParamError(
            "prompt",
            f"has {prompt_len} tokens, which leaves no room to generate in the "
            f"maximum context length of {max_model_len} tokens",
            CONTEXT_CODE,
        )
    return room


def check_context(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """The one check of prompt + max_tokens against the context length (engine, server and CLI)."""
    if max_tokens > context_room(prompt_len, max_model_len):
        raise ParamError(
            "max_tokens",
            f"({max_tokens}) plus the prompt ({prompt_len} tokens) exceeds the "
            f"maximum context length of {max_model_len} tokens",
            CONTEXT_CODE,
        )


def check_batch(sequences: int, max_num_seqs: int, param: str = "n") -> None:
    """The one check of a request's sequences (its samples; the server: prompts x samples) against the
    engine's batch: they run together, so more than max_num_seqs can never be scheduled."""
    if sequences > max_num_seqs:
        raise ParamError(
            param,
            f"makes the request run {sequences} sequences, more than the engine's batch "
            f"of {max_num_seqs} (max_num_seqs)",
        )


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    Penalties follow OpenAI and transformers: with c[t] the count of token t among the *generated*
    tokens, logit[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0); repetition_penalty
    divides positive (multiplies negative) logits of every token in prompt + generated; logit_bias
    adds to the logit of the given token ids; min_tokens forbids EOS and stop_token_ids until that
    many tokens are generated; `structured` (engine/structured.py) masks tokens its grammar forbids.
    The order: repetition, frequency/presence, logit_bias, min_tokens, grammar, then temperature,
    top-k, top-p. `logprobs` / `prompt_logprobs` report the model's own log-softmax (before any of
    these), with that many top alternatives (0 = only the chosen / prompt token).
    `n` samples share the prompt's KV blocks; sample i draws from seed + i. The ranges: the module's table.
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below sampler.GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    structured: object | None = None  # engine.structured.Grammar: one matcher per sample

    def __post_init__(self):
        _int("max_tokens", self.max_tokens, 1)
        _real("temperature", self.temperature, lambda v: 0 <= v <= 2, "a number in [0, 2]")
        _real("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]")
        _int("top_k", self.top_k, -1, what="-1, 0 (off) or a positive integer")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None:
            _int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1, "an integer in [-2**63, 2**63)")
        self.stop = stop_list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        bad = next((t for t in self.stop_token_ids if not (_is_int(t) and t >= 0)), None)
        if bad is not None:
            raise ParamError("stop_token_ids", f"must hold token ids (integers >= 0), got {bad!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ParamError("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        _int("n", self.n, 1, MAX_SAMPLES)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _int(name, getattr(self, name), 0, MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            _real(name, getattr(self, name), lambda v: -2 <= v <= 2, "a number in [-2, 2]")
        _real("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "a finite number > 0")
        bias = {}
        for k, v in (self.logit_bias or {}).items():
            tok = _token_id(k)
            if not (_is_real(v) and -100 <= v <= 100):
                raise ParamError(
                    "logit_bias", f"values must be numbers in [-100, 100], got {v!r} for token {tok}"
                )
            bias[tok] = float(v)
        self.logit_bias = bias
        _int(
            "min_tokens",
            self.min_tokens,
            0,
            self.max_tokens,
            f"an integer in [0, max_tokens={self.max_tokens}]",
        )

    @property
    def penalized(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


# One token's log-probability: (token id, logprob, [(alternative id, logprob), ...] best first).
TokenLogprob = tuple[int, float, list[tuple[int, float]]]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error: <why>" (this request only)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    index: int = 0  # sample number within the request (n > 1)
    cumulative_logprob: float = 0.0  # sum of the generated tokens' logprobs (model log-softmax)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (first None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
