"""Atomic, resumable checkpoints.

A checkpoint is a directory ``<run_dir>/checkpoints/step_<N>`` written by ``accelerate``'s
``save_state`` (model, optimizer, scheduler, every process's RNG, and the registered trainer and
data-stream state; DeepSpeed's sharded states too). It is written under a temporary name and
renamed only once complete, so a run killed mid-write leaves the previous checkpoint intact and
no half-written one that ``--resume`` could pick up.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelerate import Accelerator

_STEP_DIR = re.compile(r"^step_(\d+)$")


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


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = []
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def save_checkpoint(accelerator: Accelerator, run_dir: Path, step: int, keep: int) -> Path:
    root = checkpoints_dir(run_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)  # the atomic step: a complete checkpoint appears at once
        steps = sorted(
            (int(m.group(1)), p)
            for p in root.iterdir()
            if (m := _STEP_DIR.match(p.name)) and p.is_dir()
        )
        for _, old in steps[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final
