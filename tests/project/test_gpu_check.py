"""bench/gpu_check.py is not broken: its CPU dry run (toy sizes) goes end to end, every configuration
line parses and its counters show the switches the label promises; the routing map keeps the
recorded trace's reuse."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
import gpu_check_model as M  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--device",
            "cpu",
            "--out",
            str(out),
            "--rounds",
            "1",
            "--tokens",
            "3",
            "--prompt",
            "6",
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = {}
    for line in r.stdout.splitlines():
        parsed = gpu_check.parse_line(line)
        if parsed is not None:
            lines[parsed["config"], parsed["routing"]] = parsed
    return r, lines


@pytest.mark.slow  # the dry run: nine processes
def test_every_configuration_line_parses(dry_run):
    r, lines = dry_run
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    want = {("resident", "recorded"), ("torch-moe", "recorded")} | {
        (c, ro) for c in gpu_check.CACHED if c != "torch-moe" for ro in ("recorded", "random")
    }
    assert set(lines) == want
    for key, v in lines.items():
        assert "error" not in v, (key, v)
        assert v["decode_tok_s"] > 0 and v["prefill_tok_s"] > 0, (key, v)
    for routing in ("recorded", "random"):
        for other in ("resident", "sync-lru", "cpu-moe", "cpu-compute-off"):
            assert f"gpu_check ratio routing={routing} decode_tok_s default/{other}=" in r.stdout
    assert "gpu_check ratio routing=recorded decode_tok_s default/torch-moe=" in r.stdout


@pytest.mark.slow
def test_configurations_do_what_their_labels_say(dry_run):
    _, lines = dry_run
    res = lines["resident", "recorded"]
    assert res["misses"] == 0 and res["hit_rate"] == 1.0 and res["device_slots"] == 64
    for routing in ("recorded", "random"):
        moe = lines["cpu-moe", routing]  # every miss on the CPU, nothing prefetched, top_k slots
        assert moe["cpu_computed_share"] == 1.0 and moe["prefetch_issued"] == 0 and moe["device_slots"] == 8
        assert moe["hit_rate"] == 0.0 and moe["misses"] > 0
        lru = lines["sync-lru", routing]  # no prefetch, no CPU compute
        assert lru["prefetch_issued"] == 0 and lru["cpu_computed_share"] == 0.0 and lru["misses"] > 0
        off = lines["cpu-compute-off", routing]
        assert off["cpu_computed_share"] == 0.0
        assert lines["default", routing]["device_slots"] == 16  # 25% of 64
    # the torch MoE code computes what the default computes (on the CPU both are the same code)
    assert lines["torch-moe", "recorded"]["misses"] == lines["default", "recorded"]["misses"]


def test_a_failing_configuration_is_a_line_not_the_end(tmp_path, capsys):
    args = argparse.Namespace(
        device="cpu",
        tokens=1,
        prompt=2,
        rounds=1,
        share=0.25,
        max_model_len=64,
        sync_steps=1,
        config_timeout=120,
        out=str(tmp_path),
    )
    got = gpu_check.child(args, "default", "recorded", tmp_path / "missing-model", tmp_path / "missing.npz")
    assert "error" in got and got["config"] == "default"
    assert capsys.readouterr().out.startswith("gpu_check config=default routing=recorded error=")
    assert (
        "missing-model" in (tmp_path / "logs" / "default-recorded.log").read_text()
    )  # the child's traceback


def test_mapped_routing_keeps_the_recorded_reuse():
    gen = torch.Generator().manual_seed(0)
    N, Ld, Kd, Ed = 40, 6, 4, 32
    demo = torch.rand(N, Ld, Ed, generator=gen).argsort(-1)[..., :Kd]
    ahead = torch.rand(N, Ld, Ed, generator=gen).argsort(-1)[..., :Kd]
    table, pred = M.map_trace(demo.numpy(), ahead.numpy(), num_experts=64, top_k=8, layers=12)
    assert table.shape == (N, 12, 8) and pred.shape == (N, 12, 8)
    assert set(table.unique().tolist()) <= set(range(64))
    for bl in range(12):
        dl = M.demo_layer(bl, Ld)
        sets = [set(table[r, bl].tolist()) for r in range(N)]
        dsets = [set(demo[r, dl].tolist()) for r in range(N)]
        assert all(len(s) == 8 for s in sets)  # distinct experts per token
        for r in range(N):  # any two tokens share twice as many bench experts as demo experts
            for s in range(r + 1, N):
                assert len(sets[r] & sets[s]) == 2 * len(dsets[r] & dsets[s])
        if bl > 0:  # the prediction overlaps the truth as the demo router's did
            for r in range(N):
                got = len(set(pred[r, bl].tolist()) & sets[r])
                assert got == 2 * len(set(ahead[r, dl].tolist()) & dsets[r])


def test_a_trace_that_cannot_map_is_refused():
    demo = torch.zeros(3, 2, 4, dtype=torch.int64)
    demo[0, 0] = torch.tensor([0, 1, 2, 40])  # expert 40 of a top-4 trace: 80+ bench experts needed
    with pytest.raises(ValueError, match="cannot map onto top-8 of 64"):
        M.map_trace(demo.numpy(), demo.numpy(), num_experts=64, top_k=8, layers=2)


# -- what the device machine will meet (shared/reviews: device readiness) -----------------------------------
DEVICE_ABSENT = (
    "fastapi",
    "uvicorn",
    "llguidance",
    "pydantic",
    "pydantic_core",
    "starlette",
    "openai",
    "xgrammar",
)
BLOCKER = f'''
import sys
class _Absent:
    """The device image lacks these packages: importing one fails as it would there."""
    names = {DEVICE_ABSENT!r}
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the device image)", name=name)
        return None
sys.meta_path.insert(0, _Absent())
'''


def device_like_env(tmp_path: Path, extra: str = "") -> dict:
    """An environment whose every Python process (children too) cannot import the packages the device
    image lacks: a sitecustomize.py first on PYTHONPATH."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER + extra)
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
    )


