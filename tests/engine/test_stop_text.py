"""engine/stop_text.py: incremental detokenisation and stop strings, against the whole decode of the
completion (the tokenizer's own `decode` of every id at once, then `str.find`) as the reference."""

from __future__ import annotations

import pytest

TEXT = (
    "Hello, wörld! 你好，世界。 Emoji: 🙂🚀 done.\n  indented  spaces\tand tabs; "
    "résumé naïve café — «quotes» 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 END"
)


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir):
    from expertcache.engine.tokenizer import Tokenizer

    return Tokenizer(qwen3_tokenizer_dir)


def feed(tok, ids, stop):
    from expertcache.engine.stop_text import StopText

    text = StopText(tok, stop)
    out, stopped_at = [], None
    for i, t in enumerate(ids):
        piece, stopped = text.add(t, finished=i == len(ids) - 1)
        out.append(piece)
        assert len(text.held) <= max((len(s) - 1 for s in stop), default=0) + 4, "held text is bounded"
        if stopped:
            stopped_at = i
            break
    return "".join(out), stopped_at


def test_pieces_join_to_the_whole_decode(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 30
    got, stopped = feed(tok, ids, [])
    assert stopped is None and got == tok.decode(ids)


@pytest.mark.parametrize(
    "stop",
    [["世界"], ["🚀"], ["tabs", "Emoji"], ["résumé"], ["END"], ["not there"], ["s", "spaces"], ["\n  "]],
)
def test_stop_strings_cut_at_the_first_match(tok, stop):
    ids = tok.encode(TEXT, add_special_tokens=False)
    whole = tok.decode(ids)
    hits = [whole.find(s) for s in stop if whole.find(s) >= 0]
    got, stopped = feed(tok, ids, stop)
    assert got == (whole[: min(hits)] if hits else whole)
    assert (stopped is not None) == bool(hits)
    if hits:  # it stopped at the token that completed the match, not later
        assert min(hits) + len(stop[[whole.find(s) for s in stop].index(min(hits))]) > len(
            tok.decode(ids[:stopped])
        )


def test_split_utf8_character_is_held_until_complete(tok):
    char = next(c for c in "𝔘𝔫𝔦𝔠𝔬𝔡𝔢🜁🝖𓀀" if len(tok.encode(c, add_special_tokens=False)) > 1)
    ids = tok.encode(char, add_special_tokens=False)  # one character, several byte-level tokens
    from expertcache.engine.stop_text import StopText

    text = StopText(tok, [])
    pieces = [text.add(t, finished=False)[0] for t in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == char


def test_each_step_decodes_a_bounded_window(tok):
    """The per-token work does not grow with the completion: every decode call sees a few ids."""
    from expertcache.engine.stop_text import StopText

    seen = []

    class Counting:
        def decode(self, ids, **kw):
            seen.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode(TEXT * 20, add_special_tokens=False)
    text = StopText(Counting(), ["zzz"])
    for t in ids:
        text.add(t, finished=False)
    assert len(ids) > 500 and max(seen) <= 8


def test_invalid_utf8_joins_like_the_whole_decode(tok):
    """Random byte tokens (lone continuation bytes, cut characters, lead bytes never completed):
    the pieces still join to exactly what decoding every id at once gives."""
    import random

    rng = random.Random(0)
    emoji = tok.encode("🙂é€", add_special_tokens=False)
    for _ in range(200):
        ids = [rng.choice([rng.randrange(256), rng.choice(emoji)]) for _ in range(rng.randint(1, 30))]
        got, stopped = feed(tok, ids, [])
        assert got == tok.decode(ids), ids
