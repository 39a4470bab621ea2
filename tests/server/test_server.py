"""`expertcache serve` end to end: the real server in a subprocess on a free loopback port,
driven by the official openai client (and httpx for raw HTTP).

One server (tiny random Qwen3-MoE checkpoint, --api-key) serves the whole module; its fixture
kills it in a finalizer. Every loop is bounded; all traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")

from serving import start_server, wait_until  # noqa: E402

KEY = "test-key-123"


@pytest.fixture(scope="module")
def server(qwen3_checkpoint, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    with start_server(
        qwen3_checkpoint,
        log_path,
        "--api-key",
        KEY,
        "--served-model-name",
        "tiny",
        "--log-interval",
        "1",
        key=KEY,
    ) as srv:
        yield srv


def chat(client, content: str, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


# -- lifecycle -------------------------------------------------------------------------------------


def test_health_goes_from_loading_to_ok(server):
    codes = [c for c, _ in server.health]
    assert codes[-1] == 200 and server.health[-1][1] == {"status": "ok"}
    for code, body in server.health[:-1]:  # everything before ready is a 503 'loading' with a progress
        assert code == 503 and body["status"] == "loading" and 0.0 <= body["progress"] <= 1.0
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_health_503_while_loading_in_process(qwen3_checkpoint, monkeypatch):
    """The loading window is too short to hit reliably with a tiny model: hold it open here."""
    from fastapi.testclient import TestClient

    from expertcache.server import loader
    from expertcache.server.app import ServerConfig, create_app

    gate = threading.Event()
    real_run = loader.ModelLoader._run

    def held_run(self):
        self.total_bytes, self.read_bytes = 100, 42
        gate.wait(20)
        real_run(self)

    monkeypatch.setattr(loader.ModelLoader, "_run", held_run)
    app = create_app(ServerConfig("tiny", {"model": str(qwen3_checkpoint)}))
    with TestClient(app, base_url="http://localhost") as c:  # a loopback Host: the server's default names
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading", "progress": 0.42}
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        gate.set()
        deadline = time.monotonic() + 120  # an upper bound for a loaded machine, not a measured time
        while c.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.get("/health").json() == {"status": "ok"}


# -- generation ------------------------------------------------------------------------------------


def test_chat_stream_matches_non_stream(server):
    client = server.client()
    full = chat(client, "Hello there")
    assert full.choices[0].finish_reason in ("length", "stop")
    u = full.usage
    assert u.completion_tokens >= 1 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    timings = full.model_extra["timings"]
    assert timings["predicted_n"] == u.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == u.prompt_tokens

    chunks = list(chat(client, "Hello there", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens


def test_raw_stream_ends_with_done(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with server.http() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_completions_text_ids_and_stream(server, qwen3_llm):
    from expertcache import SamplingParams

    client = server.client()
    a = client.completions.create(
        model="tiny",
        prompt="The quick brown fox",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert a.object == "text_completion"
    want = qwen3_llm.generate(
        "The quick brown fox", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    assert a.usage.completion_tokens == 8 and a.choices[0].finish_reason == "length"
    assert a.choices[0].text == want.text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny",
            prompt="The quick brown fox",
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert streamed == a.choices[0].text
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens >= 1


def test_stop_string_and_seed(server, qwen3_llm):
    client = server.client()
    full = (
        client.completions.create(
            model="tiny", prompt="Hello world", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = full[6:8]
    cut = client.completions.create(
        model="tiny",
        prompt="Hello world",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.find(stop)]
    s1, s2 = (
        chat(
            client,
            "seeded",
            temperature=1.0,
            top_p=0.9,
            seed=7,
            max_tokens=6,
            extra_body={"top_k": 50, "ignore_eos": True},
        )
        .choices[0]
        .message.content
        for _ in range(2)
    )
    assert s1 == s2
    from expertcache import SamplingParams

    # the same sampling in process: temperature, top_p, top_k and the seed all reached the engine
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    assert s1 == qwen3_llm.chat([{"role": "user", "content": "seeded"}], params)[0].text
    other = (
        chat(
            client,
            "seeded",
            temperature=1.0,
            top_p=0.9,
            seed=8,
            max_tokens=6,
            extra_body={"top_k": 50, "ignore_eos": True},
        )
        .choices[0]
        .message.content
    )
    assert (
        other
        == qwen3_llm.chat(
            [{"role": "user", "content": "seeded"}],
            SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, top_k=50, seed=8, ignore_eos=True),
        )[0].text
    )


def test_concurrent_greedy_equals_sequential(server):
    client = server.client()
    prompts = ["Hello world", "What is the capital of France?", "Numbers: 0 1 2", "The end of the story"]
    sequential = [chat(client, p, max_tokens=10).choices[0].message.content for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(
            pool.map(lambda p: chat(client, p, max_tokens=10).choices[0].message.content, prompts)
        )
    assert concurrent == sequential


def test_shared_system_prompt_hits_prefix_cache(server):
    client = server.client()
    system = "You are a helpful assistant. " * 6 + "The quick brown fox jumps over the lazy dog. " * 2
    hits0, computed0 = (
        server.metric("expertcache:prefix_cache_hits_total"),
        server.metric("expertcache:prompt_tokens_computed_total"),
    )
    usages = []
    for q in ("Hello there", "What is 42?"):
        r = client.chat.completions.create(
            model="tiny",
            max_tokens=2,
            temperature=0,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
        )
        usages.append(r.usage)
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached >= 64, usages  # the shared system prompt, in whole 16-token blocks
    hits = server.metric("expertcache:prefix_cache_hits_total") - hits0
    computed = server.metric("expertcache:prompt_tokens_computed_total") - computed0
    assert hits >= cached
    assert computed <= usages[0].prompt_tokens + usages[1].prompt_tokens - cached


# -- bad input -------------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("malformed json", "/v1/chat/completions", b'{"messages": [', None),
    ("not an object", "/v1/chat/completions", [1, 2], None),
    ("wrong type", "/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, "temperature"),
    ("string max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": MSG}, "model"),
    ("max_tokens 0", "/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ("max_tokens < 0", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    (
        "max_completion_tokens 0",
        "/v1/chat/completions",
        {"messages": MSG, "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
    ("beyond context", "/v1/chat/completions", {"messages": MSG, "max_tokens": 100000}, "max_tokens"),
    ("prompt beyond context", "/v1/completions", {"prompt": list(range(1, 300)), "max_tokens": 1}, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, "messages"),
    (
        "unknown role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        "messages[0].role",
    ),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("n=0", "/v1/chat/completions", {"messages": MSG, "n": 0}, "n"),
    ("top_p 0", "/v1/chat/completions", {"messages": MSG, "top_p": 0}, "top_p"),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, "prompt"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 10**9]}, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, "prompt"),
    ("suffix", "/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("functions", "/v1/chat/completions", {"messages": MSG, "functions": [{"name": "f"}]}, "functions"),
    ("logprobs 6", "/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    (
        "top_logprobs 21",
        "/v1/chat/completions",
        {"messages": MSG, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": MSG, "top_logprobs": 2},
        "top_logprobs",
    ),
    (
        "presence_penalty 3",
        "/v1/chat/completions",
        {"messages": MSG, "presence_penalty": 3},
        "presence_penalty",
    ),
    (
        "frequency_penalty -2.5",
        "/v1/completions",
        {"prompt": "hi", "frequency_penalty": -2.5},
        "frequency_penalty",
    ),
    ("logit_bias key", "/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("logit_bias value", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 200}}, "logit_bias"),
    ("best_of < n", "/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    ("best_of streamed", "/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
    (
        "tools without tool format",
        "/v1/chat/completions",
        {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
    ),
    (
        "tool_choice without tools",
        "/v1/chat/completions",
        {"messages": MSG, "tool_choice": "required"},
        "tool_choice",
    ),
    (
        "bad json_schema",
        "/v1/chat/completions",
        {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
    ),
    (
        "two constraints",
        "/v1/chat/completions",
        {"messages": MSG, "response_format": {"type": "json_object"}, "guided_regex": "a+"},
        "guided_regex",
    ),
]


# every SamplingParams field out of its range (engine/params.py's table), through the server: the 400 names
# the request's parameter that set it (chat's top_logprobs and max_completion_tokens, best_of for the samples)
OUT_OF_RANGE = [
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": 100000}, "max_completion_tokens"),
    ("/v1/completions", {"temperature": 2.5}, "temperature"),
    ("/v1/chat/completions", {"top_p": 1.5}, "top_p"),
    ("/v1/completions", {"top_k": -2}, "top_k"),
    ("/v1/completions", {"seed": 2**63}, "seed"),
    ("/v1/chat/completions", {"seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"stop": ["ok", ""]}, "stop"),
    ("/v1/completions", {"n": -1}, "n"),
    ("/v1/completions", {"best_of": 0, "n": 0}, "best_of"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"logit_bias": {"5": -101}}, "logit_bias"),
    (
        "/v1/completions",
        {"logit_bias": {"1000000": 1}},
        "logit_bias",
    ),  # outside the vocabulary: the engine's check
    ("/v1/completions", {"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens"),
]


@pytest.mark.parametrize(
    "path,fields,param", OUT_OF_RANGE, ids=[f"{p[-16:]}-{b}" for p, b, _ in OUT_OF_RANGE]
)
def test_each_sampling_field_out_of_range_is_400_naming_it(server, path, fields, param):
    body = {"prompt": "hi", **fields} if path == "/v1/completions" else {"messages": MSG, **fields}
    with server.http() as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        err["param"] == param and err["message"].startswith(f"'{param}' ") and "\n" not in err["message"]
    ), err


def test_seed_range_is_the_engines(server):
    """Both ends of the one seed range (a signed 64-bit integer) are served, and reproducible."""
    client = server.client()
    for seed in (-(2**63), 2**63 - 1, -1):
        a, b = (
            client.completions.create(model="tiny", prompt="seeded", max_tokens=4, temperature=1.0, seed=seed)
            .choices[0]
            .text
            for _ in range(2)
        )
        assert a == b


@pytest.mark.parametrize("name,path,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_400(server, name, path, body, param):
    with server.http() as c:
        r = (
            c.post(path, content=body, headers={"content-type": "application/json"})
            if isinstance(body, bytes)
            else c.post(path, json=body)
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (
            err["type"] == "invalid_request_error"
            and err["message"]
            and set(err) == {"message", "type", "param", "code"}
        )
        assert err["param"] == param
        assert c.get("/health").status_code == 200


def test_api_key_required(server):
    with server.http(auth=False) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = c.post("/v1/chat/completions", json={"messages": MSG}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/health").status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert chat(server.client(), "still alive").choices[0].message.content is not None


# every route and what it answers without the key (docs/limits.md's table): only /health and the
# browser UI's static files are public; /metrics needs --public-metrics; the API docs need --api-docs
ROUTES = [
    ("GET", "/health", 200),
    ("GET", "/", 200),
    ("GET", "/ui/app.js", 200),
    ("GET", "/metrics", 401),
    ("GET", "/stats", 401),
    ("GET", "/v1/models", 401),
    ("GET", "/v1/models/tiny", 401),
    ("POST", "/v1/completions", 401),
    ("POST", "/v1/chat/completions", 401),
    ("POST", "/tokenize", 401),
    ("POST", "/detokenize", 401),
    ("GET", "/docs", 401),
    ("GET", "/redoc", 401),
    ("GET", "/openapi.json", 401),
    ("GET", "/no/such/route", 401),
]


@pytest.mark.parametrize("method,path,status", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_every_route_needs_the_key(server, method, path, status):
    with server.http(auth=False) as c:
        r = c.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == status, r.text
        if status == 401:
            assert r.json()["error"]["code"] == "invalid_api_key"
    with server.http() as c:  # with the key: served, and the API docs do not exist without --api-docs
        bodies = {
            "/v1/completions": {"prompt": "hi", "max_tokens": 1},
            "/tokenize": {"prompt": "hi"},
            "/v1/chat/completions": {"messages": MSG, "max_tokens": 1},
            "/detokenize": {"tokens": [1]},
        }
        r = c.request(method, path, json=bodies.get(path))
        expected = 404 if path in ("/docs", "/redoc", "/openapi.json", "/no/such/route") else 200
        assert r.status_code == expected, r.text


def test_health_names_no_files_after_a_failed_load(tmp_path):
    """A load error goes to the log; /health says only 'error'."""
    from fastapi.testclient import TestClient

    from expertcache.server.app import ServerConfig, create_app

    missing = tmp_path / "secret-dir" / "no-model"
    app = create_app(ServerConfig("tiny", {"model": str(missing)}))
    with TestClient(app, base_url="http://localhost") as c:
        deadline = time.monotonic() + 60  # an upper bound, not a measured time
        while c.get("/health").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        r = c.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "error"}, r.text
    assert app.state.server.loader.error and "secret-dir" in app.state.server.loader.error


def test_client_disconnect_aborts_request(server):
    aborted0 = server.metric("expertcache:request_success_total", 'finished_reason="abort"')
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with server.http() as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break  # leave mid-stream: the connection closes with the context

        def idle():
            eng = c.get("/stats").json()["engine"]
            return eng if eng["running"] == 0 and eng["waiting"] == 0 else None

        eng = wait_until(idle) or c.get("/stats").json()["engine"]
    assert eng["running"] == 0 and eng["kv_cache_usage"] == 0.0
    assert eng["engine_counters"]["generated_tokens"] > 0
    assert server.metric("expertcache:request_success_total", 'finished_reason="abort"') == aborted0 + 1


def _post_raw(url: str, path: str, body: dict):
    """A POST on a raw socket (closing it drops the connection at once, as a client that goes away)."""
    import socket

    host, port = url.rsplit("//", 1)[1].split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)), timeout=30)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_dropped_non_streaming_requests_are_aborted(server, path):
    """10 cycles of 2 non-streaming requests whose connections drop while they generate: every one is
    aborted in the engine (the abort count grows by 2 a cycle, far fewer tokens generated than asked
    for), and none is left running or holding KV blocks."""
    max_tokens = 200  # the tiny model's context is 256 tokens
    body = {
        "model": "tiny",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        **({"prompt": "Hello"} if path == "/v1/completions" else {"messages": MSG}),
    }
    with server.http() as c:

        def engine():
            return c.get("/stats").json()["engine"]

        for cycle in range(10):
            aborted0 = server.metric("expertcache:request_success_total", 'finished_reason="abort"')
            tokens0 = engine()["engine_counters"]["generated_tokens"]
            socks = [_post_raw(server.url, path, body) for _ in range(2)]
            running = wait_until(lambda: engine()["running"] == 2, interval_s=0.005)
            for s in socks:
                s.close()
            eng = wait_until(lambda: (e := engine())["running"] == 0 and e["waiting"] == 0 and e) or engine()
            aborted = server.metric("expertcache:request_success_total", 'finished_reason="abort"') - aborted0
            assert running and aborted == 2, (cycle, aborted, eng)
            assert eng["kv_cache_usage"] == 0.0, (cycle, eng)
            assert eng["engine_counters"]["generated_tokens"] - tokens0 < 2 * max_tokens, (cycle, eng)


# -- observability ---------------------------------------------------------------------------------


def test_metrics_and_stats(server):
    chat(server.client(), "count me", max_tokens=3)
    with server.http() as c:
        text = c.get("/metrics").text
        stats = c.get("/stats").json()
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "expert_cache_hits_total",
        "expert_cache_misses_total",
        "expert_cache_bytes_total",
        "expert_cpu_computed_share",
    ):
        assert f"expertcache:{name}" in text, name
    assert server.metric("expertcache:generation_tokens_total") >= 3
    assert stats["status"] == "ok" and isinstance(stats["expert_stats"], dict)
    assert stats["engine"]["engine_counters"]["generated_tokens"] >= 3
    # the periodic status line (--log-interval 1) appears while the engine works: keep it busy until it does
    client = server.client()
    assert wait_until(
        lambda: (
            chat(client, "keep busy", max_tokens=32, extra_body={"ignore_eos": True})
            and "Avg generation throughput" in server.log_path.read_text(errors="replace")
        )
    )


def test_server_log_has_no_tracebacks(server):
    """A client leaving mid-stream and one leaving mid-body (this test makes both, whatever ran
    before) are logged as one INFO line each: no ERROR, no traceback."""
    import socket

    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with server.http() as c, c.stream("POST", "/v1/completions", json=body) as r:
        next(r.iter_lines())  # the first event, then leave
    host, port = server.url.rsplit("//", 1)[1].split(":")
    with socket.create_connection(
        (host, int(port)), timeout=30
    ) as s:  # promises 1000 bytes, sends 10, leaves
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"prompt": '.encode()
        )
    deadline = time.monotonic() + 60  # an upper bound, not a measured time
    log = ""
    while time.monotonic() < deadline:
        log = server.log_path.read_text(errors="replace")
        if "aborted: client disconnected" in log and "before its body was complete" in log:
            break
        time.sleep(0.05)
    assert "aborted: client disconnected" in log and "before its body was complete" in log, log[-3000:]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_expert_metrics_follow_the_stats_layout(monkeypatch, qwen3_checkpoint):
    """Per-tier expert counters come from a real tiered engine's expert_stats() (a key renamed in
    experts/stats.py makes a line vanish or read 0 here)."""
    from expertcache import LLM, SamplingParams
    from expertcache.server.metrics import ServerMetrics
    from expertcache.server.stats_log import ThroughputLog

    llm = LLM(str(qwen3_checkpoint), device_memory="50%")
    llm.generate([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    stats = llm.expert_stats()
    tiers = stats["per_tier"]
    assert tiers["device"]["hits"] + tiers["device"]["misses"] > 0
    snap = {
        "running": 2,
        "waiting": 1,
        "kv_cache_usage": 0.5,
        "prefix_cache_queries": 100,
        "prefix_cache_hits": 40,
        "num_preemptions": 0,
        "expert_stats": stats,
        "engine_counters": {"prompt_tokens": 60, "generated_tokens": 7},
    }
    m = ServerMetrics()
    m.attach(lambda: snap, lambda: 1.0)
    text = m.render().decode()
    for tier, d in tiers.items():
        if "hits" in d:
            assert f'expertcache:expert_cache_hits_total{{tier="{tier}"}} {float(d["hits"])}' in text, tier
            assert f'expertcache:expert_cache_misses_total{{tier="{tier}"}} {float(d["misses"])}' in text, (
                tier
            )
        moved = sum(v for k, v in d.items() if "bytes" in k)
        assert f'expertcache:expert_cache_bytes_total{{tier="{tier}"}} {float(moved)}' in text, tier
    for line in (
        f"expertcache:expert_cpu_computed_share {float(stats['cpu_computed_share'])}",
        "expertcache:kv_cache_usage_perc 0.5",
        "expertcache:prefix_cache_hits_total 40.0",
    ):
        assert line in text, line
    log = ThroughputLog(interval_s=1.0)
    from expertcache.server import stats_log

    start = time.monotonic()
    later = types.SimpleNamespace(monotonic=lambda: start + 2.0)  # two seconds later: one line due
    monkeypatch.setattr(stats_log, "time", later)
    line = log.maybe_log(snap)
    assert "Running: 2 reqs" in line and "Prefix cache hit rate: 40.0%" in line
    assert f"Expert hit rate: {stats['hit_rate'] * 100:.1f}%" in line, line


def test_tiered_expert_cache_reports_stats_in_process(qwen3_checkpoint):
    """With an expert budget the loader, timings and metrics see the tiered cache's statistics."""
    from fastapi.testclient import TestClient

    from expertcache.server.app import ServerConfig, create_app

    app = create_app(
        ServerConfig("tiny", {"model": str(qwen3_checkpoint), "device_memory": "50%", "progress": True})
    )
    with TestClient(app, base_url="http://localhost") as c:
        deadline = time.monotonic() + 120  # an upper bound for a loaded machine, not a measured time
        while time.monotonic() < deadline:
            health = c.get("/health")
            if health.status_code == 200 or health.json().get("status") == "error":
                break
            time.sleep(0.05)
        assert health.json() == {"status": "ok"}, health.json()
        before = c.get("/stats").json()["expert_stats"]
        r = c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        stats = c.get("/stats").json()["expert_stats"]
        # the request ran alone: its hit rate is the engine's counters' change over it
        hits, misses = stats["hits"] - before.get("hits", 0), stats["misses"] - before.get("misses", 0)
        assert hits + misses > 0
        assert r.json()["timings"]["expert_hit_rate"] == pytest.approx(round(hits / (hits + misses), 4))
        cfg = app.state.server.engine.llm.cfg
        counts = stats["use_counts"]  # [MoE layers][experts]: routed (token, expert) pairs
        assert len(counts) == sum(cfg.moe_layers) and all(len(row) == cfg.num_experts for row in counts)
        used = sum(map(sum, counts)) - sum(map(sum, before.get("use_counts", [])))
        # top-k pairs per routed token; hits and misses count each expert once per layer and step
        assert used % cfg.top_k == 0 and used >= hits + misses
        text = c.get("/metrics").text
        assert 'expertcache:expert_cache_misses_total{tier="device"}' in text
        assert "expertcache:model_load_progress 1.0" in text