def test_the_blocker_blocks(tmp_path):
    env = device_like_env(tmp_path)
    for name in ("fastapi", "uvicorn", "llguidance"):
        r = subprocess.run(
            [sys.executable, "-c", f"import {name}"],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert r.returncode == 1 and "absent on the device image" in r.stderr, (name, r.stderr[-500:])


def test_the_cpu_dry_run_needs_only_the_device_packages(tmp_path):
    """bench/gpu_check.py --device cpu with fastapi/uvicorn/llguidance/pydantic unimportable (in the parent
    and in every child) goes end to end; the results folder gets the summary only."""
    env = device_like_env(tmp_path)
    out, results = tmp_path / "work", tmp_path / "results"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--device",
            "cpu",
            "--quick",
            "--out",
            str(out),
            "--results",
            str(results),
            "--only",
            "resident",
            "default",
            "--rounds",
            "1",
            "--tokens",
            "2",
            "--prompt",
            "6",
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [gpu_check.parse_line(x) for x in r.stdout.splitlines()]
    got = {(x["config"], x["routing"]): x for x in lines if x}
    assert set(got) == {("resident", "recorded"), ("default", "recorded")}
    for v in got.values():
        assert "error" not in v and v["decode_tok_s"] > 0 and v["seconds"] > 0 and v["load_s"] >= 0, v
    assert sorted(p.name for p in results.iterdir()) == ["child-logs.txt", "summary.txt"]
    summary = (results / "summary.txt").read_text()
    assert "gpu_check config=default routing=recorded decode_tok_s=" in summary
    assert "gpu_check done failed=0" in summary
    assert (out / "ckpt-tiny" / "config.json").exists()  # the checkpoint stays in the work folder
    assert "== default-recorded.log" in (results / "child-logs.txt").read_text()


def test_a_deadline_skips_the_remaining_configurations_with_a_line(tmp_path):
    # in a process of its own: the engine it loads would import the Triton kernels here, compiled, before
    # the Triton test modules turn the interpreter on
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
            "--only",
            "resident",
            "default",
            "--deadline",
            "0",
            "--rounds",
            "1",
            "--tokens",
            "2",
            "--prompt",
            "6",
        ],
        check=False,
        capture_output=True,
        text=True,
        env=device_like_env(tmp_path),
        timeout=600,
        cwd=ROOT,
    )
    out = r.stdout
    assert r.returncode == 1, r.stderr[-2000:]
    for config in ("resident", "default"):
        assert f'gpu_check config={config} routing=recorded skipped="deadline"' in out
    assert "decode_tok_s=" not in out


