"""Units, hardware profiles (TOML) and the cost model against hand-computed formulas."""

import pytest

from expertcache.cost.profiles import BUILTIN, Profile, get_profile
from expertcache.trace.replay import ReplayResult
from expertcache.trace.simulate import ModelShape, simulate
from expertcache.units import parse_bytes


def test_parse_bytes():
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("16GiB") == 16 << 30
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("64k") == 65536 and parse_bytes("4096") == 4096
    for bad in ("12 parsecs", "", "-3MiB", "MiB"):
        with pytest.raises(ValueError, match="invalid byte size"):
            parse_bytes(bad)


def test_builtin_and_toml_profiles(tmp_path):
    assert {"cpu-only", "rtx3060-pcie4", "rtx4090-pcie4", "a100-pcie4", "h100-pcie5", "laptop-pcie3"} <= set(
        BUILTIN
    )
    (tmp_path / "rigs.toml").write_text(
        "[profiles.box]\nlink_gbs = 10\ndisk_gbs = 1\ncpu_mem_gbs = 20\ncpu_gflops = 100\n"
        "gpu_mem_gbs = 300\ngpu_tflops = 10\n[profiles.other]\nlink_gbs = 1\ndisk_gbs = 1\n"
        "cpu_mem_gbs = 1\ncpu_gflops = 1\n"
    )
    p = get_profile(f"{tmp_path}/rigs.toml:box")
    assert p == Profile("box", 10, 1, 20, 100, 300, 10)
    assert not get_profile(f"{tmp_path}/rigs.toml:other").has_gpu
    with pytest.raises(ValueError, match="pick one"):
        get_profile(f"{tmp_path}/rigs.toml")
    (tmp_path / "bad.toml").write_text("link_gbs = 1\ndisk_gbs = 1\ncpu_mem_gbs = 1\n")
    with pytest.raises(ValueError, match="lacks field 'cpu_gflops'"):
        get_profile(f"{tmp_path}/bad.toml")
    with pytest.raises(ValueError, match="unknown"):
        get_profile("tpu-v9")


def result(hits, misses, issued=0, rows=100, eb=1_000_000):
    return ReplayResult(
        "lru",
        4,
        False,
        hits,
        misses,
        hits / (hits + misses),
        misses * eb,
        eb,
        steps=rows,
        rows=rows,
        pairs=hits + misses,
        prefetch_issued=issued,
    )


PROF = Profile("t", link_gbs=1, disk_gbs=0.5, cpu_mem_gbs=10, cpu_gflops=100, gpu_mem_gbs=100, gpu_tflops=1)
SHAPE = ModelShape(expert_params=500_000, dense_params=1_000_000, bytes_per_param=2.0)


def test_formulas_by_hand():
    r = result(hits=150, misses=50)
    dense = 100 * max(2e6 / 100e9, 2e6 / 1e12)  # 2e-3 s
    gpu = max(1e6 / 100e9, 1e6 / 1e12)  # 1e-5 s per use
    cpu = max(1e6 / 10e9, 1e6 / 100e9)  # 1e-4 s, cheaper than a 1e-3 s transfer
    p = simulate(r, SHAPE, PROF)
    assert p.dense_s == pytest.approx(dense)
    assert p.cpu_miss_s == pytest.approx(50 * cpu) and p.misses_on_cpu == 50
    assert p.total_s == pytest.approx(dense + 150 * gpu + 50 * cpu)
    assert p.tok_s == pytest.approx(100 / p.total_s)
    q = simulate(r, SHAPE, PROF, cpu_compute=False)
    assert q.transfer_stall_s == pytest.approx(50 * 1e-3) and q.misses_transferred == 50
    assert q.total_s == pytest.approx(dense + 200 * gpu + 50e-3)
    d = simulate(r, SHAPE, PROF, from_disk=True)
    assert d.cpu_miss_s == pytest.approx(50 * (cpu + 1e6 / 0.5e9))


def test_more_hits_is_faster_and_prefetch_overlaps():
    slow = simulate(result(100, 100), SHAPE, PROF, cpu_compute=False)
    fast = simulate(result(180, 20), SHAPE, PROF, cpu_compute=False)
    assert fast.tok_s > slow.tok_s
    p = simulate(result(150, 50, issued=2), SHAPE, PROF)  # 2 ms of prefetch vs >= 2 ms of compute
    assert p.prefetch_stall_s == 0.0
    p = simulate(result(150, 50, issued=20), SHAPE, PROF)
    assert p.prefetch_stall_s == pytest.approx(20e-3 - (2e-3 + 150 * 1e-5))


def test_cpu_only_and_config(tmp_path):
    p = simulate(result(150, 50), SHAPE, BUILTIN["cpu-only"])
    assert p.misses_on_cpu == 50 and p.transfer_stall_s == 0
    s = ModelShape.from_config(
        {
            "hidden_size": 8,
            "num_hidden_layers": 2,
            "moe_intermediate_size": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 4,
            "num_experts": 3,
            "vocab_size": 10,
        }
    )
    assert s.expert_params == 96 and s.dense_params == 2 * (8 * 8 * 2 + 8 * 4 * 2 + 8 * 3) + 80
    with pytest.raises(ValueError, match="missing field 'vocab_size'"):
        ModelShape.from_config(
            {"hidden_size": 8, "num_hidden_layers": 2, "intermediate_size": 4, "num_attention_heads": 2}
        )
