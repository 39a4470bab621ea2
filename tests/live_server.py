"""`expertcache serve` in a subprocess on a free loopback port, for tests that drive it with
third-party clients (openai, langchain-openai, lm-eval). Every wait is bounded."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

START_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model_dir: Path, log_path: Path, *args: str, health: list | None = None):
    """-> base URL (http://127.0.0.1:PORT) of a healthy server; killed on exit. `health` collects
    every (status code, body) of /health seen while waiting."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "expertcache.server", str(model_dir), "--port", str(port),
                                 "--no-access-log", *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            try:
                r = httpx.get(url + "/health", timeout=2)
                if health is not None:
                    health.append((r.status_code, r.json()))
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            pytest.fail(f"server not healthy within {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)
