"""The PNGs: trace replay (titled, one distinct line style per policy, MIN as the reference with a note
when a policy beats it), trace stats (labelled colour bar), plan (tiers against budgets); each command
says where it wrote the file."""

from __future__ import annotations

import pytest

from expertcache.cli import main
from expertcache.trace.synthetic import synth_trace

plt = pytest.importorskip("matplotlib.pyplot")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def figures(monkeypatch):
    """Keep the figures the plotting code closes, to inspect them."""
    kept = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    return kept


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("pics") / "skewed.npz"
    synth_trace(layers=3, experts=8, top_k=2, tokens=200, seed=1, zipf=1.2, reuse=0.4).save(p)
    return p


def test_replay_png(trace_path, tmp_path, capsys, figures):
    out = tmp_path / "sweep.png"
    assert main(["trace", "replay", str(trace_path), "--sweep", "--policy", "all", "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    assert f"wrote the hit-rate plot to {out}" in capsys.readouterr().err
    ax = figures[-1].axes[0]
    assert ax.get_title().startswith("skewed.npz: model") and "top-2 of 8 experts" in ax.get_title()
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    policies = [k for k in lines if k != "MIN (reference)"]
    assert "MIN (reference)" in lines and len(policies) == 6
    styles = {(lines[k].get_linestyle(), lines[k].get_marker()) for k in policies}
    assert len(styles) == len(policies)  # no policy hides behind another
    notes = [t.get_text() for t in ax.texts]
    assert any("above MIN" in t for t in notes) == any(
        h > m for p in policies for h, m in zip(lines[p].get_ydata(), lines["MIN (reference)"].get_ydata())
    )


def test_stats_png_labelled(trace_path, tmp_path, capsys, figures):
    out = tmp_path / "heat.png"
    assert main(["trace", "stats", str(trace_path), "--png", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG and f"wrote the heatmap to {out}" in capsys.readouterr().err
    fig = figures[-1]
    labels = [a.get_ylabel() for a in fig.axes]
    assert "routed (token, expert) pairs" in labels and "MoE layer" in labels


def test_plan_png(qwen3_checkpoint, tmp_path, capsys, figures):
    out = tmp_path / "plan.png"
    assert main(["plan", str(qwen3_checkpoint), "--device-memory", "50%", "--png", str(out)]) == 0
    assert (
        out.read_bytes()[:8] == PNG and f"wrote the memory plan picture to {out}" in capsys.readouterr().err
    )
    ax = figures[-1].axes[0]
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert ticks[-1].startswith("RAM") and "disk" in ticks
    assert any(t.get_text().startswith("expert budget") for t in ax.texts)
