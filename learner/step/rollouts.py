"""One step's rollouts: generate G completions per prompt, score them, compute advantages.

Runs on every rank for that rank's share of the prompts (so nothing is generated twice); the
advantages need the whole group, which always lives on one rank.

An episode whose environment raised ends with ``error`` set and reward 0.0 (rewards.episode). It
says nothing about the policy, so it stays out of the loss (its mask is zeroed) and out of its
group's baseline (``group_advantages(valid=...)``). The step logs a warning with the first error
(the first time with its traceback), and a step in which every episode (of every rank)
failed stops the run with ``EpisodesFailedError`` (``check_episodes``): that is a broken or
unreachable environment, and training on its zeros would only teach noise.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.config import EnvironmentConfig, LearnerConfig
from learner.data.prompts import data_columns
from learner.step.advantages import group_advantages
from learner.step.batch import Rollout
from rewards.chat import ChatFormat
from rewards.env import Environment
from rewards.episode import EpisodeResult, GenerateFn, Generation, run_episodes
from rewards.scoring import RewardRunner, RewardSpec
from rollout_server.client import RolloutClient
from rollout_server.protocol import GenerateRequest, Sample

logger = logging.getLogger(__name__)


_traceback_shown: set[str] = set()  # environments whose failure traceback was logged


class EpisodesFailedError(RuntimeError):
    """Every episode of a step ended with an error raised by the environment."""


@dataclass
class StepRollouts:
    rollouts: list[Rollout]
    rewards: torch.Tensor  # [B*G] total (weighted) reward
    metrics: dict[str, float] = field(default_factory=dict)
    first_error: str | None = None  # of the step's failed episodes, if any
    valid: list[bool] | None = None  # False: left out of its group's baseline (failed episode)


def check_episodes(
    cfg: LearnerConfig, step: StepRollouts, gather: Callable[[list], list] | None = None
) -> None:
    """Raise ``EpisodesFailedError`` when every episode of the step failed, on every rank:
    ``gather`` (``accelerate.utils.gather_object`` with several ranks) collects what each rank
    saw, so that all of them raise together or none does."""
    failed, errors = [step.metrics["episode/error_frac"]], [step.first_error]
    if gather is not None:
        failed, errors = gather(failed), gather(errors)
    if min(failed) == 1.0:
        name = cfg.environment.name if cfg.environment else "?"
        first = next((e for e in errors if e is not None), "?")
        raise EpisodesFailedError(
            f"environment {name!r}: every episode of the step failed, so it has nothing to "
            f"learn from; first error: {first}. Fix the environment"
        )


def reward_runner(
    cfg: LearnerConfig, rows: list[dict[str, Any]], prompt_column: str
) -> RewardRunner:
    """The run's ``[[rewards]]`` with its ``[scoring]`` timeout and failure policy, for prompts
    from ``rows``: a reward parameter that none of their columns fills is a ``RewardSpecError``
    now, not at the first step."""
    runner = RewardRunner(
        [RewardSpec(**r.model_dump()) for r in cfg.rewards],
        timeout_s=cfg.scoring.timeout_s,
        policy=cfg.scoring.policy,
    )
    runner.check_columns([*data_columns(rows, prompt_column), "completion_ids"])
    return runner


# An episode's turns draw from its seed + turn; episodes of a request lie this far apart.
_EPISODE_SEED_STRIDE = 1 << 16


def request_seed(cfg: LearnerConfig, kind: str, step: int, rank: int = 0) -> int | None:
    """The seed of one step's generation (``sampling.seed`` set; else None): a hash of that
    seed, ``kind`` ("train", "eval"), the step and the rank, below 2**40. The server draws
    prompt k's sample i from seed + k*n + i, so requests far apart in the hash's range never
    share draws, and a rerun or a resumed run draws each step's samples again."""
    if cfg.sampling.seed is None:
        return None
    key = f"{cfg.sampling.seed}:{kind}:{step}:{rank}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=5).digest(), "big")


def generate_request(
    cfg: LearnerConfig, prompts: list[Any], seed: int | None = None
) -> GenerateRequest:
    """The request for ``prompts``. It asks for the sampled tokens' log-probs only when the loss
    uses them (an off-policy correction: ``grpo.tis_cap``, ``grpo.correction_low``, a rejection
    band): without them vLLM's generation is faster."""
    s = cfg.sampling
    return GenerateRequest(
        prompts=prompts,
        seed=seed,
        logprobs=cfg.grpo.needs_sampling_logprobs,
        n=s.num_generations,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        stop=s.stop,
        ignore_eos=s.ignore_eos,
        chat_template_kwargs=s.chat_template_kwargs,
        return_routed_experts=cfg.model.routing_replay != "off",
    )


def _sampling_logprobs(req: GenerateRequest, sample: Sample) -> list[float]:
    """The sample's log-probs; zeros (unused by the loss) when the request did not ask for them."""
    return sample.logprobs if req.logprobs else [0.0] * len(sample.token_ids)


