"""The learner's model-FLOPs count (the ``mfu`` metric), by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from learner.run.perf import train_flops


def test_train_flops_counts_each_sequence_by_its_own_length():
    cfg = SimpleNamespace(
        hidden_size=4, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=3, intermediate_size=5, vocab_size=7,
    )  # fmt: skip
    # per layer: q and o 4*2*3 each, k and v 4*1*3 each, MLP 3*4*5; LM head 7*4
    weights = 2 * (2 * 24 + 2 * 12 + 60) + 28
    attention_per_key = 4 * 2 * 2 * 3  # 4 * layers * heads * head_dim

    def one(length: int) -> float:  # forward + backward of one sequence: 3 forwards
        return length * 3 * (2 * weights + attention_per_key * length / 2)

    assert train_flops(cfg, [10, 300, 40]) == pytest.approx(one(10) + one(300) + one(40))
    assert train_flops(cfg, [10, 300], passes=2) == pytest.approx(2 * (one(10) + one(300)))
    assert train_flops(cfg, []) == 0.0
