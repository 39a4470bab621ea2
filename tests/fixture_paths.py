"""Where the test data that is not built at test time lives: tests/fixtures/, inside the repository.

Every test reads these paths from here (one place), so a fresh clone runs them all.
- QWEN3_TOKENIZER_DIR: the real Qwen3 tokenizer.json + tokenizer_config.json (its chat template) and
  the LICENSE they are distributed with (see tests/fixtures/README.md);
- TINYMOE_ROUTING: the routing of the trained tinymoe-py16 checkpoint (45 MB, too large to ship) on
  2 x 128 of its held-out tokens, recorded by bench/trace_tinymoe.py (command in the README there).
"""

from pathlib import Path

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
QWEN3_TOKENIZER_DIR = FIXTURES_DIR / "qwen3-tokenizer"
TINYMOE_ROUTING = FIXTURES_DIR / "tinymoe-py16-routing.npz"