def truncate_prompts(
    prompts: list[Any], tokenizer: Any, max_tokens: int, chat_template_kwargs: dict[str, Any]
) -> tuple[list[list[int]], list[bool]]:
    """Token ids of each prompt (chat template applied), cut to the last ``max_tokens``."""
    out, overlong = [], []
    for p in prompts:
        text = (
            tokenizer.apply_chat_template(
                p, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
            )
            if isinstance(p, list)
            else p
        )
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        overlong.append(len(ids) > max_tokens)
        out.append(ids[-max_tokens:])
    return out, overlong


async def prompts_to_send(
    cfg: LearnerConfig, rows: list[dict[str, Any]], prompt_col: str, tokenizer: Any
) -> tuple[list[Any], list[bool]]:
    """The rows' prompts as the server gets them (cut to ``grpo.max_prompt_tokens``, as token
    ids, when that is set) and which ones were cut."""
    prompts: list[Any] = [r[prompt_col] for r in rows]
    if not cfg.grpo.max_prompt_tokens:
        return prompts, [False] * len(rows)
    if tokenizer is None:
        raise ValueError("grpo.max_prompt_tokens needs the tokenizer to count prompt tokens")
    return await asyncio.to_thread(
        truncate_prompts,
        prompts,
        tokenizer,
        cfg.grpo.max_prompt_tokens,
        cfg.sampling.chat_template_kwargs,
    )


def episode_generate(
    client: RolloutClient, base: GenerateRequest, versions: list[int]
) -> GenerateFn:
    """An episode's ``generate``: one sample of ``base`` for the ids so far; each sample's
    weight version is appended to ``versions``. A seeded ``base`` seeds turn t with seed + t."""
    turn = 0

    async def generate(ids: list[int]) -> Generation:
        nonlocal turn
        update: dict[str, Any] = {"prompts": [ids]}
        if base.seed is not None:
            update["seed"] = base.seed + turn
        turn += 1
        resp = await client.generate(base.model_copy(update=update))
        sample = resp.results[0].samples[0]
        versions.append(sample.weight_version)
        logprobs = _sampling_logprobs(base, sample)
        return Generation(sample.token_ids, logprobs, sample.text, sample.finish_reason)

    return generate


async def collect(
    cfg: LearnerConfig,
    client: RolloutClient,
    scorer: RewardRunner,
    rows: list[dict[str, Any]],
    *,
    tokenizer: Any = None,
    seed: int | None = None,
) -> StepRollouts:
    """Generate, score and attach group-relative advantages for ``rows`` (this rank's prompts);
    ``seed``: the request's (``request_seed``)."""
    assert cfg.data is not None
    g = cfg.sampling.num_generations
    prompt_col = cfg.data.prompt_column
    prompts_in, overlong = await prompts_to_send(cfg, rows, prompt_col, tokenizer)
    t0 = time.perf_counter()
    req = generate_request(cfg, prompts_in, seed)
    resp = await client.generate(req)
    t_gen = time.perf_counter() - t0
    mask_prompt = cfg.grpo.overlong_prompts == "mask"
    mask_cut = cfg.grpo.mask_truncated_completions

    rollouts: list[Rollout] = []
    prompts, completions, finish = [], [], []
    # every column of any row of the batch, None where a row lacks it
    columns: dict[str, list[Any]] = {k: [] for k in data_columns(rows, prompt_col)}
    if "completion_ids" in columns:
        raise ValueError(
            "the data has a 'completion_ids' column, a name the learner keeps for the sampled "
            "token ids it passes to reward functions: rename that column"
        )
    columns["completion_ids"] = []  # the sampled token ids, e.g. for length(unit="tokens")
    for row, result, too_long in zip(rows, resp.results, overlong, strict=True):
        if len(result.samples) != g:
            raise RuntimeError(f"server returned {len(result.samples)} samples, asked for {g}")
        for s in result.samples:
            excluded = (mask_prompt and too_long) or (mask_cut and s.finish_reason == "length")
            rollouts.append(
                Rollout(
                    prompt_ids=result.prompt_token_ids,
                    completion_ids=s.token_ids,
                    sampling_logprobs=_sampling_logprobs(req, s),
                    completion_mask=[0 if excluded else 1] * len(s.token_ids),
                    weight_version=s.weight_version,
                    routes=s.routed_experts.decode() if s.routed_experts is not None else None,
                )
            )
            prompts.append(row[prompt_col])
            completions.append(s.text)
            finish.append(s.finish_reason)
            for k in columns:
                columns[k].append(s.token_ids if k == "completion_ids" else row.get(k))

    t0 = time.perf_counter()
    scored = await scorer.score(prompts, completions, columns)
    t_score = time.perf_counter() - t0
    metrics = {
        **scored.metrics,
        "completion/truncated_frac": sum(f == "length" for f in finish) / len(finish),
        "prompts/overlong_frac": sum(overlong) / len(overlong),
        "completion/excluded_frac": sum(not any(r.completion_mask) for r in rollouts)
        / len(rollouts),
        "time/generate": t_gen,
        "time/score": t_score,
    }
    return finish_step(cfg, rollouts, scored.total, metrics)


