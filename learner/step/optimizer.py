"""The optimizer step that GRPO (``learner.step.update``) and SFT (``learner.sft``) share.

A step accumulates the gradients of several micro-batches, then steps once. Under DeepSpeed the
engine owns both: it is told where the step ends (accelerate's backward would step it after
every micro-batch) and clips with its config's ``gradient_clipping``. Otherwise the gradient is
all-reduced only on the last micro-batch (``no_sync`` before it), clipped, and the step is
skipped when its norm is not finite: one nan or inf gradient would make every weight nan, and
the next sync would serve them.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

logger = logging.getLogger(__name__)


def deepspeed_engine(policy: torch.nn.Module) -> Any:
    """The DeepSpeed engine ``accelerator.prepare`` wrapped the policy in; None without one."""
    return policy if hasattr(policy, "set_gradient_accumulation_boundary") else None


@contextlib.contextmanager
def accumulating(
    accelerator: Accelerator,
    policy: torch.nn.Module,
    engine: Any,
    *,
    last: bool,
    saved: Callable[[], AbstractContextManager[Any]] | None = None,
) -> Iterator[None]:
    """The forward and backward of one micro-batch of a step (``last``: the step's last one):
    the engine told whether the step ends here, or DDP's all-reduce held until it does;
    ``saved``: the context the micro-batch's saved activations live in (offloading)."""
    if engine is not None:
        engine.set_gradient_accumulation_boundary(last)
        sync: AbstractContextManager[Any] = contextlib.nullcontext()
    else:
        sync = accelerator.no_sync(policy) if not last else contextlib.nullcontext()
    activations = saved() if saved is not None else contextlib.nullcontext()
    with sync, activations:
        yield


def backward(accelerator: Accelerator, engine: Any, loss: torch.Tensor) -> None:
    if engine is not None:
        engine.backward(loss)  # gradient_accumulation_steps = 1: no extra scaling
    else:
        accelerator.backward(loss)


def optimizer_step(
    accelerator: Accelerator,
    policy: torch.nn.Module,
    optimizer: Any,
    engine: Any,
    max_grad_norm: float,
) -> float:
    """Step on the accumulated gradients; returns their norm."""
    if engine is not None:  # clips with the DeepSpeed config's gradient_clipping
        engine.step()
        return float(engine.get_global_grad_norm() or 0.0)
    return step_if_finite(accelerator, policy, optimizer, max_grad_norm)


class NonFiniteError(RuntimeError):
    """Steps in a row had a non-finite gradient: the run cannot make progress."""


def step_if_finite(
    accelerator: Accelerator, policy: torch.nn.Module, optimizer: Any, max_grad_norm: float
) -> float:
    """Clip, then step only if the gradient norm is finite: one nan or inf gradient would
    otherwise make every weight nan, and the next sync would serve them. Returns the norm
    (nan or inf for a skipped step; ``NonFiniteGuard`` stops a run that keeps skipping)."""
    grad_norm = float(accelerator.clip_grad_norm_(policy.parameters(), max_grad_norm))
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@dataclass
class NonFiniteGuard:
    """Warns for a step skipped for a non-finite gradient, stops after ``limit`` in a row."""

    limit: int = 3
    in_a_row: int = 0

    def check(self, step: int, metrics: dict[str, float]) -> None:
        if math.isfinite(metrics["grad_norm"]):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        what = f"step {step}: gradient norm {metrics['grad_norm']} (loss {metrics['loss']})"
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"{what}: {self.in_a_row} steps in a row with a non-finite gradient (the "
                "weights are those of the last finite step). Lower optim.lr, check the data and "
                "rewards, or resume from a checkpoint"
            )
        logger.warning("%s: the optimizer step was skipped, the weights are unchanged", what)
