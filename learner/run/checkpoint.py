"""Atomic, durable, resumable checkpoints.

A checkpoint is a directory ``<run_dir>/checkpoints/step_<N>`` written by ``accelerate``'s
``save_state`` (model, optimizer, scheduler, every process's RNG, and the registered trainer and
data-stream state; DeepSpeed's sharded states too). It is written under a temporary name and
renamed only once complete, so a run killed mid-write leaves the previous checkpoint intact and
no half-written one that ``--resume`` could pick up; the next run deletes the temporary
directory. Its files and directory are fsynced before the rename and the rename after it: a host
that crashes (power, kernel) can otherwise keep the rename but lose the data written just
before it, leaving empty or truncated files under a complete-looking name.

A write that fails (a full disk, a quota, a file size limit) deletes the unfinished directory
and ends in ``CheckpointWriteError``: one line naming the checkpoint, the reason and the one
``--resume`` continues from.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelerate import Accelerator

CHECKPOINT_WRITE_EXIT = 74  # EX_IOERR: free space, then --resume
_STEP_DIR = re.compile(r"^step_(\d+)$")
# safetensors' errors carry Rust's io::Error: "... (os error 28)" or "Os { code: 28, ..."
_RUST_IO = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")
_TMP_PREFIX = ".tmp-"
log = logging.getLogger(__name__)


class TrainerState:
    """What the loop needs to continue: the step reached and the weight version served."""

    def __init__(self) -> None:
        self.step = 0
        self.weight_version = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "weight_version": self.weight_version}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.weight_version = int(state["weight_version"])


ADAPTER_DIR = "adapter"


def adapter_only_checkpoints(accelerator: Accelerator, policy: Any) -> bool:
    """With (Q)LoRA and no DeepSpeed, a checkpoint holds the adapter alone, saved by PEFT
    (``adapter/adapter_model.safetensors`` + ``adapter_config.json``: loadable with
    ``PeftModel.from_pretrained``), not the frozen base weights; on resume the base comes from
    the model path again. Returns whether the hooks were installed."""
    if accelerator.state.deepspeed_plugin is not None:
        return False  # DeepSpeed's engine writes its own (sharded) model states
    peft_model = getattr(accelerator.unwrap_model(policy), "model", None)
    if not (hasattr(peft_model, "peft_config") and hasattr(peft_model, "save_pretrained")):
        return False

    def save(models: list[Any], weights: list[Any], output_dir: str) -> None:
        index = next(i for i, m in enumerate(models) if m is policy)
        weights.pop(index)  # accelerate would write the full state dict from it
        if accelerator.is_main_process:
            peft_model.save_pretrained(str(Path(output_dir) / ADAPTER_DIR))

    def load(models: list[Any], input_dir: str) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = Path(input_dir) / ADAPTER_DIR / "adapter_model.safetensors"
        if not path.is_file():
            raise FileNotFoundError(
                f"{input_dir} has no {ADAPTER_DIR}/adapter_model.safetensors: it was not written "
                "by a LoRA run; resume with the model.lora settings it was written with"
            )
        result = set_peft_model_state_dict(peft_model, load_file(str(path)))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"the adapter in {path} does not fit this model.lora config (missing "
                f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}): resume with the "
                "r/target_modules it was trained with"
            )
        models.remove(policy)  # loaded: accelerate must not look for a full state dict

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return True


def restore(
    accelerator: Accelerator, run_dir: Path, policy: Any, *state: Any, resume: bool
) -> Path | None:
    """Make checkpoints hold ``state`` (the data stream, the trainer's counters) besides the
    model, optimizer and scheduler (with (Q)LoRA: the adapter alone), then, with ``resume``,
    load the run's last checkpoint (a damaged one falls back to the one before). Returns it,
    or None when the run starts fresh."""
    accelerator.register_for_checkpointing(*state)
    adapter_only_checkpoints(accelerator, policy)
    if accelerator.is_main_process:
        _remove_unfinished(run_dir)
    if not resume:
        return None
    found = all_checkpoints(run_dir)
    if not found:
        log.warning("--resume: no checkpoint in %s, starting from step 0", run_dir)
        return None
    for ckpt, older in itertools.pairwise(found):  # newest first
        try:
            accelerator.load_state(str(ckpt))
            return ckpt
        except Exception as e:  # a damaged checkpoint: fall back to the one before
            log.warning(
                "--resume: checkpoint %s cannot be loaded (%s: %s); trying %s",
                ckpt.name,
                type(e).__name__,
                e,
                older.name,
            )
    accelerator.load_state(str(found[-1]))  # the oldest: its error, if any, ends the run
    return found[-1]


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def all_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories, newest first."""
    found = []
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = all_checkpoints(run_dir)
    return found[0] if found else None


def _remove_unfinished(run_dir: Path) -> None:
    """Delete the temporary directories of checkpoints whose writing was cut off."""
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(_TMP_PREFIX) and p.is_dir():
                log.warning("deleting %s: a checkpoint whose writing was cut off", p)
                shutil.rmtree(p, ignore_errors=True)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a directory too: that makes its entries durable
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems (FUSE, CIFS) cannot fsync a directory
        if not (e.errno == errno.EINVAL and path.is_dir()):
            raise
    finally:
        os.close(fd)


def fsync_tree(top: Path) -> None:
    """fsync every file under ``top``, then every directory, deepest first."""
    for dirpath, _, filenames in os.walk(top, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, say); the unfinished one is deleted."""


def write_failure(e: BaseException) -> str | None:
    """Why ``e`` (or an error it came from) is a failed write to disk, in words, or None when it
    is something else: an ``OSError``, safetensors' Rust I/O error, torch's failed file write."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError):
            where = f" ({cur.filename})" if cur.filename else ""
            return f"{cur.strerror or cur}{where}"
        text = str(cur)
        if m := _RUST_IO.search(text):
            return os.strerror(int(m.group(1) or m.group(2)))
        for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            if os.strerror(code) in text:
                return os.strerror(code)
        if "file write failed" in text:  # torch.save: PytorchStreamWriter, no errno
            return "a file write failed"
        cur = cur.__cause__ or cur.__context__
    return None


def _failed_anywhere(accelerator: Accelerator, failed: bool) -> bool:
    """Whether ``failed`` is true on any rank (every rank must call it)."""
    if accelerator.num_processes == 1:
        return failed
    import torch

    flags = accelerator.gather(torch.tensor([float(failed)], device=accelerator.device))
    return bool(flags.max().item() > 0)


def save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, keep: int) -> Path:
    """Write step ``step``'s checkpoint (every rank calls it), keep the newest ``keep``. A write
    that fails on any rank deletes the unfinished directory and raises ``CheckpointWriteError``
    (a failed write) or the error itself, on every rank."""
    root = checkpoints_dir(run_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f"{_TMP_PREFIX}step_{step:06d}"
    error: Exception | None = None
    try:  # every rank reaches every barrier below, failed or not
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    except Exception as e:
        error = e
    accelerator.wait_for_everyone()
    try:
        if error is None:
            accelerator.save_state(str(tmp), safe_serialization=True)
    except Exception as e:
        error = e
    accelerator.wait_for_everyone()
    try:
        if error is None and accelerator.is_local_main_process:  # one per host: its ranks' files
            fsync_tree(tmp)
    except Exception as e:
        error = e
    if _failed_anywhere(accelerator, error is not None):
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # gives the space back, too
        accelerator.wait_for_everyone()
        _raise_write_error(error, final, run_dir)
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # the atomic step: a complete checkpoint appears at once
        fsync_path(root)  # the rename itself
        steps = sorted(
            (int(m.group(1)), p)
            for p in root.iterdir()
            if (m := _STEP_DIR.match(p.name)) and p.is_dir()
        )
        for _, old in steps[:-keep]:
            # renamed first, so a kill mid-delete leaves a temporary name (removed by the next
            # run's restore), never a partly deleted directory under a checkpoint's name
            doomed = root / f"{_TMP_PREFIX}{old.name}"
            shutil.rmtree(doomed, ignore_errors=True)
            old.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _raise_write_error(error: Exception | None, final: Path, run_dir: Path) -> None:
    """Raise the error of a checkpoint that could not be written: ``CheckpointWriteError`` for a
    failed write (or another rank's failure), else ``error`` itself."""
    reason = "another rank could not write its part" if error is None else write_failure(error)
    if reason is None:
        assert error is not None
        raise error
    newest = latest_checkpoint(run_dir)
    resume = f"continues from {newest.name}" if newest is not None else "starts again from step 0"
    raise CheckpointWriteError(
        f"could not write the checkpoint {final} ({reason}); the unfinished one is deleted. "
        f"Make room (free space on that disk, or lift the quota or file size limit), then run "
        f"again with --resume, which {resume}"
    ) from error


@contextmanager
def final_model_write(path: Path) -> Iterator[None]:
    """Around writing a run's final model to ``path``: a failed write deletes the unfinished
    directory and becomes ``CheckpointWriteError``, saying that ``--resume`` writes it again."""
    try:
        yield
    except Exception as e:
        reason = write_failure(e)
        if reason is None:
            raise
        shutil.rmtree(path.with_name(f"{_TMP_PREFIX}{path.name}"), ignore_errors=True)
        raise CheckpointWriteError(
            f"could not write the final model {path} ({reason}); the unfinished one is deleted. "
            "Make room (free space on that disk, or lift the quota or file size limit), then run "
            "again with --resume, which writes it from the last checkpoint"
        ) from e
