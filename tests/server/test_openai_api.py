"""The OpenAI API as third-party clients use it, against a live `expertcache serve` on a tiny random
Qwen3-MoE checkpoint carrying the real Qwen3 chat template (with tools): logprobs (chat and
completions, whole and streamed) against log_softmax of LLM.logits, lm-eval's loglikelihood request,
n / best_of / batched prompts against single runs, JSON schema output, forced tool calls, and the
official openai client, langchain-openai and lm-eval each driving the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from serving import start_server

from expertcache import LLM, SamplingParams

openai = pytest.importorskip("openai")

ATOL = 2e-4
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"],
            "additionalProperties": False,
        },
    },
}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_checkpoint(checkpoint, qwen3_tokenizer_dir):
    template = json.loads((qwen3_tokenizer_dir / "tokenizer_config.json").read_text())["chat_template"]
    return checkpoint("qwen3_moe", chat_template=template, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def url(tool_checkpoint, tmp_path_factory):
    with start_server(
        tool_checkpoint, tmp_path_factory.mktemp("api") / "server.log", "--served-model-name", "tiny"
    ) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def ref(tool_checkpoint):
    return LLM(str(tool_checkpoint), max_model_len=2048)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def ref_logprobs(ref: LLM, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(ref.logits(ids), dim=-1)


# -- logprobs ---------------------------------------------------------------------------------------


def test_chat_logprobs_equal_model_log_softmax(url, client, ref):
    prompt = post(url, "/tokenize", {"messages": MSG})["tokens"]
    gen = ref.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    lp = ref_logprobs(ref, prompt + gen)
    kw = dict(
        model="tiny",
        messages=MSG,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    for entries in (whole, streamed):
        assert len(entries) == len(gen)
        for j, (e, tok) in enumerate(zip(entries, gen)):
            row = lp[len(prompt) - 1 + j]
            assert bytes(e.bytes) == ref.tokenizer.token_bytes(tok)
            assert abs(e.logprob - float(row[tok])) < ATOL
            top = torch.topk(row, 3)
            assert [a.logprob for a in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=ATOL)
            assert [bytes(a.bytes) for a in e.top_logprobs] == [
                ref.tokenizer.token_bytes(t) for t in top.indices
            ]


def test_logprobs_are_the_model_s_before_penalties_bias_and_grammar(url, ref):
    """Logprobs report the model's own log-softmax: with a frequency penalty, a logit_bias and a
    regex grammar shaping the choice, each token's logprob is the unpenalised row's."""
    body = {
        "prompt": PROMPT_IDS,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
        "frequency_penalty": 1.5,
        "logit_bias": {"77": 3},
        "guided_regex": "[a-z]+",
    }
    got = post(url, "/v1/completions", body)["choices"][0]
    grammar = ref.grammars.regex("[a-z]+")
    gen = ref.generate(
        PROMPT_IDS,
        SamplingParams(
            max_tokens=6,
            temperature=0,
            ignore_eos=True,
            frequency_penalty=1.5,
            logit_bias={77: 3},
            structured=grammar,
        ),
    )[0].token_ids
    plain = ref.generate(PROMPT_IDS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[
        0
    ].token_ids
    assert gen != plain  # the penalty, bias and grammar did shape the choice
    lp = ref_logprobs(ref, PROMPT_IDS + gen)
    values = got["logprobs"]["token_logprobs"]
    assert len(values) == len(gen)
    for j, tok in enumerate(gen):
        row = lp[len(PROMPT_IDS) - 1 + j]
        assert abs(values[j] - float(row[tok])) < ATOL
        # the two best alternatives (the chosen token is listed too when it is not among them)
        assert sorted(got["logprobs"]["top_logprobs"][j].values(), reverse=True)[:2] == pytest.approx(
            torch.topk(row, 2).values.tolist(), abs=ATOL
        )


# lm-eval 0.4 local-completions, loglikelihood with --batch_size 2: the body it posts (token ids
# of context + continuation per request; recorded from lm_eval.models.openai_completions)
def lm_eval_body(prompts: list[list[int]]) -> dict:
    return {
        "model": "tiny",
        "prompt": prompts,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }


def test_lm_eval_loglikelihood_request(url, ref):
    ctx = [ref.tokenizer.encode("The capital of France is"), ref.tokenizer.encode("Two plus two is")]
    cont = [ref.tokenizer.encode(" Paris"), ref.tokenizer.encode(" four")]
    prompts = [c + k for c, k in zip(ctx, cont)]
    for _ in range(2):  # the second time the prompts' blocks are in the prefix cache: still recomputed
        out = post(url, "/v1/completions", lm_eval_body(prompts))
        assert [c["index"] for c in out["choices"]] == [0, 1]
        for c, ids, n_ctx in zip(out["choices"], prompts, [len(x) for x in ctx]):
            lps = c["logprobs"]
            assert len(lps["tokens"]) == len(ids) + 1 and lps["token_logprobs"][0] is None
            lp = ref_logprobs(ref, ids)
            want = [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
            assert lps["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=ATOL)
            # lm-eval's parse: the continuation's sum and whether each token is the argmax
            got = sum(lps["token_logprobs"][n_ctx:-1])
            assert got == pytest.approx(sum(want[n_ctx - 1 :]), abs=1e-3)
            for i, top in enumerate(lps["top_logprobs"][n_ctx:-1], start=n_ctx):
                greedy = int(torch.argmax(lp[i - 1])) == ids[i]
                assert (lps["token_logprobs"][i] == max(top.values())) == greedy
            assert c["text"].startswith(ref.tokenizer.decode(ids))


def test_echo_without_logprobs(url, ref):
    out = post(
        url, "/v1/completions", {"prompt": "hello world", "echo": True, "max_tokens": 3, "temperature": 0}
    )
    c = out["choices"][0]
    assert c["text"].startswith("hello world") and c["logprobs"] is None


def test_completion_logprobs_streamed_equal_whole(url):
    body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 5, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    whole = post(url, "/v1/completions", body)["choices"][0]["logprobs"]
    tokens, values = [], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                if ch["logprobs"]:
                    tokens += ch["logprobs"]["tokens"]
                    values += ch["logprobs"]["token_logprobs"]
    assert tokens == whole["tokens"] and values == pytest.approx(whole["token_logprobs"], abs=1e-6)
    assert all(len(t) <= 3 for t in whole["top_logprobs"])


# -- n, best_of, batched prompts ---------------------------------------------------------------------


def test_n_samples_equal_single_runs_with_their_seeds(url):
    body = {"prompt": [11, 12, 13, 14], "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    many = post(url, "/v1/completions", {**body, "n": 3})
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert many["usage"]["completion_tokens"] == 18 and many["usage"]["prompt_tokens"] == 4
    for c in many["choices"]:
        alone = post(url, "/v1/completions", {**body, "seed": 11 + c["index"]})["choices"][0]
        assert c["text"] == alone["text"]


def test_best_of_returns_the_most_likely_sample(url):
    body = {
        "prompt": [21, 22, 23],
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
        "logprobs": 0,
    }
    all3 = post(url, "/v1/completions", {**body, "n": 3})["choices"]
    best = post(url, "/v1/completions", {**body, "best_of": 3})["choices"]
    assert len(best) == 1
    sums = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in all3}
    assert best[0]["text"] == max(sums, key=sums.get)


def test_batched_prompts_number_choices_prompt_major(url):
    prompts = [[31, 32, 33], [41, 42, 43, 44]]
    out = post(
        url,
        "/v1/completions",
        {"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        alone = post(
            url, "/v1/completions", {"prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        )["choices"][0]["text"]
        assert out["choices"][2 * i]["text"] == out["choices"][2 * i + 1]["text"] == alone
    assert out["usage"]["prompt_tokens"] == 7


# each sampling field the server maps onto SamplingParams, at temperature 0: the server's completion
# equals LLM.generate's with the same SamplingParams, and differs from the plain one (so the field
# was not dropped on the way)
PROMPT_IDS = [51, 52, 53, 54, 55, 56]
SAMPLING_CASES = (
    [
        # a bias makes the random model repeat a token (77; 53 of the prompt), which the penalty then acts on
        ("presence_penalty", {"logit_bias": {"77": 3}, "presence_penalty": 2.0}, dict(presence_penalty=2.0)),
        (
            "frequency_penalty",
            {"logit_bias": {"77": 3}, "frequency_penalty": 2.0},
            dict(frequency_penalty=2.0),
        ),
        (
            "repetition_penalty",
            {"logit_bias": {"53": 6}, "repetition_penalty": 3.0},
            dict(repetition_penalty=3.0),
        ),
        ("logit_bias", {"logit_bias": {"77": 100}}, {}),
        ("guided_choice", {"guided_choice": ["Paris", "Oslo"]}, lambda g: g.choice(["Paris", "Oslo"])),
        ("guided_regex", {"guided_regex": "[0-9]{3}"}, lambda g: g.regex("[0-9]{3}")),
        ("guided_json", {"guided_json": SCHEMA_FOR_SAMPLING}, lambda g: g.json_schema(SCHEMA_FOR_SAMPLING)),
        (
            "guided_grammar",
            {"guided_grammar": 'start: "yes" | "no"'},
            lambda g: g.lark('start: "yes" | "no"'),
        ),
        ("response_format", {"response_format": {"type": "json_object"}}, lambda g: g.json_object()),
    ]
    if (
        SCHEMA_FOR_SAMPLING := {
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
            "additionalProperties": False,
        }
    )
    else []
)


def _ref_params(ref: LLM, body: dict, extra, max_tokens: int) -> SamplingParams:
    kw = {"structured": extra(ref.grammars)} if callable(extra) else dict(extra)
    bias = {int(k): v for k, v in body.get("logit_bias", {}).items()}
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logit_bias=bias, **kw)


@pytest.mark.parametrize("name,body,extra", SAMPLING_CASES, ids=[c[0] for c in SAMPLING_CASES])
def test_sampling_fields_reach_the_engine(url, ref, name, body, extra):
    max_tokens = 12
    got = post(
        url,
        "/v1/completions",
        {"prompt": PROMPT_IDS, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **body},
    )
    want = ref.generate(PROMPT_IDS, _ref_params(ref, body, extra, max_tokens))[0]
    # the same without the field under test (a bias that only sets up a penalty stays)
    plain = ref.generate(
        PROMPT_IDS, _ref_params(ref, body if name.endswith("penalty") else {}, {}, max_tokens)
    )[0]
    assert want.token_ids != plain.token_ids, (
        f"{name} changes nothing here: the test would not see it dropped"
    )
    assert got["choices"][0]["text"] == want.text
    assert got["usage"]["completion_tokens"] == len(want.token_ids)


def test_min_tokens_reaches_the_engine(url, ref):
    """EOS pushed up by logit_bias ends the plain completion at once; min_tokens=5 holds it off."""
    eos = ref.tokenizer.eos_token_id
    bias = {str(eos): 100}
    got = post(
        url,
        "/v1/completions",
        {"prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "logit_bias": bias, "min_tokens": 5},
    )
    want = ref.generate(
        PROMPT_IDS, SamplingParams(max_tokens=12, temperature=0, logit_bias={eos: 100}, min_tokens=5)
    )[0]
    plain = ref.generate(PROMPT_IDS, SamplingParams(max_tokens=12, temperature=0, logit_bias={eos: 100}))[0]
    assert len(plain.token_ids) <= 1 and len(want.token_ids) == 6 and want.token_ids[-1] == eos
    assert got["choices"][0]["text"] == want.text and got["usage"]["completion_tokens"] == 6


# -- structured output and tools ---------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "boolean"}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}


def test_json_schema_response_format(client):
    for seed in range(2):
        r = client.chat.completions.create(
            model="tiny",
            messages=MSG,
            max_tokens=40,
            temperature=1.0,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True},
            },
        )
        doc = json.loads(r.choices[0].message.content)
        assert set(doc) == {"answer", "score"} and isinstance(doc["answer"], bool) and 0 <= doc["score"] <= 9


def _check_weather_call(call):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7 and set(args) == {"city", "days"}


def test_tool_choice_required_end_to_end(client, url):
    r = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=80,
        temperature=1.0,
        seed=3,
        parallel_tool_calls=False,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_weather_call(choice.message.tool_calls[0])

    # named: only that function, among two
    r = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        tools=[TIME, WEATHER],
        max_tokens=80,
        seed=4,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    _check_weather_call(r.choices[0].message.tool_calls[0])

    # streamed: the call arrives as a tool_calls delta, then finish_reason tool_calls
    calls, reasons = [], []
    for chunk in client.chat.completions.create(
        model="tiny",
        messages=MSG,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=80,
        seed=3,
        stream=True,
        parallel_tool_calls=False,
    ):
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            reasons.append(chunk.choices[0].finish_reason)
    assert len(calls) == 1 and calls[0].index == 0 and reasons[-1] == "tool_calls"
    _check_weather_call(calls[0])

    # the call and its result go back into the conversation through the template
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [choice.message.tool_calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = httpx.post(url + "/tokenize", json={"messages": history}, timeout=30).json()["tokens"]
    text = httpx.post(url + "/detokenize", json={"tokens": rendered}, timeout=30).json()["prompt"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and '"name": "get_weather"' in text


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def test_tools_none_and_auto(client):
    """The output is steered into a complete Qwen tool call (guided_regex; tool_choice 'auto' is no
    constraint): with 'auto' it is reported as a call, with 'none' as plain content."""
    import re

    regex = re.escape(CALL_TEXT)
    kw = dict(
        model="tiny",
        messages=MSG,
        tools=[WEATHER],
        max_tokens=400,
        temperature=0,
        extra_body={"guided_regex": regex},
    )
    auto = client.chat.completions.create(tool_choice="auto", **kw).choices[0]
    assert auto.finish_reason == "tool_calls" and len(auto.message.tool_calls) == 1, auto
    assert auto.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(auto.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert not auto.message.content
    streamed = [
        c.choices[0]
        for c in client.chat.completions.create(tool_choice="auto", stream=True, **kw)
        if c.choices
    ]
    calls = [t for c in streamed for t in (c.delta.tool_calls or [])]
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert streamed[-1].finish_reason == "tool_calls"
    none = client.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert none.message.tool_calls is None and none.finish_reason == "stop"
    assert '"name": "get_weather"' in none.message.content


# -- small endpoints -------------------------------------------------------------------------------


def test_models_tokenize_detokenize(url, ref):
    assert httpx.get(url + "/v1/models/tiny").json()["id"] == "tiny"
    r = httpx.get(url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    out = post(url, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert out["tokens"] == ref.tokenizer.encode("hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 2048 and len(out["token_strs"]) == out["count"]
    assert post(url, "/detokenize", {"tokens": out["tokens"]})["prompt"] == "hello world"
    r = httpx.post(url + "/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


# -- third-party clients ---------------------------------------------------------------------------


def test_langchain_bind_tools_and_structured_output(url):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    llm = lc.ChatOpenAI(
        model="tiny",
        base_url=url + "/v1",
        api_key="none",
        temperature=1.0,
        max_tokens=80,
        seed=3,
        timeout=60,
        max_retries=0,
    )
    msg = llm.bind_tools([WEATHER], tool_choice="required").invoke("Weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert msg.tool_calls[0]["args"]["city"] in ("Paris", "Oslo")

    class Verdict(BaseModel):
        answer: bool
        score: int = Field(ge=0, le=9)

    got = llm.with_structured_output(Verdict, method="json_schema").invoke("Is water wet?")
    assert isinstance(got, Verdict) and 0 <= got.score <= 9


BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow  # importing lm-eval (datasets, evaluate, ...) takes most of its time
def test_lm_eval_multiple_choice_end_to_end(url, ref, tool_checkpoint, tmp_path):
    """lm-eval's local-completions on a multiple-choice task from a local file; every
    loglikelihood it got equals the model's own, computed here from LLM.logits."""
    lm_eval = pytest.importorskip("lm_eval")
    import transformers
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    subprocess.run(
        [sys.executable, str(BENCH / "lm_eval_task.py"), str(tmp_path)], check=True, capture_output=True
    )
    docs = [json.loads(line) for line in (tmp_path / "mc.jsonl").read_text().splitlines()]
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=tiny,base_url={url}/v1/completions,tokenizer={tool_checkpoint},num_concurrent=1,"
        "max_retries=1,tokenized_requests=True",
        tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        batch_size=2,
        log_samples=True,
    )
    acc = results["results"]["tiny_mc"]["acc,none"]
    tok = transformers.AutoTokenizer.from_pretrained(str(tool_checkpoint))
    right = 0
    samples = results["samples"]["tiny_mc"]
    assert len(samples) == len(docs)
    for s in samples:
        doc = s["doc"]
        lls = []
        for k, choice in enumerate(doc["choices"]):
            # lm-eval's request: context, " " + choice; the continuation's ids = whole[len(context ids):]
            ctx = tok.encode(doc["question"])
            cont = tok.encode(doc["question"] + " " + choice)[len(ctx) :]
            lp = ref_logprobs(ref, ctx + cont)
            want = sum(float(lp[len(ctx) + i - 1, t]) for i, t in enumerate(cont))
            got = float(s["resps"][k][0][0])
            assert got == pytest.approx(want, abs=1e-3)
            lls.append(want)
        right += int(max(range(len(lls)), key=lls.__getitem__) == doc["answer"])
    assert acc == pytest.approx(right / len(docs))


def test_streamed_output_full_of_open_tool_markers(url, ref):
    """A completion steered into 100 unclosed `<tool_call>` markers, streamed with tools on: no call
    is reported, the whole text arrives as content (held until the end: a marker is open), and a
    request sent meanwhile gets the same answer as alone."""
    import threading

    forced = "<tool_call> x" * 100
    body = {
        "model": "tiny",
        "messages": MSG,
        "tools": [WEATHER],
        "max_tokens": 1200,
        "temperature": 0,
        "stream": True,
        "guided_regex": "(<tool_call> x){100}",
    }
    good = {"prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    alone = post(url, "/v1/completions", good)["choices"][0]["text"]
    events, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                events.append({"error": r.read().decode()})
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
        started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120), events
    assert post(url, "/v1/completions", good)["choices"][0]["text"] == alone
    t.join(600)
    assert events and all("error" not in e for e in events), events[:2]
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    assert not any(d.get("tool_calls") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == forced
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
