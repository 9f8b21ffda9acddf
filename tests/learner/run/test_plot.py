"""``python -m learner plot``: a run's curves, and clear errors for what is not a run."""

from __future__ import annotations

import json
import warnings

from learner.cli import main


def test_plot_of_an_sft_run_marks_the_panels_it_did_not_log(tmp_path):
    lines = [{"step": s, "loss": 1.0 / s, "time/train": 0.1} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels" legend warning
        assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_plot_of_a_directory_that_is_no_run_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "is " in err and "a learner run directory?" in err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "has no records yet" in capsys.readouterr().err


def _records(with_kl: bool) -> list[dict]:
    out = []
    for s in range(1, 21):
        r = {"step": s, "reward/mean": s / 20, "entropy": 5.5 - s / 10, "clip_region": 0.0,
             "completion/len_mean": 15.5 + (s % 2) / 2, "time/train": 0.1}  # fmt: skip
        if with_kl:
            r["kl"] = 1e-3 * s
        if s % 10 == 0:
            r["eval/reward/mean"] = s / 25
        out.append(r)
    return out


def _panel(fig, title: str):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def test_the_panels_say_what_they_plot():
    from learner.run.plot import build_figure

    fig = build_figure(_records(with_kl=True), "run")
    reward = _panel(fig, "reward")
    (evals,) = [ln for ln in reward.get_lines() if ln.get_label() == "eval/reward/mean"]
    assert evals.get_linestyle() == "None" and evals.get_marker() == "o"  # points, no slopes
    (train,) = [ln for ln in reward.get_lines() if ln.get_label() == "reward/mean"]
    assert train.get_linestyle() == "-"

    entropy = _panel(fig, "entropy / KL")
    assert entropy.get_ylabel() == "entropy (nats/token)"
    (kl_axis,) = [
        ax for ax in fig.axes if ax is not entropy and ax.bbox.bounds == entropy.bbox.bounds
    ]
    assert [ln.get_label() for ln in kl_axis.get_lines()] == ["kl"]
    assert kl_axis.get_ylabel().startswith("KL")
    assert {t.get_text() for t in entropy.get_legend().get_texts()} == {"entropy", "kl"}

    assert _panel(fig, "clip fraction").get_ylabel() == "fraction of tokens"
    length = _panel(fig, "completion length")
    low, high = length.get_ylim()
    assert low == 0 and 16 < high < 17.5  # 15.5-16 tokens drawn as about 16, not as a swing


def test_a_run_without_a_reference_model_says_why_there_is_no_kl():
    from learner.run.plot import build_figure

    fig = build_figure(_records(with_kl=False), "run")
    entropy = _panel(fig, "entropy / KL")
    assert any("grpo.beta = 0" in t.get_text() for t in entropy.texts)
    assert [ln.get_label() for ln in entropy.get_lines()] == ["entropy"]
