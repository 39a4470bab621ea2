"""`expertcache trace simulate --schedule`: the schedule model from the command line, and its refusals."""

from __future__ import annotations

import json

from expertcache.cli import main
from expertcache.cost.profiles import get_profile
from expertcache.trace.simulate import ModelShape, simulate_schedule
from expertcache.trace.synthetic import synth_trace

CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "vocab_size": 100,
}


def test_schedule_flag_prints_the_schedule_model(tmp_path, capsys):
    trace = synth_trace(layers=4, experts=16, top_k=2, tokens=64, seed=1)
    trace.save(tmp_path / "t.npz")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    # rtx4090-pcie4 without the CPU job's fixed cost: at these tiny experts its 0.1 ms would keep every
    # miss off the CPU, and the test needs CPU misses to see the flag reach the model
    card = get_profile("rtx4090-pcie4")
    fields = {k: v for k, v in card.__dict__.items() if k != "name" and v} | {"cpu_job_ms": 0.0}
    (tmp_path / "card.toml").write_text("".join(f"{k} = {float(v)}\n" for k, v in fields.items()))
    prof = str(tmp_path / "card.toml")
    args = [
        "trace",
        "simulate",
        str(tmp_path / "t.npz"),
        "--capacity",
        "4",
        "--profile",
        prof,
        "--model-config",
        str(tmp_path / "config.json"),
        "--schedule",
        "--json",
    ]
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)
    want = simulate_schedule(trace, ModelShape.from_config(CONFIG), get_profile(prof), "adaptive", 4, 64)
    assert got["tok_s"] == want.tok_s and got["critical"] == want.critical and got["misses_on_cpu"] > 0
    assert main(args + ["--no-cpu-compute"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["misses_on_cpu"] == 0  # the flag reaches the model


def test_schedule_flag_refusals(tmp_path, capsys):
    trace = synth_trace(layers=2, experts=8, top_k=2, tokens=16, seed=1)
    trace.save(tmp_path / "t.npz")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    base = ["trace", "simulate", str(tmp_path / "t.npz"), "--capacity", "4", "--schedule"]
    assert (
        main(
            base
            + ["--profile", "rtx4090-pcie4", "--model-config", str(tmp_path / "config.json"), "--from-disk"]
        )
        == 2
    )
    assert "drop --from-disk" in capsys.readouterr().err
    assert main(base + ["--profile", "rtx4090-pcie4"]) == 2
    assert "pass --model-config" in capsys.readouterr().err
