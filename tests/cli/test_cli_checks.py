"""Errors before the load: every bad flag value is one line on stderr naming the flag, exit code 2,
and not one weight file (.safetensors) is opened (watched through Python's audit hook on open)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from expertcache.cli import main
from expertcache.trace.synthetic import synth_trace

OPENED: list[str] | None = None


def _audit(event, args):
    if OPENED is not None and event == "open" and str(args[0]).endswith(".safetensors"):
        OPENED.append(str(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def watch():
    global OPENED
    OPENED = []
    yield OPENED
    OPENED = None


def run(capsys, *argv):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.err.strip(), cap.out


def one_line_error(rc, err, *needles):
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def test_watch_sees_a_weight_file_opened(watch, capsys, qwen3_checkpoint):
    """The audit hook does see the load (so the other tests' empty lists mean something)."""
    rc, err, _ = run(capsys, "generate", qwen3_checkpoint, "--prompt", "hi", "--max-tokens", "1")
    assert rc == 0 and watch


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--temperature", "-1"], ["--temperature -1", "[0, 2]"]),
        (["--temperature", "2.5"], ["--temperature 2.5", "[0, 2]"]),
        (["--top-p", "1.5"], ["--top-p 1.5", "(0, 1]"]),
        (["--top-p", "0"], ["--top-p 0"]),
        (["--top-k", "-3"], ["--top-k -3"]),
        (["--max-tokens", "0"], ["--max-tokens 0", ">= 1"]),
        (["--seed", str(2**63)], [f"--seed {2**63}", "[-2**63, 2**63)"]),
        (["--seed", str(-(2**63) - 1)], [f"--seed {-(2**63) - 1}", "[-2**63, 2**63)"]),
        (["--stop", "ok", "--stop", ""], ["--stop ''", "non-empty"]),
        (["--top-p", "abc"], ["argument --top-p", "invalid float"]),
        (["--prefetch", "sideways"], ["argument --prefetch", "invalid choice"]),
        (["--max-model-len", "8"], ["--prompt:", "--max-model-len 8", "tokens"]),
        (["--max-model-len", "0"], ["--max-model-len 0"]),
        (["--max-tokens", "5000"], ["--max-tokens 5000", "default context of"]),
    ],
)
def test_generate_flags_checked_before_the_load(watch, capsys, qwen3_checkpoint, flags, needles):
    rc, err, _ = run(
        capsys, "generate", qwen3_checkpoint, "--prompt", "a prompt of several words here", *flags
    )
    one_line_error(rc, err, *needles)
    assert watch == []


def test_chat_and_demo_check_sampling_first(watch, capsys, qwen3_checkpoint):
    one_line_error(*run(capsys, "chat", qwen3_checkpoint, "--temperature", "-2")[:2], "--temperature -2")
    one_line_error(*run(capsys, "demo", qwen3_checkpoint, "--top-p", "2")[:2], "--top-p 2")
    assert watch == []


def test_missing_model_same_message_for_generate_and_plan(watch, capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    rc1, e1, _ = run(capsys, "generate", missing, "--prompt", "x")
    rc2, e2, _ = run(capsys, "plan", missing)
    one_line_error(rc1, e1, f"model directory {missing} does not exist")
    one_line_error(rc2, e2, f"model directory {missing} does not exist")


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "t.npz"
    synth_trace(layers=2, experts=8, top_k=2, tokens=32, seed=0).save(path)
    return path


def test_trace_files_and_capacities(watch, capsys, tmp_path, trace_file, qwen3_checkpoint):
    missing = tmp_path / "missing.npz"
    text = tmp_path / "notes.txt"
    text.write_text("not a trace")
    other = tmp_path / "other.npz"
    np.savez(other, a=np.zeros(3))
    one_line_error(
        *run(capsys, "trace", "replay", missing, "--capacity", 2)[:2], f"trace {missing}", "no such file"
    )
    one_line_error(*run(capsys, "trace", "stats", text)[:2], f"trace {text}", "not a routing trace")
    one_line_error(*run(capsys, "trace", "stats", other)[:2], f"trace {other}", "not an expertcache trace")
    one_line_error(*run(capsys, "trace", "export", tmp_path, tmp_path / "o.jsonl")[:2], "is a directory")
    one_line_error(
        *run(capsys, "trace", "replay", trace_file, "--capacity", "2", "--stats", missing)[:2],
        f"--stats {missing}",
        "no such file",
    )
    one_line_error(
        *run(capsys, "trace", "replay", trace_file, "--capacity", "0")[:2], "--capacity 0", "1 and 8"
    )
    one_line_error(
        *run(capsys, "trace", "replay", trace_file, "--capacity", "2,9")[:2], "--capacity 9", "1 and 8"
    )
    one_line_error(
        *run(capsys, "trace", "simulate", trace_file, "--capacity", "9", "--profile", "x")[:2], "--capacity 9"
    )
    assert run(capsys, "trace", "replay", trace_file, "--capacity", "8")[0] == 0
    assert watch == []
    # plan reads safetensors headers by design (never the weights), so it is not watched here
    one_line_error(
        *run(capsys, "plan", qwen3_checkpoint, "--trace", missing)[:2], f"--trace {missing}", "no such file"
    )


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    import expertcache

    assert capsys.readouterr().out.strip() == f"expertcache {expertcache.__version__}"


def test_host_memory_zero_points_at_low_memory(capsys, cache_checkpoint):
    rc, err, _ = run(
        capsys,
        "generate",
        cache_checkpoint,
        "--prompt",
        "hi",
        "--max-tokens",
        "1",
        "--device-memory",
        "50%",
        "--host-memory",
        "0",
    )
    last = err.splitlines()[-1]  # budgets are checked by the cache's own validation (after the progress bar)
    assert rc == 2 and last.startswith("error: host_memory=0") and "--low-memory" in last, err


def test_help_documents_percent_budgets(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "25% (of all the routed experts' bytes)" in text and "0 needs --low-memory" in text


def test_plan_auto_kv_is_what_generate_allocates(capsys, qwen3_checkpoint):
    import json

    from expertcache import LLM

    assert main(["plan", str(qwen3_checkpoint), "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv"]
    llm = LLM(str(qwen3_checkpoint))  # the CLI's defaults: kv auto, 16 sequences, the default context
    assert kv["auto_tokens"] == llm.kv.num_blocks * llm.kv.block_size
    assert kv["auto_max_model_len"] == llm.max_model_len
    llm.close()


def test_quantize_drops_the_demo_manifest_and_writes_0644(tmp_path, capsys):
    import os

    from expertcache import demo

    src = demo.build_demo_model(
        tmp_path / "src",
        num_layers=1,
        num_experts=4,
        top_k=2,
        hidden=64,
        moe_intermediate=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        num_shards=1,
    )
    umask = os.umask(0)
    os.umask(umask)
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~umask for f in src.iterdir())  # safetensors included
    assert main(["quantize", str(src), str(tmp_path / "q"), "--experts", "int8"]) == 0
    out = tmp_path / "q"
    assert not (out / demo.MANIFEST).exists() and (out / "tokenizer.json").exists()
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~umask for f in out.iterdir())
