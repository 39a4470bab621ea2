"""The tokenizer rebuilt from a GGUF file's tokenizer.ggml.* (gguf/tokenizer.py): a tokenizer.json
written into GGUF metadata the way llama.cpp's converter does, re-read, encodes a fixed multilingual
text to the same ids as the tokenizer.json itself."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

pytest.importorskip("gguf")

from fixture_paths import QWEN3_TOKENIZER_DIR
from gguf_files import tokenizer_metadata, write_gguf

from expertcache.engine.tokenizer import Tokenizer, load_tokenizer
from expertcache.errors import CheckpointError

DEMO = Path(__file__).resolve().parents[2] / "expertcache" / "demo_model"
TEXT = (
    "Hello, world! It's 2026: café naïve résumé — 12345 + 678 = 13023.\n\n  Indented\tTab\r\n"
    "日本語のテキストと中文文本，한국어 텍스트. Привет, мир! مرحبا بالعالم. Γειά σου. 🙂👍🏽 "
    "def f(x):\n    return x ** 2  # it's    spaced   out\n<|im_start|>user\nhi<|im_end|>\n<think>\n</think>"
)


def _gguf(tmp_path, tokenizer_json: Path, pre: str, **kw) -> Path:
    meta = tokenizer_metadata(tokenizer_json, pre, **kw)
    return write_gguf(tmp_path / "tok.gguf", "test", {}, meta)


@pytest.mark.parametrize("where,pre", [(DEMO, "gpt-2"), (QWEN3_TOKENIZER_DIR, "qwen2")])
def test_gguf_tokenizer_encodes_as_the_tokenizer_json(tmp_path, where, pre):
    if not (where / "tokenizer.json").is_file():
        pytest.skip(f"{where} absent")
    ref = HFTokenizer.from_file(str(where / "tokenizer.json"))
    eos = "<|im_end|>" if ref.token_to_id("<|im_end|>") is not None else None
    path = _gguf(
        tmp_path, where / "tokenizer.json", pre, eos=eos, chat_template="{{ messages[0]['content'] }}"
    )
    tok = Tokenizer(path)
    expected = ref.encode(TEXT, add_special_tokens=False).ids
    assert tok.encode(TEXT, add_special_tokens=False) == expected
    assert tok.decode(expected, skip_special_tokens=False) == ref.decode(expected, skip_special_tokens=False)
    assert tok.eos_token == eos
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    specials = {i for i, t in ref.get_added_tokens_decoder().items() if t.special}
    assert {i for i in specials if tok.is_special(i)} == specials


def test_unknown_pre_and_model_are_refused_by_name(tmp_path):
    path = _gguf(tmp_path, DEMO / "tokenizer.json", "tekken")
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre 'tekken' is not supported"):
        Tokenizer(path)
    meta = [("tokenizer.ggml.model", "llama", "str"), ("tokenizer.ggml.tokens", ["a"], "str[]")]
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model 'llama' is not supported"):
        Tokenizer(write_gguf(tmp_path / "spm.gguf", "test", {}, meta))


def test_add_bos_and_the_tokenizer_dir_override(tmp_path):
    path = _gguf(tmp_path, DEMO / "tokenizer.json", "llama-bpe", bos="<|endoftext|>", add_bos=True)
    tok = Tokenizer(path)
    bos = tok.tok.token_to_id("<|endoftext|>")
    assert tok.encode("hi")[0] == bos and tok.encode("hi", add_special_tokens=False)[0] != bos
    assert (
        load_tokenizer(path, DEMO).encode(TEXT)
        == HFTokenizer.from_file(str(DEMO / "tokenizer.json")).encode(TEXT).ids
    )
    with pytest.raises(CheckpointError, match="no tokenizer.json in that directory"):
        load_tokenizer(path, tmp_path)


@pytest.mark.parametrize("pre", ["qwen2", "qwen35", "llama-bpe", "glm4", "gpt-4o", "deepseek-v3", "gpt-2"])
def test_every_pre_tokenizer_builds_and_round_trips(tmp_path, pre):
    tok = Tokenizer(_gguf(tmp_path, DEMO / "tokenizer.json", pre))
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == (
        TEXT if pre not in ("qwen2", "qwen35") else __import__("unicodedata").normalize("NFC", TEXT)
    )
