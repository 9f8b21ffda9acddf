"""A GRPO run's setup, before its rollout servers start: the launch checked, the prompts and
their rewards read, the model, optimizer and schedule built and prepared, a checkpoint loaded.

The order is the one whose errors come cheapest: the config against the launch, then the data,
environment and rewards (a bad column or reward name stops the run before any model loads),
then the model.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from transformers import AutoTokenizer

from learner.config import LearnerConfig
from learner.data.prompts import PromptFormat, PromptStream, load_rows
from learner.evaluate import Evaluator
from learner.loss.grpo import LossConfig
from learner.model.layout import plan_layout
from learner.model.setup import build_models
from learner.run.checkpoint import TrainerState, restore
from learner.run.perf import peak_tflops
from learner.run.runtime import (
    SetupError,
    check_model_options,
    machine_count,
    make_accelerator,
    optimizer_and_schedule,
    raise_on_every_rank,
    resolve_model,
    start_run,
    use_fused_adamw,
)
from learner.step.optimizer import NonFiniteGuard
from learner.step.rollouts import reward_runner
from learner.step.update import StepOptions
from rewards.chat import ChatFormat
from rewards.env import Environment
from rewards.scoring import RewardRunner

logger = logging.getLogger(__name__)


@dataclass
class Prompts:
    """The training prompts (or tasks) in their checkpointed order, and what scores them."""

    rows: list[dict[str, Any]]
    stream: PromptStream
    env_cls: type[Environment] | None  # [environment]: its episodes score themselves
    scorer: RewardRunner | None  # [data]: the [[rewards]]


@dataclass
class Run:
    """A GRPO run once set up: what its steps read, and the state they advance."""

    cfg: LearnerConfig
    accelerator: Accelerator
    run_dir: Path
    prompts: Prompts
    evaluator: Evaluator | None
    model_path: str  # what an embedded rollout server loads
    tokenizer: Any
    chat: ChatFormat | None  # with an [environment]
    policy: torch.nn.Module
    ref_policy: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    hf_config: Any  # the model's, for MFU
    state: TrainerState
    resumed: bool  # from a checkpoint
    loss_cfg: LossConfig
    opts: StepOptions
    peak: float | None  # TFLOP/s, for MFU
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0


def setup(cfg: LearnerConfig, *, resume: bool) -> Run:
    """Everything the run needs before its rollout servers start."""
    accelerator = make_accelerator()
    run_dir = Path(cfg.run.run_dir)
    start_run(
        accelerator,
        run_dir,
        cfg,
        cfg.run.seed,
        cfg.grpo.prompts_per_step,
        "grpo.prompts_per_step",
        resume=resume,
    )
    check_launch(accelerator, cfg)
    # The data, environment and rewards before any model loads: their errors come at once.
    prompts = load_prompts(cfg)
    evaluator = Evaluator(cfg, run_dir / "eval", prompts.env_cls) if cfg.eval is not None else None
    model_path = resolve_model(
        cfg, cfg.model.name_or_path, run_dir / "model", accelerator=accelerator
    )
    if cfg.sft is not None:  # warm start: SFT first, GRPO starts from its weights (learner/sft.py)
        from learner.sft import warm_start

        model_path = warm_start(cfg, model_path, run_dir, resume=resume)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    policy, ref_policy, optimizer, scheduler = build_training(cfg, accelerator, model_path)
    hf_config = accelerator.unwrap_model(policy).model.config
    chat = None
    if prompts.env_cls is not None:
        from rewards.chat import HFChatFormat

        chat = HFChatFormat(tokenizer, cfg.sampling.chat_template_kwargs)
    state = TrainerState()
    resumed = restore_run(cfg, accelerator, run_dir, policy, prompts.stream, state, resume=resume)
    loss_cfg, opts = LossConfig.of(cfg.grpo, cfg.sampling.max_tokens), StepOptions.of(cfg)
    if cfg.rollout.max_staleness and cfg.grpo.tis_cap is None:
        logger.warning(
            "rollout.max_staleness = %d with grpo.tis_cap = none: stale samples are trained on "
            "with no importance weight for the lag",
            cfg.rollout.max_staleness,
        )
    return Run(
        cfg=cfg,
        accelerator=accelerator,
        run_dir=run_dir,
        prompts=prompts,
        evaluator=evaluator,
        model_path=model_path,
        tokenizer=tokenizer,
        chat=chat,
        policy=policy,
        ref_policy=ref_policy,
        optimizer=optimizer,
        scheduler=scheduler,
        hf_config=hf_config,
        state=state,
        resumed=resumed,
        loss_cfg=loss_cfg,
        opts=opts,
        peak=peak_tflops(cfg.run.peak_tflops),
    )


def check_launch(accelerator: Accelerator, cfg: LearnerConfig) -> None:
    """Refuse what the config asks that this launch (DeepSpeed, its ZeRO stage) cannot run."""
    ds = accelerator.state.deepspeed_plugin
    if ds is not None and ds.zero_stage == 3 and cfg.grpo.beta > 0 and cfg.model.lora is None:
        raise ValueError(
            "grpo.beta > 0 under ZeRO-3 needs model.lora (the reference is the adapter-less "
            "model); a frozen full copy is not supported with ZeRO-3 — or set grpo.beta = 0"
        )
    check_model_options(accelerator, cfg.model)
    shared_embedded = not cfg.rollout.servers and not cfg.rollout.embedded.per_rank
    if shared_embedded and (machines := machine_count(accelerator)) > 1:
        raise_on_every_rank(
            SetupError(
                f"the learner runs on {machines} machines and rollout.servers is empty: an "
                "embedded rollout server listens on machine 0's loopback address, which the "
                "other machines' processes cannot reach. Start rollout servers (python -m "
                "rollout_server --host ADDRESS) and list them in rollout.servers, or give "
                "each process its own with rollout.embedded.per_rank (docs/multi-node.md)"
            )
        )


def load_prompts(cfg: LearnerConfig) -> Prompts:
    """The [environment]'s tasks, or the [data] rows and their [[rewards]]."""
    if cfg.environment is not None:
        from rewards.env import get_tasks
        from rewards.registry import load_environment

        env_cls = load_environment(cfg.environment.name)
        rows = asyncio.run(get_tasks(env_cls, cfg.environment.split))
        return Prompts(rows, PromptStream(rows, seed=cfg.run.seed, shuffle=True), env_cls, None)
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
    # [[rewards]] go with [data] (the config's validator)
    return Prompts(rows, stream, None, reward_runner(cfg, rows, d.prompt_column))


