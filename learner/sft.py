"""Supervised fine-tuning with the chunked NLL: ``python -m learner sft``, or a GRPO warm start.

The loss is the mean negative log-likelihood of the assistant / completion tokens of a step
(all ranks), computed from hidden states and the LM-head weight chunk by chunk
(``learner.loss.nll.chunked_nll``: Triton on CUDA, chunked PyTorch on CPU), so the
``[tokens, vocab]`` logits never exist and prompt tokens never reach the head. As for GRPO, the
head runs inside a module's forward (``NLLPolicy``), so DeepSpeed ZeRO-3 gathers its weight.

Warm start: a config with an ``[sft]`` section *and* GRPO data runs SFT into ``RUN_DIR/sft``
first (metrics, checkpoints, and ``RUN_DIR/sft/final``: the model with any LoRA merged, plus the
tokenizer); GRPO then builds its policy from ``RUN_DIR/sft/final`` (an embedded rollout server
starts from it; external servers receive it by a weight sync before the first generation). A
``RUN_DIR/sft/final`` already there is reused, so a resumed run never repeats the SFT. The GRPO
KL reference (``grpo.beta`` > 0) is then the SFT model, and LoRA adapters (``model.lora``) trained
by the SFT are merged into it, so GRPO's adapters start fresh on top.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from transformers import AutoTokenizer

from learner.config import LearnerConfig
from learner.data.prompts import PromptStream
from learner.data.sft import RowFormat, SFTExample, load_sft_rows, tokenize_row
from learner.loss.nll import chunked_nll
from learner.model.export import save_model
from learner.model.policy import PolicyLogprobs
from learner.model.setup import build_models
from learner.run.checkpoint import TrainerState, final_model_write, restore
from learner.run.metrics import MetricsLogger, Trackers
from learner.run.runtime import (
    StopOnSigterm,
    TrainingStopped,
    check_model_options,
    make_accelerator,
    optimizer_and_schedule,
    resolve_model,
    start_run,
    use_fused_adamw,
)
from learner.step.batch import Rollout, TrainBatch, collate, micro_batches
from learner.step.optimizer import (
    NonFiniteGuard,
    accumulating,
    backward,
    deepspeed_engine,
    optimizer_step,
)
from learner.step.update import reduce_metrics

logger = logging.getLogger(__name__)


class NLLPolicy(PolicyLogprobs):
    """The policy's decoder and a chunked-NLL head: ``forward`` returns the mean NLL of the
    targets at ``loss_mask`` (fp32). Subclassing ``PolicyLogprobs`` keeps its ZeRO-3 external
    registration of the head weight."""

    def __init__(
        self,
        model: nn.Module,
        *,
        chunk_size: int = 1024,
        fused: bool = False,
        fused_chunk_size: int | None = None,
    ):
        super().__init__(
            model, temperature=1.0, chunk_size=chunk_size, fused_chunk_size=fused_chunk_size
        )
        self.fused = fused  # sft.fused_loss: the NLL fused with the LM head (3 products)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T]
        loss_mask: torch.Tensor,  # [B, T-1]
    ) -> torch.Tensor:
        hidden = self.model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask
        ).last_hidden_state  # [B, T, H]
        return chunked_nll(
            hidden[:, :-1],  # position t predicts token t+1
            self.model.get_output_embeddings().weight,  # [V, H]
            input_ids[:, 1:],
            loss_mask,
            chunk_size=self.chunk_size,
            fused=self.fused,
            fused_chunk_size=self.fused_chunk_size,
        )


def example_rollout(example: SFTExample, pad_id: int) -> Rollout:
    """``example`` as a rollout whose 'prompt' is the first token: ``learner.step.batch.collate``
    aligns the mask to targets (position t predicts token t+1) exactly as for GRPO. A row shorter
    than two tokens becomes padding without targets (every rank keeps the same row count)."""
    ids, mask = example.input_ids, example.loss_mask
    if len(ids) < 2:
        return Rollout([pad_id], [pad_id], [0.0], [0])
    n = len(ids) - 1
    return Rollout(ids[:1], ids[1:], [0.0] * n, mask[1:])


def sft_steps(cfg: LearnerConfig, num_rows: int) -> int:
    s = cfg.sft
    assert s is not None
    if s.steps is not None:
        return s.steps
    return max(1, math.ceil((s.epochs or 1.0) * num_rows / s.batch_size))


def sft_step(
    accelerator: Accelerator,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[TrainBatch],
    max_grad_norm: float,
) -> dict[str, float]:
    """Forward/backward each micro-batch, one optimizer step. Each micro-batch's mean NLL is
    weighted by its share of the step's targets on all ranks (times the world size, which the
    gradient all-reduce divides back out): the step minimises the mean over every target."""
    dev = accelerator.device
    world = accelerator.num_processes
    counts = [b.num_loss_tokens for b in batches]
    total = float(accelerator.reduce(torch.tensor(float(sum(counts)), device=dev), "sum"))
    engine = deepspeed_engine(policy)
    nll_sum = torch.zeros((), dtype=torch.float64, device=dev)
    for i, b in enumerate(batches):
        b = b.to(dev)
        with accumulating(accelerator, policy, engine, last=i == len(batches) - 1):
            nll = policy(b.input_ids, b.attention_mask, b.loss_mask)
            loss = nll * (counts[i] * world / max(total, 1.0))
            backward(accelerator, engine, loss)
        nll_sum += nll.detach().double() * counts[i]
    grad_norm = optimizer_step(accelerator, policy, optimizer, engine, max_grad_norm)
    nll_total = float(accelerator.reduce(nll_sum, "sum"))
    return {
        "loss": nll_total / max(total, 1.0),
        "grad_norm": grad_norm,
        "tokens/trained": total,
        "tokens/padded": float(sum(b.input_ids.numel() for b in batches)),
    }


@dataclass
class SFTRun:
    """An SFT run once set up (``setup_sft``): what its steps read and advance."""

    cfg: LearnerConfig
    accelerator: Accelerator
    out: Path
    steps: int
    rows: list[dict[str, Any]]
    fmt: RowFormat
    tokenizer: Any
    policy: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    stream: PromptStream
    state: TrainerState
    guard: NonFiniteGuard = field(default_factory=NonFiniteGuard)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0


def train_sft(
    cfg: LearnerConfig,
    *,
    resume: bool = False,
    out_dir: str | Path | None = None,
    model_path: str | None = None,
) -> dict[str, float]:
    """SFT as configured into ``out_dir`` (default ``run.run_dir``): metrics, checkpoints and
    ``out_dir/final``. Returns the last step's metrics (main process)."""
    if cfg.sft is None:
        raise ValueError("the config has no [sft] section: add one (see learner/configs/)")
    run = setup_sft(cfg, resume=resume, out_dir=out_dir, model_path=model_path)
    # a warm start's SFT is RUN_DIR/sft: its own tracker run, named after the run's
    out = run.out.resolve()
    log = sft_metrics_log(run, out.name if out_dir is None else f"{out.parent.name}-sft")
    last: dict[str, float] = {}
    stopped = False
    with StopOnSigterm() as stop:  # SIGTERM: end the step, checkpoint it, stop
        try:
            while run.state.step < run.steps:
                last = sft_train_step(run)
                if log is not None:
                    log.log(run.state.step, last)
                if stop.checkpoint(run.accelerator, run.out, run.state.step, run.steps, cfg.run):
                    stopped = True
                    break
        finally:
            if log is not None:
                log.close()
    accelerator = run.accelerator
    save_final(run, stopped)
    accelerator.free_memory()
    del run  # the model and optimizer: GRPO may follow in this process
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return last if accelerator.is_main_process else {}


