"""The command line: every error is one line on stderr with exit code 2 (a traceback only with
--debug); the API key can come from a file so it stays out of the process list."""

from __future__ import annotations

import argparse

import checkpoints as C
import pytest

from expertcache.cli import main


def run(capsys, *argv):
    rc = main(list(argv))
    err = capsys.readouterr().err.strip()
    return rc, err


def test_missing_model_is_one_line_exit_2(capsys, tmp_path):
    rc, err = run(capsys, "generate", str(tmp_path / "nope"), "--prompt", "x")
    assert rc == 2 and len(err.splitlines()) == 1 and "nope" in err and "Traceback" not in err


def test_debug_shows_the_traceback(tmp_path):
    from expertcache.errors import CheckpointError

    with pytest.raises(CheckpointError, match="nope"):
        main(["generate", str(tmp_path / "nope"), "--prompt", "x", "--debug"])


def test_sandbox_refused_template_is_one_line(capsys, qwen3_checkpoint, tmp_path):
    """A chat template that reaches for Python internals is refused by the sandbox: one line."""
    bad = C.copy_checkpoint(qwen3_checkpoint, tmp_path / "model")
    C.write_tokenizer(bad, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    rc, err = run(capsys, "generate", str(bad), "--prompt", "hi", "--chat", "--max-tokens", "1")
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert rc == 2 and "Traceback" not in err and len(errors) == 1, err
    assert errors[0].startswith("error: ") and "tokenizer_config.json" in errors[0] and "sandbox" in errors[0]


def _serve_args(**kw):
    base = dict(api_key=None, api_key_file=None)
    return argparse.Namespace(**{**base, **kw})


def test_api_key_file(tmp_path, monkeypatch):
    from expertcache.errors import ConfigError
    from expertcache.server.cli import api_key

    monkeypatch.delenv("EXPERTCACHE_API_KEY", raising=False)
    f = tmp_path / "key"
    f.write_text("s3cret-key\n")
    assert api_key(_serve_args(api_key_file=str(f))) == "s3cret-key"
    monkeypatch.setenv("EXPERTCACHE_API_KEY", "from-env")
    assert api_key(_serve_args()) == "from-env"
    assert api_key(_serve_args(api_key_file=str(f))) == "s3cret-key"  # the file wins over the variable
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        api_key(_serve_args(api_key_file=str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match="missing"):
        api_key(_serve_args(api_key_file=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="not both"):
        api_key(_serve_args(api_key="a", api_key_file=str(f)))


def test_generate_prints_the_plan_lines_known_after_the_load(capsys, qwen3_checkpoint):
    """Load-time quantization and the KV cache are reported by `generate`, not only kept in llm.plan_lines."""
    rc, err = run(
        capsys,
        "generate",
        str(qwen3_checkpoint),
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
        "--lm-head",
        "int8",
        "--dense",
        "int8",
    )
    assert rc in (0, None), err
    lines = err.splitlines()
    for start in (
        "dense projections: int8 (group 128), quantized at load:",
        "lm_head: int8 (group 128)",
        "dense weights ",
    ):
        assert any(line.startswith(start) for line in lines), (start, err)
