"""The GRPO loop: setup, train, cleanup.

One step: this rank's prompts -> ``/generate`` (G samples each) -> rewards -> group-relative
advantages -> chunked GRPO loss over micro-batches -> optimizer step -> weight sync (main process)
-> next step. Runs as ``python -m learner`` (one process) or under ``accelerate launch`` (DDP on
CPU/GPU, DeepSpeed ZeRO-2/3 on GPU); each rank generates and trains on its own prompts.

Overlap (``rollout.max_staleness`` = s > 0): up to s generations run ahead on an event-loop thread
while the main thread trains, so the rollout servers never idle; a batch is trained on only if the
weights that produced it are at most s versions old, and the truncated importance weight corrects
for the lag.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import time
import zlib
from collections import deque
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from transformers import AutoTokenizer

from learner.config import LearnerConfig
from learner.data.prompts import PromptFormat, PromptStream, load_rows
from learner.evaluate import Evaluator
from learner.loss.grpo import LossConfig
from learner.model.export import save_model
from learner.model.setup import build_models
from learner.run.checkpoint import TrainerState, restore
from learner.run.metrics import MetricsLogger, Trackers
from learner.run.perf import peak_tflops, profiled, train_flops
from learner.run.runtime import (
    SetupError,
    StopOnSigterm,
    TrainingStopped,
    check_model_options,
    make_accelerator,
    optimizer_and_schedule,
    resolve_model,
    start_run,
    use_fused_adamw,
)
from learner.servers.pool import (
    EventLoopThread,
    check_server_limits,
    main_decides,
    may_prepare,
    restarted,
    servers,
    sync_weights,
    updated_by_another,
)
from learner.step.dynamic_sampling import fill_step
from learner.step.rollouts import (
    StepRollouts,
    check_episodes,
    collect,
    collect_episodes,
    request_seed,
    reward_runner,
)
from learner.step.update import (
    NonFiniteGuard,
    StepOptions,
    build_micro_batches,
    max_over_ranks,
    reduce_metrics,
    train_on,
)
from learner.sync import make_transport
from rollout_server.client import RolloutClient

logger = logging.getLogger(__name__)


class StalenessError(RuntimeError):
    pass


def _loss_config(cfg: LearnerConfig) -> LossConfig:
    g = cfg.grpo
    return LossConfig(
        loss_type=g.loss_type,
        eps_low=g.eps_low,
        eps_high=g.eps_high,
        beta=g.beta,
        tis_cap=g.tis_cap,
        max_completion_length=cfg.sampling.max_tokens,
        entropy_coef=g.entropy_coef,
        importance_sampling_level=g.importance_sampling_level,
    )


def _step_options(cfg: LearnerConfig) -> StepOptions:
    g = cfg.grpo
    return StepOptions(
        micro_batch_size=g.micro_batch_size,
        num_iterations=g.num_iterations,
        max_grad_norm=cfg.optim.max_grad_norm,
        packing=g.packing,
        fused_loss=g.fused_loss,
        max_tokens_per_micro_batch=g.max_tokens_per_micro_batch,
        pad_to_multiple_of=g.pad_to_multiple_of,
        activation_offloading=cfg.model.activation_offloading,
        need_reference=g.beta > 0,
        reference_is_adapterless=cfg.model.lora is not None,
        skip_zero_advantage=g.skip_zero_advantage,
        count_zero_advantage=g.count_zero_advantage,
    )


def train(cfg: LearnerConfig, *, resume: bool = False) -> dict[str, float]:
    """Run GRPO as configured; returns the last step's metrics (main process)."""
    accelerator = make_accelerator()
    run_dir = Path(cfg.run.run_dir)
    world = accelerator.num_processes
    start_run(
        accelerator,
        run_dir,
        cfg,
        cfg.run.seed,
        cfg.grpo.prompts_per_step,
        "grpo.prompts_per_step",
        resume=resume,
    )
    ds = accelerator.state.deepspeed_plugin
    if ds is not None and ds.zero_stage == 3 and cfg.grpo.beta > 0 and cfg.model.lora is None:
        raise ValueError(
            "grpo.beta > 0 under ZeRO-3 needs model.lora (the reference is the adapter-less "
            "model); a frozen full copy is not supported with ZeRO-3 — or set grpo.beta = 0"
        )
    check_model_options(accelerator, cfg.model)
    # The data, environment and rewards before any model loads: their errors come at once.
    env_cls = None
    if cfg.environment is not None:
        from rewards.env import get_tasks
        from rewards.registry import load_environment

        env_cls = load_environment(cfg.environment.name)
        rows = asyncio.run(get_tasks(env_cls, cfg.environment.split))
        stream = PromptStream(rows, seed=cfg.run.seed, shuffle=True)
    else:
        assert cfg.data is not None  # the config validator guarantees data or environment
        d = cfg.data
        rows = load_rows(
            d.path,
            d.prompt_column,
            split=d.split,
            subset=d.subset,
            prompt_format=PromptFormat.of(d),
        )
        stream = PromptStream(rows, seed=d.seed, shuffle=d.shuffle)
    scorer = None
    if cfg.data is not None:  # [[rewards]] go with [data] (the config's validator)
        scorer = reward_runner(cfg, rows, cfg.data.prompt_column)
    evaluator = Evaluator(cfg, run_dir / "eval", env_cls) if cfg.eval is not None else None
    model_path = resolve_model(
        cfg, cfg.model.name_or_path, run_dir / "model", accelerator=accelerator
    )
    if cfg.sft is not None:  # warm start: SFT first, GRPO starts from its weights (learner/sft.py)
        from learner.sft import warm_start

        model_path = warm_start(cfg, model_path, run_dir, resume=resume)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    policy, ref_policy = build_models(cfg, model_path)
    o = cfg.optim
    optimizer, scheduler = optimizer_and_schedule(
        policy,
        o,
        lr=o.lr,
        schedule=o.schedule,
        warmup_steps=o.warmup_steps,
        steps=cfg.run.steps,
        fused=use_fused_adamw(accelerator),
    )
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    if ref_policy is not None:
        ref_policy = ref_policy.to(accelerator.device)
    hf_config = accelerator.unwrap_model(policy).model.config
    chat = None
    if env_cls is not None:
        from rewards.chat import HFChatFormat

        chat = HFChatFormat(tokenizer, cfg.sampling.chat_template_kwargs)
    state = TrainerState()
    ckpt = restore(accelerator, run_dir, policy, stream, state, resume=resume)
    if ckpt is not None:
        logger.info("resumed from %s at step %d", ckpt, state.step)
        if state.step >= cfg.run.steps:
            logger.warning(
                "nothing to train: the checkpoint is at step %d and run.steps = %d "
                "(raise run.steps to train further)",
                state.step,
                cfg.run.steps,
            )

    loss_cfg, opts = _loss_config(cfg), _step_options(cfg)
    if cfg.rollout.max_staleness and cfg.grpo.tis_cap is None:
        logger.warning(
            "rollout.max_staleness = %d with grpo.tis_cap = none: stale samples are trained on "
            "with no importance weight for the lag",
            cfg.rollout.max_staleness,
        )
    peak = peak_tflops(cfg.run.peak_tflops)
    loop = EventLoopThread()
    metrics_log = (
        MetricsLogger(
            run_dir,
            total_steps=cfg.run.steps,
            start_step=state.step,
            tensorboard=cfg.run.tensorboard,
            progress_bar=cfg.run.progress_bar,
            trackers=Trackers.of(cfg, run_dir.resolve().name),
        )
        if accelerator.is_main_process
        else None
    )
    last: dict[str, float] = {}
    warned_ahead = False
    guard = NonFiniteGuard()
    # each step's rollouts in flight, the fingerprint of its prompts, and the prompts
    pending: deque[tuple[concurrent.futures.Future[StepRollouts], int, list[dict[str, Any]]]]
    pending = deque()
    stopped = False
    try:
        with (
            StopOnSigterm(at_once=True) as stop,
            servers(cfg, model_path, run_dir, accelerator) as urls,
        ):
            client = RolloutClient(
                urls,
                api_key=cfg.rollout.api_key or os.environ.get("ROLLOUT_API_KEY"),
                timeout_s=cfg.rollout.timeout_s,
                max_retries=cfg.rollout.max_retries,
            )
            loop.run(client.wait_ready(cfg.rollout.ready_timeout_s))
            infos = loop.run(client.info())
            check_server_limits(cfg, infos, cfg.rollout.servers)
            if evaluator is not None and (
                problems := evaluator.check_limits(infos, cfg.rollout.servers)
            ):
                raise SetupError("; ".join(problems) + ": lower it, or raise the server's limit")
            syncer = make_transport(cfg.rollout, client, device=accelerator.device)
            if accelerator.is_main_process:  # before the first generation: see connect()
                loop.run(syncer.connect())
            # The servers must serve the checkpoint's (or the SFT's) weights, not the base model's
            # (an embedded server already starts from the SFT's).
            resync = ckpt is not None or (cfg.sft is not None and bool(cfg.rollout.servers))
            if cfg.rollout.servers and not resync:  # a server another learner already updated
                resync = main_decides(accelerator, lambda: updated_by_another(infos))
            if resync:
                sync_weights(accelerator, loop, syncer, policy, state, resync=True)
            if evaluator is not None and state.step == 0 and evaluator.due(0):
                ev = _evaluate(accelerator, loop, evaluator, client, 0, tokenizer, chat)
                if metrics_log is not None:
                    metrics_log.log(0, ev)
            per_rank = cfg.grpo.prompts_per_step // world
            rank = accelerator.process_index

            def rollouts_of(rows: list[dict[str, Any]], kind: str, step: int) -> Coroutine:
                """Generate and score this rank's share of ``rows`` for ``step``."""
                mine = rows[rank * per_rank : (rank + 1) * per_rank]
                seed = request_seed(cfg, kind, step, rank)
                if env_cls is not None:
                    return collect_episodes(cfg, client, env_cls, chat, mine, seed)
                assert scorer is not None
                return collect(cfg, client, scorer, mine, tokenizer=tokenizer, seed=seed)

            def launch(rows: list[dict[str, Any]] | None = None) -> None:
                if rows is None:
                    rows = stream.take(cfg.grpo.prompts_per_step)
                # the step these rows train, also when a restarted server makes them go again
                coro = rollouts_of(rows, "train", state.step + len(pending) + 1)
                pending.append((loop.submit(coro), rows_fingerprint(rows), rows))
                stream.pending = len(pending) * cfg.grpo.prompts_per_step

            def refill_round(k: int, short: bool) -> StepRollouts | None:
                rows = stream.take_refill(cfg.grpo.prompts_per_step)  # on every rank
                return loop.run(rollouts_of(rows, f"refill{k}", state.step + 1)) if short else None

            stop.steps_begin()
            while state.step < cfg.run.steps:
                t_step = time.perf_counter()
                ahead = 1 + cfg.rollout.max_staleness
                while len(pending) < ahead and state.step + len(pending) < cfg.run.steps:
                    launch()
                future, fingerprint, rows = pending.popleft()
                t0 = time.perf_counter()
                step_rollouts = future.result()
                t_wait = time.perf_counter() - t0
                if env_cls is not None:  # all ranks stop, or none: gathered
                    check_episodes(cfg, step_rollouts, gather_object if world > 1 else None)
                stream.pending = len(pending) * cfg.grpo.prompts_per_step
                staleness = state.weight_version - int(step_rollouts.metrics["weight_version/min"])
                if staleness < 0 and not warned_ahead:
                    warned_ahead = True
                    logger.warning(
                        "samples from weight version %d, newer than this learner's %d: is another "
                        "learner updating these rollout servers? Give each learner its own.",
                        int(step_rollouts.metrics["weight_version/min"]),
                        state.weight_version,
                    )
                staleness = max_over_ranks(accelerator, staleness)  # one branch on every rank
                if staleness > cfg.rollout.max_staleness:
                    if not main_decides(
                        accelerator,
                        lambda: restarted(loop.run(client.info()), state.weight_version),
                    ):
                        raise StalenessError(
                            f"samples {staleness} versions old, bound {cfg.rollout.max_staleness}"
                        )
                    # A server restarted and serves its base weights: sync this learner's again
                    # and generate the same prompts again (the data order does not change).
                    redo = [rows, *(r for _, _, r in pending)]
                    for f, _, _ in pending:
                        f.cancel()
                    pending.clear()
                    sync_weights(accelerator, loop, syncer, policy, state, resync=True)
                    for r in redo:
                        launch(r)
                    continue
                t_refill = 0.0
                if cfg.grpo.dynamic_sampling:  # top the batch up with informative groups
                    t0 = time.perf_counter()
                    step_rollouts = fill_step(
                        cfg,
                        step_rollouts,
                        per_rank,
                        refill_round,
                        most=lambda n: max_over_ranks(accelerator, n),
                    )
                    t_refill = time.perf_counter() - t0
                sleep_level = cfg.rollout.sleep_while_training
                if sleep_level and accelerator.is_main_process:
                    loop.run(client.sleep(sleep_level))  # colocated: give the GPU to training
                prepared = None
                if may_prepare(cfg, accelerator, pending):  # the servers are idle: queue the
                    hf_model = accelerator.unwrap_model(policy).model  # sync's receives now
                    prepared = loop.submit(syncer.prepare(hf_model))
                t0 = time.perf_counter()
                micro = build_micro_batches(step_rollouts.rollouts, opts, loss_cfg, pad_id)
                profile = accelerator.is_main_process and state.step + 1 in cfg.run.profile_steps
                with profiled(
                    run_dir / "profile" if profile else None,
                    f"step_{state.step + 1}",
                    trace=cfg.run.profile_trace,
                ):
                    train_metrics = train_on(
                        accelerator, policy, ref_policy, optimizer, loss_cfg, micro, opts
                    )
                guard.check(state.step + 1, train_metrics)
                scheduler.step()
                t_train = time.perf_counter() - t0
                t0 = time.perf_counter()
                if sleep_level and accelerator.is_main_process:
                    loop.run(client.wake_up(["weights"]))  # weights first, KV cache after the load
                if prepared is not None:
                    try:
                        prepared.result()
                    except Exception:  # the push announces instead
                        logger.warning("preparing the weight sync failed", exc_info=True)
                sync_weights(accelerator, loop, syncer, policy, state)
                if sleep_level and accelerator.is_main_process:
                    loop.run(client.wake_up(["kv_cache"]))
                t_sync = time.perf_counter() - t0
                state.step += 1
                lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in micro.trained]
                flops = train_flops(hf_config, lengths, cfg.grpo.num_iterations)  # this rank's
                local = {
                    **step_rollouts.metrics,
                    **train_metrics,
                    "reward/mean": float(step_rollouts.rewards.mean()),
                    "reward/std": float(step_rollouts.rewards.std()),
                    "staleness": float(staleness),
                    "time/wait_generate": t_wait,
                    **({"time/refill": t_refill} if cfg.grpo.dynamic_sampling else {}),
                    "time/train": t_train,
                    "throughput/train_tokens_per_s": train_metrics["tokens/trained"]
                    / max(t_train, 1e-9),
                    "time/sync": t_sync,
                    "time/step": time.perf_counter() - t_step,
                    "lr": scheduler.get_last_lr()[0],
                    "weight_version": float(state.weight_version),
                    "data/position": float(stream.position - stream.pending),
                    "data/fingerprint": float(fingerprint),
                }
                if peak:
                    local["mfu"] = flops / max(t_train, 1e-9) / (peak * 1e12)
                last = reduce_metrics(accelerator, local)
                if evaluator is not None and evaluator.due(state.step):  # the weights just synced
                    last.update(
                        _evaluate(accelerator, loop, evaluator, client, state.step, tokenizer, chat)
                    )
                if metrics_log is not None:
                    metrics_log.log(state.step, last)
                if stop.checkpoint(accelerator, run_dir, state.step, cfg.run.steps, cfg.run):
                    stopped = True
                    break
            syncer.close()
            loop.run(client.aclose())
    finally:
        for future, _, _ in pending:
            future.cancel()
        loop.close()
        if metrics_log is not None:
            metrics_log.close()
    if stopped:
        accelerator.wait_for_everyone()
        accelerator.end_training()
        raise TrainingStopped(state.step, cfg.run.steps, run_dir)
    _check_ranks_agree(accelerator, policy, run_dir)
    if cfg.run.save_final:  # every rank: under ZeRO-3 the parameters are gathered
        save_model(accelerator, policy, tokenizer, run_dir / "final")
    # Every rank must reach the process-group teardown together: a rank that tears down while
    # another is still saving leaves that one hanging in gloo's destructor at exit.
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return last if accelerator.is_main_process else {}


