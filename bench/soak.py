"""Soak: many concurrent clients against the server on loopback for a bounded time, then checks
that nothing leaked and nothing changed.

    python bench/soak.py                              # the demo model, 32 clients, 120 s
    python bench/soak.py --model DIR --clients 32 --seconds 180 --device-memory 25% --host-memory 50%

The server runs in this process (uvicorn on 127.0.0.1 in a thread, the usual engine thread) so
the end checks can read the engine's own state; the clients and the /health poller run in a
child process (asyncio), so that /health times the server alone. Each client loops until the deadline, drawing
(fixed seed) one of: a random sampled request (temperature, top_p, top_k, seed, penalties,
logprobs, stop, n, streamed or not), a greedy probe whose answer must equal the idle server's,
a stream it abandons after a few chunks or a request it abandons before the answer (disconnects),
or an invalid request (bad JSON, deep nesting, a lone surrogate, wrong types, a 2 MB body). A
poller times /health every 20 ms throughout.

At the end, once idle: KV blocks all free (no references), no sequences left, expert tables
consistent with no pinned expert and slot bytes equal to the checkpoint (TieredExperts.check),
no request counted in flight, the greedy probes answered as on the idle server, and the process
RSS after the run within a bound of its value after the first fifth of it.

Output: one `soak key=value ...` line (requests, 5xx, leaked blocks, health p50/p99/max ms, RSS
growth) and the hardware line; exit 1 if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KEY = "soak-key"
PROBES = ["The expert cache keeps", "Hello world", "Numbers: 1 2 3", "A mixture of experts routes"]
WORDS = "the expert cache keeps hot experts in fast memory while the router picks a few of them".split()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(llm_kwargs: dict, max_concurrent_per_key: int = 0):
    """-> (url, ServerState, uvicorn.Server, thread), once /health says ok."""
    import uvicorn

    from expertcache.server.app import ServerConfig, create_app
    from expertcache.server.limits import Limits

    cfg = ServerConfig(
        model_name="soak",
        llm_kwargs=llm_kwargs,
        api_key=KEY,
        log_interval=0,
        limits=Limits(None, max_concurrent_per_key),
    )
    app = create_app(cfg)
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return url, app.state.server, server, thread
            if r.json().get("status") == "error":
                raise SystemExit(f"the model failed to load: {r.json().get('message')}")
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server did not become healthy within 300 s")


def _random_request(rng: random.Random) -> tuple[str, dict]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
    body = {
        "max_tokens": rng.randint(1, 16),
        "temperature": rng.choice([0, 1e-40, 0.3, 0.7, 1.0, 1.5, 2.0]),
        "top_p": rng.choice([None, 1.0, 0.9, 0.5]),
        "top_k": rng.choice([None, 0, 5, 40]),
        "seed": rng.choice([None, rng.randint(0, 2**31)]),
        "stream": rng.random() < 0.5,
        "ignore_eos": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        body["presence_penalty"] = rng.uniform(-2, 2)
        body["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.2:
        body["stop"] = rng.sample(WORDS, 2)
    if rng.random() < 0.2:
        body["n"] = 2
    if rng.random() < 0.5:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)
    return "/v1/completions", body


INVALID = [
    b'{"prompt": ',
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}",
    b'{"prompt": "a \\ud800 b"}',
    b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
    b'{"prompt": "hi", "temperature": "hot"}',
    b'{"prompt": "hi", "max_tokens": 100000}',
    b'{"messages": [{"role": "wizard", "content": "x"}]}',
    json.dumps({"prompt": "x" * (2 << 20)}).encode(),  # over the default 1 MiB body limit
]


class Tally:
    def __init__(self):
        self.requests = self.ok = self.client_errors = self.server_errors = 0
        self.disconnects = self.invalid = self.greedy = self.greedy_mismatches = 0
        self.problems: list[str] = []

    def status(self, code: int, what: str) -> None:
        self.requests += 1
        if code >= 500:
            self.server_errors += 1
            self.problems.append(f"{code} from {what}")
        elif code >= 400:
            self.client_errors += 1
        else:
            self.ok += 1


async def _client(
    c: httpx.AsyncClient,
    rng: random.Random,
    deadline: float,
    reference: dict,
    tally: Tally,
    requests: int | None = None,
) -> None:
    """Requests until the deadline, or (`requests`) exactly that many, the deadline then only a bound."""
    done = 0
    while time.monotonic() < deadline and (requests is None or done < requests):
        done += 1
        kind = rng.random()
        if kind < 0.15:  # greedy probe
            p = rng.choice(PROBES)
            r = await c.post(
                "/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            )
            tally.status(r.status_code, "greedy probe")
            tally.greedy += 1
            if r.status_code == 200 and r.json()["choices"][0]["text"] != reference[p]:
                tally.greedy_mismatches += 1
                tally.problems.append(f"greedy answer for {p!r} changed under load")
        elif kind < 0.30:  # an abandoned stream
            path, body = _random_request(rng)
            body.update(stream=True, max_tokens=64, ignore_eos=True)
            async with c.stream("POST", path, json=body) as r:
                tally.status(r.status_code, "abandoned stream")
                n = rng.randint(1, 4)
                async for line in r.aiter_lines():
                    n -= line.startswith("data:")
                    if n <= 0:
                        break
            tally.disconnects += 1
        elif kind < 0.38:  # a request abandoned before its answer
            path, body = _random_request(rng)
            body.update(stream=False, max_tokens=64, ignore_eos=True)
            try:
                await asyncio.wait_for(c.post(path, json=body), timeout=rng.uniform(0.05, 0.5))
                tally.status(200, "abandoned request")
            except (asyncio.TimeoutError, httpx.TimeoutException):
                tally.requests += 1
            tally.disconnects += 1
        elif kind < 0.48:  # invalid
            r = await c.post(
                rng.choice(["/v1/completions", "/v1/chat/completions"]),
                content=rng.choice(INVALID),
                headers={"content-type": "application/json"},
            )
            tally.status(r.status_code, "invalid request")
            tally.invalid += 1
            if r.status_code < 400:
                tally.problems.append(f"invalid request answered {r.status_code}")
        else:
            path, body = _random_request(rng)
            if body["stream"]:
                async with c.stream("POST", path, json=body) as r:
                    text = "".join([line async for line in r.aiter_lines()])
                    tally.status(r.status_code, f"stream {path}")
                    if '"server_error"' in text:
                        tally.server_errors += 1
                        tally.problems.append(f"server_error event in a stream: {text[-300:]}")
            else:
                r = await c.post(path, json=body)
                tally.status(r.status_code, f"{path} {r.text[:200]}")


async def _poll_health(c: httpx.AsyncClient, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        r = await c.get("/health")
        out.append(time.perf_counter() - t0)

        if r.status_code != 200:
            out.append(float("inf"))
        await asyncio.sleep(0.02)


async def _load(
    url: str,
    clients: int,
    seconds: float,
    seed: int,
    reference: dict,
    tally: Tally,
    health: list[float],
    requests: int | None = None,
) -> None:
    # clients are made first: making one costs ~0.1 s of this loop (its SSL context), which the
    # poller would otherwise count as /health latency
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with (
        httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120, limits=limits
        ) as c,
        httpx.AsyncClient(base_url=url, timeout=30) as h,
    ):
        deadline = time.monotonic() + seconds
        stop = asyncio.Event()
        poller = asyncio.ensure_future(_poll_health(h, stop, health))
        await asyncio.gather(
            *(
                _client(c, random.Random(seed * 1000 + i), deadline, reference, tally, requests)
                for i in range(clients)
            )
        )
        stop.set()
        await poller


def client_main(
    url: str, clients: int, seconds: float, seed: int, reference: dict, requests: int | None = None
) -> dict:
    """The clients and the /health poller (a process of their own: their work must not share the
    server's GIL, or /health would time the clients too) -> the tally as a dict."""
    tally, health = Tally(), []
    asyncio.run(_load(url, clients, seconds, seed, reference, tally, health, requests))
    return {**vars(tally), "health": health}


def _run_clients(
    url: str, clients: int, seconds: float, seed: int, reference: dict, requests: int | None = None
) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--client",
        url,
        "--clients",
        str(clients),
        "--seconds",
        str(seconds),
        "--seed",
        str(seed),
        "--reference",
        json.dumps(reference),
    ]
    if requests is not None:
        cmd += ["--requests-per-client", str(requests)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 600)
    if out.returncode != 0:
        raise SystemExit(f"the client process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _warm_up(url: str, seed: int) -> None:
    """One request of each kind first: first-use costs (imports, template compiles, thread pools)
    are start-up, not load."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        for _ in range(12):
            path, body = _random_request(rng)
            c.post(path, json=body)
        for bad in INVALID:
            c.post("/v1/completions", content=bad, headers={"content-type": "application/json"})


def _greedy(url: str) -> dict:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        return {
            p: c.post(
                "/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            ).json()["choices"][0]["text"]
            for p in PROBES
        }


def idle_checks(state, timeout: float = 60.0) -> dict:
    """Wait for the engine to go idle, then count what is still held."""
    llm = state.engine.llm
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = state.engine.snapshot()
        if snap.get("running") == 0 and snap.get("waiting") == 0 and not state.in_flight.active:
            break
        time.sleep(0.05)
    time.sleep(0.3)  # the engine thread is back in its idle wait
    kv = llm.kv
    free = set(kv.free)
    out = {
        "leaked_blocks": kv.num_blocks - len(free) + sum(b.ref_count > 0 for b in kv.blocks if b.id in free),
        "sequences_left": len(llm.engine.seqs)
        + len(llm.engine.scheduler.running)
        + len(llm.engine.scheduler.waiting),
        "in_flight_left": sum(state.in_flight.active.values()),
        "pinned_experts": 0,
        "expert_check": "resident",
    }
    experts = llm.experts
    if hasattr(experts, "check"):
        out["pinned_experts"] = sum(
            len(t.pinned) for t in experts.dev_tables + list(experts.host_tables or [])
        )
        try:
            experts.check(contents=True)
            out["expert_check"] = "ok"
        except AssertionError as e:
            out["expert_check"] = f"failed: {e}"
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(
    llm_kwargs: dict,
    clients: int = 32,
    seconds: float = 120.0,
    seed: int = 0,
    rss_growth_limit_mb: float = 64.0,
    requests_per_client: int | None = None,
) -> dict:
    """The whole soak; -> figures and checks (`failures` lists what did not hold). With
    `requests_per_client` each client sends exactly that many requests (`seconds` is then only an upper
    bound), so what runs does not depend on the machine's speed."""
    url, state, server, thread = start_server(llm_kwargs)
    try:
        reference = _greedy(url)
        _warm_up(url, seed + 1)  # and the first answers' allocations are not growth
        rss = []
        # the RSS baseline: after the first fifth of a timed run; right after the warm-up of a counted one
        timer = (
            threading.Timer(seconds / 5, lambda: rss.append(rss_mb()))
            if requests_per_client is None
            else None
        )
        if timer is None:
            rss.append(rss_mb())
        else:
            timer.start()
        t0 = time.perf_counter()
        t = _run_clients(url, clients, seconds, seed, reference, requests_per_client)
        wall = time.perf_counter() - t0
        if timer is not None:
            timer.join()
        checks = idle_checks(state)
        after = _greedy(url)
        rss.append(rss_mb())
    finally:
        server.should_exit = True
        thread.join(30)
    health = t["health"]
    res = {
        "clients": clients,
        "seconds": round(wall, 1),
        "requests": t["requests"],
        "ok": t["ok"],
        "4xx": t["client_errors"],
        "5xx": t["server_errors"],
        "disconnects": t["disconnects"],
        "invalid": t["invalid"],
        "greedy_probes": t["greedy"],
        "greedy_mismatches": t["greedy_mismatches"],
        **checks,
        "greedy_after_equal": after == reference,
        "health_n": len(health),
        "health_p50_ms": round(percentile(health, 0.5) * 1000, 1),
        "health_p99_ms": round(percentile(health, 0.99) * 1000, 1),
        "health_max_ms": round(max(health, default=float("nan")) * 1000, 1),
        "rss_mb": round(rss[-1], 1),
        "rss_growth_mb": round(rss[-1] - rss[0], 1),
    }
    failures = list(t["problems"][:10])
    if res["5xx"]:
        failures.append(f"{res['5xx']} server errors")
    for k in ("leaked_blocks", "sequences_left", "in_flight_left", "pinned_experts", "greedy_mismatches"):
        if res[k]:
            failures.append(f"{k}={res[k]}")
    if res["expert_check"] not in ("ok", "resident"):
        failures.append(res["expert_check"])
    if not res["greedy_after_equal"]:
        failures.append("greedy answers after the soak differ from the idle server's")
    if res["rss_growth_mb"] > rss_growth_limit_mb:
        failures.append(f"RSS grew {res['rss_growth_mb']} MB (limit {rss_growth_limit_mb})")
    res["failures"] = failures
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--device-memory", default="25%", help="expert budget of the fastest tier (default: 25%%)"
    )
    ap.add_argument("--host-memory", default="50%", help="expert budget in host RAM (default: 50%%)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rss-growth-limit-mb", type=float, default=64.0)
    ap.add_argument(
        "--requests-per-client",
        type=int,
        default=None,
        help="each client sends exactly this many requests (--seconds: an upper bound)",
    )
    ap.add_argument("--client", default=None, metavar="URL", help=argparse.SUPPRESS)  # the client process
    ap.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        print(
            json.dumps(
                client_main(
                    args.client,
                    args.clients,
                    args.seconds,
                    args.seed,
                    json.loads(args.reference),
                    args.requests_per_client,
                )
            )
        )
        return 0
    import torch
    from common import hardware_line

    if args.threads:
        torch.set_num_threads(args.threads)
    kw = dict(
        model=args.model,
        device="cpu",
        max_num_seqs=args.max_num_seqs,
        device_memory=args.device_memory,
        host_memory=args.host_memory,
    )
    res = run(kw, args.clients, args.seconds, args.seed, args.rss_growth_limit_mb, args.requests_per_client)
    failures = res.pop("failures")
    print("soak " + " ".join(f"{k}={v}" for k, v in res.items()))
    print(hardware_line())
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
