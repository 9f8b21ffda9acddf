"""SFT on one GPU: our chunked-NLL step against TRL 1.16's SFTTrainer and a full-logits step.

    python3 bench/bench_sft_gpu.py --out-dir $OUT                       # Qwen3-4B shape, 16k
    python3 bench/bench_sft_gpu.py --model qwen3-8b --seq 16384 --out-dir $OUT   # an H200

TRL v1.4 announced its chunked NLL with "Qwen3-4B, 1×H100 80GB, 16k seq: OOM → 63.8 GB" (and
Qwen3-14B on 8×H100 FSDP2 58.9 → 38.9 GB); TRL 1.16's default SFT loss ("nll") is that path's
successor, a fused LM head that projects only the target positions, in tiles. This runs the
three ways of computing the SFT loss on the same random-weight model, the same sequence, the
same optimizer, each in a fresh process so each peak is its own:

- full: ``model(input_ids, labels=...)``: the Hugging Face loss (logits of every position,
  upcast to float32, cross entropy), what SFT did before chunked losses.
- trl:  TRL 1.16 ``SFTTrainer`` (``loss_type="nll"``, its fused LM head), the dataset given
  pre-tokenized with ``labels`` (-100 on the prompt).
- ours: ``learner.sft.NLLPolicy`` + ``sft_step`` with ``sft.fused_loss = false``: the chunked NLL
  through ``token_logprobs`` (Triton kernels on CUDA, the logits recomputed in the backward; only
  target rows reach the head, the logits never exist whole).
- ours-fused: the same with ``sft.fused_loss = true`` (the learner's default): the NLL fused
  with the head, 3 N·H·V products instead of 4, one chunk's bf16 logits in memory.

All: bf16 weights, fused AdamW (torch's one-kernel update, states in bf16, the weights' dtype;
the learner's own optimizer on a GPU, ``optim="adamw_torch_fused"`` for TRL), gradient
checkpointing (non-reentrant), SDPA attention, one sequence of ``--seq`` tokens a step whose last
``--target-fraction`` is the completion. The weights come from the same seed in every process and
the data too, so step 1's loss must agree across variants (a check, printed).

Reported per variant: the peak ``max_memory_allocated`` of a training step (weights, gradients,
optimizer states and activations: the figure TRL's announcement gives), that peak minus the model
state (weights + gradients + AdamW states = 8 bytes a parameter), the peak of the forward and
backward alone (read just before the optimizer step: where the loss path shows), the median step
time after the first step, and step 1's loss. A variant that runs out of memory reads OOM.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout_server.tiny import QWEN3_0_6B_SHAPE, QWEN3_4B_SHAPE  # noqa: E402 (light: no torch)

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": QWEN3_0_6B_SHAPE,
    "qwen3-4b": QWEN3_4B_SHAPE,
    "qwen3-8b": {**QWEN3_0_6B_SHAPE, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "tie_word_embeddings": False},
    "qwen3-14b": {**QWEN3_0_6B_SHAPE, "hidden_size": 5120, "intermediate_size": 17408,
                  "num_hidden_layers": 40, "num_attention_heads": 40, "tie_word_embeddings": False},
}  # fmt: skip
VARIANTS = ("full", "trl", "ours", "ours-fused")
LR = 1e-5
DEVICE = "cuda"  # --device cpu: a quick check of the script itself on a small shape


def _model(name: str):
    import torch
    from transformers import Qwen3ForCausalLM

    from rollout_server.tiny import tiny_qwen3_config

    config = tiny_qwen3_config(**SHAPES[name])
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.train()
    return model


def _data(seq: int, vocab: int, target_fraction: float, steps: int):
    """``steps`` rows of random token ids; the first ``1 - target_fraction`` is the prompt."""
    import torch

    g = torch.Generator().manual_seed(1)
    prompt = seq - int(seq * target_fraction)
    rows = [torch.randint(0, vocab, (seq,), generator=g).tolist() for _ in range(steps)]
    return rows, prompt


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Meter:
    """Per step: wall time, peak allocated over the step, and the peak reached before the
    optimizer step (``before_step``, called from the optimizer's pre-step hook or TRL's
    ``on_pre_optimizer_step``): the forward and backward alone."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.step_peaks: list[int] = []
        self.fwd_bwd_peaks: list[int] = []

    def _peak(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0

    def begin(self) -> None:
        import torch

        _sync()
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()

    def before_step(self, *_: Any) -> None:
        self.fwd_bwd_peaks.append(self._peak())

    def end(self) -> None:
        _sync()
        self.times.append(time.perf_counter() - self.t0)
        self.step_peaks.append(self._peak())

    def timed(self, fn) -> Any:
        self.begin()
        out = fn()
        self.end()
        return out


def run_full(model, rows, prompt, meter: Meter) -> list[float]:
    import torch

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=DEVICE == "cuda")
    opt.register_step_pre_hook(meter.before_step)
    losses = []

    def step(ids: list[int]) -> float:
        x = torch.tensor([ids], device=DEVICE)
        labels = x.clone()
        labels[:, :prompt] = -100
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    for ids in rows:
        losses.append(meter.timed(lambda ids=ids: step(ids)))
    return losses


