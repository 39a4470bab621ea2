"""Checkpoints are checked, not trusted: dtypes, integer config fields, the layer count and NaN/inf
weights give an error naming the file, tensor or field; from the command line one line, exit 2."""

from __future__ import annotations

import json

import checkpoints as C
import pytest
import torch

from expertcache.cli import main
from expertcache.errors import CheckpointError, ConfigError

GREEDY = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
PROBE = [5, 17, 200, 3, 44]


@pytest.fixture
def broken(qwen3_checkpoint, tmp_path):
    return C.copy_checkpoint(qwen3_checkpoint, tmp_path / "model")


def load(api, path, **kw):
    return api.LLM(str(path), device="cpu", **kw)


def cli_error(capsys, path, *extra) -> str:
    """`expertcache generate` on the checkpoint: exit 2 with exactly one line saying 'error: ...'."""
    rc = main(["generate", str(path), "--prompt", "hi", "--max-tokens", "2", *extra])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def poison(name, value=float("nan")):
    def fn(tensors):
        t = tensors[name].clone()
        t.view(-1)[t.numel() // 2] = value
        tensors[name] = t
        return tensors

    return fn


@pytest.mark.parametrize(
    "field,value",
    [
        ("vocab_size", 2048.7),
        ("hidden_size", "abc"),
        ("hidden_size", [256]),
        ("num_hidden_layers", 0),
        ("num_attention_heads", True),
        ("num_experts", -1),
        ("moe_intermediate_size", "32"),
    ],
)
def test_integer_config_fields_are_named(expertcache_api, capsys, broken, field, value):
    C.edit_config(broken, **{field: value})
    with pytest.raises(ConfigError) as info:
        load(expertcache_api, broken)
    msg = str(info.value)
    assert "config.json" in msg and field in msg and repr(value) in msg, msg
    line = cli_error(capsys, broken)
    assert field in line and repr(value) in line


def test_integral_float_is_accepted(expertcache_api, broken, qwen3_llm):
    C.edit_config(broken, hidden_size=64.0, vocab_size=float(qwen3_llm.cfg.vocab_size))
    llm = load(expertcache_api, broken)
    assert llm.cfg.hidden_size == 64 and isinstance(llm.cfg.hidden_size, int)


def test_fewer_layers_in_config_than_tensors_is_an_error(expertcache_api, capsys, broken):
    C.edit_config(broken, num_hidden_layers=1)  # the checkpoint holds 2
    with pytest.raises(ConfigError, match=r"num_hidden_layers=1.*2 layers"):
        load(expertcache_api, broken)
    assert "num_hidden_layers=1" in cli_error(capsys, broken)


def test_integer_dense_weight_is_refused(expertcache_api, capsys, broken):
    name = "model.layers.0.self_attn.q_proj.weight"
    C.rewrite_tensors(broken, lambda t: {**t, name: (t[name] * 100).to(torch.int16)})
    with pytest.raises(CheckpointError, match=rf"{name} is stored as int16.*floating point"):
        load(expertcache_api, broken)
    assert name in cli_error(capsys, broken)


def test_integer_expert_weight_is_refused(expertcache_api, broken):
    def fn(t):
        return {k: (v * 100).to(torch.int16) if ".experts." in k else v for k, v in t.items()}

    C.rewrite_tensors(broken, fn)
    with pytest.raises(CheckpointError, match=r"experts.*int16.*floating point"):
        load(expertcache_api, broken)


@pytest.mark.parametrize(
    "name,value",
    [
        ("model.layers.1.self_attn.o_proj.weight", float("nan")),
        ("model.norm.weight", float("inf")),
        ("model.embed_tokens.weight", float("-inf")),
        ("lm_head.weight", float("nan")),
    ],
)
def test_nonfinite_dense_weight_named_at_load(expertcache_api, capsys, broken, name, value):
    C.rewrite_tensors(broken, poison(name, value))
    with pytest.raises(CheckpointError, match=rf"{name} holds non-finite values.*--no-check-finite"):
        load(expertcache_api, broken)
    assert name in cli_error(capsys, broken)


def test_no_check_finite_loads_and_the_request_fails_naming_the_layer(expertcache_api, broken):
    """Skipping the scan, a NaN in layer 1's attention reaches the logits: the request ends with an
    error naming layer 1, not an empty 'stop' answer."""
    C.rewrite_tensors(broken, poison("model.layers.1.self_attn.o_proj.weight"))
    llm = load(expertcache_api, broken, check_finite=False)
    out = llm.generate([PROBE], expertcache_api.SamplingParams(**GREEDY))[0]
    assert out.finish_reason.startswith("error: ") and "non-finite logits" in out.finish_reason
    assert "layer 1" in out.finish_reason and out.token_ids == []
    assert llm.kv.num_free == llm.kv.num_blocks  # its blocks went back


EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"


def test_nonfinite_expert_named_when_resident(expertcache_api, capsys, broken):
    C.rewrite_tensors(broken, poison(EXPERT))
    with pytest.raises(CheckpointError, match=r"experts\.3\..*up_proj.*expert 3 of layer 1.*non-finite"):
        load(expertcache_api, broken)
    assert "expert 3 of layer 1" in cli_error(capsys, broken)


def test_nonfinite_expert_found_at_first_read_into_a_tier(expertcache_api, broken, caplog, qwen3_llm):
    """Experts of a tiered cache are first read while serving: the read is checked once, logged
    naming the tensor, and a request routed through that expert fails naming it; the requests
    batched with it that never used it answer exactly as on the clean checkpoint."""
    C.rewrite_tensors(broken, poison(EXPERT))
    llm = load(expertcache_api, broken, device_memory="25%", host_memory="25%")
    try:
        params = expertcache_api.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompts = [[t] + PROBE for t in range(40, 200, 10)]  # enough routing to reach expert 3
        outs = llm.generate(prompts, params)
        failed = [o for o in outs if o.finish_reason.startswith("error")]
        assert (1, 3) in llm.source.nonfinite and "expert 3 of layer 1" in caplog.text
        assert failed, "no request routed to the poisoned expert"
        for o in failed:
            assert "layer 1" in o.finish_reason and "experts.3." in o.finish_reason, o.finish_reason
        ok = [i for i, o in enumerate(outs) if o.finish_reason == "length"]
        assert ok, "every request routed to the poisoned expert: nothing shows the others go on"
        clean = qwen3_llm.generate([prompts[i] for i in ok], params)
        assert [outs[i].token_ids for i in ok] == [c.token_ids for c in clean]
        assert llm.kv.num_free == llm.kv.num_blocks
    finally:
        llm.close()


def test_bad_tokenizer_config_names_the_file(expertcache_api, capsys, broken):
    (broken / "tokenizer_config.json").write_text('{"chat_template": ')
    with pytest.raises(CheckpointError, match="tokenizer_config.json: invalid JSON"):
        load(expertcache_api, broken)
    assert "tokenizer_config.json" in cli_error(capsys, broken)


def test_quantized_integer_parts_still_load(expertcache_api, broken, tmp_path):
    """The documented integer codes of a quantized expert layout are not 'integer weights'."""
    from expertcache.quantize.rewrite import quantize_checkpoint

    out = tmp_path / "int8"
    quantize_checkpoint(broken, out, "int8")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "expertcache"
    llm = load(expertcache_api, out)
    assert len(llm.generate([PROBE], expertcache_api.SamplingParams(**GREEDY))[0].token_ids) == 4


def test_server_fails_only_the_requests_routed_through_a_bad_expert(
    broken, tmp_path, qwen3_llm, expertcache_api
):
    """End to end: with a NaN expert read lazily by a tiered cache, a request routed through it gets
    an OpenAI error object (non-streamed) or an SSE error event (streamed) naming the expert, while
    requests batched with it that never use it answer exactly as on the clean checkpoint."""
    import threading

    from serving import start_server

    C.rewrite_tensors(broken, poison(EXPERT))
    prompts = [[t] + PROBE for t in range(40, 200, 10)]
    params = expertcache_api.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    clean = [o.token_ids for o in qwen3_llm.generate(prompts, params)]
    with start_server(
        broken, tmp_path / "server.log", "--device-memory", "25%", "--host-memory", "25%"
    ) as srv:
        results: dict = {}

        def one(i):
            body = {
                "prompt": prompts[i],
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
                "stream": i % 2 == 1,
            }
            with srv.http() as c:
                r = c.post("/v1/completions", json=body)
                results[i] = (r.status_code, r.text if body["stream"] else r.json())

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ok = failed = 0
        for i, (status, got) in sorted(results.items()):
            if i % 2:  # streamed: 200 with either a normal end or one error event
                assert status == 200
                if '"error"' in got:
                    failed += 1
                    err = json.loads(next(line[6:] for line in got.splitlines() if '"error"' in line))[
                        "error"
                    ]
                    assert "non-finite" in err["message"] and "experts.3." in err["message"], err
                else:
                    ok += 1
                    assert got.rstrip().endswith("data: [DONE]")
                    events = [
                        json.loads(line[6:])
                        for line in got.splitlines()
                        if line.startswith("data: ") and line != "data: [DONE]"
                    ]
                    text = "".join(c["text"] for e in events for c in e.get("choices", []))
                    assert text == qwen3_llm.tokenizer.decode(clean[i]), (i, text)
            elif status == 200:
                ok += 1
                assert got["usage"]["completion_tokens"] == 24
                assert got["choices"][0]["text"] == qwen3_llm.tokenizer.decode(clean[i])
            else:
                failed += 1
                assert status == 500 and got["error"]["type"] == "server_error"
                assert "non-finite" in got["error"]["message"] and "layer 1" in got["error"]["message"]
        assert ok and failed, results
        with srv.http() as c:
            assert c.get("/health").status_code == 200
            stats = c.get("/stats").json()["engine"]
            assert stats["running"] == 0 and stats["kv_cache_usage"] == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_finite_scan_in_chunks_finds_every_position(dtype, monkeypatch):
    """The dense-weight scan goes a chunk at a time (bounded temporaries); a NaN or inf anywhere, at
    a chunk's edge included, is found, as torch.isfinite over the whole tensor finds it."""
    from expertcache.loader import checks

    monkeypatch.setattr(checks, "FINITE_CHUNK", 7)
    base = torch.linspace(-3, 3, 50).reshape(5, 10)
    assert checks.is_finite(base.to(dtype))
    for pos in range(50):
        for bad in (
            (float("nan"),) if dtype == torch.float8_e4m3fn else (float("nan"), float("inf"))
        ):  # e4m3fn has no inf
            t = base.clone().reshape(-1)
            t[pos] = bad
            t = t.reshape(5, 10).to(dtype)
            want = bool(torch.isfinite(t.float()).all())
            assert checks.is_finite(t) == want and not want, (pos, bad)