def test_run_order_and_unknown_configurations():
    assert gpu_check.plan_runs(["resident", "default", "torch-moe"], ["random", "recorded"]) == [
        ("default", "random"),
        ("resident", "recorded"),
        ("default", "recorded"),
        ("torch-moe", "recorded"),
    ]
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--only", "defualt"])


def test_the_memory_cap_gets_a_device_index(monkeypatch):
    """torch.cuda.set_per_process_memory_fraction refuses torch.device('cuda') (no index): the check's cap
    passes the current device's index (the CUDA entry points stubbed, no GPU needed)."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch._C, "_cuda_setMemoryFraction", lambda f, d: calls.append((f, d)), raising=False)
    with pytest.raises(ValueError, match="specified index"):  # what the check used to call
        torch.cuda.set_per_process_memory_fraction(0.5, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda d: argparse.Namespace(total_memory=8 << 30) if d == torch.device("cuda", 3) else None,
    )
    gpu_check.cap_memory(torch.device("cuda"), 2 << 30)
    assert calls == [(0.25, 3)]
    assert gpu_check.cuda_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_every_gpu_marked_file_is_run():
    files = gpu_check.gpu_test_files()
    for f in (
        "tests/engine/test_gpu.py",
        "tests/experts/test_executor.py",
        "tests/build/test_device_plan.py",
        "tests/build/test_cost_model.py",
        "tests/models/test_families.py",
    ):
        assert f in files
    assert all((ROOT / f).exists() for f in files)


def test_with_a_cuda_device_the_triton_tests_compile_rather_than_interpret(tmp_path):
    """The Triton test modules turn the interpreter on only without a CUDA device: with one (faked here)
    and TRITON_INTERPRET unset, importing them leaves the kernels compiled and the tensors on CUDA."""
    env = device_like_env(tmp_path, "import torch\ntorch.cuda.is_available = lambda: True\n")
    env.pop("TRITON_INTERPRET", None)
    code = (
        "import os, sys; sys.path[:0] = ['tests', 'tests/kernels']; import test_triton_moe as t; "
        "from expertcache.kernels import triton_moe; "
        "print(os.environ.get('TRITON_INTERPRET'), triton_moe.interpreted(), t.DEV)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["None", "False", "cuda"]


@pytest.mark.slow  # the dry run of the one-command device check: about two minutes here
def test_device_run_script_leaves_only_a_summary(tmp_path):
    env = device_like_env(tmp_path)
    env.update(
        OUT=str(tmp_path / "results"),
        WORK=str(tmp_path / "work"),
        DEVICE="cpu",
        PYTHON=sys.executable,
        CONFIGS="resident default",
    )
    env.setdefault("XDG_CACHE_HOME", str(Path.home() / ".cache"))  # the built C++ kernels
    r = subprocess.run(
        ["bash", str(ROOT / "bench" / "device_run.sh")],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    files = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert files == ["child-logs.txt", "probe.txt", "summary.txt"], files
    summary = (tmp_path / "results" / "summary.txt").read_text()
    assert "gpu_check config=default routing=recorded decode_tok_s=" in summary
    assert "gpu_check config=default routing=random decode_tok_s=" in summary
    assert "gpu_check done failed=0" in summary
    assert "device_run: " in r.stdout


def test_the_parent_never_initialises_cuda(monkeypatch):
    """The parent's hardware line names the GPU through nvidia-smi: a CUDA context in the parent would
    hold device memory beside the children's plans and the tests' exact slot counts."""

    def refuse(*a, **k):
        raise AssertionError("the parent initialised CUDA")

    monkeypatch.setattr(gpu_check, "gpu_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_name", refuse)
    monkeypatch.setattr(torch.cuda, "get_device_properties", refuse)
    line = gpu_check.parent_hardware_line(kernels=False)
    assert "gpu='NVIDIA H200'" in line and "cpu_kernels=not-asked" in line
    assert torch.cuda.get_device_name is refuse  # put back
