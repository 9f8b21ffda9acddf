"""DAPO's dynamic sampling (`grpo.dynamic_sampling`): a step tops its batch up with informative
groups from the data's refill pass, keeps informative groups first, and resumes exactly.

The end-to-end test runs the real learner (embedded transformers server, tiny Qwen3, the
`charset` reward) on data where only some rows can give differing rewards, and checks each
step's rounds against the count replayed from the seeded streams."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.config import ConfigError, load_config
from learner.data.prompts import PromptStream
from learner.run.metrics import read_metrics
from learner.step import dynamic_sampling
from learner.step.batch import Rollout
from learner.step.dynamic_sampling import fill_step, informative, merge_rounds
from learner.step.rollouts import StepRollouts, finish_step
from tests.learner.launch import cpu_launch

ROOT = Path(__file__).resolve().parents[3]
G = 4


def _cfg(**grpo: object):
    sets = [f"sampling.num_generations={G}", *(f"grpo.{k}={v}" for k, v in grpo.items())]
    return load_config(ROOT / "learner" / "configs" / "demo.toml", sets)


def _round(cfg, group_rewards: list[list[float]], *, tag: int, seconds: float = 1.0):
    """A scored round: one group a list of G rewards; completion ids name round and group."""
    rollouts, rewards = [], []
    for gi, rs in enumerate(group_rewards):
        for i, r in enumerate(rs):
            rollouts.append(Rollout([1, 2], [tag, gi, i], [-0.5] * 3, [1, 1, 1]))
            rewards.append(r)
    metrics = {"time/generate": seconds, "time/score": 0.5, "completion/truncated_frac": tag / 10}
    return finish_step(cfg, rollouts, rewards, metrics)


def _groups(step: StepRollouts) -> list[tuple[int, int]]:
    """(round tag, group index) of each kept group."""
    return [tuple(r.completion_ids[:2]) for r in step.rollouts[::G]]


FLAT, SPREAD = [1.0] * G, [0.0, 1.0, 0.0, 1.0]


def test_informative_means_differing_rewards_with_loss_tokens():
    cfg = _cfg()
    step = _round(cfg, [FLAT, SPREAD, [0.0] * G], tag=1)
    assert informative(step, G) == [False, True, False]
    for r in step.rollouts[G : 2 * G]:  # a spread group without loss tokens teaches nothing
        r.completion_mask = [0, 0, 0]
    assert informative(step, G) == [False, False, False]


def test_merge_keeps_informative_groups_first_and_recomputes_advantages():
    cfg = _cfg(scale_rewards="batch")
    first = _round(cfg, [SPREAD, FLAT, FLAT, [0.0, 0.0, 0.0, 2.0]], tag=1, seconds=2.0)
    second = _round(cfg, [FLAT, [1.0, 2.0, 3.0, 4.0]], tag=2, seconds=3.0)
    merged = merge_rounds(cfg, [first, second], groups=4)
    assert _groups(merged) == [(1, 0), (1, 3), (2, 1), (1, 1)]
    rewards = [*SPREAD, 0.0, 0.0, 0.0, 2.0, 1.0, 2.0, 3.0, 4.0, *FLAT]
    assert merged.rewards.tolist() == rewards
    # "batch" scaling: the kept batch's std, not either round's
    t = torch.tensor(rewards).view(4, G)
    expected = ((t - t.mean(1, keepdim=True)) / (torch.tensor(rewards).std() + 1e-4)).flatten()
    got = torch.tensor([r.advantage for r in merged.rollouts])
    torch.testing.assert_close(got, expected)
    m = merged.metrics
    assert m["time/generate"] == 5.0 and m["time/score"] == 1.0  # summed over the rounds
    assert m["completion/truncated_frac"] == pytest.approx((0.1 * 16 + 0.2 * 8) / 24)
    assert m["sampling/rounds"] == 2 and m["sampling/groups_generated"] == 6
    assert m["sampling/informative_frac"] == pytest.approx(3 / 6)
    assert m["groups/zero_advantage"] == 1  # the one uninformative group kept to fill
    assert m["tokens/generated"] == 6 * G * 3


def test_a_metric_some_rounds_lack_is_the_mean_of_those_that_have_it():
    cfg = _cfg()
    first = _round(cfg, [FLAT], tag=1)
    second = _round(cfg, [SPREAD, SPREAD], tag=2)
    first.metrics["reward/charset/mean"] = 0.25  # the reward abstained on the whole 2nd round
    merged = merge_rounds(cfg, [first, second], groups=1)
    assert merged.metrics["reward/charset/mean"] == 0.25


def test_merge_keeps_failed_episodes_out_of_the_baseline():
    cfg = _cfg()
    rollouts = [Rollout([1], [9, 0, i], [-0.1] * 3, [1, 1, 1]) for i in range(G)]
    rollouts[3].completion_mask = [0, 0, 0]  # a failed episode: masked, reward 0, not valid
    metrics = {"time/generate": 1.0, "time/score": 0.0}
    step = finish_step(cfg, rollouts, [1.0, 1.0, 1.0, 0.0], metrics, [True, True, True, False])
    assert informative(step, G) == [False]  # the valid rewards are all equal
    merged = merge_rounds(cfg, [step], groups=1)
    assert [r.advantage for r in merged.rollouts] == [0.0] * G


def _fill(cfg, first, later: list[StepRollouts], groups: int, others_short: int = 0):
    calls: list[tuple[int, bool]] = []

    def generate_round(k: int, short: bool) -> StepRollouts | None:
        calls.append((k, short))
        return later[k - 1] if short else None

    step = fill_step(cfg, first, groups, generate_round, most=lambda n: max(n, others_short))
    return step, calls


def test_rounds_stop_once_the_batch_is_full():
    cfg = _cfg(dynamic_sampling=True, max_sampling_rounds=5)
    first = _round(cfg, [FLAT, SPREAD, FLAT], tag=1)
    later = [_round(cfg, [SPREAD, FLAT, FLAT], tag=2), _round(cfg, [FLAT, SPREAD, SPREAD], tag=3)]
    step, calls = _fill(cfg, first, later, groups=3)
    assert calls == [(1, True), (2, True)]
    assert _groups(step) == [(1, 1), (2, 0), (3, 1)]
    assert step.metrics["groups/zero_advantage"] == 0 and step.metrics["sampling/rounds"] == 3


def test_a_full_rank_takes_the_rounds_rows_but_generates_nothing():
    cfg = _cfg(dynamic_sampling=True, max_sampling_rounds=3)
    first = _round(cfg, [SPREAD, SPREAD], tag=1)
    step, calls = _fill(cfg, first, [], groups=2, others_short=1)  # another rank is short
    assert calls == [(1, False), (2, False)]
    assert step.metrics["sampling/rounds"] == 1 and _groups(step) == [(1, 0), (1, 1)]


def test_a_batch_short_after_the_last_round_is_filled_and_warns(caplog):
    cfg = _cfg(dynamic_sampling=True, max_sampling_rounds=2)
    first = _round(cfg, [FLAT, FLAT], tag=1)
    dynamic_sampling._warned_short = False
    with caplog.at_level(logging.WARNING, logger="learner.step.dynamic_sampling"):
        step, calls = _fill(cfg, first, [_round(cfg, [FLAT, SPREAD], tag=2)], groups=2)
    assert calls == [(1, True)]
    assert _groups(step) == [(2, 1), (1, 0)]
    assert step.metrics["groups/zero_advantage"] == 1
    assert "1 of 2 groups informative after 2 rounds" in caplog.text
    assert "grpo.max_sampling_rounds" in caplog.text


def test_max_sampling_rounds_below_two_is_refused():
    with pytest.raises(ConfigError, match="max_sampling_rounds"):
        _cfg(dynamic_sampling=True, max_sampling_rounds=1)


def test_the_refill_pass_leaves_the_main_order_alone_and_resumes():
    rows = [{"i": i} for i in range(10)]
    plain = PromptStream(rows, seed=3, shuffle=True)
    main_only = [r["i"] for r in plain.take(25)]
    order = list(range(10))
    random.Random(3).shuffle(order)  # the main order is the one runs before refills had
    assert main_only[:10] == order

    stream = PromptStream(rows, seed=3, shuffle=True)
    mixed = [r["i"] for r in stream.take(7)]
    refill = [r["i"] for r in stream.take_refill(4)]
    mixed += [r["i"] for r in stream.take(18)]
    assert mixed == main_only
    assert sorted(refill + [r["i"] for r in stream.take_refill(6)]) == list(range(10))
    assert refill != main_only[:4]  # its own seeded order

    state = stream.state_dict()
    again = PromptStream(rows, seed=3, shuffle=True)
    again.load_state_dict(state)
    assert again.take_refill(5) == stream.take_refill(5)
    assert again.take(5) == stream.take(5)
    old = {k: v for k, v in state.items() if k != "refill_position"}  # a checkpoint from before
    again.load_state_dict(old)
    assert again.refill_position == 0


def _charset_data(path: Path, n: int, informative_every: int) -> list[dict]:
    """Rows of a demo-like prompt; every ``informative_every``-th row names an ``allowed`` set
    (its completions' charset rewards differ); the others name none (null): the reward abstains,
    every completion's total is 0.0."""
    rows = []
    for i in range(n):
        row: dict = {"prompt": [{"role": "user", "content": f"Sing song {i} with vowels."}]}
        row["allowed"] = "abcdefghijklm nopqrstuvwxyz" if i % informative_every == 0 else None
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _write_config(tmp_path: Path, rows: int, prompts: int, rounds_cap: int) -> Path:
    data = tmp_path / "data.jsonl"
    _charset_data(data, n=rows, informative_every=3)
    config = tmp_path / "ds.toml"
    config.write_text(
        f"""
[model]
name_or_path = "tiny"
[data]
path = "{data}"
[sampling]
num_generations = {G}
max_tokens = 12
ignore_eos = true
seed = 7
[[rewards]]
name = "charset"
[grpo]
prompts_per_step = {prompts}
dynamic_sampling = true
max_sampling_rounds = {rounds_cap}
[run]
progress_bar = false
save_final = false
checkpoint_every = 1
"""
    )
    return config


def _learn(config: Path, run_dir: Path, steps: int, *, ranks: int = 1, resume: bool = False):
    cmd = [*(cpu_launch(ranks) if ranks > 1 else [sys.executable]), "-m", "learner"]
    cmd += ["--config", str(config), "--run-dir", str(run_dir), "--set", f"run.steps={steps}"]
    proc = subprocess.run(
        cmd + (["--resume"] if resume else []),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _replay(config: Path, steps: int, ranks: int) -> tuple[list[float], list[float]]:
    """Each step's expected sampling/rounds and sampling/informative_frac (means over the
    ranks), from the seeded streams: a round adds the rows that name an ``allowed`` set."""
    cfg = load_config(config)
    rows = [json.loads(line) for line in Path(cfg.data.path).read_text().splitlines()]
    stream = PromptStream(rows, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    per_rank = cfg.grpo.prompts_per_step // ranks

    def useful(batch: list[dict]) -> list[int]:
        shares = [batch[i * per_rank : (i + 1) * per_rank] for i in range(ranks)]
        return [sum(r["allowed"] is not None for r in share) for share in shares]

    rounds, fracs = [], []
    for _ in range(steps):
        have, made = useful(stream.take(cfg.grpo.prompts_per_step)), [1] * ranks
        for _k in range(1, cfg.grpo.max_sampling_rounds):
            short = [h < per_rank for h in have]
            if not any(short):
                break
            extra = useful(stream.take_refill(cfg.grpo.prompts_per_step))
            for i in range(ranks):
                if short[i]:
                    have[i], made[i] = have[i] + extra[i], made[i] + 1
        rounds.append(sum(made) / ranks)
        fracs.append(sum(h / (m * per_rank) for h, m in zip(have, made, strict=True)) / ranks)
    return rounds, fracs


@pytest.mark.slow
def test_the_learner_fills_each_step_and_a_resume_draws_the_same_refills(tmp_path):
    config = _write_config(tmp_path, rows=24, prompts=4, rounds_cap=6)
    run_dir = tmp_path / "run"
    _learn(config, run_dir, steps=2)
    _learn(config, run_dir, steps=4, resume=True)  # from step 2's checkpoint
    records = read_metrics(run_dir)
    rounds, fracs = _replay(config, 4, ranks=1)
    assert max(rounds) > 1  # the data makes the learner look further
    assert [r["sampling/rounds"] for r in records] == rounds
    assert [r["sampling/informative_frac"] for r in records] == pytest.approx(fracs)
    assert [r["groups/zero_advantage"] for r in records] == [0.0] * 4
    assert all(r["time/refill"] > 0 for r, k in zip(records, rounds, strict=True) if k > 1)


@pytest.mark.slow
def test_two_ranks_refill_together_and_stop_together(tmp_path):
    config = _write_config(tmp_path, rows=24, prompts=4, rounds_cap=6)
    run_dir = tmp_path / "ddp"
    _learn(config, run_dir, steps=3, ranks=2)
    records = read_metrics(run_dir)
    rounds, fracs = _replay(config, 3, ranks=2)
    assert [r["sampling/rounds"] for r in records] == rounds
    assert [r["sampling/informative_frac"] for r in records] == pytest.approx(fracs)
    sums = json.loads((run_dir / "rank_checksums.json").read_text())
    assert len(sums) == 2 and sums[0] == sums[1]
