"""Metric sinks (main process only): a JSONL log, TensorBoard and a progress bar."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

BAR_KEYS = {"reward/mean": "reward", "loss": "loss", "completion/len_mean": "len"}


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        start_step: int,
        tensorboard: bool,
        progress_bar: bool,
        desc: str = "GRPO",
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        _drop_after(self.path, start_step)  # a resumed run redoes the steps after its checkpoint
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        self._bar = (
            tqdm(total=total_steps, initial=start_step, desc=desc, unit="step", dynamic_ncols=True)
            if progress_bar
            else None
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        record: dict[str, Any] = {"step": step, "time": time.time(), **clean}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._bar is not None:
            self._bar.set_postfix(
                {short: f"{clean[k]:.3g}" for k, short in BAR_KEYS.items() if k in clean}
            )
            self._bar.update(1)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) for every record of a metrics file. A last line that does not parse is a
    record cut off by a host crash (the file is flushed, not fsynced: its tail may be missing
    or zeros) and is left out; one anywhere else is a damaged file and raises."""
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}:{i + 1} is not a JSON record: {line[:80]!r}") from None
    return out


def _drop_after(path: Path, step: int) -> None:
    """Keep only the records of steps up to ``step`` (atomically), and no cut-off last line."""
    if not path.is_file():
        return
    keep = [line for line, rec in _records(path) if int(rec["step"]) <= step]
    if "".join(keep) != path.read_text(errors="replace"):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line if line.endswith("\n") else line + "\n" for line in keep))
        tmp.replace(path)


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """Records of ``metrics.jsonl``, one per step (the last written wins after a resume)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a learner run directory?")
    by_step = {int(rec["step"]): rec for _, rec in _records(path)}
    return [by_step[s] for s in sorted(by_step)]
