"""``python -m learner plot RUN_DIR``: draw the run's curves into ``RUN_DIR/curves.png``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from learner.run.metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]
    ylabel: str
    # A length, a fraction or a duration: the axis starts at 0, so that 15.5-16 tokens reads as
    # about 16 rather than as a swing filling the panel.
    from_zero: bool = False
    # Keys on a right-hand axis of their own (a KL of 0.001 beside an entropy of 5)...
    right_keys: tuple[str, ...] = ()
    right_ylabel: str = ""
    # ... and what the panel says when none of them was logged.
    right_missing: str = ""


PANELS = (
    Panel("reward", ("reward/mean", "eval/reward/mean"), "mean reward"),
    Panel("loss", ("loss",), "loss"),
    Panel(
        "entropy / KL",
        ("entropy",),
        "entropy (nats/token)",
        right_keys=("kl",),
        right_ylabel="KL to the reference (nats/token)",
        right_missing="no KL: grpo.beta = 0 (no reference model)",
    ),
    Panel("completion length", ("completion/len_mean",), "tokens", from_zero=True),
    Panel(
        "clip fraction",
        ("clip_region", "clip_low", "clip_high"),
        "fraction of tokens",
        from_zero=True,
    ),
    Panel(
        "seconds per phase",
        ("time/generate", "time/score", "time/train", "time/sync"),
        "seconds",
        from_zero=True,
    ),
)

# Evaluations happen every N steps: their values are drawn as points, not joined by slopes
# that no measurement stands behind.
EVAL_PREFIX = "eval/"


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in pts], [y for _, y in pts]


def _draw(ax: Axes, records: list[dict[str, Any]], keys: tuple[str, ...], colors: Any) -> int:
    """Plot each logged key of ``keys`` on ``ax``; how many were logged."""
    drawn = 0
    for key in keys:
        xs, ys = _series(records, key)
        if not xs:
            continue
        style: dict[str, Any] = {"label": key, "color": next(colors)}
        if key.startswith(EVAL_PREFIX):
            style.update(linestyle="none", marker="o", markersize=6)
        else:
            style.update(marker="." if len(xs) < 60 else None)
        ax.plot(xs, ys, **style)
        drawn += 1
    return drawn


def build_figure(records: list[dict[str, Any]], title: str) -> Figure:
    """The six panels of a run's records (one dict per step, as in ``metrics.jsonl``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, PANELS, strict=True):
        colors = iter(cycle * 2)
        drawn = _draw(ax, records, panel.keys, colors)
        handles, labels = ax.get_legend_handles_labels()
        if panel.right_keys:
            right = ax.twinx()
            if _draw(right, records, panel.right_keys, colors):
                right.set_ylabel(panel.right_ylabel)
                more_h, more_l = right.get_legend_handles_labels()
                handles, labels = handles + more_h, labels + more_l
                drawn += 1
            else:
                right.set_yticks([])
                ax.text(0.98, 0.97, panel.right_missing, ha="right", va="top",
                        transform=ax.transAxes, fontsize=8, alpha=0.7)  # fmt: skip
        if not drawn:  # e.g. an SFT run logs no rewards
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", alpha=0.6)
        elif panel.from_zero:
            top = max(ax.get_ylim()[1], 1e-3)  # all zeros (no clipping yet) still spans 0-0.001
            ax.set_ylim(0, top * 1.05)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        if len(handles) > 1:
            ax.legend(handles, labels, fontsize=8, loc="best")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no records yet")
    fig = build_figure(records, f"run: {run_dir}")
    import matplotlib.pyplot as plt

    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
