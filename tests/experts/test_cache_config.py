"""CacheConfig: every bad or inapplicable cache option is refused before a weight byte is read.

The check opens nothing: each case runs with the checkpoint's safetensors files made unopenable
(any open of them fails the test), so a refusal that came after loading would show."""

from __future__ import annotations

import argparse
import builtins
import os

import pytest

from expertcache import LLM
from expertcache.errors import ConfigError
from expertcache.experts.config import CacheAblation, CacheConfig
from expertcache.experts.policy import ONLINE


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail on any open of a .safetensors file (Python's open, os.open, safetensors.safe_open)."""
    opened = []

    def guard(real):
        def wrapped(path, *a, **k):
            if str(path).endswith(".safetensors"):
                opened.append(str(path))
                raise AssertionError(f"weight file opened before the options were checked: {path}")
            return real(path, *a, **k)

        return wrapped

    monkeypatch.setattr(builtins, "open", guard(builtins.open))
    monkeypatch.setattr(os, "open", guard(os.open))
    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", guard(safetensors.safe_open))
    return opened


BAD = [
    (dict(device_memory="25%", cache_policy="foo"), "cache_policy: unknown 'foo'"),
    (dict(device_memory="25%", cache_policy="min"), "trace replay only"),
    (dict(device_memory="12 parsecs"), "device_memory: invalid byte size"),
    (dict(device_memory="0%"), r"device_memory: a percentage must lie in \(0, 100\]"),
    (dict(device_memory="150%"), "device_memory: a percentage"),
    (dict(device_memory=-5), "device_memory must be >= 0"),
    (dict(device_memory="25%", host_memory="x%"), "host_memory: cannot parse"),
    (dict(device_memory="25%", prefetch="sometimes"), "prefetch: must be one of auto, device, host, off"),
    (dict(device_memory="25%", cpu_compute="maybe"), "cpu_compute: must be auto, always or never"),
    (dict(device_memory="25%", prefill_admit_tokens=-1), "prefill_admit_tokens: an integer >= 0"),
    (dict(device_memory="25%", prefetch_gate=3.0), "prefetch_gate"),
    (dict(device_memory="25%", overlap_io="yes"), "overlap_io: must be True or False"),
    (
        dict(device_memory="25%", load_stats="/nonexistent/stats.json"),
        "load_stats: /nonexistent/stats.json is not a file",
    ),
    (dict(device_memory="25%", cache_size=3), "unknown option 'cache_size'"),
    (
        dict(cache_policy="lru"),
        "cache_policy: only the expert cache uses this option.*every expert is resident",
    ),
    (dict(prefetch="device", cpu_compute="always"), "prefetch, cpu_compute: only the expert cache"),
    (dict(exclusive=False), "exclusive: only the expert cache"),
    (dict(max_model_len=0), "max_model_len: an integer >= 1"),
    (dict(max_model_len=10**9), "max_model_len=1000000000 exceeds the model's max_position_embeddings"),
]


@pytest.mark.parametrize("kw, msg", BAD, ids=[m.split(":")[0][:30] for _, m in BAD])
def test_bad_option_is_refused_before_any_weight_is_read(cache_checkpoint, no_weight_reads, kw, msg):
    with pytest.raises(ConfigError, match=msg):
        LLM(str(cache_checkpoint), **kw)
    assert no_weight_reads == []


def test_guard_would_see_a_load(cache_checkpoint, no_weight_reads):
    """The fixture catches a real load (so the test above can fail)."""
    with pytest.raises(AssertionError, match="weight file opened"):
        LLM(str(cache_checkpoint), device_memory="25%")


def test_good_options_and_keywords():
    c = CacheConfig.from_options(device_memory="25%", cache_policy="lru", prefetch=False, overlap_io=False)
    assert (c.policy, c.prefetch, c.ablation) == ("lru", "off", CacheAblation(overlap_io=False))
    assert c.cache_only_options() == ["cache_policy", "prefetch", "overlap_io"]
    assert CacheConfig.from_options(prefetch=True, host_memory="1GiB").prefetch == "device"
    assert not CacheConfig().tiered and CacheConfig(low_memory=True).tiered
    with pytest.raises(AttributeError):
        c.policy = "lfu"  # frozen


def test_policy_with_every_expert_resident_is_a_printed_note(cache_checkpoint):
    llm = LLM(str(cache_checkpoint), device_memory="100%", cache_policy="lru", prefetch="off")
    assert (
        "note: every expert is resident, so cache_policy, prefetch have nothing to act on" in llm.plan_lines
    )
    llm.close()


def test_cli_cache_policy_choices_are_the_online_policies(capsys):
    from expertcache.cli_common import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--cache-policy", "lfu"]).cache_policy == "lfu"
    with pytest.raises(SystemExit):
        p.parse_args(["--cache-policy", "foo"])
    assert "invalid choice: 'foo'" in capsys.readouterr().err
    action = next(a for a in p._actions if a.dest == "cache_policy")
    assert tuple(action.choices) == ONLINE
    for bad in (["--threads", "0"], ["--threads", "two"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
