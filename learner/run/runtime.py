"""Process setup shared by the GRPO trainer and the SFT stage."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from pydantic import BaseModel

from learner.run.checkpoint import latest_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from learner.config import LearnerConfig, ModelConfig, RunConfig

log = logging.getLogger(__name__)


def make_accelerator() -> Accelerator:
    """An ``Accelerator`` (CPU when there is no GPU) ready for our own micro-batch loop.

    No dataloader goes through ``prepare()`` and we set DeepSpeed's accumulation boundary
    ourselves, so DeepSpeed is told one micro-batch per step and no accumulation."""
    acc = Accelerator(cpu=not torch.cuda.is_available())
    if acc.num_processes > 1:  # which machine each rank runs on: a multi-node launch's first check
        log.info(
            "process %d of %d (local %d of %s) on %s, device %s",
            acc.process_index,
            acc.num_processes,
            acc.local_process_index,
            os.environ.get("LOCAL_WORLD_SIZE", "?"),
            socket.gethostname(),
            acc.device,
        )
    ds = acc.state.deepspeed_plugin
    if ds is not None:
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
        ds.deepspeed_config["gradient_accumulation_steps"] = 1
    return acc


def machine_count(acc: Accelerator) -> int:
    """The machines the launch spans: its processes over this machine's (``LOCAL_WORLD_SIZE``,
    set by torchrun, which ``accelerate launch`` runs)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))
    return max(1, acc.num_processes // max(local, 1))


def use_fused_adamw(acc: Accelerator, fused: bool | str = "auto") -> bool:
    """Whether AdamW runs as one fused kernel (``optim.fused``). ``"auto"``: wherever its
    states live on the GPU. Under DeepSpeed the ZeRO optimizer hands the client optimizer its
    fp32 partitions, on the GPU unless the optimizer is offloaded: measured on an H200, the
    4B-parameter update of ZeRO-2 on one GPU takes 0.18-0.25 s in torch's multi-tensor path
    (docs/benchmarks.md, "The training phase")."""
    if acc.device.type != "cuda" or fused is False:
        return False
    ds = acc.state.deepspeed_plugin
    offloaded = ds is not None and ds.offload_optimizer_device not in (None, "none")
    if offloaded and fused is True:
        raise ValueError(
            "optim.fused = true with the optimizer offloaded to the CPU: the fused kernel runs "
            'on the GPU only; set optim.fused = "auto" (or false)'
        )
    return not offloaded


def check_model_options(acc: Accelerator, model: ModelConfig) -> None:
    """Refuse ``[model]`` options that this launch cannot run, naming the fix."""
    if acc.state.deepspeed_plugin is None:
        return
    lora = model.lora
    if lora is not None and lora.quantization != "none":
        raise ValueError(
            f"model.lora.quantization={lora.quantization!r} (QLoRA) does not run under DeepSpeed: "
            'launch without a DeepSpeed config (one GPU or DDP), or set it to "none"'
        )


class SetupError(ValueError):
    """A run cannot start as configured; the message names the setting to change."""


class RunDirError(SetupError):
    """The run directory already holds a run and ``--resume`` was not given."""


def check_fresh_run_dir(run_dir: Path) -> None:
    """A run without ``--resume`` must not start in a directory that holds another run: its
    metrics would mix with the old ones, checkpoint rotation would delete the new checkpoints
    and keep the old ones, and a later ``--resume`` would continue the old run."""
    found = latest_checkpoint(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if found is None and metrics.is_file() and metrics.stat().st_size:
        found = metrics
    if found is None and (run_dir / "final" / "config.json").exists():
        found = run_dir / "final"
    if found is not None:
        raise RunDirError(
            f"{run_dir.resolve()} already holds a run ({found.name}): pass --resume to continue "
            "it, or start a new one in another directory (--run-dir DIR, or run.run_dir), or "
            "delete this one"
        )


def start_run(
    acc: Accelerator,
    run_dir: Path,
    cfg: BaseModel,
    seed: int,
    batch: int,
    what: str,
    *,
    resume: bool,
) -> None:
    """Check the batch splits over the ranks and that a fresh run gets a fresh directory, write
    the resolved config, seed every RNG."""
    if batch % acc.num_processes:
        raise ValueError(
            f"{what} = {batch} must be divisible by the number of processes ({acc.num_processes})"
        )
    if not resume:
        check_fresh_run_dir(run_dir)
    check_trackers(cfg)
    if acc.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_config(run_dir / "config.json", cfg)
    check_shared_run_dir(acc, run_dir)
    set_seed(seed)


def check_shared_run_dir(acc: Accelerator, run_dir: Path, wait_s: float = 10.0) -> None:
    """Every rank must see what the main process writes in the run directory: a checkpoint
    holds every rank's files (RNG states, DeepSpeed's partitions) in one directory that the
    main process renames once all are written, and the tiny model and the SFT warm start are
    written by the main process and loaded by all. Across machines that takes a disk every
    machine mounts at the same path; without one, a ``SetupError`` on every rank before any
    model loads, rather than checkpoints that a resume cannot read. ``wait_s`` covers a
    network file system's attribute cache."""
    if acc.num_processes == 1:
        return
    from accelerate.utils import broadcast_object_list, gather_object

    marker = run_dir / ".shared-by-every-rank"
    token = [secrets.token_hex(8) if acc.is_main_process else ""]
    if acc.is_main_process:
        marker.write_text(token[0])
    broadcast_object_list(token, from_process=0)  # after the main process wrote it
    deadline = time.monotonic() + wait_s
    while not (seen := _holds(marker, token[0])) and time.monotonic() < deadline:
        time.sleep(0.2)
    blind = [rank for rank, ok in enumerate(gather_object([seen])) if not ok]
    if acc.is_main_process:
        marker.unlink()
    if blind:
        raise_on_every_rank(
            SetupError(
                f"run.run_dir {run_dir} is not shared by every process: process(es) {blind} "
                "cannot see the file the main process wrote there. Across machines the run "
                "directory must be on a disk every machine mounts at the same path "
                "(docs/multi-node.md)"
            )
        )


def raise_on_every_rank(error: SetupError) -> NoReturn:
    """Raise ``error``, which every rank found alike, after leaving the process group in step
    with the others: a rank whose peers already exited can abort (SIGABRT) in gloo's teardown
    at exit, after its one-line error, instead of exiting 2."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    raise error


def _holds(path: Path, text: str) -> bool:
    try:
        return path.read_text() == text
    except OSError:
        return False


def write_config(path: Path, cfg: BaseModel) -> None:
    """The resolved config, readable by its owner only, with every ``api_key`` as ``"***"``
    (the file is copied around with the run; the key is not)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file left by an earlier run keeps its mode otherwise
    with os.fdopen(fd, "w") as f:
        json.dump(masked(cfg.model_dump(mode="json")), f, indent=2)


def masked(tree: Any) -> Any:
    """``tree`` with the value of every set ``api_key`` replaced by ``"***"``."""
    if isinstance(tree, dict):
        return {
            k: "***" if k == "api_key" and v is not None else masked(v) for k, v in tree.items()
        }
    if isinstance(tree, list):
        return [masked(v) for v in tree]
    return tree


def check_trackers(cfg: BaseModel) -> None:
    """Each of ``run.report_to``'s trackers importable, or a ``SetupError`` naming its package
    (accelerate would only warn and drop it)."""
    import importlib.util

    run = getattr(cfg, "run", None)
    for name in getattr(run, "report_to", []):
        if importlib.util.find_spec(name) is None:
            raise SetupError(
                f"run.report_to names {name!r}, whose package is not installed: pip install "
                f"{name.replace('_', '-')}, or drop it from run.report_to"
            )


def resolve_model(
    cfg: LearnerConfig,
    ref: str,
    tiny_dir: Path,
    *,
    setting: str = "model.name_or_path =",
    accelerator: Accelerator | None = None,
) -> str:
    """The model to load for ``ref``: a directory or hub id, checked (a ``SetupError`` naming
    ``setting`` otherwise), or for ``"tiny"`` the demo's random-weight model, written once to
    ``tiny_dir`` by the main process."""
    if ref != "tiny":
        from rollout_server.settings import check_model_ref

        try:
            check_model_ref(ref)
        except ValueError as e:
            raise SetupError(f"{setting} {e}") from None
        return ref
    if (accelerator is None or accelerator.is_main_process) and not (
        tiny_dir / "config.json"
    ).exists():
        from rollout_server.tiny import save_tiny_model

        save_tiny_model(tiny_dir, seed=cfg.run.seed, **cfg.model.tiny)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    return str(tiny_dir)


def optimizer_and_schedule(
    policy: torch.nn.Module,
    optim: Any,
    *,
    lr: float,
    schedule: str,
    warmup_steps: int,
    steps: int,
    fused: bool = False,
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the trainable parameters (``optim``: betas, weight decay) and its schedule.

    ``fused`` (see ``use_fused_adamw``): one kernel for the whole update instead of torch's
    default multi-tensor path, which allocates temporaries as large as the trainable
    parameters: measured on an H100, a 4B-parameter bf16 SFT step peaks 4.7 GB lower
    (docs/benchmarks.md, "SFT on one GPU")."""
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=lr,
        betas=optim.betas,
        weight_decay=optim.weight_decay,
        fused=fused or None,
    )
    scheduler = get_scheduler(
        schedule, optimizer, num_warmup_steps=warmup_steps, num_training_steps=steps
    )
    return optimizer, scheduler


class TrainingStopped(Exception):
    """SIGTERM (a preemption, ``docker stop``) stopped the run after a step, with a checkpoint of
    that step: ``--resume`` continues it."""

    def __init__(self, step: int, steps: int, run_dir: Path) -> None:
        super().__init__(
            f"stopped by SIGTERM after step {step} of {steps}, with a checkpoint of it in "
            f"{run_dir / 'checkpoints'}: run again with --resume to continue"
        )
        self.step = step


class StoppedBeforeTraining(BaseException):
    """SIGTERM before the first step (while the rollout servers start, the weights first go to
    them or the starting weights are evaluated): nothing was trained, so the learner stops at
    once. A ``BaseException``, as ``KeyboardInterrupt``: no ``except Exception`` on the way may
    swallow it, and every ``finally`` (the embedded server's stop) runs."""

    def __init__(self) -> None:
        super().__init__(
            "stopped by SIGTERM before the first step, while the rollout servers started: "
            "nothing was trained since the learner started, so there was nothing to checkpoint; "
            "run the same command again to go on"
        )


class StopOnSigterm:
    """SIGTERM asks the loop to stop after the step in progress (the handler only sets a flag;
    the previous handler is back on exit). Every rank stops at the same step: ``requested``
    agrees over them (any rank's request counts). With ``at_once``, until ``steps_begin()``,
    SIGTERM raises ``StoppedBeforeTraining`` wherever the main thread is instead: a rollout
    server may take minutes to start, and there is no step to finish yet."""

    def __init__(self, *, at_once: bool = False) -> None:
        self._flag = False
        self._previous: Any = None
        self._at_once = at_once

    def steps_begin(self) -> None:
        """From here on, SIGTERM waits for the step in progress."""
        self._at_once = False

    def __enter__(self) -> StopOnSigterm:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if self._at_once:
            self._at_once = False  # once: a second SIGTERM must not break the cleanup
            raise StoppedBeforeTraining
        if not self._flag:
            log.warning(
                "SIGTERM: stopping after this step, with a checkpoint of it (under torchrun "
                "this also follows another rank's failure: look for that rank's error)"
            )
        self._flag = True

    def checkpoint(
        self, accelerator: Accelerator, run_dir: Path, step: int, steps: int, run: RunConfig
    ) -> bool:
        """After step ``step`` of ``steps``: a checkpoint when one is due (``run.checkpoint_every``,
        the last step) or SIGTERM asked to stop. Returns whether the loop stops here."""
        stopping = self.requested(accelerator)
        if stopping or step % run.checkpoint_every == 0 or step == steps:
            save_checkpoint(accelerator, run_dir, step, run.keep_checkpoints)
        return stopping and step < steps

    def requested(self, accelerator: Accelerator) -> bool:
        if accelerator.num_processes == 1:
            return self._flag
        flag = torch.tensor([float(self._flag)], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)
