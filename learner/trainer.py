"""The GRPO loop: setup, train, cleanup.

One step: this rank's prompts -> ``/generate`` (G samples each) -> rewards -> group-relative
advantages -> chunked GRPO loss over micro-batches -> optimizer step -> weight sync (main process)
-> next step. Runs as ``python -m learner`` (one process) or under ``accelerate launch`` (DDP on
CPU/GPU, DeepSpeed ZeRO-2/3 on GPU); each rank generates and trains on its own prompts.

Overlap (``rollout.max_staleness`` = s > 0): up to s generations run ahead on an event-loop thread
while the main thread trains, so the rollout servers never idle; a batch is trained on only if the
weights that produced it are at most s versions old (``learner.step.inflight``), and the
truncated importance weight corrects for the lag.

The setup (``learner.trainer_setup``) builds a ``Run``; ``train_step`` is one step of it.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator

from learner.config import LearnerConfig
from learner.model.export import save_model
from learner.run.checkpoint import final_model_write
from learner.run.drift import DriftWatch
from learner.run.idle import IdleWatch
from learner.run.metrics import MetricsLogger, Trackers
from learner.run.perf import profiled, train_flops
from learner.run.runtime import SetupError, StopOnSigterm, TrainingStopped
from learner.servers.client import make_client
from learner.servers.connection import ServerConnection
from learner.servers.pool import (
    EventLoopThread,
    check_server_limits,
    main_decides,
    servers,
    servers_ready,
    updated_by_another,
)
from learner.step.dynamic_sampling import fill_step
from learner.step.inflight import Arrived, InFlightRollouts, RankRollouts
from learner.step.rollouts import StepRollouts
from learner.step.update import (
    StepBatches,
    build_micro_batches,
    max_over_ranks,
    reduce_metrics,
    train_on,
    version_lag_metrics,
)
from learner.sync import make_transport
from learner.trainer_setup import Run, setup

logger = logging.getLogger(__name__)


def train(cfg: LearnerConfig, *, resume: bool = False) -> dict[str, float]:
    """Run GRPO as configured; returns the last step's metrics (main process)."""
    run = setup(cfg, resume=resume)
    loop = EventLoopThread()
    metrics_log = open_metrics_log(run)
    inflight: InFlightRollouts | None = None
    last: dict[str, float] = {}
    drift = DriftWatch()  # says so when the servers stop serving the learner's policy
    idle = IdleWatch(cfg.grpo.prompts_per_step // run.accelerator.num_processes)
    stopped = False
    try:
        with (
            StopOnSigterm(at_once=True) as stop,
            servers(cfg, run.model_path, run.run_dir, run.accelerator) as (urls, key),
        ):
            conn = connect(run, loop, urls, key)
            if run.evaluator is not None and run.state.step == 0 and run.evaluator.due(0):
                ev = evaluate(run, conn, 0)
                if metrics_log is not None:
                    metrics_log.log(0, ev)
            inflight = in_flight(run, conn)
            stop.steps_begin()
            while run.state.step < cfg.run.steps:
                metrics = train_step(run, conn, inflight)
                if metrics is None:  # a restarted server: the step's prompts go again
                    continue
                last, step = metrics, run.state.step
                for warning in (drift.check(step, metrics), idle.check(step, metrics)):
                    if warning is not None and run.accelerator.is_main_process:
                        logger.warning(warning)
                if run.evaluator is not None and run.evaluator.due(run.state.step):
                    last.update(evaluate(run, conn, run.state.step))  # the weights just synced
                if metrics_log is not None:
                    metrics_log.log(run.state.step, last)
                if stop.checkpoint(
                    run.accelerator, run.run_dir, run.state.step, cfg.run.steps, cfg.run
                ):
                    stopped = True
                    break
            conn.close()
    finally:
        if inflight is not None:
            inflight.cancel()
        loop.close()
        if metrics_log is not None:
            metrics_log.close()
    return finish(run, last, stopped=stopped)


def train_step(
    run: Run, conn: ServerConnection, inflight: InFlightRollouts
) -> dict[str, float] | None:
    """One step on every rank: wait for its rollouts (topped up by dynamic sampling), train on
    them while the servers sleep or prepare the sync, push the new weights. Returns the step's
    metrics (averaged over the ranks), or None when a restarted server made its prompts go
    again (the step was not trained)."""
    cfg = run.cfg
    t_step = time.perf_counter()
    arrived = inflight.next()
    if arrived is None:
        return None
    step_rollouts, t_refill = arrived.rollouts, 0.0
    if cfg.grpo.dynamic_sampling:  # top the batch up with informative groups
        t0 = time.perf_counter()
        most = functools.partial(max_over_ranks, run.accelerator)
        per_rank = cfg.grpo.prompts_per_step // run.accelerator.num_processes
        step_rollouts = fill_step(cfg, step_rollouts, per_rank, inflight.refill_round, most=most)
        t_refill = time.perf_counter() - t0
    prepared = conn.before_training(inflight.pending)
    t0 = time.perf_counter()
    micro, train_metrics = train_on_rollouts(run, step_rollouts)
    t_train = time.perf_counter() - t0
    t0 = time.perf_counter()
    conn.after_training(prepared)
    t_sync = time.perf_counter() - t0
    run.state.step += 1
    times = StepTimes(t_step, arrived.wait_s, t_refill, t_train, t_sync)
    local = step_metrics(run, arrived, step_rollouts, micro, train_metrics, times)
    return reduce_metrics(run.accelerator, {**local, **conn.metrics()})


def train_on_rollouts(
    run: Run, step_rollouts: StepRollouts
) -> tuple[StepBatches, dict[str, float]]:
    """The step's micro-batches and the optimizer step on them (under the profiler for
    ``run.profile_steps``); the schedule moves on."""
    cfg, acc, step = run.cfg, run.accelerator, run.state.step + 1
    lags = version_lag_metrics(  # the learner's version before this step's update
        acc, step_rollouts.rollouts, run.state.weight_version, cfg.rollout.max_staleness
    )
    micro = build_micro_batches(step_rollouts.rollouts, run.opts, run.loss_cfg, run.pad_id)
    profile = acc.is_main_process and step in cfg.run.profile_steps
    with profiled(
        run.run_dir / "profile" if profile else None, f"step_{step}", trace=cfg.run.profile_trace
    ):
        train_metrics = train_on(
            acc, run.policy, run.ref_policy, run.optimizer, run.loss_cfg, micro, run.opts
        )
    run.guard.check(step, train_metrics)
    run.scheduler.step()
    return micro, {**train_metrics, **lags}


@dataclass
class StepTimes:
    """Where a step's time went (seconds; ``start``: ``perf_counter`` at its start)."""

    start: float
    wait: float  # for its rollouts
    refill: float  # dynamic sampling's further rounds
    train: float
    sync: float


def step_metrics(
    run: Run,
    arrived: Arrived,
    step_rollouts: StepRollouts,
    micro: StepBatches,
    train_metrics: dict[str, float],
    times: StepTimes,
) -> dict[str, float]:
    """This rank's metrics of the step just trained."""
    cfg, stream = run.cfg, run.prompts.stream
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in micro.trained]
    flops = train_flops(run.hf_config, lengths, cfg.grpo.num_iterations)  # this rank's
    local = {
        **step_rollouts.metrics,
        **train_metrics,
        "reward/mean": float(step_rollouts.rewards.mean()),
        "reward/std": float(step_rollouts.rewards.std()),
        "staleness": float(arrived.staleness),
        "time/wait_generate": times.wait,
        **({"time/refill": times.refill} if cfg.grpo.dynamic_sampling else {}),
        "time/train": times.train,
        "throughput/train_tokens_per_s": train_metrics["tokens/trained"] / max(times.train, 1e-9),
        "time/sync": times.sync,
        "time/step": time.perf_counter() - times.start,
        "lr": run.scheduler.get_last_lr()[0],
        "weight_version": float(run.state.weight_version),
        "data/position": float(stream.position - stream.pending),
        "data/fingerprint": float(arrived.fingerprint),
    }
    if run.peak:
        local["mfu"] = flops / max(times.train, 1e-9) / (run.peak * 1e12)
    return local


