"""The real `expertcache serve` in a subprocess on a free loopback port, for the server tests.

`start_server(checkpoint, log_path, *flags, key=...)` is a context manager: it waits (bounded)
until /health says ok, yields a `Server`, and kills the process on exit. `wait_until` polls a
condition with a generous bound (no sleep stands in for an event).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

START_TIMEOUT_S = 180  # an upper bound for a loaded machine, not a measured time


def wait_until(condition, timeout_s: float = 60.0, interval_s: float = 0.05):
    """Poll `condition()` until it returns something true (returned) or `timeout_s` passes (its last
    value returned): a generous upper bound for a loaded machine, not a measured time."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path, health: list, key: str | None):
        self.proc, self.url, self.log_path, self.health, self.key = proc, url, log_path, health, key

    def http(self, auth: bool = True, key: str | None = None) -> httpx.Client:
        key = key or self.key
        headers = {"Authorization": f"Bearer {key}"} if auth and key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def client(self):
        import openai

        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.key or "none", timeout=120, max_retries=0
        )

    def metric(self, name: str, labels: str = "") -> float:
        with self.http() as c:
            text = c.get("/metrics").text
        for line in text.splitlines():
            if line.startswith(name + (labels and "{" + labels + "}")) and not line.startswith("#"):
                head, _, value = line.rpartition(" ")
                if head == name + (labels and "{" + labels + "}"):
                    return float(value)
        return 0.0

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


@contextmanager
def start_server(
    checkpoint, log_path: Path, *flags: str, key: str | None = None, timeout_s: float = START_TIMEOUT_S
):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "expertcache.server",
                str(checkpoint),
                "--port",
                str(port),
                "--no-access-log",
                *flags,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    health: list[tuple[int, dict]] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert proc.poll() is None, (
                f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            )
            try:
                r = httpx.get(url + "/health", timeout=2)
                health.append((r.status_code, r.json()))
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            pytest.fail(f"server not healthy within {timeout_s} s:\n{log_path.read_text()[-3000:]}")
        yield Server(proc, url, log_path, health, key)
    finally:
        proc.kill()
        proc.wait(timeout=10)
