"""The trace subcommands through an argparse parser built the way the main CLI does."""

import argparse
import json

import numpy as np
import pytest

from expertcache.trace.cli import add_trace_subcommands
from expertcache.trace.format import RoutingTrace
from expertcache.trace.replay import replay


def run(argv, capsys):
    ap = argparse.ArgumentParser(prog="expertcache")
    add_trace_subcommands(ap.add_subparsers(dest="cmd", required=True))
    args = ap.parse_args(["trace", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def trace_file(tmp_path, capsys):
    p = tmp_path / "s.npz"
    rc, out, _ = run(
        [
            "synth",
            str(p),
            "--layers",
            "2",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--tokens",
            "120",
            "--zipf",
            "1.2",
            "--reuse",
            "0.4",
            "--expert-bytes",
            "1MiB",
        ],
        capsys,
    )
    assert rc == 0 and "120 rows x 2 layers x top-2" in out and p.exists()
    return p


def test_replay_json(trace_file, capsys):
    rc, out, _ = run(
        ["replay", str(trace_file), "--capacity", "2,3", "--policy", "lru,min", "--json"], capsys
    )
    rows = json.loads(out)
    assert rc == 0 and [(r["policy"], r["capacity"]) for r in rows] == [
        ("lru", 2),
        ("min", 2),
        ("lru", 3),
        ("min", 3),
    ]
    ref = replay(RoutingTrace.load(trace_file), "lru", 3)
    r = rows[2]
    assert set(r) >= {"policy", "capacity", "hit_rate", "min_hit_rate", "bytes_moved", "per_layer"}
    assert (r["hit_rate"], r["min_hit_rate"], r["bytes_moved"]) == (
        ref.hit_rate,
        ref.min_hit_rate,
        ref.bytes_moved,
    )
    assert rows[3]["hit_rate"] == rows[3]["min_hit_rate"] and len(r["per_layer"]) == 2


def test_replay_budget_all_and_png(trace_file, tmp_path, capsys):
    rc, out, _ = run(["replay", str(trace_file), "--budget", "6MiB", "--policy", "all", "--json"], capsys)
    rows = json.loads(out)
    assert {r["capacity"] for r in rows} == {3} and {"lru", "lfru", "static", "lfru-admit"} <= {
        r["policy"] for r in rows
    }
    png = tmp_path / "sweep.png"
    rc, out, _ = run(["replay", str(trace_file), "--sweep", "--policy", "lru", "--png", str(png)], capsys)
    assert rc == 0 and png.stat().st_size > 1000 and "MIN" in out
    rc, _, err = run(["replay", str(trace_file), "--budget", "1KiB"], capsys)
    assert rc == 2 and "--budget" in err
    rc, _, err = run(["replay", str(trace_file), "--capacity", "2", "--policy", "bogus"], capsys)
    assert rc == 2 and "bogus" in err


def test_stats_import_export_simulate(trace_file, tmp_path, capsys):
    rc, out, _ = run(["stats", str(trace_file), "--json", "--png", str(tmp_path / "h.png")], capsys)
    s = json.loads(out)
    assert rc == 0 and s["rows"] == 120 and (tmp_path / "h.png").exists()
    jl, back = tmp_path / "t.jsonl", tmp_path / "back.npz"
    assert run(["export", str(trace_file), str(jl)], capsys)[0] == 0
    assert run(["import", str(jl), str(back), "--num-experts", "8", "--expert-bytes", "1MiB"], capsys)[0] == 0
    np.testing.assert_array_equal(RoutingTrace.load(back).experts, RoutingTrace.load(trace_file).experts)
    rc, _, err = run(["import", str(jl), str(back), "--num-experts", "4"], capsys)
    assert rc == 2 and "out of range" in err
    rc, out, _ = run(
        ["simulate", str(trace_file), "--capacity", "3", "--profile", "rtx3060-pcie4", "--json"], capsys
    )
    p = json.loads(out)
    assert rc == 0 and p["tok_s"] > 0 and p["profile"] == "rtx3060-pcie4"
