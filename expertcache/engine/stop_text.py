"""A sample's generated text, decoded incrementally and checked against its stop strings on the new
tail only.

Per token the work is bounded by the stop strings, not by the completion: the tokenizer decodes a
window of a few tokens (from `prefix` to the end, the text of `prefix..read` subtracted: the
incremental detokenisation of vLLM and TGI, which keeps the spaces and merges a whole decode
would give), and each stop string is searched for in the text not yet emitted, which is never
longer than the longest stop string minus one plus the new piece. Invariants:
- `emitted + held` == the decode of every token seen so far (up to an unfinished UTF-8 character
  at the end, held back while more bytes can still complete it, at most MAX_PENDING_TOKENS tokens;
  bytes that can never become valid are emitted as the whole decode replaces them);
- no stop string occurs in `emitted + held` except, when `stopped`, once at the end of the
  held text (cut there): a match can only end in the new piece, and it starts at most
  len(stop) - 1 characters before it, inside `held`.
"""

from __future__ import annotations

import codecs

MAX_PENDING_TOKENS = 8  # a UTF-8 character has at most 4 bytes; tokens without bytes (skipped) are rare


class StopText:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer, self.stop, self.skip_special = tokenizer, stop, skip_special_tokens
        self.hold = max((len(s) - 1 for s in stop), default=0)  # characters that could start a stop string
        self.ids: list[int] = []
        self.prefix = self.read = 0  # token offsets: ids[prefix:read] decoded already, ids[read:] not yet
        self.held = ""  # decoded, not yet emitted (could still become a stop string)

    def _decode_new(self, force: bool) -> str:
        """The text the tokens after `read` add, or "" while it ends inside a UTF-8 character
        (unless `force`)."""
        if self.read == len(self.ids):
            return ""

        def dec(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

        before = dec(self.ids[self.prefix : self.read]) if self.read > self.prefix else ""
        after = dec(self.ids[self.prefix :])
        if (
            not force
            and after.endswith("\ufffd")
            and self._incomplete()
            and len(self.ids) - self.read < MAX_PENDING_TOKENS
        ):
            return ""  # an incomplete UTF-8 character: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def _incomplete(self) -> bool:
        """Whether the text ends inside a UTF-8 character that more bytes can still complete (then
        wait), rather than with bytes no continuation can make valid (then emit: the whole decode
        replaces them the same way). Without the tokenizer's token bytes: assume it can."""
        token_bytes = getattr(self.tokenizer, "token_bytes", None)
        if token_bytes is None:
            return True
        tail = b"".join(token_bytes(t) for t in self.ids[-3:])[-3:]  # an unfinished character has <= 3 bytes
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        dec.decode(tail, final=False)
        return bool(dec.getstate()[0])

    def add(self, token: int | None, finished: bool) -> tuple[str, bool]:
        """Take the next token (None: nothing to decode, e.g. a stop token) -> (text to emit, whether a
        stop string was found). `finished`: the sample ends here, emit everything held."""
        if token is not None:
            self.ids.append(token)
        window = self.held + self._decode_new(force=finished)
        hits = [i for i in (window.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.held = ""
            return window[: min(hits)], True
        if finished:
            self.held = ""
            return window, False
        cut = len(window) - self.hold
        if cut <= 0:
            self.held = window
            return "", False
        self.held = window[cut:]
        return window[:cut], False
