"""Loss-curve PNGs (matplotlib, optional) and the convergence-parity table."""
from __future__ import annotations

from pathlib import Path


def loss_png(path: Path, curves: dict[str, tuple[list[float], list[tuple[int, float]]]], title: str) -> str | None:
    """Overlay training (lines) and validation (markers) losses, one colour per label; returns None when
    written, else a one-line note (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no loss-curve PNG (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    for i, (label, (losses, vals)) in enumerate(curves.items()):
        colour = f"C{i}"
        ax.plot(range(1, len(losses) + 1), losses, color=colour, lw=1.0, alpha=0.8,
                ls=("-", "--", ":", "-.")[i % 4], label=f"{label} train")
        if vals:
            ax.plot([s for s, _ in vals], [v for _, v in vals], "o", color=colour, ms=4, label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def parity_table(runs: dict[int, dict]) -> tuple[list[dict], float]:
    """Per tp: the largest per-step |Δloss| against the first tp, relative to the loss, and the final
    validation loss; plus the worst relative difference overall."""
    base_tp = next(iter(runs))
    base = runs[base_tp]["losses"]
    rows, worst = [], 0.0
    for tp, run in runs.items():
        deltas = [abs(a - b) for a, b in zip(run["losses"], base)]
        rel = max((d / abs(b) for d, b in zip(deltas, base)), default=0.0)
        worst = max(worst, rel)
        rows.append({"tp": tp, "steps": len(run["losses"]), "max_abs_dloss": max(deltas, default=0.0),
                     "max_rel_dloss": rel, "final_loss": run["losses"][-1], "val_loss": run["val_loss"],
                     "tokens_per_s": run["tokens_per_s"]})
    return rows, worst


def markdown(rows: list[dict], base_tp: int) -> str:
    """The table as Markdown."""
    lines = [f"| tp | steps | max abs Δloss vs tp={base_tp} | max Δloss / loss | final train loss | final val loss | tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tp']} | {r['steps']} | {r['max_abs_dloss']:.2e} | {r['max_rel_dloss']:.2e} | "
                     f"{r['final_loss']:.4f} | {r['val_loss']:.4f} | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)
