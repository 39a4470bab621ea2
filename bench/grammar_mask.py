"""Constrained decoding on the CPU: xgrammar vs llguidance (per-token mask cost, schema coverage),
then the engine's overhead per generated token with a grammar, at batch 1 and 16.

Part 1: for each library, a JSON schema is compiled against a real tokenizer (Qwen3, 151k tokens),
then B matchers walk the same valid document token by token; one step = fill the B token bitmasks
(the library), apply them to [B, V] logits (the engine's apply_bitmask, the same for both), accept
one token per matcher. Median microseconds per step and per token (alternating rounds), compile
time, and which of a set of schema features each library compiles.

Part 2: the demo model generates 32 tokens per sequence for B sequences, without and with a
grammar (llguidance regex `[a-z ]+`, which never completes, so every step is masked); reported:
wall ms per step (generate time / 32), and the grammar's overhead per generated token.

    python bench/grammar_mask.py [--tokenizer DIR] [--rounds 5] [--no-engine]

Lines: `grammar_mask lib=... batch=... mask_us_step=... mask_us_token=... apply_us_step=... compile_ms=...`
(mask: the library's fill + accept; apply: the engine's masking of the logits),
`coverage lib=... ok=.../... failed=[...]`, `grammar_engine batch=... plain_ms_step=... grammar_ms_step=...
overhead_us_per_token=...`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import hardware_line

from expertcache.engine.structured import apply_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "kind": {"enum": ["person", "robot", "other"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
    "additionalProperties": False,
}
DOC = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "tags": ["math", "poetry", "engines"],
        "address": {"city": "London", "zip": "W1"},
        "kind": "person",
    },
    separators=(",", ":"),
)

COVERAGE = {
    "enum": {"enum": ["a", "b"]},
    "const": {"const": 3},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "$ref/$defs": {
        "$defs": {"p": {"type": "integer"}},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/p"}},
    },
    "recursive $ref": {
        "$defs": {
            "n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}
        },
        "$ref": "#/$defs/n",
    },
    "pattern": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]+$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minimum/maximum": {"type": "integer", "minimum": -3, "maximum": 10},
    "exclusiveMinimum number": {"type": "number", "exclusiveMinimum": 0},
    "min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},
    "type list (nullable)": {"type": ["string", "null"]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "multipleOf": {"type": "integer", "multipleOf": 5},
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok_dir: Path, vocab: int):
        import transformers
        import xgrammar as xgr

        self.xgr = xgr
        hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab = vocab

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.vocab)

    def fill(self, ms, bitmask):
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, ms, tok: int):
        for m in ms:
            assert m.accept_token(tok), "xgrammar rejected a valid token"


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok_dir: Path, vocab: int):
        import llguidance
        import llguidance.torch as lt

        self.ll, self.lt = llguidance, lt
        self.tok = llguidance.LLTokenizer((tok_dir / "tokenizer.json").read_text(), n_vocab=vocab)
        self.vocab = vocab

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        err = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        if err:
            raise ValueError(err)
        return grammar

    def matchers(self, grammar, n: int):
        return [self.ll.LLMatcher(self.tok, grammar) for _ in range(n)]

    def bitmask(self, n: int):
        return self.lt.allocate_token_bitmask(n, self.vocab)

    def fill(self, ms, bitmask):
        for i, m in enumerate(ms):
            self.lt.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, ms, tok: int):
        for m in ms:
            assert m.consume_token(tok), f"llguidance rejected a valid token: {m.get_error()}"


def walk(lib, compiled, tokens: list[int], batch: int) -> tuple[float, float]:
    """Seconds per step over one pass of the document at this batch size: (fill + accept, apply)."""
    ms = lib.matchers(compiled, batch)
    bitmask = lib.bitmask(batch)
    logits = torch.zeros(batch, lib.vocab)
    rows = list(range(batch))
    lib_s = apply_s = 0.0
    for tok in tokens:
        t0 = time.perf_counter()
        lib.fill(ms, bitmask)
        t1 = time.perf_counter()
        apply_bitmask(logits, rows, bitmask)
        t2 = time.perf_counter()
        lib.accept(ms, tok)
        lib_s += time.perf_counter() - t2 + t1 - t0
        apply_s += t2 - t1
    return lib_s / len(tokens), apply_s / len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokenizer", default=str(Path(__file__).resolve().parents[2] / "shared" / "tokenizers" / "qwen3")
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-engine", action="store_true", help="skip part 2 (the demo model)")
    args = ap.parse_args()
    torch.manual_seed(0)
    tok_dir = Path(args.tokenizer)
    from tokenizers import Tokenizer

    hf_tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab = hf_tok.get_vocab_size(with_added_tokens=True)
    tokens = hf_tok.encode(DOC, add_special_tokens=False).ids
    print(hardware_line())
    print(f"document: {len(tokens)} tokens, vocab {vocab}")
    libs = [XGrammar(tok_dir, vocab), LLGuidance(tok_dir, vocab)]
    compiled, compile_ms = {}, {}
    for lib in libs:
        t0 = time.perf_counter()
        compiled[lib.name] = lib.compile(SCHEMA)
        compile_ms[lib.name] = (time.perf_counter() - t0) * 1000
        walk(lib, compiled[lib.name], tokens, 1)  # warm-up
    times = {(lib.name, b): [] for lib in libs for b in (1, 16)}
    for _ in range(args.rounds):  # alternating rounds: both libraries see the same machine load
        for b in (1, 16):
            for lib in libs:
                times[(lib.name, b)].append(walk(lib, compiled[lib.name], tokens, b))
    for (name, b), ts in times.items():
        lib_s, apply_s = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
        print(
            f"grammar_mask lib={name} batch={b} mask_us_step={lib_s * 1e6:.1f} mask_us_token={lib_s / b * 1e6:.1f} "
            f"apply_us_step={apply_s * 1e6:.1f} compile_ms={compile_ms[name]:.1f}"
        )
    for lib in libs:
        failed = []
        for feature, schema in COVERAGE.items():
            try:
                lib.compile(schema)
            except Exception:  # noqa: BLE001 - a refusal is what we are counting
                failed.append(feature)
        print(f"coverage lib={lib.name} ok={len(COVERAGE) - len(failed)}/{len(COVERAGE)} failed={failed}")
    if not args.no_engine:
        engine_overhead(args.rounds)


def engine_overhead(rounds: int, tokens: int = 32) -> None:
    from expertcache import LLM, SamplingParams

    llm = LLM(max_num_seqs=16)
    grammar = llm.grammars.regex("[a-z ]+")
    print(f"engine: demo model, vocab {llm.cfg.vocab_size}, {tokens} tokens per sequence")

    def ms_per_step(batch: int, structured) -> float:
        """Wall time of a whole generate (prefill included, the same in both) per decode step."""
        p = SamplingParams(max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True, structured=structured)
        t0 = time.perf_counter()
        llm.generate([[5 + i, 6, 7, 8] for i in range(batch)], p)
        return (time.perf_counter() - t0) / tokens * 1000

    for b in (1, 16):
        ms_per_step(b, grammar)  # warm-up
        plain, masked = [], []
        for _ in range(rounds):  # alternating
            plain.append(ms_per_step(b, None))
            masked.append(ms_per_step(b, grammar))
        p, m = statistics.median(plain), statistics.median(masked)
        print(
            f"grammar_engine batch={b} plain_ms_step={p:.2f} grammar_ms_step={m:.2f} "
            f"overhead_us_per_token={(m - p) / b * 1000:.0f}"
        )


if __name__ == "__main__":
    main()