def open_metrics_log(run: Run) -> MetricsLogger | None:
    """The main process's metric sinks; None on the other ranks."""
    if not run.accelerator.is_main_process:
        return None
    cfg = run.cfg
    return MetricsLogger(
        run.run_dir,
        total_steps=cfg.run.steps,
        start_step=run.state.step,
        tensorboard=cfg.run.tensorboard,
        progress_bar=cfg.run.progress_bar,
        trackers=Trackers.of(cfg, run.run_dir.resolve().name),
    )


def connect(
    run: Run, loop: EventLoopThread, urls: list[str], api_key: str | None
) -> ServerConnection:
    """The servers ready, checked against what the config asks of them, the weight sync
    connected, and the run's weights on them where they serve others."""
    cfg, accelerator = run.cfg, run.accelerator
    client = make_client(cfg, run.tokenizer, urls, api_key, run.hf_config.vocab_size)
    loop.run(servers_ready(client, cfg.rollout))
    infos = loop.run(client.info())
    external = urls if cfg.rollout.external else []
    check_server_limits(cfg.sampling, infos, external)
    if run.evaluator is not None and (problems := run.evaluator.check_limits(infos, external)):
        raise SetupError("; ".join(problems) + ": lower it, or raise the server's limit")
    syncer = make_transport(cfg.rollout, client, device=accelerator.device)
    if accelerator.is_main_process:  # before the first generation: see connect()
        loop.run(syncer.connect())
    conn = ServerConnection(cfg.rollout, accelerator, loop, client, syncer, run.policy, run.state)
    # The servers must serve the checkpoint's (or the SFT's) weights, not the base model's
    # (an embedded server already starts from the SFT's).
    resync = run.resumed or (cfg.sft is not None and cfg.rollout.external)
    if cfg.rollout.external and not resync:  # a server another learner already updated
        resync = main_decides(accelerator, functools.partial(updated_by_another, infos))
    if resync:
        conn.resync()
    return conn


