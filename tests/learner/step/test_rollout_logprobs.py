"""Collecting a step's rollouts against a real server on loopback: log-probs are asked for only
when the loss uses them (truncated IS), single-turn and multi-turn; every column reaches the
rewards; failed episodes are warned about, and a step where all failed stops the run."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from pydantic import BaseModel

from learner.config import load_config
from learner.step.rollouts import (
    EpisodesFailedError,
    check_episodes,
    collect,
    collect_episodes,
    generate_request,
)
from rewards.env import Environment, ToolResult, tool
from rewards.scoring import RewardRunner
from rollout_server.client import RolloutClient
from rollout_server.settings import ServerSettings

CONFIGS = Path(__file__).resolve().parents[3] / "learner" / "configs"


class Answer(BaseModel):
    answer: str


class StrResult(Environment):
    """Its terminal tool returns a str, not a ToolResult: every episode fails."""

    def get_prompt(self):
        return "Say something."

    @tool(terminal=True)
    def grade(self, args: Answer):
        return "right"


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    with start_server(ServerSettings(model=str(tiny_model_dir), max_model_len=2048)) as s:
        yield s


@pytest.mark.parametrize("cap", ["2.0", "none"])
async def test_prompts_get_logprobs_only_for_truncated_is(server, cap):
    cfg = load_config(CONFIGS / "demo.toml", [f"grpo.tis_cap={cap}", "sampling.max_tokens=8"])
    assert generate_request(cfg, ["x"]).logprobs == (cap != "none")
    rows = [{"prompt": "sing", "allowed": "aeiou"}, {"prompt": "a song", "allowed": "aeiou"}]
    scorer = RewardRunner([{"name": "charset"}])
    async with RolloutClient(server.url) as client:
        step = await collect(cfg, client, scorer, rows)
    assert len(step.rollouts) == 2 * cfg.sampling.num_generations
    for r in step.rollouts:
        assert len(r.sampling_logprobs) == len(r.completion_ids) >= 1
        if cap == "none":  # not asked for: zeros, which the loss never reads
            assert r.sampling_logprobs == [0.0] * len(r.completion_ids)
        else:
            assert all(lp <= 0 for lp in r.sampling_logprobs)
            assert any(lp < 0 for lp in r.sampling_logprobs)


async def test_episodes_without_logprobs_still_run(server, tiny_model_dir):
    from transformers import AutoTokenizer

    from rewards.chat import HFChatFormat
    from rewards.env import get_tasks
    from rewards.registry import load_environment

    cfg = load_config(CONFIGS / "calculator.toml", ["grpo.tis_cap=none"])
    env_cls = load_environment(cfg.environment.name)
    tasks = (await get_tasks(env_cls, cfg.environment.split))[:2]
    chat = HFChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir), {})
    async with RolloutClient(server.url) as client:
        step = await collect_episodes(cfg, client, env_cls, chat, tasks)
    assert step.metrics["episode/error_frac"] == 0.0
    for r in step.rollouts:
        assert r.sampling_logprobs == [0.0] * len(r.completion_ids)


async def test_rewards_get_the_sampled_token_ids(server):
    """The learner passes ``completion_ids``: length(unit="tokens") scores the sampled tokens."""
    cfg = load_config(CONFIGS / "demo.toml", ["sampling.max_tokens=8"])
    rows = [{"prompt": "sing", "allowed": "aeiou"}, {"prompt": "a song", "allowed": "aeiou"}]
    target = 4
    scorer = RewardRunner([{"name": "length", "kwargs": {"target": target, "unit": "tokens"}}])
    async with RolloutClient(server.url) as client:
        step = await collect(cfg, client, scorer, rows)
        with pytest.raises(ValueError, match=r"'completion_ids' column.*rename"):
            await collect(cfg, client, scorer, [{**r, "completion_ids": [1]} for r in rows])
    want = [max(0.0, 1 - abs(len(r.completion_ids) - target) / target) for r in step.rollouts]
    assert step.rewards.tolist() == pytest.approx(want)


async def test_rows_with_different_columns_all_reach_the_rewards(server):
    """JSONL rows may differ in their columns: a column that the batch's first row lacks still
    reaches the reward functions (None for the rows without it)."""
    cfg = load_config(CONFIGS / "demo.toml", ["sampling.max_tokens=4"])
    rows = [{"prompt": "sing"}, {"prompt": "a song", "allowed": "aeiou"}]
    scorer = RewardRunner([{"name": "charset"}])
    async with RolloutClient(server.url) as client:
        step = await collect(cfg, client, scorer, rows)
    g = cfg.sampling.num_generations
    assert step.metrics["reward/charset/none_frac"] == 0.5  # the first row's G abstain
    assert len(step.rewards) == 2 * g


async def test_failed_episodes_are_warned_about_and_all_failed_stops(
    server, tiny_model_dir, caplog
):
    from transformers import AutoTokenizer

    from rewards.chat import HFChatFormat

    cfg = load_config(CONFIGS / "calculator.toml", ["environment.name='str_result'"])
    chat = HFChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir), {})
    async with RolloutClient(server.url) as client:
        with caplog.at_level("WARNING", logger="learner.step.rollouts"):
            step = await collect_episodes(cfg, client, StrResult, chat, [{}])
            await collect_episodes(cfg, client, StrResult, chat, [{}])
    error = "TypeError: tool StrResult.grade returned str; return a rewards.env.ToolResult"
    n = cfg.sampling.num_generations
    assert step.first_error == error and step.metrics["episode/error_frac"] == 1.0
    line = (
        f"environment 'str_result': {n} of {n} episodes failed (reward 0.0, left out of the "
        f"loss and their group's baseline; episode/error_frac); first error: {error}"
    )
    first, second = (r.getMessage() for r in caplog.records)
    # the first time, where it was raised (once per run), then one line a step
    assert first.startswith(line + "\n(shown once per run) Traceback (most recent call last):")
    assert 'rewards/env.py", line' in first and first.rstrip().endswith(error)
    assert second == line

    def with_rank_1(failed_frac: float):  # gather_object over ranks 0 (this one) and 1
        return lambda mine: [*mine, failed_frac if isinstance(mine[0], float) else None]

    with pytest.raises(EpisodesFailedError) as info:  # every episode of every rank failed
        check_episodes(cfg, step, with_rank_1(1.0))
    assert str(info.value) == (
        "environment 'str_result': every episode of the step failed, so it has nothing to learn "
        f"from; first error: {error}. Fix the environment"
    )
    check_episodes(cfg, step, with_rank_1(0.5))  # rank 1's episodes did not all fail: go on


class EveryOtherFails(Environment):
    """Its terminal tool raises on every other call and grades the rest 0.0, 0.5 or 1.0 in turn:
    groups with failed and graded siblings."""

    calls = itertools.count()

    def get_prompt(self):
        return "Say something."

    @tool(terminal=True)
    def grade(self, args: Answer) -> ToolResult:
        i = next(self.calls)
        if i % 2:
            raise RuntimeError("the sandbox crashed")
        return ToolResult(text="graded", reward=(i // 2 % 3) / 2, finished=True)


async def test_failed_episodes_stay_out_of_the_loss_and_their_groups_baseline(
    server, tiny_model_dir
):
    from transformers import AutoTokenizer

    from rewards.chat import HFChatFormat

    cfg = load_config(CONFIGS / "calculator.toml", ["environment.name='every_other_fails'"])
    chat = HFChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir), {})
    async with RolloutClient(server.url) as client:
        step = await collect_episodes(cfg, client, EveryOtherFails, chat, [{}, {}, {}])
    g = cfg.sampling.num_generations
    failed = [not any(r.completion_mask) for r in step.rollouts]
    assert 0 < sum(failed) < len(failed) and step.metrics["episode/error_frac"] > 0
    for k in range(0, len(step.rollouts), g):
        group = step.rollouts[k : k + g]
        bad = failed[k : k + g]
        assert all(r.advantage == 0.0 for r, b in zip(group, bad, strict=True) if b)
        graded = [float(step.rewards[k + j]) for j in range(g) if not bad[j]]
        advantages = [r.advantage for r, b in zip(group, bad, strict=True) if not b]
        if len(set(graded)) > 1:  # centred among the graded ones alone
            assert sum(advantages) == pytest.approx(0.0, abs=1e-5)
            assert advantages[graded.index(max(graded))] > 0
