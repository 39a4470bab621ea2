"""`expertcache chat`: a conversation through a pseudo-terminal (prompt, streamed reply, stats line,
/reset, Ctrl-D), and one prompt read from a pipe. Replies are checked against LLM.chat greedy on
the same conversation."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from expertcache import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"}
N = 6


@pytest.fixture(scope="module")
def reference(qwen3_checkpoint):
    llm = LLM(str(qwen3_checkpoint))
    sp = SamplingParams(max_tokens=N, temperature=0.0)

    def reply(messages):
        return llm.chat(messages, sp)[0].text

    yield reply
    llm.close()


def _read_until(fd, needle: str, buf: list[str], start: int = 0, timeout: float = 120.0) -> str:
    """Read the terminal into buf until `needle` appears after offset `start`; returns all text so far."""
    end = time.monotonic() + timeout
    while needle not in "".join(buf)[start:]:
        left = end - time.monotonic()
        assert left > 0, f"timed out waiting for {needle!r}; got {''.join(buf)!r}"
        r, _, _ = select.select([fd], [], [], left)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            buf.append(chunk.decode("utf-8", "replace").replace("\r\n", "\n"))
    return "".join(buf)


def test_chat_repl_through_a_pty(qwen3_checkpoint, reference):
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "expertcache.cli",
            "chat",
            str(qwen3_checkpoint),
            "--max-tokens",
            str(N),
            "--temperature",
            "0",
        ],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=ENV,
        close_fds=True,
    )
    os.close(slave)
    buf: list[str] = []
    try:
        _read_until(master, "> ", buf)
        assert "/exit or Ctrl-D" in "".join(buf)
        first = "".join(buf)
        os.write(master, b"hello there\n")
        _read_until(master, "decode", buf, len(first))
        out = _read_until(master, "> ", buf, len(first))[len(first) :]
        reply1 = reference([{"role": "user", "content": "hello there"}])
        assert out.startswith("hello there\n" + reply1 + "\n"), (out, reply1)  # the echo, then the reply
        assert f"generated tokens {N}" in out
        mark = len("".join(buf))
        os.write(master, b"and again\n")
        _read_until(master, "decode", buf, mark)
        out2 = _read_until(master, "> ", buf, mark)[mark:]
        reply2 = reference(
            [
                {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": reply1},
                {"role": "user", "content": "and again"},
            ]
        )
        assert out2.startswith("and again\n" + reply2 + "\n"), (out2, reply2)  # the conversation is kept
        mark = len("".join(buf))
        os.write(master, b"/reset\n")
        text = _read_until(master, "cleared", buf, mark)
        _read_until(
            master, "> ", buf, text.index("cleared", mark)
        )  # the prompt, before typing (the pty echoes at once)
        mark = len("".join(buf))
        os.write(master, b"and again\n")
        _read_until(master, "decode", buf, mark)
        out3 = _read_until(master, "> ", buf, mark)[mark:]
        fresh = reference([{"role": "user", "content": "and again"}])
        assert "and again\n" + fresh + "\n" in out3
        os.write(master, b"\x04")  # Ctrl-D
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def test_chat_reads_a_piped_prompt(qwen3_checkpoint, reference):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "expertcache.cli",
            "chat",
            str(qwen3_checkpoint),
            "--max-tokens",
            str(N),
            "--temperature",
            "0",
        ],
        input="what is a cache?\n",
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == reference([{"role": "user", "content": "what is a cache?"}]) + "\n"
    assert f"generated tokens {N}" in r.stderr


def test_chat_refuses_an_empty_pipe(qwen3_checkpoint, monkeypatch, capsys):
    import io

    from expertcache.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    assert main(["chat", str(qwen3_checkpoint)]) == 2
    assert "stdin: no prompt" in capsys.readouterr().err
