"""The server under hostile or careless input: every bad body is a 4xx OpenAI error object naming
the parameter, /health keeps answering while huge bodies are refused, nulls and defaults follow
OpenAI, one request's tiny temperature never breaks the others, and a per-key concurrency limit."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest
from serving import start_server, wait_until

KEYS = ("key-one-111", "key-two-222")
JSON = {"content-type": "application/json"}
PER_KEY = 4
MAX_MODEL_LEN = 256  # the tiny checkpoint's max_position_embeddings


@pytest.fixture(scope="module")
def server(qwen3_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "keys").write_text("\n".join(KEYS) + "\n")
    with start_server(
        qwen3_checkpoint,
        tmp / "server.log",
        "--api-key-file",
        str(tmp / "keys"),
        "--max-concurrent-per-key",
        str(PER_KEY),
        "--max-num-seqs",
        "8",
        key=KEYS[0],
    ) as srv:
        yield srv
        assert "Traceback" not in srv.log_path.read_text(errors="replace"), srv.log_tail()


def is_error_object(r, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def deep(n: int) -> bytes:
    return b'{"prompt": ' + b"[" * n + b"]" * n + b"}"


HOSTILE = [
    ("nested 100000 deep", "/v1/completions", deep(100_000), "prompt", "nests deeper"),
    ("nested 65 deep", "/v1/completions", deep(65), "prompt", "nests deeper"),
    (
        "5000-digit integer",
        "/v1/completions",
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        "max_tokens",
        "digits",
    ),
    (
        "1000-char float",
        "/v1/completions",
        b'{"prompt": "hi", "temperature": 0.' + b"1" * 1000 + b"}",
        "temperature",
        "characters",
    ),
    ("NaN", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', None, "NaN"),
    ("Infinity", "/v1/chat/completions", b'{"messages": [], "top_p": -Infinity}', None, "Infinity"),
    ("lone surrogate in prompt", "/v1/completions", b'{"prompt": "hi \\ud800 there"}', "prompt", "surrogate"),
    (
        "lone surrogate in chat",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}',
        "messages[0].content",
        "surrogate",
    ),
    (
        "lone surrogate in a list prompt",
        "/v1/completions",
        b'{"prompt": ["\\ud83d"]}',
        "prompt[0]",
        "surrogate",
    ),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', None, "not valid JSON"),
    (
        "over-long text prompt",
        "/v1/completions",
        json.dumps({"prompt": "hello " * 100_000}).encode(),
        "prompt",
        "maximum context length",
    ),
]


@pytest.mark.parametrize("name,path,body,param,needle", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_body_is_400(server, name, path, body, param, needle):
    with server.http() as c:
        err = is_error_object(
            c.post(path, content=body, headers={"content-type": "application/json"}), 400, param
        )
        assert needle in err["message"], err
        assert c.get("/health").status_code == 200


def test_huge_bodies_are_413_while_health_answers(server):
    """A 10 MB body (declared or chunked) is refused before it is read or as soon as it passes the
    limit; an over-long prompt under the limit is judged on a prefix. /health is polled meanwhile:
    it never waits behind them (the bound here is generous for a loaded machine; the README has
    the measured p99)."""
    lat, stop = [], threading.Event()

    def poll():
        with server.http() as h:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert h.get("/health").status_code == 200
                lat.append(time.perf_counter() - t0)
                time.sleep(0.005)

    big = json.dumps({"prompt": "hello world " * 900_000}).encode()  # 10.8 MB
    assert len(big) > 10_000_000
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with server.http() as c:
            for _ in range(3):
                err = is_error_object(c.post("/v1/completions", content=big, headers=JSON), 413)
                assert err["code"] == "request_too_large" and "--max-request-bytes" in err["message"]

                def chunks():
                    for i in range(0, len(big), 1 << 20):
                        yield big[i : i + (1 << 20)]

                is_error_object(c.post("/v1/completions", content=chunks(), headers=JSON), 413)
                mb = json.dumps({"prompt": "hello world " * 80_000}).encode()  # 0.96 MB: under the limit
                is_error_object(c.post("/v1/completions", content=mb, headers=JSON), 400, "prompt")
    finally:
        stop.set()
        poller.join()
    assert (
        len(lat) >= 3
    )  # every poll answered 200 (asserted in the poller); the latency is printed, not asserted
    print(
        f"/health while 10 MB bodies were refused: {len(lat)} polls, max {max(lat) * 1e3:.1f} ms, "
        f"median {sorted(lat)[len(lat) // 2] * 1e3:.1f} ms"
    )


def test_over_long_text_is_judged_on_a_prefix():
    """A 2-million-character prompt for a 256-token context is refused after tokenizing a prefix of
    16 characters per context token, not the whole text."""
    from expertcache.server.errors import ApiError
    from expertcache.server.limits import CHARS_PER_TOKEN_BOUND, encode_bounded

    seen = []

    class TwoCharsPerToken:
        def encode(self, text, add_special_tokens=True):
            seen.append(len(text))
            return list(range(len(text) // 2))

    with pytest.raises(ApiError) as e:
        encode_bounded(TwoCharsPerToken(), "ab" * 1_000_000, MAX_MODEL_LEN, "prompt")
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    assert seen == [CHARS_PER_TOKEN_BOUND * MAX_MODEL_LEN]


def test_declared_oversize_body_is_refused_before_it_is_sent(server):
    """Content-Length over the limit: the 413 arrives after the headers and 1 KiB of the body, the
    other 10 MB never sent."""
    import socket

    host, port = server.url.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            "Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n".encode()
            + b" " * 1024
        )
        answer = b""
        while b"request_too_large" not in answer:  # the status line, headers and error object
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    answer = answer.decode("latin-1")
    assert answer.startswith("HTTP/1.1 413") and "request_too_large" in answer, answer[:400]


def test_nulls_are_accepted_where_openai_allows(server):
    with server.http() as c:
        body = {
            "prompt": "hi",
            "n": None,
            "stream": None,
            "temperature": None,
            "top_p": None,
            "max_tokens": 2,
            "stop": None,
            "seed": None,
            "logprobs": None,
            "stream_options": None,
        }
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "n": None,
            "stream": None,
            "max_tokens": None,
            "max_completion_tokens": 2,
        }
        assert c.post("/v1/chat/completions", json=chat).status_code == 200


def test_max_tokens_defaults(server):
    """16 for completions (OpenAI, vLLM); the rest of the context for chat."""
    with server.http() as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
        r = c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        ).json()
        assert r["usage"]["completion_tokens"] == MAX_MODEL_LEN - r["usage"]["prompt_tokens"]


def test_404_405_are_openai_errors(server):
    with server.http() as c:
        assert is_error_object(c.get("/v1/nope"), 404)["code"] == "not_found"
        r = c.get("/v1/completions")
        assert is_error_object(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
        assert is_error_object(c.put("/health"), 405)


def test_tiny_temperatures_alongside_concurrent_streams(server):
    """1e-40 and 5e-324 pass validation and are greedy; the streams batched with them finish
    normally and greedy ones equal their sequential answers."""
    prompts = ["The quick brown", "Hello world", "Numbers: 1 2"]
    with server.http() as c:
        ref = [
            c.post(
                "/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            ).json()["choices"][0]["text"]
            for p in prompts
        ]

    def stream(args):
        i, (p, t) = args
        with server.http(key=KEYS[i % 2]) as c:  # 7 streams: 4 + 3, within the limit per key
            body = {"prompt": p, "max_tokens": 8, "temperature": t, "ignore_eos": True, "stream": True}
            text, reason = "", None
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        d = json.loads(line[6:])
                        assert "error" not in d, d
                        text += d["choices"][0]["text"]
                        reason = d["choices"][0]["finish_reason"] or reason
            return text, reason

    jobs = [(p, t) for p in prompts for t in (1e-40, 5e-324)] + [(prompts[0], 0.9)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(stream, enumerate(jobs)))
    assert all(reason == "length" for _, reason in outs)
    for (p, _), (text, _) in zip(jobs[:-1], outs[:-1]):
        assert text == ref[prompts.index(p)]


def held_open(server, key: str):
    """A raw connection that sent its request's headers and half its body: the request holds its
    place (counted from its arrival) until the socket closes, whatever the machine's speed."""
    import socket

    host, port = server.url.rsplit("//", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt": '.encode()
    )
    return s


