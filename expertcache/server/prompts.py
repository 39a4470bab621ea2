"""Request prompt -> token ids, with 400s that name the parameter at fault.

Runs on a worker thread (app.py), never the event loop: it only reads the tokenizer (its batch
encode releases the GIL; the Jinja chat template is sandboxed) and the model config, never the
engine. A text is tokenized only as far as the context length needs (limits.encode_bounded).
"""

from __future__ import annotations

from jinja2 import TemplateError

from ..errors import CheckpointError
from .errors import ApiError
from .limits import encode_bounded
from .protocol import ChatMessage


def completion_ids(llm, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if llm.tokenizer is None:
            raise ApiError("this model has no tokenizer.json: send 'prompt' as a list of token ids", "prompt")
        try:
            ids = encode_bounded(llm.tokenizer, prompt, llm.max_model_len, "prompt")
        except (TypeError, ValueError, UnicodeError) as e:
            raise ApiError(f"'prompt' cannot be tokenized: {e}", "prompt") from None
    else:
        ids = list(prompt)
        vocab = llm.cfg.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(f"'prompt' token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
    if not ids:
        raise ApiError("'prompt' is empty: at least one token is needed", "prompt")
    return ids


def chat_ids(
    llm, messages: list[ChatMessage], add_generation_prompt: bool = True, **template_kwargs
) -> list[int]:
    """template_kwargs (tools=, reasoning_effort=) go into the template's context, as transformers does."""
    tok = llm.tokenizer
    if tok is None or not tok.chat_template:
        raise ApiError("this model has no chat template: use /v1/completions", "messages")
    try:
        text = tok.apply_chat_template(
            [m.as_template_dict() for m in messages],
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
    except (TemplateError, CheckpointError, ValueError, TypeError) as e:
        raise ApiError(f"the chat template rejected 'messages': {e}", "messages") from None
    try:
        ids = encode_bounded(tok, text, llm.max_model_len, "messages", add_special_tokens=False)
    except (TypeError, ValueError, UnicodeError) as e:
        raise ApiError(f"'messages' cannot be tokenized: {e}", "messages") from None
    if not ids:
        raise ApiError("'messages' rendered to an empty prompt", "messages")
    return ids
