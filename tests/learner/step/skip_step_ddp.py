"""One train step under `accelerate launch --multi_gpu --num_processes 2` (gloo on CPU), with and
without skipping zero-advantage rollouts; rank 0's rollouts all have zero advantage. Writes
OUT/rank{k}.pt: the weights after each step, the micro-batch counts, and metrics reduced
from different keys on the two ranks. Used by
test_skip_zero_advantage.py."""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

from learner.loss.grpo import LossConfig
from learner.model.policy import PolicyLogprobs
from learner.step.update import (
    StepOptions,
    build_micro_batches,
    equalize_batches,
    reduce_metrics,
    train_on,
)
from tests.learner.rollout_data import random_rollouts


def main(model_dir: str, out: str) -> None:
    acc = Accelerator(cpu=True)
    rank = acc.process_index
    rollouts = random_rollouts(8, seed=1 + rank)
    for r in rollouts:
        r.advantage = 0.0 if rank == 0 else (r.advantage or 0.5)
    cfg = LossConfig(loss_type="dapo")
    result: dict = {"micro_batches": {}}
    for mode in ("all", "skip"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        policy = PolicyLogprobs(model, chunk_size=5)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        policy, opt = acc.prepare(policy, opt)
        opts = StepOptions(micro_batch_size=2, skip_zero_advantage=mode == "skip")
        step = equalize_batches(acc, build_micro_batches(rollouts, opts, cfg, pad_id=0))
        result["micro_batches"][mode] = len(step.batches)
        if mode == "skip":
            result["fillers"] = step.fillers
        result[f"{mode}_metrics"] = train_on(acc, policy, None, opt, cfg, step, opts)
        result[mode] = {k: p.detach().clone() for k, p in model.named_parameters()}
    # ranks with different metric keys (a reward that abstained on all of rank 0's completions)
    own = {"shared": float(rank), **({"reward/x/mean": 0.5} if rank == 1 else {})}
    result["reduced"] = reduce_metrics(acc, own)
    torch.save(result, f"{out}/rank{rank}.pt")
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
