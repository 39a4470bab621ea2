"""Request prompt -> token ids, with 400s that name the parameter at fault.

Runs on the event loop thread: it only reads the tokenizer (thread-safe encode, sandboxed
Jinja chat template) and the model config, never the engine.
"""

from __future__ import annotations

from jinja2 import TemplateError

from ..errors import CheckpointError
from .errors import ApiError
from .protocol import ChatMessage


def completion_ids(llm, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if llm.tokenizer is None:
            raise ApiError("this model has no tokenizer.json: send 'prompt' as a list of token ids", "prompt")
        ids = llm.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        vocab = llm.cfg.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(f"'prompt' token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
    if not ids:
        raise ApiError("'prompt' is empty: at least one token is needed", "prompt")
    return ids


def chat_ids(llm, messages: list[ChatMessage], add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
    """template_kwargs (tools=, reasoning_effort=) go into the template's context, as transformers does."""
    tok = llm.tokenizer
    if tok is None or not tok.chat_template:
        raise ApiError("this model has no chat template: use /v1/completions", "messages")
    try:
        ids = tok.encode_chat([m.as_template_dict() for m in messages], add_generation_prompt=add_generation_prompt,
                              **template_kwargs)
    except (TemplateError, CheckpointError, ValueError, TypeError) as e:
        raise ApiError(f"the chat template rejected 'messages': {e}", "messages") from None
    if not ids:
        raise ApiError("'messages' rendered to an empty prompt", "messages")
    return ids
