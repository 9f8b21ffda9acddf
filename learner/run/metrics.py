"""Metric sinks (main process only): a JSONL log, TensorBoard, experiment trackers (W&B, MLflow...
through accelerate's tracker classes) and a progress bar."""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

BAR_KEYS = {"reward/mean": "reward", "loss": "loss", "completion/len_mean": "len"}


@dataclass
class Trackers:
    """``run.report_to``'s experiment trackers for one run directory (accelerate's classes).

    Each run directory is one tracker run: its id is kept in ``RUN_DIR/tracker_run_id``, so a
    ``--resume`` continues the same W&B run (W&B ignores steps logged below a run's current
    step: the steps a resume trains again keep the killed run's values there)."""

    report_to: list[str]
    project: str
    name: str
    config: dict[str, Any]
    kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg: Any, name: str) -> Trackers | None:
        """From a ``LearnerConfig`` (``run.report_to``, ``run.project``, ``run.tracker_kwargs``);
        None when it names no tracker."""
        run = cfg.run
        if not run.report_to:
            return None
        return cls(run.report_to, run.project, name, _flat(cfg.model_dump(mode="json")),
                   run.tracker_kwargs)  # fmt: skip

    def start(self, run_dir: Path) -> list[Any]:
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        id_file = run_dir / "tracker_run_id"
        if not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:16] + "\n")
        run_id = id_file.read_text().strip()
        started = []
        for kind in self.report_to:
            kwargs = dict(self.kwargs.get(kind, {}))
            if kind == "wandb":
                kwargs = {"name": self.name, "id": run_id, "resume": "allow",
                          "dir": str(run_dir), **kwargs}  # fmt: skip
            tracker_cls = LOGGER_TYPE_TO_CLASS[kind]
            if tracker_cls.requires_logging_directory:
                tracker = tracker_cls(self.project, str(run_dir / "trackers"), **kwargs)
            else:
                tracker = tracker_cls(self.project, **kwargs)
            tracker.start()
            tracker.store_init_configuration(self.config)
            started.append(tracker)
        return started


# a key whose last word names a secret (hf_token, api_key), not one that counts tokens
_SECRET = re.compile(r"(^|_)(api_key|token|secret|password)$", re.IGNORECASE)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"grpo": {"beta": 0.0}}`` as ``{"grpo.beta": 0.0}`` (every tracker takes flat keys),
    with secrets (``rollout.api_key``) masked: the config leaves the machine."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = "***" if v is not None and _SECRET.search(str(k)) else v
    return out


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
        trackers: Trackers | None = None,
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        _drop_after(self.path, start_step)  # a resumed run redoes the steps after its checkpoint
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        self._trackers = trackers.start(run_dir) if trackers is not None else []
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
        for tracker in self._trackers:
            tracker.log(clean, step=step)
        if self._bar is not None:
            self._bar.set_postfix(
                {short: f"{clean[k]:.3g}" for k, short in BAR_KEYS.items() if k in clean}
            )
            self._bar.update(1)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        for tracker in self._trackers:
            tracker.finish()
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
