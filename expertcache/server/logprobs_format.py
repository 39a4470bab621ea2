"""TokenLogprob entries (engine) -> the logprobs objects of OpenAI's chat and completions APIs.

Values are the model's log-softmax before penalties, grammar masks and temperature (what
OpenAI reports), clamped to -9999.0 so the JSON stays finite. A token's text is its bytes
decoded as UTF-8, or `bytes:\\xNN...` when it is part of a character (vLLM's convention);
without a tokenizer, `token_id:N`.
"""

from __future__ import annotations

FLOOR = -9999.0


def _lp(v: float) -> float:
    return max(float(v), FLOOR)


class TokenText:
    """Token id -> (text, bytes), cached per id."""

    def __init__(self, tokenizer):
        self.tok, self.cache = tokenizer, {}

    def __call__(self, tid: int) -> tuple[str, list[int]]:
        got = self.cache.get(tid)
        if got is None:
            if self.tok is None:
                got = (f"token_id:{tid}", list(str(tid).encode()))
            else:
                b = self.tok.token_bytes(tid)
                try:
                    text = b.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
                got = (text, list(b))
            self.cache[tid] = got
        return got


def chat_content(entries: list, text: TokenText) -> list[dict]:
    out = []
    for tid, lp, alts in entries:
        t, b = text(tid)
        tops = []
        for aid, alp in alts:
            at, ab = text(aid)
            tops.append({"token": at, "logprob": _lp(alp), "bytes": ab})
        out.append({"token": t, "logprob": _lp(lp), "bytes": b, "top_logprobs": tops})
    return out


def chat_logprobs(entries: list, text: TokenText) -> dict:
    return {"content": chat_content(entries, text), "refusal": None}


def completion_logprobs(
    entries: list, text: TokenText, first_token: int | None = None, offset: int = 0
) -> dict:
    """entries may start with None (an echoed prompt's first token, `first_token`: no logprob).
    top_logprobs holds the chosen token and its top alternatives (vLLM's convention)."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        if e is None:
            t = text(first_token)[0] if first_token is not None else ""
            tokens.append(t)
            values.append(None)
            tops.append(None)
        else:
            tid, lp, alts = e
            t = text(tid)[0]
            tokens.append(t)
            values.append(_lp(lp))
            top = {text(a)[0]: _lp(v) for a, v in alts}
            top.setdefault(t, _lp(lp))
            tops.append(top)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
