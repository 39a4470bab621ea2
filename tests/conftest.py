"""Shared fixtures.

Checkpoints are built by tests/checkpoints.py (tiny random transformers models) and cached
per session: `checkpoint(family, **overrides)` returns the same directory for the same
arguments. transformers is only the test oracle; the engine never imports it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The Triton tests run the kernels interpreted on CPU tensors. Triton reads the variable when its language
# module is first imported, which any test module may cause (torch.nn.attention.bias pulls in torch._dynamo
# and triton), so it is set here, before every test module, and only where no GPU would compile the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The engine's default CPU math is fast where the CPU has it; the suite's oracle is transformers' float32
# math, so its default is exact (tests of the fast math and of the default itself say so explicitly).
os.environ.setdefault("EXPERTCACHE_CPU_MATH", "exact")

# Shared builders (checkpoints.py, gguf_files.py, ...) live in tests/, the tests in a folder per package;
# a test module may also share helpers by module name with one in another folder (test_kernels' routing,
# test_quant_checkpoints' writers), so every folder is importable (test file names are unique).
TESTS_DIR = Path(__file__).resolve().parent
for _d in [TESTS_DIR, *sorted(p for p in TESTS_DIR.iterdir() if p.is_dir() and any(p.glob("test_*.py")))]:
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

import checkpoints  # noqa: E402
from fixture_paths import QWEN3_TOKENIZER_DIR  # noqa: E402

# The test models are tiny: extra intra-op threads only add OpenMP synchronisation, which on a
# shared 2-core machine made a 24-token generation ~50x slower (index_add_ spin-waits).
torch.set_num_threads(1)


# ---------------------------------------------------------------------------
# markers


def pytest_addoption(parser):
    parser.addoption(
        "--reverse",
        action="store_true",
        help="run the collected tests in reverse order (every test must pass in any order)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse"):
        items.reverse()


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


# ---------------------------------------------------------------------------
# checkpoints


def _key(family, overrides):
    return (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """Factory: checkpoint(family, **make_checkpoint_kwargs) -> Path, built once per session."""
    cache: dict = {}

    def build(family: str, **kwargs) -> Path:
        key = _key(family, kwargs)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"ckpt-{family}")
            cache[key] = checkpoints.make_checkpoint(root, family, name="model", **kwargs)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def qwen3_checkpoint(checkpoint) -> Path:
    """The default tiny Qwen3-MoE checkpoint (fp32, vocab 320, ChatML template)."""
    return checkpoint("qwen3_moe")


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer + chat template (tests/fixtures/qwen3-tokenizer, in the repository)."""
    return QWEN3_TOKENIZER_DIR


# ---------------------------------------------------------------------------
# engine


@pytest.fixture(scope="session")
def expertcache_api():
    """The engine's public API module (imported lazily so checkpoint-only tests still run)."""
    import expertcache

    return expertcache


@pytest.fixture(scope="session")
def qwen3_llm(expertcache_api, qwen3_checkpoint):
    """An LLM on the default tiny Qwen3-MoE checkpoint, shared by the whole session."""
    return expertcache_api.LLM(str(qwen3_checkpoint), device="cpu")


@pytest.fixture(scope="session")
def qwen3_reference(qwen3_checkpoint):
    """transformers' model for the default tiny Qwen3-MoE checkpoint (fp32, eager attention)."""
    return checkpoints.load_reference(qwen3_checkpoint)


@pytest.fixture(scope="session")
def cache_checkpoint(checkpoint) -> Path:
    """Qwen3-MoE with 16 experts, top-2, 3 layers, bf16 storage: enough experts for the cache to work."""
    return checkpoint(
        "qwen3_moe", dtype=torch.bfloat16, num_experts=16, num_experts_per_tok=2, num_hidden_layers=3
    )


@pytest.fixture(autouse=True)
def _kernels_path_at_prefill(request):
    """The fast math's prefill matmul path is taken above a crossover measured on the machine (timing):
    outside tests/kernels/test_prefill_gemm.py, which sets its crossovers itself, every weight stays on the C++
    kernels so no test's path depends on the machine's speed."""
    if request.node.path.name == "test_prefill_gemm.py":
        yield
        return
    from expertcache.kernels import prefill_gemm

    with prefill_gemm.fixed_crossover(prefill_gemm.NEVER):
        yield
