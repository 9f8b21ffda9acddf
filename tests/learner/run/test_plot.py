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