def run_ours(model, rows, prompt, meter: Meter, fused: bool = False) -> list[float]:
    from learner.config.step import OptimConfig
    from learner.run.runtime import make_accelerator, optimizer_and_schedule, use_fused_adamw
    from learner.sft import NLLPolicy, sft_step
    from learner.step.batch import Rollout, collate

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    acc = make_accelerator()
    policy = NLLPolicy(model, fused=fused)
    optim = OptimConfig(betas=(0.9, 0.999))  # transformers' defaults, as TRL runs
    opt, _ = optimizer_and_schedule(
        policy, optim, lr=LR, schedule="constant", warmup_steps=0, steps=len(rows),
        fused=use_fused_adamw(acc),
    )  # fmt: skip
    opt.register_step_pre_hook(meter.before_step)
    policy, opt = acc.prepare(policy, opt)
    losses = []
    for ids in rows:
        c = len(ids) - prompt
        r = Rollout(ids[:prompt], ids[prompt:], [0.0] * c, [1] * c)
        m = meter.timed(lambda r=r: sft_step(acc, policy, opt, [collate([r], 0)], 1.0))
        losses.append(m["loss"])
    return losses


def run_trl(model, rows, prompt, meter: Meter) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from rollout_server.tiny import make_tiny_tokenizer

    labels = [[-100] * prompt + ids[prompt:] for ids in rows]
    data = Dataset.from_dict({"input_ids": rows, "labels": labels})

    class Measure(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            meter.begin()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            meter.before_step()

        def on_step_end(self, args, state, control, **kw):
            meter.end()

    with tempfile.TemporaryDirectory() as out:
        cfg = SFTConfig(
            output_dir=out,
            per_device_train_batch_size=1,
            max_steps=len(rows),
            learning_rate=LR,
            lr_scheduler_type="constant",
            optim="adamw_torch_fused" if DEVICE == "cuda" else "adamw_torch",
            max_grad_norm=1.0,
            bf16=DEVICE == "cuda",
            use_cpu=DEVICE == "cpu",
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            max_length=len(rows[0]),
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            dataloader_num_workers=0,
            dataset_kwargs={"skip_prepare_dataset": True},  # given tokenized, with labels
            seed=0,
        )
        trainer = SFTTrainer(
            model=model,
            args=cfg,
            train_dataset=data,
            processing_class=make_tiny_tokenizer(),
            callbacks=[Measure()],
        )
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def worker(args: argparse.Namespace) -> None:
    import torch

    model = _model(args.model)
    params = sum(p.numel() for p in model.parameters())
    rows, prompt = _data(args.seq, model.config.vocab_size, args.target_fraction, args.steps)
    runner = {
        "full": run_full,
        "trl": run_trl,
        "ours": run_ours,
        "ours-fused": functools.partial(run_ours, fused=True),
    }[args.worker]
    result: dict[str, Any] = {"variant": args.worker, "params": params}
    meter = Meter()
    try:
        losses = runner(model, rows, prompt, meter)
    except torch.OutOfMemoryError as e:
        result["oom"] = str(e).splitlines()[0]
        print(json.dumps(result))
        return
    state = params * 8  # bf16 weights + gradients + AdamW's two moments
    peak, fwd_bwd = max(meter.step_peaks), max(meter.fwd_bwd_peaks)
    result.update(
        losses=losses,
        step_s=meter.times,
        median_step_s=statistics.median(meter.times[1:]),
        peak_gb=peak / 1e9,
        peak_minus_state_gb=(peak - state) / 1e9,
        fwd_bwd_peak_gb=fwd_bwd / 1e9,
        step_peaks_gb=[b / 1e9 for b in meter.step_peaks],
        fwd_bwd_peaks_gb=[b / 1e9 for b in meter.fwd_bwd_peaks],
    )
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3-4b")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--target-fraction", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (>= 2: step 1 warms up)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--out-dir", type=Path, default=None, help="write sft_gpu.json here")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.steps < 2:
        p.error("--steps must be at least 2: the first step is a warm-up, not timed")
    if args.worker:
        worker(args)
        return
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if device is None:
        sys.exit(
            "bench_sft_gpu.py needs a CUDA GPU (the loss alone, on CPU too: bench_sft_loss.py)"
        )
    shape = ["--model", args.model, "--seq", str(args.seq), "--steps", str(args.steps)]
    shape += ["--target-fraction", str(args.target_fraction)]
    rows = {}
    for v in args.variants:
        cmd = [sys.executable, __file__, "--worker", v, *shape]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode or not lines:
            rows[v] = {"variant": v, "error": out.stderr[-2000:]}
            print(f"{v}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        rows[v] = json.loads(lines[-1])
    print(f"\nSFT step, {args.model} shape, 1 x {args.seq} tokens, bf16, AdamW, {device}")
    head = f"{'variant':10} {'peak GB':>8} {'- state':>8} {'fwd+bwd':>8} {'step s':>8}"
    print(f"{head} {'step-1 loss':>12}")
    for v, r in rows.items():
        if "error" in r or "oom" in r:
            print(f"{v:10} {'OOM' if 'oom' in r else 'failed':>8}")
            continue
        print(
            f"{v:10} {r['peak_gb']:8.2f} {r['peak_minus_state_gb']:8.2f} "
            f"{r['fwd_bwd_peak_gb']:8.2f} {r['median_step_s']:8.3f} {r['losses'][0]:12.4f}"
        )
    meta = {
        "device": device,
        "torch": torch.__version__,
        "model": args.model,
        "seq": args.seq,
        "target_fraction": args.target_fraction,
        "steps": args.steps,
        "variants": rows,
    }
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "sft_gpu.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
