"""One GRPO (or SFT) learner step on fixed rollouts under ``accelerate launch`` (ZeRO-3 on GPU).

Run by tests/gpu/test_zero3_step.py with 1 and 2 processes: the loss and the global gradient
norm must agree (each rank trains on its share of the same rollouts; the DAPO normaliser and
SFT's mean over every target are global, so the sharding must not change the numbers).
`--fused`: the loss fused with the LM head (`grpo.fused_loss`, or `sft.fused_loss` with `--sft`),
whose weight ZeRO-3 gathers for it. `--sft`: one SFT step (`learner.sft.sft_step`, the chunked
NLL) on the same sequences, the completions as targets. Every 4th rollout has zero advantage
(left out of the GRPO step: `grpo.skip_zero_advantage`). Prints one JSON line on rank 0.
`--updates PATH`: rank 0 saves every parameter's update (fp32 master weights after the step
minus before, gathered) to PATH, so that the runs can be compared parameter by parameter: equal
loss and gradient norm do not show that each shard's gradient reached its own parameter. The
AdamW step is made linear in the gradient (eps far above every clipped gradient element, lr
large enough that the update of a norm weight of 1.0 shows in its fp32 master weight: its
gradient is ~1e-9, under fp32's spacing there with lr 1; no weight decay), so the updates differ
only as much as the gradients do; a plain Adam first step is about lr * sign(g), which bf16 noise flips.
"""

from __future__ import annotations

import json
import random
import sys

import torch

from learner.config import load_config
from learner.loss.grpo import LossConfig
from learner.model.setup import build_models
from learner.run.runtime import make_accelerator
from learner.step.batch import Rollout, collate, micro_batches
from learner.step.update import StepOptions, build_micro_batches, reduce_metrics, train_on
from learner.sync.zero3 import strip_wrappers


def rollouts(n: int, vocab: int, seed: int = 0) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(32, 96), rng.randint(64, 192)
        out.append(
            Rollout(
                [rng.randrange(vocab) for _ in range(p)],
                [rng.randrange(vocab) for _ in range(c)],
                [-rng.random() * 5 for _ in range(c)],
                [1] * c,
                advantage=rng.uniform(-1, 1),
            )
        )
    return out


def master_weights(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trained parameter's fp32 master copy, whole, on the CPU (the optimizer's, gathered
    under ZeRO-3: a collective call, every rank makes it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in policy.named_parameters():
        if p.requires_grad:
            full = safe_get_full_fp32_param(p)
            assert full is not None, f"no fp32 master weights for {name}"
            out[strip_wrappers(name)] = full.detach().float().cpu()
    return out


def main(model_dir: str, fused: bool = False, sft: bool = False, updates: str = "") -> None:
    acc = make_accelerator()
    cfg = load_config(
        None,
        [f'data.path="{model_dir}"', 'rewards=[{name="length"}]', 'model.dtype="bfloat16"'],
    )
    policy, _ = build_models(cfg, model_dir)
    if sft:
        from learner.sft import NLLPolicy

        policy = NLLPolicy(policy.model, fused=fused)
    trained = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e6, eps=1.0, weight_decay=0.0)  # linear: see above
    policy, opt = acc.prepare(policy, opt)
    before = master_weights(policy) if updates else {}
    vocab = 256  # ids every tokenizer/model of the suite has
    mine = rollouts(16, vocab)[acc.process_index :: acc.num_processes]
    if sft:
        from learner.sft import sft_step

        batches = [collate(mb, 0) for mb in micro_batches(mine, 4)]
        m = sft_step(acc, policy, opt, batches, max_grad_norm=1.0)
    else:  # rank 0's share holds 4 zero-advantage rollouts, left out: 1 micro-batch against
        # rank 1's 2, so rank 0 runs a filler of weight 0 (every forward gathers ZeRO-3's weights)
        for i, r in enumerate(mine):
            if (i * acc.num_processes + acc.process_index) % 4 == 0:  # its index in all 16
                r.advantage = 0.0
        opts = StepOptions(micro_batch_size=4, fused_loss=fused)
        cfg = LossConfig(loss_type="dapo")
        step = build_micro_batches(mine, opts, cfg, pad_id=0)
        m = train_on(acc, policy, None, opt, cfg, step, opts)
    m = reduce_metrics(acc, {"loss": m["loss"], "grad_norm": m["grad_norm"]})
    if updates:
        after = master_weights(policy)
        if acc.is_main_process:
            torch.save({n: after[n] - w for n, w in before.items()}, updates)
    if acc.is_main_process:
        out = {"world": acc.num_processes, "fused": fused, "sft": sft, **m}
        print(json.dumps(out), flush=True)
    acc.end_training()


if __name__ == "__main__":
    flags = sys.argv[2:]
    main(
        sys.argv[1],
        fused="--fused" in flags,
        sft="--sft" in flags,
        updates=flags[flags.index("--updates") + 1] if "--updates" in flags else "",
    )
