"""CI's skip accounting (.ci/check_skips.py): only the allowed reasons pass, module skips included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHECK = Path(__file__).resolve().parents[2] / ".ci" / "check_skips.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_ok" time="0.1"/>
<testcase classname="tests.test_gpu" name="test_x" time="0"><skipped type="pytest.skip"
 message="needs a CUDA device">conftest.py:34: needs a CUDA device</skipped></testcase>
{extra}
</testsuite></testsuites>"""


def check(tmp_path, extra: str = "") -> subprocess.CompletedProcess:
    p = tmp_path / "junit.xml"
    p.write_text(JUNIT.format(extra=extra))
    return subprocess.run([sys.executable, str(CHECK), str(p)], capture_output=True, text=True)


def test_gpu_and_cpu_feature_skips_pass(tmp_path):
    r = check(
        tmp_path,
        '<testcase classname="tests.test_fast_math" name="t" time="0"><skipped type="pytest.skip" '
        'message="the fast CPU math needs the C++ kernels and AVX-512 BF16/VNNI">x</skipped></testcase>',
    )
    assert r.returncode == 0 and "skips: 2 allowed" in r.stdout and "0 not allowed" in r.stdout


def test_a_missing_dependency_or_data_skip_fails(tmp_path):
    r = check(
        tmp_path,
        '<testcase classname="tests.test_b" name="test_y" time="0"><skipped type="pytest.skip" '
        'message="openai missing">x</skipped></testcase>',
    )
    assert r.returncode == 1 and "not allowed: tests.test_b::test_y: openai missing" in r.stdout


def test_a_skipped_module_fails_with_its_reason(tmp_path):
    r = check(
        tmp_path,
        '<testcase classname="" name="" time="0"><skipped message="collection skipped">'
        "('tests/test_c.py', 5, \"Skipped: could not import 'llguidance'\")</skipped></testcase>",
    )
    assert r.returncode == 1 and "could not import 'llguidance'" in r.stdout and "tests/test_c.py" in r.stdout
