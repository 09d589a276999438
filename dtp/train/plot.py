"""Loss-curve PNGs (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path


def loss_png(
    path: Path, curves: dict[str, tuple[list[float], list[tuple[int, float]]]], title: str
) -> str | None:
    """Overlay training (lines) and validation (markers) losses, one colour per label; returns None
    when written, else a one-line note (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no loss-curve PNG (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    for i, (label, (losses, vals)) in enumerate(curves.items()):
        colour = f"C{i}"
        ax.plot(
            range(1, len(losses) + 1),
            losses,
            color=colour,
            lw=1.0,
            alpha=0.8,
            ls=("-", "--", ":", "-.")[i % 4],
            label=f"{label} train",
        )
        if vals:
            ax.plot(
                [s for s, _ in vals],
                [v for _, v in vals],
                "o",
                color=colour,
                ms=4,
                label=f"{label} val",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None
