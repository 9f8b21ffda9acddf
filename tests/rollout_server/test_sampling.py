"""The logit processing and sampling functions against hand-computed distributions."""

from __future__ import annotations

import math

import pytest
import torch

from rollout_server.engine.sampling import (
    apply_repetition_penalty,
    find_stop,
    sample_tokens,
    sampling_logprobs,
)

NEG_INF = float("-inf")


def _row(logits, *, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> list[float]:
    out = sampling_logprobs(
        torch.tensor([logits], dtype=torch.float32),
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )
    return out[0].tolist()


def _log_normalised(probs: list[float]) -> list[float]:
    total = sum(probs)
    return [math.log(p / total) if p > 0 else NEG_INF for p in probs]


def _assert_close(got: list[float], want: list[float]) -> None:
    for g, w in zip(got, want, strict=True):
        if w == NEG_INF:
            assert g == NEG_INF
        else:
            assert g == pytest.approx(w, abs=1e-6)


# probs 0.1, 0.2, 0.3, 0.4 written as logits log(p)
PROBS = [0.1, 0.2, 0.3, 0.4]
LOGITS = [math.log(p) for p in PROBS]


def test_plain_softmax_at_temperature_one():
    _assert_close(_row(LOGITS), _log_normalised(PROBS))


def test_temperature_half_squares_the_probabilities():
    # logits / 0.5 = 2 log p -> p^2 renormalised
    _assert_close(_row(LOGITS, temperature=0.5), _log_normalised([p * p for p in PROBS]))


def test_top_k_keeps_the_k_largest_renormalised():
    _assert_close(_row(LOGITS, top_k=2), _log_normalised([0, 0, 0.3, 0.4]))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # sorted 0.4, 0.3, 0.2, 0.1: mass before 0.3 is 0.4 < 0.5, before 0.2 is 0.7 >= 0.5
    _assert_close(_row(LOGITS, top_p=0.5), _log_normalised([0, 0, 0.3, 0.4]))
    # mass before 0.3 is 0.4 >= 0.35: only the top token stays (log-prob 0)
    _assert_close(_row(LOGITS, top_p=0.35), [NEG_INF, NEG_INF, NEG_INF, 0.0])


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # top-k 3 -> 0.2/0.9, 0.3/0.9, 0.4/0.9; mass before 0.3/0.9 = 0.444 < 0.6, before
    # 0.2/0.9 = 0.778 >= 0.6 -> keep 0.3 and 0.4
    _assert_close(_row(LOGITS, top_k=3, top_p=0.6), _log_normalised([0, 0, 0.3, 0.4]))


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    # threshold 0.6 * 0.4 = 0.24: 0.1 and 0.2 go
    _assert_close(_row(LOGITS, min_p=0.6), _log_normalised([0, 0, 0.3, 0.4]))


def test_greedy_reports_the_unfiltered_softmax():
    _assert_close(_row(LOGITS, temperature=0.0, top_k=1, top_p=0.1), _log_normalised(PROBS))


def test_rows_with_different_parameters_do_not_interact():
    settings = [
        {"temperature": 1.0},
        {"top_k": 2},
        {"top_p": 0.5, "temperature": 0.5},
        {"min_p": 0.6},
        {"temperature": 0.0},
    ]
    batch = sampling_logprobs(
        torch.tensor([LOGITS] * len(settings)),
        torch.tensor([s.get("temperature", 1.0) for s in settings]),
        torch.tensor([s.get("top_k", -1) for s in settings]),
        torch.tensor([s.get("top_p", 1.0) for s in settings]),
        torch.tensor([s.get("min_p", 0.0) for s in settings]),
    )
    for row, s in zip(batch.tolist(), settings, strict=True):
        _assert_close(row, _row(LOGITS, **s))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_inverse_cdf_sampling_picks_the_token_whose_cdf_interval_holds_the_draw():
    logprobs = torch.tensor([[NEG_INF, math.log(0.5), NEG_INF, math.log(0.5)]] * 4)
    uniforms = torch.tensor([0.0, 0.49, 0.51, 0.9999999999], dtype=torch.float64)
    greedy = torch.tensor([False] * 4)
    assert sample_tokens(logprobs, greedy, uniforms).tolist() == [1, 1, 3, 3]


def test_sampling_never_returns_a_filtered_token_and_greedy_takes_the_argmax():
    logprobs = torch.tensor([_row(LOGITS, top_k=2)] * 3)
    tokens = sample_tokens(
        logprobs,
        torch.tensor([False, False, True]),
        torch.tensor([0.0, 1.0 - 1e-16, 0.3], dtype=torch.float64),
    )
    assert tokens.tolist() == [2, 3, 3]


def test_sampled_frequencies_follow_the_distribution():
    gen = torch.Generator().manual_seed(0)
    draws = 20000
    uniforms = torch.rand(draws, generator=gen, dtype=torch.float64)
    logprobs = torch.tensor([LOGITS] * draws).log_softmax(-1)
    tokens = sample_tokens(logprobs, torch.zeros(draws, dtype=torch.bool), uniforms)
    freq = torch.bincount(tokens, minlength=4).double() / draws
    # binomial standard error <= sqrt(0.25 / 20000) = 0.0035; allow 4 sigma
    assert torch.allclose(freq, torch.tensor(PROBS, dtype=torch.float64), atol=0.014)


def test_find_stop_returns_the_earliest_stop():
    assert find_stop("abc STOP def END", ["END", "STOP"]) == 4
    assert find_stop("abc", ["x", ""]) is None