def test_public_metrics_api_docs_and_allowed_hosts_in_process(qwen3_checkpoint):
    """--public-metrics opens /metrics only; --api-docs adds the docs behind the key; a server bound
    elsewhere answers only the --allowed-hosts names."""
    from fastapi.testclient import TestClient

    from expertcache.server.app import ServerConfig, create_app
    from expertcache.server.gate import Access

    access = Access.for_bind("0.0.0.0", ["models.lan"], api_key="k", public_metrics=True, api_docs=True)
    app = create_app(ServerConfig("tiny", {"model": str(qwen3_checkpoint)}, access=access))
    with TestClient(app, base_url="http://models.lan:8000") as c:
        assert c.get("/metrics").status_code == 200
        assert c.get("/stats").status_code == 401
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert c.get(path).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer k"}).status_code == 200, path
        r = c.get("/health", headers={"host": "localhost:8000"})  # a name not in --allowed-hosts
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--host", "0.0.0.0"], "--allowed-hosts"),
        (["--max-stop-strings", "65"], "--max-stop-strings"),
        (["--max-logit-bias", "-1"], "--max-logit-bias"),
        (["--record-routing-max-steps", "0"], "--record-routing-max-steps"),
    ],
)
def test_serve_flags_are_checked_before_loading(flags, needle):
    import argparse

    from expertcache.errors import ConfigError
    from expertcache.server.cli import _server_config, add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(flags)
    args.model, args.api_key = None, None
    with pytest.raises(ConfigError, match=needle):
        _server_config(args)


