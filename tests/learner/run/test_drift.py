"""``DriftWatch``: silent while the servers' log-probs are the learner's, a warning once the
importance weight holds far from 1 (a server that did not load a sync), repeated while it lasts,
and quiet again after it comes back."""

from __future__ import annotations

from learner.run.drift import DriftWatch


def test_the_watch_warns_once_the_drift_holds_and_again_while_it_lasts() -> None:
    watch = DriftWatch(drift=0.25, patience=2, every=3)
    steps = [1.0, 0.97, 1.04, 0.02, 1.0, 0.01, 0.0, 2.0, 0.1, 0.05, 0.0, 0.99, 0.3]
    warned = [s for s, w in enumerate(steps, 1) if watch.check(s, {"is_weight": w})]
    # 4 alone is one step off (reset by 5); 6-11 off: the 2nd (7), then every 3rd (10); 13
    # starts again
    assert warned == [7, 10]
    message = DriftWatch(patience=1).check(12, {"is_weight": 0.0})
    assert message is not None and "step 12" in message and "is_weight 0.000" in message
    assert "weight sync loads" in message


def test_no_importance_weight_no_warning() -> None:
    watch = DriftWatch(patience=1)
    assert all(watch.check(s, {"loss": 0.0}) is None for s in range(1, 5))
    assert watch.off_steps == 0


def test_a_step_that_trained_no_token_neither_counts_nor_resets() -> None:
    """Every group's advantage zero: the step has no ``is_weight`` (no token to average), so it
    is no evidence either way."""
    watch = DriftWatch(patience=2)
    assert watch.check(1, {"is_weight": 0.0}) is None
    assert watch.check(2, {"loss": 0.0, "tokens/trained": 0.0}) is None
    assert watch.check(3, {"is_weight": 0.0}) is not None