def setup_sft(
    cfg: LearnerConfig, *, resume: bool, out_dir: str | Path | None, model_path: str | None
) -> SFTRun:
    """The launch checked, the data read, the model and optimizer built and prepared, and a
    resumed run's checkpoint loaded."""
    s = cfg.sft
    assert s is not None
    accelerator = make_accelerator()
    out = Path(out_dir if out_dir is not None else cfg.run.run_dir)
    start_run(accelerator, out, cfg, cfg.run.seed, s.batch_size, "sft.batch_size", resume=resume)
    check_model_options(accelerator, cfg.model)
    if model_path is None:
        model_path = resolve_model(
            cfg, cfg.model.name_or_path, out / "model", accelerator=accelerator
        )
    rows, fmt = load_sft_rows(s)
    steps = sft_steps(cfg, len(rows))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    no_ref = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"beta": 0.0})})
    policy = NLLPolicy(
        build_models(no_ref, model_path)[0].model,
        chunk_size=cfg.grpo.logprob_chunk_size,
        fused=s.fused_loss,
        fused_chunk_size=cfg.grpo.fused_chunk_size,
    )
    optimizer, scheduler = optimizer_and_schedule(
        policy,
        cfg.optim,
        lr=s.lr,
        schedule=s.schedule,
        warmup_steps=s.warmup_steps,
        steps=steps,
        fused=use_fused_adamw(accelerator, cfg.optim.fused),
    )
    policy, optimizer, scheduler = accelerator.prepare(policy, optimizer, scheduler)
    stream = PromptStream(rows, seed=cfg.run.seed, shuffle=True)
    state = TrainerState()
    ckpt = restore(accelerator, out, policy, stream, state, resume=resume)
    if ckpt is not None:
        logger.info("SFT resumed from %s at step %d", ckpt, state.step)
    return SFTRun(cfg, accelerator, out, steps, rows, fmt, tokenizer, policy, optimizer,
                  scheduler, stream, state)  # fmt: skip


