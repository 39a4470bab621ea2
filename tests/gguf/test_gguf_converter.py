"""Optional: a tiny Qwen3-MoE checkpoint (the real Qwen3 tokenizer) converted by llama.cpp's own
convert_hf_to_gguf.py loads, tokenizes as its tokenizer.json does, and gives transformers' logits on the
weights the converter's gguf package dequantizes; that file requantized by llama-quantize to Q4_K_M (its
down experts Q6_K in some layers, Q4_K in others) loads and gives them too. Skipped where the converter
($EXPERTCACHE_LLAMA_CPP, else the llama-cpp-python source tree in ~/.cache/expertcache-peers) or
llama-quantize ($EXPERTCACHE_LLAMA_QUANTIZE, else ~/.cache/expertcache-peers/build/bin) is absent."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

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
QUANTIZE = Path(
    os.environ.get(
        "EXPERTCACHE_LLAMA_QUANTIZE", Path.home() / ".cache/expertcache-peers/build/bin/llama-quantize"
    )
)
TEXT = "Hello world, 你好世界! Привет. def f(x): return x ** 2"


@pytest.mark.skipif(
    not CONVERTER.is_file(), reason="llama.cpp's converter absent (bench/peers: EXPERTCACHE_LLAMA_CPP)"
)
@pytest.mark.parametrize("outtype", ["q8_0"])
def test_llama_cpp_converter_output_loads(tmp_path, outtype):
    ckpt, out = _convert(tmp_path, outtype)
    _loads_with_the_oracles_logits(ckpt, out)


def _convert(tmp_path, outtype: str, **overrides) -> tuple[Path, Path]:
    ckpt = C.make_checkpoint(tmp_path, "qwen3_moe", name="q", tokenizer=False, vocab_size=151936, **overrides)
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
    return ckpt, out


@pytest.mark.skipif(
    not CONVERTER.is_file(), reason="llama.cpp's converter absent (bench/peers: EXPERTCACHE_LLAMA_CPP)"
)
@pytest.mark.skipif(
    not QUANTIZE.is_file(),
    reason="llama.cpp's llama-quantize absent (bench/peers: EXPERTCACHE_LLAMA_QUANTIZE)",
)
def test_llama_quantize_q4_k_m_output_loads(tmp_path):
    """8 layers of 256-wide experts (K-quant rows): llama-quantize's Q4_K_M puts ffn_down_exps in Q6_K where
    use_more_bits picks the layer (0, 3, 6, 7 of 8), Q4_K elsewhere; gate/up Q4_K."""
    ckpt, f16 = _convert(tmp_path, "f16", hidden_size=256, moe_intermediate_size=256, num_hidden_layers=8)
    out = tmp_path / "q-Q4_K_M.gguf"
    r = subprocess.run(
        [str(QUANTIZE), str(f16), str(out), "Q4_K_M", "2"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors if "_exps" in t.name}
    down = {int(n.split(".")[1]): t for n, t in types.items() if "ffn_down_exps" in n}
    assert down == {i: "Q6_K" if i in (0, 3, 6, 7) else "Q4_K" for i in range(8)}
    _loads_with_the_oracles_logits(ckpt, out, method="gguf-layers")


def _loads_with_the_oracles_logits(ckpt: Path, out: Path, method: str | None = None) -> None:
    llm = LLM(str(out))
    try:
        ids = llm.tokenizer.encode(TEXT)
        assert ids == HFTokenizer.from_file(str(QWEN3_TOKENIZER_DIR / "tokenizer.json")).encode(TEXT).ids
        assert llm.tokenizer.eos_token == "<|im_end|>"
        assert method is None or llm.source.method.name == method
        got = llm.logits(ids)
    finally:
        llm.close()
    ref = C.reference_logits(reference_with(C.load_reference(ckpt), dequantized_tensors(out)), ids)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-3