def in_flight(run: Run, conn: ServerConnection) -> InFlightRollouts:
    """The run's queue of steps generating ahead, on this rank's share of the prompts."""
    acc, p = run.accelerator, run.prompts
    rank_rollouts = RankRollouts(
        run.cfg,
        conn.client,
        rank=acc.process_index,
        per_rank=run.cfg.grpo.prompts_per_step // acc.num_processes,
        tokenizer=run.tokenizer,
        scorer=p.scorer,
        env_cls=p.env_cls,
        chat=run.chat,
    )
    return InFlightRollouts(run.cfg, acc, conn, rank_rollouts, p.stream, run.state)


def evaluate(run: Run, conn: ServerConnection, step: int) -> dict[str, float]:
    """Evaluate on the main process (the servers serve this step's weights); the other ranks
    wait and get no metrics."""
    assert run.evaluator is not None
    out: dict[str, float] = {}
    if run.accelerator.is_main_process:
        out = conn.loop.run(run.evaluator.run(conn.client, step, run.tokenizer, run.chat))
    run.accelerator.wait_for_everyone()
    return out


def finish(run: Run, last: dict[str, float], *, stopped: bool) -> dict[str, float]:
    """After the loop: ``TrainingStopped`` when SIGTERM stopped it, else the ranks' weights
    compared and the final model saved. Returns ``last`` on the main process."""
    accelerator, cfg = run.accelerator, run.cfg
    if stopped:
        accelerator.wait_for_everyone()
        accelerator.end_training()
        raise TrainingStopped(run.state.step, cfg.run.steps, run.run_dir)
    check_ranks_agree(accelerator, run.policy, run.run_dir)
    if cfg.run.save_final:  # every rank: under ZeRO-3 the parameters are gathered
        with final_model_write(run.run_dir / "final"):
            save_model(accelerator, run.policy, run.tokenizer, run.run_dir / "final")
    # Every rank must reach the process-group teardown together: a rank that tears down while
    # another is still saving leaves that one hanging in gloo's destructor at exit.
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return last if accelerator.is_main_process else {}


def check_ranks_agree(accelerator: Accelerator, policy: torch.nn.Module, run_dir: Path) -> None:
    """Every rank must end with identical weights; write the checksums and fail loudly if not.
    The checksum weighs every element by its position and tensor name, so weights that moved
    between tensors or within one do not pass for the same."""
    from learner.sync.zero3 import iter_gathered_params
    from rollout_server.weight_digest import name_weight, positional_sum

    with torch.no_grad():  # ZeRO-3: every rank gathers the same full tensors, bucket by bucket
        params = iter_gathered_params(accelerator.unwrap_model(policy))
        local = sum(float(positional_sum(p.reshape(-1))) * name_weight(n) for n, p in params)
    sums = accelerator.gather(torch.tensor([local], dtype=torch.float64, device=accelerator.device))
    values = sums.tolist()
    if accelerator.is_main_process:
        (run_dir / "rank_checksums.json").write_text(json.dumps(values))
    if max(values) != min(values):
        raise RuntimeError(f"ranks ended with different weights (checksums {values})")