def test_concurrency_limit_per_key(server):
    probe = {"prompt": "hi", "max_tokens": 1}
    with server.http(key=KEYS[0]) as a, server.http(key=KEYS[1]) as b:
        held = [held_open(server, KEYS[0]) for _ in range(PER_KEY)]
        try:

            def refused():  # the held requests are counted once the server has read their headers
                r = a.post("/v1/completions", json=probe)
                return r if r.status_code == 429 else None

            err = is_error_object(wait_until(refused), 429)
            assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
            assert b.post("/v1/completions", json=probe).status_code == 200
        finally:
            for s in held:
                s.close()
        # the closed connections release their places
        assert wait_until(lambda: a.post("/v1/completions", json=probe).status_code == 200), (
            "the key's places were not released after its connections closed"
        )
        assert is_error_object(
            a.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer wrong"}), 401
        )


# -- a hostile request beside a well-behaved one -----------------------------------------------------

GOOD = {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


def beside(server, name: str, hostile: Callable, status: int, param=None) -> None:
    """`hostile(client)` -> a response, sent again and again with key one while key two sends GOOD:
    every hostile response is the expected 4xx error object naming `param`, GOOD gets the same
    answer as alone, nothing is a 5xx. The slow-down of GOOD is printed as a ratio, not asserted."""
    with server.http(key=KEYS[1]) as g:
        g.post("/v1/completions", json=GOOD)  # warm-up
        t0 = time.perf_counter()
        ref = g.post("/v1/completions", json=GOOD)
        alone = time.perf_counter() - t0
    assert ref.status_code == 200, ref.text
    first, done, errors, sent = threading.Event(), threading.Event(), [], [0]

    def attack():
        try:
            with server.http(key=KEYS[0]) as h:
                while not done.is_set():
                    first.set()
                    r = hostile(h)
                    sent[0] += 1
                    is_error_object(r, status, param)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            first.set()

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        assert first.wait(60)
        with server.http(key=KEYS[1]) as g:
            t0 = time.perf_counter()
            got = g.post("/v1/completions", json=GOOD)
            loaded = time.perf_counter() - t0
    finally:
        done.set()
        attacker.join(120)
    assert not errors, errors[0]
    assert sent[0] >= 1 and got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
    print(
        f"hostile {name}: {sent[0]} refused with {status}; the other key's request took {loaded / alone:.2f}x "
        "its time alone"
    )


def post_json(path: str, body: dict):
    return lambda c: c.post(path, json=body)


MANY_STOPS = {"prompt": "hi", "max_tokens": 16, "n": 4, "stop": [f"s{i}" for i in range(95_000)]}
HOSTILE_BESIDE = [
    ("95000 stop strings", post_json("/v1/completions", MANY_STOPS), 400, "stop"),
    ("5 stop strings", post_json("/v1/completions", {"prompt": "hi", "stop": list("abcde")}), 400, "stop"),
    (
        "a 1000-character stop string",
        post_json(
            "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": "x" * 1000}
        ),
        400,
        "stop",
    ),
    (
        "1500 prompts",
        post_json("/v1/completions", {"prompt": ["hi"] * 1500, "max_tokens": 16}),
        400,
        "prompt",
    ),
    (
        "3 prompts x n=2 over the per-key limit",
        post_json("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}),
        400,
        "prompt",
    ),
    (
        "n over --max-num-seqs",
        post_json("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 9}),
        400,
        "n",
    ),
    (
        "301 logit_bias entries",
        post_json("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(301)}}),
        400,
        "logit_bias",
    ),
    (
        "text/plain JSON from a foreign site",
        lambda c: c.post(
            "/v1/completions",
            content=json.dumps(GOOD),
            headers={
                "content-type": "text/plain",
                "host": "attacker.example",
                "origin": "http://attacker.example",
            },
        ),
        400,
        None,
    ),
    (
        "text/plain JSON",
        lambda c: c.post("/v1/completions", content=json.dumps(GOOD), headers={"content-type": "text/plain"}),
        415,
        None,
    ),
    (
        "JSON with a foreign Origin",
        lambda c: c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers={"origin": "https://attacker.example"},
        ),
        403,
        None,
    ),
    ("a rebinding Host", lambda c: c.get("/v1/models", headers={"host": "attacker.example:8000"}), 400, None),
    ("no API key", lambda c: c.get("/stats", headers={"authorization": ""}), 401, None),
    (
        "a body over the limit",
        lambda c: c.post(
            "/v1/completions",
            content=b"{" + b" " * (2 << 20) + b"}",
            headers={"content-type": "application/json"},
        ),
        413,
        None,
    ),
]


@pytest.mark.parametrize("name,hostile,status,param", HOSTILE_BESIDE, ids=[h[0] for h in HOSTILE_BESIDE])
def test_hostile_request_beside_a_good_one(server, name, hostile, status, param):
    beside(server, name, hostile, status, param)


def test_prompt_list_counts_against_the_key(server):
    """Sequences in flight per key = prompts x n: with one stream open, a list of 2 prompts x n=2
    (4 more, limit 4) is a 429; the other key is served meanwhile."""
    body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with server.http(key=KEYS[0]) as a, server.http(key=KEYS[1]) as b:
        with a.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            err = is_error_object(
                a.post("/v1/completions", json={"prompt": ["x", "y"], "n": 2, "max_tokens": 1}), 429
            )
            assert "--max-concurrent-per-key" in err["message"]
            assert (
                a.post("/v1/completions", json={"prompt": ["x", "y", "z"], "max_tokens": 1}).status_code
                == 200
            )
            assert (
                b.post("/v1/completions", json={"prompt": ["x", "y"], "n": 2, "max_tokens": 1}).status_code
                == 200
            )


def test_detokenize_150k_tokens_beside_a_good_one(server):
    """/detokenize decodes on a worker thread: a body of 150k ids is answered (200) while the other
    key's request is served."""
    ids = [(i * 7) % 300 for i in range(150_000)]  # ~0.75 MB of JSON: under the 1 MiB limit
    with server.http() as c:
        r = c.post("/detokenize", json={"tokens": ids[:50]})
        assert r.status_code == 200 and r.json()["prompt"]
    beside_ok(server, lambda c: c.post("/detokenize", json={"tokens": ids}))


def beside_ok(server, request: Callable) -> None:
    """Like `beside` for a request that is answered: 200 for both, the good answer unchanged."""
    with server.http(key=KEYS[1]) as g:
        ref = g.post("/v1/completions", json=GOOD).json()["choices"][0]["text"]
    with ThreadPoolExecutor(2) as pool:
        heavy = pool.submit(lambda: request(server.http(key=KEYS[0])))
        with server.http(key=KEYS[1]) as g:
            got = g.post("/v1/completions", json=GOOD)
        assert heavy.result().status_code == 200
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == ref


# -- fuzz ------------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

JUNK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def field(valid):
    """Mostly a plausible value (valid or just outside the range), sometimes anything at all."""
    return st.one_of(valid, valid, JUNK)


TEXT = st.text(max_size=40)
SAMPLING = {
    "temperature": field(st.floats(-1, 3)),
    "top_p": field(st.floats(-0.5, 1.5)),
    "top_k": field(st.integers(-3, 50)),
    "seed": field(st.integers(-(2**65), 2**65)),
    "stop": field(st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3)),
    "n": field(st.integers(-1, 3)),
    "stream": field(st.booleans()),
    "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)),
    "repetition_penalty": field(st.floats(-1, 3)),
    "logit_bias": field(st.dictionaries(st.integers(-5, 400).map(str), st.floats(-150, 150), max_size=3)),
    "min_tokens": field(st.integers(-1, 5)),
    "ignore_eos": field(st.booleans()),
    "model": field(st.just("nope")),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "response_format": field(
        st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}])
    ),
    "user": field(TEXT),
    "suffix": field(TEXT),
}
COMPLETION = st.fixed_dictionaries(
    {
        "prompt": field(TEXT | st.lists(st.integers(-5, 400), max_size=8) | st.lists(TEXT, max_size=2)),
        "max_tokens": field(st.integers(-2, 6)).filter(lambda v: v is not None),
    },  # null: 16 tokens, tested above
    optional={
        **SAMPLING,
        "logprobs": field(st.integers(-1, 6)),
        "echo": field(st.booleans()),
        "best_of": field(st.integers(-1, 3)),
    },
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": field(st.sampled_from(["system", "user", "assistant", "tool", "wizard"])),
        "content": field(
            TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)
        ),
    },
    optional={"name": field(TEXT)},
)
CHAT = st.fixed_dictionaries(
    {
        "messages": field(st.lists(MESSAGE, max_size=3)),
        # a null or absent limit runs to the end of the context (tested above): keep fuzz examples short
        "max_tokens": field(st.integers(-2, 6)).filter(lambda v: v is not None),
    },
    optional={
        **SAMPLING,
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(-1, 21)),
        "max_completion_tokens": field(st.integers(-2, 6)),
        "tool_choice": field(st.sampled_from(["none", "auto", "required"])),
        "reasoning_effort": field(st.sampled_from(["low", "max"])),
    },
)


def _no_server_error(r, body) -> None:
    assert r.status_code < 500, (body, r.text)
    if r.status_code == 200 and body.get("stream") is True:
        assert '"server_error"' not in r.text, (body, r.text)


@pytest.mark.parametrize("path,schema", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_fuzz_request_schema_never_5xx(server, path, schema):
    """Random bodies over the request schema (bounded: 40 examples per route, derandomized): no 5xx,
    no server_error event in a stream; afterwards the server answers /health and greedy requests
    exactly as before."""
    probe = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with server.http() as c:
        before = c.post("/v1/completions", json=probe).json()["choices"][0]["text"]

        @hypothesis.settings(
            max_examples=40,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )
        @hypothesis.given(body=schema)
        def one(body):
            _no_server_error(c.post(path, json=body), body)

        one()
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json=probe).json()["choices"][0]["text"] == before

        def idle():
            eng = c.get("/stats").json()["engine"]
            return eng if eng["running"] == 0 and eng["waiting"] == 0 else None

        stats = wait_until(idle) or c.get("/stats").json()["engine"]
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_cache_usage"] == 0.0