def sft_metrics_log(run: SFTRun, name: str) -> MetricsLogger | None:
    """The main process's metric sinks (``name``: the tracker run's); None on the others."""
    if not run.accelerator.is_main_process:
        return None
    cfg = run.cfg
    return MetricsLogger(
        run.out,
        total_steps=run.steps,
        start_step=run.state.step,
        tensorboard=cfg.run.tensorboard,
        progress_bar=cfg.run.progress_bar,
        desc="SFT",
        trackers=Trackers.of(cfg, name),
    )


def sft_batches(run: SFTRun) -> tuple[list[TrainBatch], float, float]:
    """This rank's share of the next ``sft.batch_size`` rows as micro-batches, and the
    fractions of its examples cut to ``sft.max_length`` and left with no target."""
    cfg, s, acc = run.cfg, run.cfg.sft, run.accelerator
    assert s is not None
    per_rank = s.batch_size // acc.num_processes
    rank = acc.process_index
    mine = run.stream.take(s.batch_size)[rank * per_rank : (rank + 1) * per_rank]
    examples = [
        tokenize_row(run.tokenizer, r, s, run.fmt, cfg.sampling.chat_template_kwargs) for r in mine
    ]
    truncated = sum(len(e.input_ids) > s.max_length for e in examples)
    examples = [e.truncate(s.max_length) for e in examples]
    empty = sum(e.num_targets == 0 for e in examples)
    rollouts = [example_rollout(e, run.pad_id) for e in examples]
    batches = [
        collate(mb, run.pad_id, cfg.grpo.pad_to_multiple_of)
        for mb in micro_batches(rollouts, s.micro_batch_size)
    ]
    return batches, truncated / len(examples), empty / len(examples)


def sft_train_step(run: SFTRun) -> dict[str, float]:
    """One SFT step on every rank; its metrics, averaged over the ranks."""
    acc = run.accelerator
    t0 = time.perf_counter()
    batches, truncated, empty = sft_batches(run)
    m = sft_step(acc, run.policy, run.optimizer, batches, run.cfg.optim.max_grad_norm)
    run.guard.check(run.state.step + 1, m)
    run.scheduler.step()
    run.state.step += 1
    seconds = time.perf_counter() - t0
    local = {
        **m,
        "lr": run.scheduler.get_last_lr()[0],
        "time/step": seconds,
        "throughput/train_tokens_per_s": m["tokens/trained"] / max(seconds, 1e-9),
        "data/truncated_fraction": truncated,
        "data/no_target_fraction": empty,
        "epoch": run.stream.position / len(run.rows),
    }
    return reduce_metrics(acc, local)


def save_final(run: SFTRun, stopped: bool) -> None:
    """``out/final``, or ``TrainingStopped`` when SIGTERM stopped the run before its end."""
    accelerator = run.accelerator
    if stopped:
        accelerator.wait_for_everyone()
        accelerator.end_training()
        raise TrainingStopped(run.state.step, run.steps, run.out)
    with final_model_write(run.out / "final"):
        save_model(accelerator, run.policy, run.tokenizer, run.out / "final")
    accelerator.wait_for_everyone()  # no rank leaves (and tears down) while another still saves


def warm_start(cfg: LearnerConfig, model_path: str, run_dir: Path, *, resume: bool) -> str:
    """SFT before GRPO: returns the path GRPO builds its policy from (``RUN_DIR/sft/final``)."""
    out = run_dir / "sft"
    final = out / "final"
    if (final / "config.json").exists():
        logger.info("SFT warm start: reusing %s (delete it to train the SFT again)", final)
        return str(final)
    logger.info("SFT warm start into %s", out)
    train_sft(cfg, resume=resume, out_dir=out, model_path=model_path)
    return str(final)
