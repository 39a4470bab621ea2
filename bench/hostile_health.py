"""/health latency and a well-behaved client's slow-down while the server refuses hostile requests,
one case at a time.

    python bench/hostile_health.py                 # the demo model
    python bench/hostile_health.py --model DIR --repeats 5

Starts `expertcache serve` (a subprocess, loopback), polls /health every 10 ms from a thread of
this process, runs a well-behaved completion (16 greedy tokens) back to back from another thread,
and for each case sends the hostile request back to back, `--repeats` times and for `--seconds`: a 10 MB body with
Content-Length, the same body chunked, a 1 MB prompt under the body limit (longer than the
context), nesting 100,000 deep, a 5,000-digit integer, a lone surrogate, 95,000 stop strings with
n=4, 1,500 prompts, 301 logit_bias entries, a text/plain body with a foreign Host, and, as the
baseline, nothing. Output: one `hostile case=... status=... seconds=... health_n=...
health_p50_ms=... health_p99_ms=... health_max_ms=... good_n=... good_p50_ms=... good_slowdown=...`
line per case (good_slowdown: the well-behaved request's median over its median in the baseline
case), then the hardware line.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import hardware_line  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cases() -> dict:
    big = json.dumps({"prompt": "hello world " * 900_000}).encode()

    def chunked():
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    return {
        "idle": None,
        "10MB-content-length": big,
        "10MB-chunked": chunked,
        "1MB-prompt": json.dumps({"prompt": "hello world " * 80_000}).encode(),
        "nested-100000": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "int-5000-digits": b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        "lone-surrogate": b'{"prompt": "hi \\ud800"}',
        "95000-stops-n4": json.dumps(
            {"prompt": "hi", "n": 4, "stop": [f"s{i}" for i in range(95_000)]}
        ).encode(),
        "1500-prompts": json.dumps({"prompt": ["hi"] * 1500}).encode(),
        "301-logit-bias": json.dumps(
            {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}
        ).encode(),
        "text-plain-foreign-host": (
            json.dumps(GOOD).encode(),
            {"content-type": "text/plain", "host": "attacker.example"},
        ),
    }


GOOD = {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
JSON = {"content-type": "application/json"}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=5, help="hostile requests per case, at least")
    ap.add_argument(
        "--seconds", type=float, default=3.0, help="each case sends its request back to back this long"
    )
    args = ap.parse_args(argv)
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "expertcache.server",
        *([args.model] if args.model else []),
        "--port",
        str(port),
        "--no-access-log",
        "--log-level",
        "warning",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            raise SystemExit("the server did not become healthy")
        with httpx.Client(base_url=url, timeout=120) as c:
            c.post("/v1/completions", json=GOOD)  # warm-up
            baseline = None
            for name, body in cases().items():
                lat, good, stop = [], [], threading.Event()

                def poll():
                    with httpx.Client(base_url=url, timeout=120) as h:
                        while not stop.is_set():
                            t0 = time.perf_counter()
                            h.get("/health")
                            lat.append(time.perf_counter() - t0)
                            time.sleep(0.01)

                def well_behaved():
                    with httpx.Client(base_url=url, timeout=120) as g:
                        while not stop.is_set():
                            t0 = time.perf_counter()
                            assert g.post("/v1/completions", json=GOOD).status_code == 200
                            good.append(time.perf_counter() - t0)

                threads = [threading.Thread(target=poll), threading.Thread(target=well_behaved)]
                for th in threads:
                    th.start()
                time.sleep(0.2)
                t0 = time.perf_counter()
                status = "-"
                sent = 0
                while sent < args.repeats or time.perf_counter() - t0 < args.seconds:
                    sent += 1
                    if body is None:
                        time.sleep(0.1)
                        continue
                    content, headers = body if isinstance(body, tuple) else (body, JSON)
                    content = content() if callable(content) else content
                    status = c.post("/v1/completions", content=content, headers=headers).status_code
                dt = time.perf_counter() - t0
                time.sleep(0.2)
                stop.set()
                for th in threads:
                    th.join()
                baseline = baseline or pct(good, 0.5)
                print(
                    f"hostile case={name} status={status} sent={sent} seconds={dt:.2f} health_n={len(lat)} "
                    f"health_p50_ms={pct(lat, 0.5):.1f} health_p99_ms={pct(lat, 0.99):.1f} "
                    f"health_max_ms={max(lat) * 1000:.1f} good_n={len(good)} good_p50_ms={pct(good, 0.5):.1f} "
                    f"good_slowdown={pct(good, 0.5) / baseline:.2f}",
                    flush=True,
                )
    finally:
        proc.kill()
        proc.wait(10)
    print(hardware_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
