"""Evaluation on held-out prompts while training (the ``[eval]`` section).

Every ``eval.every`` steps, after the step's weights reached the servers, and after the last step
(``eval.at_start``: also on the starting weights, as step 0), the main process asks the rollout
servers for ``eval.num_generations`` completions of every held-out prompt (greedy by default:
``eval.temperature = 0``), scores them with the run's own reward functions, and logs under
``eval/…`` in the step's metrics line: the mean and std of the total reward, each function's
mean, the best-of-n mean when n > 1, completion lengths and the time taken. With
``eval.save_samples`` every sample is written with its rewards to ``RUN_DIR/eval/step_N.jsonl``.

With an ``[environment]`` the held-out prompts are the tasks of its ``eval.split``, played as
episodes like the training ones (same turn limit, timeout and reward reduction), with
``eval/episode/…`` metrics and each episode's messages in the samples file.

Nothing here trains: the samples are not importance-weighted or given advantages, and the other
ranks wait for the main process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from learner.config import LearnerConfig
from learner.data.prompts import PromptFormat, data_columns, load_rows
from learner.run.runtime import SetupError, resolve_model
from learner.servers.client import make_client
from learner.servers.embedded import embedded_for, embedded_key
from learner.servers.pool import servers_ready
from learner.step.rollouts import (
    episode_generators,
    generate_request,
    play_episodes,
    prompts_to_send,
    request_seed,
    reward_runner,
)
from rewards.env import Environment, get_tasks
from rewards.scoring import RewardRunner, RewardSpecError
from rollout_server.client import RolloutClient
from rollout_server.protocol import GenerateRequest, InfoResponse

logger = logging.getLogger(__name__)


class Evaluator:
    """The held-out prompts and their scorer; ``run`` evaluates the weights the servers serve."""

    def __init__(
        self, cfg: LearnerConfig, samples_dir: Path, env_cls: type[Environment] | None = None
    ) -> None:
        assert cfg.eval is not None
        self.cfg = cfg
        self.e = cfg.eval
        self.env_cls = env_cls
        self.samples_dir = samples_dir
        self.max_tokens = self.e.max_tokens or cfg.sampling.max_tokens
        self.scorer: RewardRunner | None = None
        if env_cls is not None:
            tasks = asyncio.run(get_tasks(env_cls, self.e.split))
            self.rows = tasks[: self.e.max_prompts] if self.e.max_prompts else tasks
            return
        assert self.e.data is not None  # the config's validator
        d = cfg.data
        assert d is not None  # [eval] data goes with [data] (the config's validator)
        rows = load_rows(
            self.e.data,
            self.e.prompt_column,
            settings=("eval.data", "eval.prompt_column"),
            split=self.e.split,
            subset=self.e.subset
            if self.e.subset is not None or self.e.data != d.path
            else d.subset,
            prompt_format=PromptFormat.of(d),
        )
        self.rows = rows[: self.e.max_prompts] if self.e.max_prompts else rows
        try:  # its own runner: eval's failures and timeouts stay out of training's counts
            self.scorer = reward_runner(cfg, self.rows, self.e.prompt_column)
        except RewardSpecError as e:
            raise SetupError(f"eval.data {self.e.data}: {e}") from None

    def due(self, step: int) -> bool:
        """Whether step ``step`` (just trained; 0 before training) is evaluated."""
        if step == 0:
            return self.e.at_start
        return step % self.e.every == 0 or step == self.cfg.run.steps

    def check_limits(self, infos: list[InfoResponse], where: list[str]) -> list[str]:
        """What the servers would refuse of eval's requests, as setup messages."""
        problems = []
        for i, info in enumerate(infos):
            server = f"the rollout server {where[i]}" if where else "the embedded rollout server"
            for setting, value, limit in (
                ("eval.num_generations", self.e.num_generations, info.limits.max_n),
                ("eval.max_tokens", self.max_tokens, info.limits.max_tokens),
            ):
                if value > limit:
                    problems.append(f"{setting} = {value} is over {server}'s limit {limit}")
        return problems

    def request(self, prompts: list[Any], step: int) -> GenerateRequest:
        """Training's request with eval's n, length and temperature; greedy: no filters."""
        e = self.e
        sampled = e.temperature > 0
        seed = request_seed(self.cfg, "eval", step) if sampled else None
        update: dict[str, Any] = {
            "n": e.num_generations,
            "max_tokens": self.max_tokens,
            "temperature": e.temperature,
            "logprobs": False,
            "ignore_eos": False,
            "return_routed_experts": False,  # nothing trains on eval samples
        }
        if not sampled:
            update.update(top_p=1.0, top_k=-1, min_p=0.0)
        return generate_request(self.cfg, prompts, seed).model_copy(update=update)

    async def run(
        self, client: RolloutClient, step: int, tokenizer: Any = None, chat: Any = None
    ) -> dict[str, float]:
        """Generate, score, write the samples (``step_<step>.jsonl``); the ``eval/…`` metrics."""
        t0 = time.perf_counter()
        if self.env_cls is not None:
            metrics = await self._episodes(client, step, chat)
        else:
            metrics = await self._prompts(client, step, tokenizer)
        metrics["eval/seconds"] = time.perf_counter() - t0
        metrics["eval/prompts"] = float(len(self.rows))
        logger.info(
            "eval at step %d: reward %.4f over %d prompts x %d (%.1f s)",
            step,
            metrics["eval/reward/mean"],
            len(self.rows),
            self.e.num_generations,
            metrics["eval/seconds"],
        )
        return metrics

    def _reward_metrics(self, total: list[float]) -> dict[str, float]:
        n = self.e.num_generations
        mean = sum(total) / len(total)
        metrics = {
            "eval/reward/mean": mean,
            "eval/reward/std": (sum((x - mean) ** 2 for x in total) / len(total)) ** 0.5,
        }
        if n > 1:
            best = [max(total[i : i + n]) for i in range(0, len(total), n)]
            metrics["eval/reward/best_of_n"] = sum(best) / len(best)
        return metrics

    async def _episodes(self, client: RolloutClient, step: int, chat: Any) -> dict[str, float]:
        assert self.env_cls is not None and self.cfg.environment is not None
        versions: list[int] = []
        base = self.request([[0]], step).model_copy(update={"n": 1})
        n = self.e.num_generations
        generate = episode_generators(client, base, versions, len(self.rows) * n)
        episodes = await play_episodes(
            self.cfg.environment, self.env_cls, self.rows, n, generate, chat
        )
        k = len(episodes)
        sampled = [sum(ep.completion_mask) for ep in episodes]
        metrics = {
            **self._reward_metrics([ep.reward for ep in episodes]),
            "eval/episode/finished_frac": sum(ep.finished for ep in episodes) / k,
            "eval/episode/error_frac": sum(ep.error is not None for ep in episodes) / k,
            "eval/episode/turns_mean": sum(ep.num_turns for ep in episodes) / k,
            "eval/completion/len_mean": sum(sampled) / k,
            "eval/weight_version": float(min(versions) if versions else 0),
        }
        if self.e.save_samples:
            records = [
                {
                    "row": i // n,
                    "sample": i % n,
                    "task": self.rows[i // n],
                    "messages": ep.messages,
                    "reward": ep.reward,
                    "step_rewards": ep.step_rewards,
                    "stop_reason": ep.stop_reason,
                    "error": ep.error,
                }
                for i, ep in enumerate(episodes)
            ]
            await asyncio.to_thread(self._write, step, records)
        return metrics

    async def _prompts(self, client: RolloutClient, step: int, tokenizer: Any) -> dict[str, float]:
        assert self.scorer is not None
        col = self.e.prompt_column
        prompts, _ = await prompts_to_send(self.cfg, self.rows, col, tokenizer)  # as in training
        resp = await client.generate(self.request(prompts, step))
        n = self.e.num_generations
        texts, finish, lengths, flat_prompts = [], [], [], []
        columns: dict[str, list[Any]] = {k: [] for k in data_columns(self.rows, col)}
        columns["completion_ids"] = []
        for row, result in zip(self.rows, resp.results, strict=True):
            for s in result.samples:
                texts.append(s.text)
                finish.append(s.finish_reason)
                lengths.append(len(s.token_ids))
                flat_prompts.append(row[col])
                for k in columns:
                    columns[k].append(s.token_ids if k == "completion_ids" else row.get(k))
        scored = await self.scorer.score(flat_prompts, texts, columns)
        metrics = {
            f"eval/{k}": v
            for k, v in scored.metrics.items()
            if k.startswith("reward/")
            and not k.startswith("reward/total/")  # eval/reward/{mean,std} below
            and k.rsplit("/", 1)[-1] in ("mean", "std", "failures")
        }
        metrics.update(self._reward_metrics(scored.total))
        metrics["eval/completion/len_mean"] = sum(lengths) / len(lengths)
        metrics["eval/completion/truncated_frac"] = sum(f == "length" for f in finish) / len(finish)
        metrics["eval/weight_version"] = float(resp.weight_version)
        if self.e.save_samples:
            records = [
                {
                    "row": i // n,
                    "sample": i % n,
                    "prompt": prompt,
                    "completion": text,
                    "finish_reason": finish[i],
                    "reward": scored.total[i],
                    "rewards": {k: v[i] for k, v in scored.per_function.items()},
                }
                for i, (prompt, text) in enumerate(zip(flat_prompts, texts, strict=True))
            ]
            await asyncio.to_thread(self._write, step, records)
        return metrics

    def _write(self, step: int, records: list[dict[str, Any]]) -> None:
        self.samples_dir.mkdir(parents=True, exist_ok=True)
        with (self.samples_dir / f"step_{step}.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


def evaluate_model(cfg: LearnerConfig, model: str | None, out_dir: Path) -> dict[str, float]:
    """``python -m learner eval``: one evaluation, no training. Without ``rollout.servers`` an
    embedded rollout server serves ``model`` (default ``model.name_or_path``: a saved model or
    checkpoint directory such as ``RUN_DIR/final``, or a hub id); with them, the weights they
    serve are evaluated as they are. Writes ``OUT/metrics.json`` and ``OUT/step_0.jsonl``."""
    from transformers import AutoTokenizer

    assert cfg.eval is not None
    if cfg.rollout.external and model is not None:
        raise SetupError(
            f"--model {model}: the config's rollout.servers serve the weights they hold, which "
            "is what gets evaluated; drop --model, or drop rollout.servers to serve it here"
        )
    env_cls = None
    if cfg.environment is not None:
        from rewards.registry import load_environment

        env_cls = load_environment(cfg.environment.name)
    evaluator = Evaluator(cfg, out_dir, env_cls)
    setting = "--model" if model else "model.name_or_path ="
    model = resolve_model(cfg, model or cfg.model.name_or_path, out_dir / "model", setting=setting)
    tokenizer = AutoTokenizer.from_pretrained(model)
    chat = None
    if env_cls is not None:
        from rewards.chat import HFChatFormat

        chat = HFChatFormat(tokenizer, cfg.sampling.chat_template_kwargs)

    async def run(urls: list[str], key: str | None) -> dict[str, float]:
        async with make_client(cfg, tokenizer, urls, key) as client:
            await servers_ready(client, cfg.rollout)  # one line naming the setting
            if problems := evaluator.check_limits(await client.info(), urls):
                raise SetupError("; ".join(problems) + ": lower it, or raise the server's limit")
            return await evaluator.run(client, 0, tokenizer, chat)

    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.rollout.external:
        metrics = asyncio.run(run(cfg.rollout.listed(), cfg.rollout.key()))
    else:
        key = embedded_key()
        with embedded_for(cfg, model, out_dir / "rollout_server.log", api_key=key) as url:
            metrics = asyncio.run(run([url], key))
    (out_dir / "metrics.json").write_text(json.dumps({"model": model, **metrics}, indent=1))
    return metrics
