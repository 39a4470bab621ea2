"""`expertcache plan --png FILE`: the memory plan as stacked bars per tier, against each budget."""

from __future__ import annotations

from ..units import fmt_bytes


def _rows(r: dict, fast: str) -> list:
    """The bars, fastest tier first: (name, [(label, bytes, colour), ...], budget or None)."""
    m, b, p, kv = r["model"], r["bytes"], r["plan"], r["kv"]
    expert_slots = p["device_used"] - (p["staging"] or 0)
    rows = [
        (
            f"{fast}",
            [
                ("dense weights", b["dense_compute"], "#8d99ae"),
                (f"experts: {p['device_slots']}/layer", expert_slots, "#e0542c"),
                ("staging", p["staging"] or 0, "#f4a261"),
                ("KV cache (auto)", kv["auto_bytes"], "#2a6fdb"),
            ],
            p["device_budget"],
        )
    ]
    if not p["resident"] and p["host_slots"] is not None:
        rows.append(
            (
                "host RAM",
                [(f"experts: {min(p['host_slots'], m['num_experts'])}/layer", p["host_used"], "#2a9d8f")],
                p["host_budget"],
            )
        )
    rows.append(
        (
            "disk",
            [(f"all {m['num_experts']} experts x {m['moe_layers']} layers", b["experts_stored"], "#bdbdbd")],
            None,
        )
    )
    return rows


def plot_plan(r: dict, path: str) -> None:
    """r: the report of plan/cli.build_report (a plan that fits)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, b = r["model"], r["bytes"]
    fast = "GPU" if r["device"] == "cuda" else "RAM (fastest tier)"
    rows = _rows(r, fast)
    fig, ax = plt.subplots(figsize=(8.5, 1.6 + 0.8 * len(rows)))
    widest = max(sum(n for _, n, _ in parts) for _, parts, _ in rows) or 1
    for y, (name, parts, budget) in enumerate(reversed(rows)):
        left = 0
        for label, n, color in parts:
            if n:
                ax.barh(
                    y,
                    n,
                    left=left,
                    color=color,
                    edgecolor="white",
                    height=0.55,
                    label=f"{label} ({fmt_bytes(n)})",
                )
                if n > 0.15 * widest:  # narrow segments are named in the legend only
                    ax.text(left + n / 2, y, fmt_bytes(n), ha="center", va="center", fontsize=7)
                left += n
        if budget:
            start = b["dense_compute"] if name == fast else 0  # the expert budget counts experts only
            ax.plot([start + budget] * 2, [y - 0.38, y + 0.38], color="black", linewidth=2)
            ax.text(start + budget, y + 0.42, f"expert budget {fmt_bytes(budget)}", fontsize=7, ha="center")
    ax.set_yticks(range(len(rows)), [name for name, _, _ in reversed(rows)])
    ax.set_xlabel("bytes")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: fmt_bytes(int(x))))
    ax.set_title(
        f"memory plan: {m['dir'].rstrip('/').split('/')[-1]} ({m['architecture']}, --device {r['device']})",
        fontsize=10,
    )
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