def build_training(
    cfg: LearnerConfig, accelerator: Accelerator, model_path: str
) -> tuple[torch.nn.Module, torch.nn.Module | None, torch.optim.Optimizer, Any]:
    """The policy, its KL reference, the optimizer and the schedule, prepared for the launch
    (its ZeRO stage and gradient checkpointing as ``plan_layout`` chooses)."""
    plan = plan_layout(accelerator, cfg, model_path)
    policy, ref_policy = build_models(
        cfg, model_path, gradient_checkpointing=plan.gradient_checkpointing, compile=plan.compile
    )
    o = cfg.optim
    optimizer, scheduler = optimizer_and_schedule(
        policy,
        o,
        lr=o.lr,
        schedule=o.schedule,
        warmup_steps=o.warmup_steps,
        steps=cfg.run.steps,
        fused=use_fused_adamw(accelerator, cfg.optim.fused),
    )
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    if ref_policy is not None:
        ref_policy = ref_policy.to(accelerator.device)
    return policy, ref_policy, optimizer, scheduler


def restore_run(
    cfg: LearnerConfig,
    accelerator: Accelerator,
    run_dir: Path,
    policy: torch.nn.Module,
    stream: PromptStream,
    state: TrainerState,
    *,
    resume: bool,
) -> bool:
    """Checkpoints hold the data stream and ``state`` too; with ``resume``, load the last one.
    Returns whether one was loaded."""
    ckpt = restore(accelerator, run_dir, policy, stream, state, resume=resume)
    if ckpt is None:
        return False
    logger.info("resumed from %s at step %d", ckpt, state.step)
    if state.step >= cfg.run.steps:
        logger.warning(
            "nothing to train: the checkpoint is at step %d and run.steps = %d "
            "(raise run.steps to train further)",
            state.step,
            cfg.run.steps,
        )
    return True
