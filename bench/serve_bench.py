"""Load generator for `expertcache serve`: throughput and latency at several concurrencies.

    python bench/serve_bench.py                          # starts a server on the demo model
    python bench/serve_bench.py --model /path/to/ckpt -n 32 --concurrency 1 4 16
    python bench/serve_bench.py --url http://127.0.0.1:8000 --api-key KEY   # an already running server

Requests are standard streamed chat completions (`stream_options.include_usage`,
`max_completion_tokens`, `ignore_eos`, temperature 0), as `vllm bench serve --backend openai-chat`
sends them, so the numbers compare. Metrics per configuration, like vLLM's:
- request throughput = finished requests / wall time; output tok/s = completion tokens / wall time;
- TTFT = request sent -> first chunk with text; TPOT = (latency - TTFT) / (output tokens - 1).

Workloads: `random` (fixed-seed word prompts, one per concurrency level) and `shared-prefix`
(one long system prompt + short distinct questions), run with prefix caching on and, when this
script starts the server itself, again with `--no-prefix-caching`. Each server gets one warm-up
request first. Output: one `serve_bench key=value ...` line per configuration (parseable), a
hardware line, then a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import AsyncOpenAI

WORDS = (
    "the expert cache keeps hot experts in fast memory while the router picks a few experts for every "
    "token and the rest wait in host memory or on disk so a model larger than the device can still run "
    "with good throughput when routing is skewed and consecutive tokens reuse experts"
).split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    out_tokens: int = 0
    in_tokens: int = 0
    cached: int = 0
    error: str = ""


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def one_request(
    client: AsyncOpenAI, model: str, messages: list[dict], max_tokens: int, seed: int
) -> Result:
    t0 = time.perf_counter()
    ttft, usage = 0.0, None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_completion_tokens=max_tokens,
            temperature=0.0,
            seed=seed,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and not ttft:
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                usage = chunk.usage
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return Result(False, error=f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - t0
    if usage is None:
        return Result(False, error="no usage chunk")
    details = usage.prompt_tokens_details
    return Result(
        True,
        ttft or latency,
        latency,
        usage.completion_tokens,
        usage.prompt_tokens,
        (details.cached_tokens or 0) if details else 0,
    )


async def run_level(client, model, convs: list[list[dict]], max_tokens: int, concurrency: int, seed: int):
    sem = asyncio.Semaphore(concurrency)

    async def limited(i, msgs):
        async with sem:
            return await one_request(client, model, msgs, max_tokens, seed + i)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(limited(i, m) for i, m in enumerate(convs)))
    return results, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [(r.latency - r.ttft) * 1000 / (r.out_tokens - 1) for r in ok if r.out_tokens > 1]
    out = sum(r.out_tokens for r in ok)
    return {
        "n": len(results),
        "ok": len(ok),
        "wall_s": round(wall, 2),
        "req_s": round(len(ok) / wall, 3),
        "out_tok_s": round(out / wall, 2),
        "ttft_p50_ms": round(pct(ttft, 50), 1),
        "ttft_p99_ms": round(pct(ttft, 99), 1),
        "tpot_p50_ms": round(pct(tpot, 50), 1),
        "tpot_p99_ms": round(pct(tpot, 99), 1),
        "in_tok": sum(r.in_tokens for r in ok),
        "cached_tok": sum(r.cached for r in ok),
        "out_tok": out,
        "errors": len(results) - len(ok),
        # shared machines: the load seen while this configuration ran explains outliers
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def hardware_line() -> str:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        torch_v = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_v = "absent"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f'serve_bench hardware cpu="{cpu}" cores={os.cpu_count()} torch={torch_v} '
        f"python={sys.version.split()[0]} loadavg_1m={load:.2f}"
    )


class LocalServer:
    """`python -m expertcache.server` on a free loopback port; killed on exit."""

    def __init__(self, model: str | None, extra: list[str], log_path: Path, timeout: float):
        self.model, self.extra, self.log_path, self.timeout = model, extra, log_path, timeout

    def __enter__(self) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "expertcache.server",
            *([self.model] if self.model else []),
            "--port",
            str(port),
            "--no-access-log",
            *self.extra,
        ]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited ({self.proc.returncode}); see {self.log_path}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise SystemExit(f"server not ready within {self.timeout} s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.log.close()


async def bench_server(url: str, args, workloads: list[str], label: str) -> list[dict]:
    client = AsyncOpenAI(
        base_url=url + "/v1", api_key=args.api_key or "none", timeout=args.request_timeout, max_retries=0
    )
    model = (await client.models.list()).data[0].id
    rng = random.Random(args.seed)
    await one_request(client, model, [{"role": "user", "content": words(rng, 8)}], 4, args.seed)  # warm-up
    rows = []
    for wl in workloads:
        if wl == "random":
            for c in args.concurrency:
                convs = [
                    [{"role": "user", "content": words(rng, args.input_words)}]
                    for _ in range(args.num_prompts)
                ]
                res, wall = await run_level(client, model, convs, args.output_len, c, args.seed)
                rows.append({"workload": "random", "server": label, "concurrency": c, **summarize(res, wall)})
                print(line(rows[-1]), flush=True)
        else:
            system = words(random.Random(args.seed + 1), args.shared_words)
            convs = [
                [{"role": "system", "content": system}, {"role": "user", "content": words(rng, 12)}]
                for _ in range(args.num_prompts)
            ]
            c = args.shared_concurrency
            # the system prompt is already cached in steady state: one unmeasured request puts it there
            await one_request(client, model, [convs[0][0], {"role": "user", "content": "hi"}], 2, args.seed)
            res, wall = await run_level(client, model, convs, args.output_len, c, args.seed)
            rows.append(
                {"workload": "shared-prefix", "server": label, "concurrency": c, **summarize(res, wall)}
            )
            print(line(rows[-1]), flush=True)
    await client.close()
    return rows


def line(row: dict) -> str:
    return "serve_bench " + " ".join(f"{k}={v}" for k, v in row.items())


def table(rows: list[dict]) -> str:
    cols = [
        "workload",
        "server",
        "concurrency",
        "ok",
        "req_s",
        "out_tok_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p99_ms",
        "in_tok",
        "cached_tok",
    ]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="target a running server instead of starting one")
    p.add_argument(
        "--model", default=None, help="model directory for the started server (default: demo model)"
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-args", default="", help="extra flags for the started server, one string")
    p.add_argument(
        "-n", "--num-prompts", type=int, default=32, help="requests per configuration (default: 32)"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--input-words", type=int, default=48, help="words per random prompt (default: 48)")
    p.add_argument("--output-len", type=int, default=32, help="completion tokens per request (default: 32)")
    p.add_argument("--shared-words", type=int, default=300, help="words in the shared system prompt")
    p.add_argument("--shared-concurrency", type=int, default=4)
    p.add_argument(
        "--workloads", nargs="+", default=["random", "shared-prefix"], choices=["random", "shared-prefix"]
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument(
        "--server-timeout", type=float, default=900, help="seconds to wait for /health (demo build)"
    )
    p.add_argument("--log-dir", default=".", help="where started servers write their logs")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so a started server is stopped too
    print(hardware_line(), flush=True)
    rows: list[dict] = []
    if args.url:
        rows += asyncio.run(bench_server(args.url.rstrip("/"), args, args.workloads, "given"))
    else:
        extra = shlex.split(args.server_args) + (["--api-key", args.api_key] if args.api_key else [])
        log_dir = Path(args.log_dir)
        with LocalServer(args.model, extra, log_dir / "serve_bench_server.log", args.server_timeout) as url:
            rows += asyncio.run(bench_server(url, args, args.workloads, "prefix-cache"))
        if "shared-prefix" in args.workloads:
            with LocalServer(
                args.model,
                extra + ["--no-prefix-caching"],
                log_dir / "serve_bench_server_nopc.log",
                args.server_timeout,
            ) as url:
                rows += asyncio.run(bench_server(url, args, ["shared-prefix"], "no-prefix-cache"))
    print(table(rows))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