def _evaluate(
    accelerator: Accelerator,
    loop: EventLoopThread,
    evaluator: Evaluator,
    client: RolloutClient,
    step: int,
    tokenizer: Any,
    chat: Any,
) -> dict[str, float]:
    """Evaluate on the main process (the servers serve this step's weights); the other ranks
    wait and get no metrics."""
    main = accelerator.is_main_process
    out = loop.run(evaluator.run(client, step, tokenizer, chat)) if main else {}
    accelerator.wait_for_everyone()
    return out


def rows_fingerprint(rows: list[dict[str, Any]]) -> int:
    """A stable 31-bit hash of a step's prompts, logged so runs can prove the same data order."""
    return zlib.crc32(json.dumps(rows, sort_keys=True).encode()) & 0x7FFFFFFF


def _check_ranks_agree(accelerator: Accelerator, policy: torch.nn.Module, run_dir: Path) -> None:
    """Every rank must end with identical weights; write the checksums and fail loudly if not."""
    from learner.sync.zero3 import iter_gathered_params

    with torch.no_grad():  # ZeRO-3: every rank gathers the same full tensors, bucket by bucket
        params = iter_gathered_params(accelerator.unwrap_model(policy))
        local = sum(float(p.double().abs().sum()) for _, p in params)
    sums = accelerator.gather(torch.tensor([local], dtype=torch.float64, device=accelerator.device))
    values = sums.tolist()
    if accelerator.is_main_process:
        (run_dir / "rank_checksums.json").write_text(json.dumps(values))
    if max(values) != min(values):
        raise RuntimeError(f"ranks ended with different weights (checksums {values})")