async def collect_episodes(
    cfg: LearnerConfig,
    client: RolloutClient,
    env_cls: type[Environment],
    chat: ChatFormat,
    tasks: list[dict[str, Any]],
    seed: int | None = None,
) -> StepRollouts:
    """G multi-turn episodes per task; tool output is in the sequence but masked out of the loss.
    ``seed``: the step's (``request_seed``), spread over the episodes and their turns."""
    assert cfg.environment is not None
    e = cfg.environment
    base = generate_request(cfg, [[0]], seed).model_copy(update={"n": 1})
    versions: list[int] = []
    g = cfg.sampling.num_generations
    generate = episode_generators(client, base, versions, len(tasks) * g)
    t0 = time.perf_counter()
    episodes = await play_episodes(e, env_cls, tasks, g, generate, chat)
    t_gen = time.perf_counter() - t0
    failed = [ep.error for ep in episodes if ep.error is not None]
    if failed:
        first = next(ep for ep in episodes if ep.error is not None)
        shown = e.name in _traceback_shown or first.traceback is None
        _traceback_shown.add(e.name)
        logger.warning(
            "environment %r: %d of %d episodes failed (reward 0.0, left out of the loss and "
            "their group's baseline; episode/error_frac); first error: %s%s",
            e.name,
            len(failed),
            len(episodes),
            failed[0],
            "" if shown else f"\n(shown once per run) {first.traceback}",
        )
    version = min(versions) if versions else 0
    rollouts = [
        Rollout(
            prompt_ids=ep.prompt_ids,
            completion_ids=ep.completion_ids,
            sampling_logprobs=ep.completion_logprobs,
            # a failed episode says nothing of the policy: out of the loss and the baseline
            completion_mask=[0] * len(ep.completion_mask) if ep.error else ep.completion_mask,
            weight_version=version,
        )
        for ep in episodes
    ]
    n = len(episodes)
    metrics = {
        "episode/turns_mean": sum(ep.num_turns for ep in episodes) / n,
        "episode/finished_frac": sum(ep.finished for ep in episodes) / n,
        "episode/error_frac": sum(ep.error is not None for ep in episodes) / n,
        "episode/tool_token_frac": sum(
            len(ep.completion_mask) - sum(ep.completion_mask) for ep in episodes
        )
        / max(1, sum(len(ep.completion_mask) for ep in episodes)),
        "time/generate": t_gen,
        "time/score": 0.0,
    }
    valid = [ep.error is None for ep in episodes]
    step = finish_step(cfg, rollouts, [ep.reward for ep in episodes], metrics, valid)
    step.first_error = failed[0] if failed else None
    return step


def episode_generators(
    client: RolloutClient, base: GenerateRequest, versions: list[int], count: int
) -> list[GenerateFn]:
    """One ``generate`` per episode (``episode_generate``); with a seeded ``base``, episode j's
    turns draw from seed + j * 2**16 + turn."""
    return [
        episode_generate(
            client,
            base
            if base.seed is None
            else base.model_copy(update={"seed": base.seed + j * _EPISODE_SEED_STRIDE}),
            versions,
        )
        for j in range(count)
    ]


async def play_episodes(
    e: EnvironmentConfig,
    env_cls: type[Environment],
    tasks: list[dict[str, Any]],
    n: int,
    generate: Sequence[GenerateFn],
    chat: ChatFormat,
) -> list[EpisodeResult]:
    """``n`` episodes of each task, with the [environment] section's limits, in task order
    (``generate``: one per episode)."""
    return await run_episodes(
        env_cls,
        [t for t in tasks for _ in range(n)],
        generate,
        chat,
        max_turns=e.max_turns,
        reward_reduce=e.reward_reduce,
        max_tokens=e.max_episode_tokens,
        episode_timeout_s=e.episode_timeout_s,
    )


def finish_step(
    cfg: LearnerConfig,
    rollouts: list[Rollout],
    rewards_list: list[float],
    metrics: dict[str, float],
    valid: list[bool] | None = None,
) -> StepRollouts:
    """Attach group-relative advantages and add the rollout metrics shared by both paths.
    ``valid``: False for samples left out of their group's baseline (failed episodes)."""
    rewards = torch.tensor(rewards_list, dtype=torch.float32)  # [B*G]
    advantages, zero_groups = group_advantages(
        rewards,
        cfg.sampling.num_generations,
        scale=cfg.grpo.scale_rewards,
        valid=None if valid is None else torch.tensor(valid),
    )
    for r, a in zip(rollouts, advantages.tolist(), strict=True):
        r.advantage = a
    lengths = torch.tensor([sum(r.completion_mask) for r in rollouts], dtype=torch.float32)
    n_tokens = float(lengths.sum())
    metrics = {
        **metrics,
        "advantage/abs_mean": float(advantages.abs().mean()),
        "advantage/std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
        "groups/zero_advantage": float(zero_groups),
        "completion/len_mean": float(lengths.mean()),
        "completion/len_max": float(lengths.max()),
        "tokens/generated": n_tokens,
        "throughput/gen_tokens_per_s": n_tokens / max(metrics["time/generate"], 1e-9),
        "weight_version/min": float(min(r.weight_version for r in rollouts)),
    }
    return StepRollouts(rollouts, rewards, metrics, valid=valid)
