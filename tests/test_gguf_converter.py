"""Optional: a tiny Qwen3-MoE checkpoint (the real Qwen3 tokenizer) converted by llama.cpp's own
convert_hf_to_gguf.py loads, tokenizes as its tokenizer.json does, and gives transformers' logits on the
weights the converter's gguf package dequantizes. Skipped where that converter is absent
($EXPERTCACHE_LLAMA_CPP, else the llama-cpp-python source tree in ~/.cache/expertcache-peers)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf")

import checkpoints as C
from fixture_paths import QWEN3_TOKENIZER_DIR
from gguf_files import dequantized_tensors, reference_with
from tokenizers import Tokenizer as HFTokenizer

from expertcache import LLM

LLAMA_CPP = Path(
    os.environ.get(
        "EXPERTCACHE_LLAMA_CPP",
        Path.home() / ".cache/expertcache-peers/llama_cpp_python-0.3.36/vendor/llama.cpp",
    )
)
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"
TEXT = "Hello world, 你好世界! Привет. def f(x): return x ** 2"


@pytest.mark.skipif(
    not CONVERTER.is_file(), reason="llama.cpp's converter absent (bench/peers: EXPERTCACHE_LLAMA_CPP)"
)
@pytest.mark.parametrize("outtype", ["q8_0"])
def test_llama_cpp_converter_output_loads(tmp_path, outtype):
    ckpt = C.make_checkpoint(tmp_path, "qwen3_moe", name="q", tokenizer=False, vocab_size=151936)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_TOKENIZER_DIR / f, ckpt / f)
    out = tmp_path / f"q-{outtype}.gguf"
    env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")}
    r = subprocess.run(
        [sys.executable, str(CONVERTER), str(ckpt), "--outfile", str(out), "--outtype", outtype],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    llm = LLM(str(out))
    try:
        ids = llm.tokenizer.encode(TEXT)
        assert ids == HFTokenizer.from_file(str(QWEN3_TOKENIZER_DIR / "tokenizer.json")).encode(TEXT).ids
        assert llm.tokenizer.eos_token == "<|im_end|>"
        got = llm.logits(ids)
    finally:
        llm.close()
    ref = C.reference_logits(reference_with(C.load_reference(ckpt), dequantized_tensors(out)), ids)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-3
