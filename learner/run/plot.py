"""``python -m learner plot RUN_DIR``: draw the run's curves into ``RUN_DIR/curves.png``."""

from __future__ import annotations

from pathlib import Path

from learner.run.metrics import read_metrics

PANELS = [
    ("reward", ["reward/mean", "eval/reward/mean"], "mean reward"),
    ("loss", ["loss"], "loss"),
    ("kl / entropy", ["kl", "entropy"], None),
    ("completion length", ["completion/len_mean"], "tokens"),
    ("clip fraction", ["clip_region", "clip_low", "clip_high"], None),
    ("seconds per phase", ["time/generate", "time/score", "time/train", "time/sync"], "s"),
]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no records yet")
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, keys, ylabel) in zip(axes.flat, PANELS, strict=True):
        plotted = 0
        for key in keys:
            ys = [r.get(key) for r in records]
            pts = [(s, y) for s, y in zip(steps, ys, strict=True) if y is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=key, marker="." if len(pts) < 60 else None)
                plotted += 1
        if not plotted:  # e.g. an SFT run logs no rewards
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", alpha=0.6)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ylabel:
            ax.set_ylabel(ylabel)
        if plotted and len(keys) > 1:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"run: {run_dir}")
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