def test_record_routing_stops_at_its_step_cap(qwen3_checkpoint, tmp_path, caplog):
    """serve --record-routing-max-steps: the trace keeps the first steps, then recording stops with
    one warning; generation goes on unchanged."""
    import numpy as np

    from expertcache import LLM, SamplingParams

    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = LLM(str(qwen3_checkpoint)).generate([5, 6, 7], params)[0].token_ids
    llm = LLM(str(qwen3_checkpoint), record_routing=str(tmp_path / "trace.npz"))
    llm.engine.record_max_steps = 3
    with caplog.at_level("WARNING", logger="expertcache"):
        out = llm.generate([5, 6, 7], params)[0].token_ids
    assert out == plain
    steps = np.concatenate(llm.engine.recorder.rows["step"])
    assert sorted(set(steps.tolist())) == [0, 1, 2]  # the first three engine steps, none after
    warnings = [r for r in caplog.records if "--record-routing-max-steps" in r.getMessage()]
    assert len(warnings) == 1


def test_allowed_hosts_flag_is_a_comma_separated_list():
    import argparse

    from expertcache.server.cli import _server_config, add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--host", "0.0.0.0", "--allowed-hosts", "models.lan, 10.0.0.5"])
    args.model, args.api_key = None, None
    assert _server_config(args).access.allowed_hosts == ("models.lan", "10.0.0.5")
