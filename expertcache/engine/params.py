"""SamplingParams and per-request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI chat's limit)


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
    `n` samples share the prompt's KV blocks; sample i draws from seed + i.
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
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        bad = next((k for k, v in self.logit_bias.items() if not -100 <= v <= 100), None)
        if bad is not None:
            raise ValueError(f"logit_bias for token {bad} must be in [-100, 100], got {self.logit_bias[bad]!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


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
