"""Tokenizer and chat template of a checkpoint (tokenizer.json + tokenizer_config.json), or of a GGUF
file (rebuilt from its tokenizer.ggml.* metadata and tokenizer.chat_template: gguf/tokenizer.py).
`load_tokenizer(model, tokenizer_dir)`: a tokenizer.json directory given instead (`--tokenizer DIR`).

Chat templates are rendered in Jinja's immutable sandbox: a template cannot reach
Python internals or mutate its inputs.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from tokenizers import Tokenizer as HFTokenizer

from ..errors import CheckpointError


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable character -> the byte it encodes."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = dict(zip(keep, keep)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_UNICODE_TO_BYTE = _byte_level_map()


def _raise(msg):
    raise TemplateError(msg)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson` (not Jinja's, which escapes HTML): the same options, the same output."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        if model_dir.suffix == ".gguf" and model_dir.is_file():
            self._from_gguf(model_dir)
            return
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{model_dir}: missing tokenizer.json (needed to turn text into tokens)")
        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        try:
            self.config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from None
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{cfg_path}: expected a JSON object")
        self.template_file = cfg_path
        template = self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next(
                (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
            )
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template, self.template_file = jinja_file.read_text(), jinja_file
        self.chat_template = template
        self._finish()

    def _from_gguf(self, path: Path) -> None:
        from ..gguf import read_header
        from ..gguf.tokenizer import build_tokenizer

        self.tok, self.config = build_tokenizer(path, read_header(path).metadata)
        self.template_file = path
        self.chat_template = self.config.get("chat_template")
        self._finish()

    def _finish(self) -> None:
        self._template = None
        self.eos_token = self._token_str("eos_token")
        self.bos_token = self._token_str("bos_token")
        self.eos_token_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None

    def _token_str(self, key: str) -> str | None:
        v = self.config.get(key)
        return v.get("content") if isinstance(v, dict) else v

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch call releases the GIL while it works (encode holds it: a long text would
        # stall every other Python thread, e.g. a server's event loop); same ids
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: byte-level BPE pieces mapped back to raw bytes (a piece
        may be part of a UTF-8 character), otherwise the UTF-8 of its decoded text."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id not in self._special_ids and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return self.tok.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise CheckpointError(f"{self.template_file}: the checkpoint has no chat template")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except TemplateError as e:
                raise CheckpointError(
                    f"{self.template_file}: the chat template does not parse ({e})"
                ) from None
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except SecurityError as e:
            raise CheckpointError(
                f"{self.template_file}: the chat template was refused by the sandbox ({e})"
            ) from None

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def load_tokenizer(model: str | Path, tokenizer_dir: str | Path | None = None) -> Tokenizer:
    """The model's own tokenizer (a checkpoint directory's tokenizer.json, a GGUF file's metadata), or,
    with `tokenizer_dir`, the tokenizer.json + tokenizer_config.json of that directory instead."""
    if tokenizer_dir is None:
        return Tokenizer(model)
    d = Path(tokenizer_dir)
    if not (d / "tokenizer.json").is_file():
        raise CheckpointError(f"--tokenizer {tokenizer_dir}: no tokenizer.json in that directory")
    return Tokenizer(d)
