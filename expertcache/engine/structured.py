"""Constrained decoding: grammars (JSON schema, regex, choice, Lark) compiled by llguidance, one
matcher per sample, and the batched token mask the sampler applies.

llguidance is a core dependency; an install that lost it makes `Grammars` raise
StructuredUnavailable, which the server turns into a 400. It was picked over xgrammar by
bench/grammar_mask.py (docs/results.md): comparable per-token mask cost, ~100x faster compiles, no
dependencies (xgrammar needs transformers and triton), and Lark grammars that can name special
tokens, which the tool-call formats of GPT-OSS and DeepSeek need.

Invariants:
- a `Grammar` is compiled once, where it is built (the server: on a worker thread, off the engine
  thread), and shared by the samples of a request; each sample's `Matcher` is a copy of the compiled
  start state (no compile on the engine thread); a `Matcher` holds one sample's parse state and sees
  every token that sample generates, in order;
- the mask covers the model's vocabulary V (ids the tokenizer lacks are never allowed); once a
  grammar is complete only EOS is allowed, and a stopped matcher ends the sequence ("stop").
"""

from __future__ import annotations

import json

import numpy as np
import torch


class StructuredUnavailable(ValueError):
    pass


def _llguidance():
    try:
        import llguidance
        import llguidance.torch  # noqa: F401 - the bitmask helpers
    except ImportError:
        raise StructuredUnavailable(
            "structured output (response_format, guided decoding, tool_choice 'required' or a named "
            "function) needs llguidance, a dependency of expertcache that is missing from this install: "
            "pip install 'llguidance>=1.0'"
        ) from None
    return llguidance


class Grammar:
    """A compiled grammar for one request; `matcher()` starts a sample's parse (a copy of the start state)."""

    def __init__(self, owner: "Grammars", spec: str, description: str, start):
        self.owner, self.spec, self.description = owner, spec, description
        self._start = start  # llguidance.LLMatcher at the start of the output, never advanced

    def matcher(self) -> "Matcher":
        return Matcher(self._start.deep_copy(), self.owner.n_vocab)


class Matcher:
    def __init__(self, m, n_vocab: int):
        self.m, self.n_vocab = m, n_vocab  # n_vocab: width of the mask (>= the model's vocabulary)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch as lt

        lt.fill_next_token_bitmask(self.m, bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self.m.consume_token(token))

    @property
    def stopped(self) -> bool:
        return bool(self.m.is_stopped())

    def error(self) -> str:
        return self.m.get_error() or ""


class Grammars:
    """Compiles grammars against one tokenizer (tokenizer.json text) and the model's vocabulary
    (model_vocab may exceed the tokenizer's: padded embeddings)."""

    def __init__(self, tokenizer_json: str, model_vocab: int, tokenizer_vocab: int, eos_ids: list[int]):
        self.ll = _llguidance()
        self.n_vocab = max(model_vocab, tokenizer_vocab)
        self.tokenizer = self.ll.LLTokenizer(
            tokenizer_json, n_vocab=self.n_vocab, eos_token=list(eos_ids) or None
        )

    def _checked(self, spec: str, description: str) -> Grammar:
        """Compile `spec` (the one compile of a request's grammar) or ValueError naming what is wrong."""
        start = self.ll.LLMatcher(self.tokenizer, spec, log_level=0)
        if start.is_error():
            err = (
                start.get_error()
                or self.ll.LLMatcher.validate_grammar(spec, self.tokenizer)
                or "invalid grammar"
            )
            raise ValueError(f"{description}: {err.strip().splitlines()[0]}")
        return Grammar(self, spec, description, start)

    def json_schema(self, schema: dict, description: str = "json_schema") -> Grammar:
        if not isinstance(schema, dict):
            raise ValueError(f"{description}: a JSON schema must be an object")
        spec = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        return self._checked(spec, description)

    def json_object(self) -> Grammar:
        return self.json_schema({"type": "object"}, "json_object")

    def regex(self, pattern: str) -> Grammar:
        return self._checked(self.ll.LLMatcher.grammar_from_regex(pattern), "regex")

    def choice(self, options: list[str]) -> Grammar:
        if not options or not all(isinstance(o, str) for o in options):
            raise ValueError("choice: a non-empty list of strings is needed")
        return self.lark("start: " + " | ".join(json.dumps(o) for o in options), "choice")

    def lark(self, grammar: str, description: str = "grammar") -> Grammar:
        return self._checked(self.ll.LLMatcher.grammar_from_lark(grammar), description)


def apply_grammar(logits: torch.Tensor, matchers: list[Matcher | None]) -> None:
    """logits [B, V] in place: tokens row b's matcher forbids become -inf (rows without one untouched)."""
    rows = [b for b, m in enumerate(matchers) if m is not None]
    width = max(matchers[b].n_vocab for b in rows)
    bitmask = torch.zeros(len(rows), (width + 31) // 32, dtype=torch.int32)
    for i, b in enumerate(rows):
        matchers[b].fill(bitmask, i)
    apply_bitmask(logits, rows, bitmask)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """logits [B, V] in place; bitmask [len(rows), W] int32, bit t of row i (little-endian words)
    set = token t allowed in logits row rows[i]."""
    V = logits.shape[1]
    forbidden = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=-1, count=V, bitorder="little").view(
        bool
    )
    forbidden = torch.from_numpy(forbidden).to(logits.device)
    for i, b in enumerate(rows):  # in place, row by row: no gather/scatter of the whole batch
        logits[b].masked_fill_(forbidden[i], float("-inf"))
