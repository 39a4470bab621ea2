"""A `tokenizers` Tokenizer rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

What llama.cpp's converter writes for a byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2"):
    tokens      [str]   every id's piece (byte-level alphabet: "Ġ" for a space byte, ...)
    token_type  [i32]   1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    merges      [str]   "left right", in rank order
    pre         str     which pre-tokenizer (the regex llama.cpp splits text with before BPE)
    bos/eos/eot/padding_token_id, add_bos_token, add_eos_token; tokenizer.chat_template
Every piece keeps its id (the BPE vocabulary holds them all); control tokens are added tokens marked
special, user-defined ones added tokens not special (both matched before pre-tokenization, as in a
tokenizer.json). `PRE` holds the regexes (from llama.cpp's llama-vocab.cpp, in their tokenizer.json
form), the NFC normalizer the Qwen tokenizers apply, and llama.cpp's `ignore_merges` per `pre`; an
unknown `pre` or model is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from ..errors import CheckpointError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Pre(NamedTuple):
    regexes: tuple[str, ...]  # applied in order, each splitting the pieces of the previous (Isolated)
    nfc: bool = False
    ignore_merges: bool = False


PRE: dict[str, Pre] = {
    "qwen2": Pre(
        (
            (
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+"
            ),
        ),
        nfc=True,
    ),
    "qwen35": Pre(
        (
            (
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            ),
        ),
        nfc=True,
    ),
    "llama-bpe": Pre((_LLAMA3,), ignore_merges=True),
    "glm4": Pre((_LLAMA3,), ignore_merges=True),
    "gpt-4o": Pre(
        (
            (
                r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+"
            ),
        )
    ),
    "deepseek-v3": Pre(
        (
            r"\p{N}{1,3}",
            r"[一-龥぀-ゟ゠-ヿ]+",
            (
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
                r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            ),
        )
    ),
    "gpt-2": Pre((r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",)),
}
PRE["llama3"] = PRE["llama-v3"] = PRE["llama-bpe"]
PRE["deepseek-r1-qwen"] = PRE["qwen2"]
PRE["glm5"] = PRE["glm4"]


class GGUFTokenizer(NamedTuple):
    tok: HFTokenizer
    config: dict  # the tokenizer_config.json fields the engine reads: bos/eos token, chat_template


def build_tokenizer(path: Path, meta: dict) -> GGUFTokenizer:
    """The Tokenizer a GGUF file's metadata describes: checked, then its BPE model, its pre-tokenizer
    and decoder, its added tokens, and its bos/eos template, in that order."""
    pre = _pre(path, meta)
    tokens, types = _tokens(path, meta)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = _merges(path, meta, vocab)
    tok = HFTokenizer(
        models.BPE(vocab, merges, ignore_merges=pre.ignore_merges, fuse_unk=False, byte_fallback=False)
    )
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    _add_tokens(tok, tokens, types)
    bos, eos = _piece(meta, tokens, "bos"), _piece(meta, tokens, "eos")
    _add_template(tok, meta, vocab, bos, eos)
    config = {"bos_token": bos, "eos_token": eos, "chat_template": meta.get("tokenizer.chat_template")}
    return GGUFTokenizer(tok, config)


def _pre(path: Path, meta: dict) -> Pre:
    """The pre-tokenizer `tokenizer.ggml.pre` names; a tokenizer other than byte-level BPE refused."""
    model = meta.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.model/tokens)")
    if model != "gpt2":
        raise CheckpointError(
            f"{path}: tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2', "
            "byte-level BPE); pass a tokenizer.json directory instead"
        )
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in PRE:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.pre {pre_name!r} is not supported (supported: "
            f"{', '.join(sorted(PRE))}); pass a tokenizer.json directory instead"
        )
    return PRE[pre_name]


def _tokens(path: Path, meta: dict) -> tuple[list[str], list[int]]:
    """Every id's piece and its token type (NORMAL where the file gives none), one each."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    return tokens, types


def _merges(path: Path, meta: dict, vocab: dict[str, int]) -> list[tuple[str, ...]]:
    """The merges in rank order, each two pieces of the vocabulary."""
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bad = next((m for m in merges if len(m) != 2 or m[0] not in vocab or m[1] not in vocab), None)
    if bad is not None:
        raise CheckpointError(
            f"{path}: tokenizer.ggml.merges holds {' '.join(bad)!r}, not two tokens of the vocabulary"
        )
    return merges


def _add_tokens(tok: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens added as special tokens, user-defined ones as added tokens not special."""
    added = [
        AddedToken(t, special=ty == CONTROL, normalized=False)
        for t, ty in zip(tokens, types)
        if ty in (CONTROL, USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])


def _piece(meta: dict, tokens: list[str], key: str) -> str | None:
    """The piece of `tokenizer.ggml.<key>_token_id`, None where it is absent or out of range."""
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def _add_template(
    tok: HFTokenizer, meta: dict, vocab: dict[str, int], bos: str | None, eos: str | None
) -> None:
    """The post-processor that adds bos/eos where `add_bos_token`/`add_eos_token` ask for them."""
    specials, single = [], "$A"
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        specials.append((bos, vocab[bos]))
        single = f"{bos} $A"
    if meta.get("tokenizer.ggml.add_eos_token") and eos is not None:
        specials.append((eos, vocab[eos]))
        single = f"{single} {eos}"
    if specials:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
