"""Prompt data: JSONL files or local Hugging Face ``datasets`` directories.

The stream is a pure function of (seed, position): epoch ``e`` visits the rows in the order of a
permutation seeded with ``seed + e``. A checkpoint stores only ``position`` (rows consumed), so a
resumed run sees exactly the same prompts in the same order as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import random
import zlib
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """The dataset cannot be read or lacks what the config asks for."""


def load_rows(
    path: str | Path,
    prompt_column: str,
    *,
    allow_empty: bool = False,
    settings: tuple[str, str] = ("data.path", "data.prompt_column"),
) -> list[dict[str, Any]]:
    """The rows of a JSONL file or ``datasets`` directory, each with a prompt that the rollout
    server would take (``allow_empty``: an empty prompt too, as SFT completions may have).
    ``settings``: the config fields of the path and the column, for the messages."""
    path = Path(path)
    path_setting, column_setting = settings
    if not path.exists():
        raise DataError(
            f"{path_setting} {path} does not exist (looked at {path.resolve()}; a relative path is "
            "read next to the config file if it is there, else from the working directory)"
        )
    if path.is_dir():
        try:
            import datasets
        except ImportError as e:  # pragma: no cover - datasets is a dev dependency
            raise DataError(f"{path} is a directory: install `datasets` to read it") from e
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{path} holds splits {list(ds)}; expected a 'train' split")
            ds = ds["train"]
        rows = [dict(r) for r in ds]
    else:
        rows = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno} is not valid JSON: {e}") from e
                if not isinstance(row, dict):
                    raise DataError(
                        f"{path}:{lineno} must be a JSON object, got {type(row).__name__}"
                    )
                rows.append(row)
    if not rows:
        raise DataError(f"{path} holds no rows")
    for i, row in enumerate(rows):
        prompt = row.get(prompt_column)
        if prompt is None:
            raise DataError(
                f"{path} row {i} has no {prompt_column!r} column (columns: {sorted(row)}); "
                f"set {column_setting}"
            )
        if not isinstance(prompt, str | list):
            raise DataError(
                f"{path} row {i}: {prompt_column!r} must be text or a list of chat messages"
            )
        if prompt or not allow_empty:
            _check_prompt(prompt, f"{path} row {i}: {prompt_column!r}")
    return rows


def data_columns(rows: list[dict[str, Any]], prompt_column: str) -> list[str]:
    """Every column of any row but the prompt, in order of appearance (JSONL rows may differ)."""
    return list(dict.fromkeys(k for r in rows for k in r if k != prompt_column))


def _check_prompt(prompt: str | list[Any], where: str) -> None:
    """What the rollout server would refuse, found at load rather than hours into a run."""
    from pydantic import ValidationError

    from rollout_server.protocol import ChatMessage

    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where} is empty text")
        return
    if not prompt:
        raise DataError(f"{where} is an empty list of messages")
    for j, message in enumerate(prompt):
        try:
            ChatMessage.model_validate(message)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise DataError(
                f"{where}, message {j}: {loc + ': ' if loc else ''}{err['msg']} (a message is "
                '{"role": "system" | "user" | "assistant" | "tool", "content": "..."})'
            ) from None


class PromptStream:
    """An endless, seeded, resumable stream of rows over epochs."""

    def __init__(self, rows: list[dict[str, Any]], *, seed: int, shuffle: bool) -> None:
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        self.pending = 0  # rows taken for generations not trained on yet (overlap)
        self._order_epoch = -1
        self._order: list[int] = []
        self._fingerprint: int | None = None

    @property
    def fingerprint(self) -> int:
        """A CRC-32 of every row (computed once), so a resume can tell the data changed."""
        if self._fingerprint is None:
            crc = 0
            for row in self.rows:
                crc = zlib.crc32(json.dumps(row, sort_keys=True, default=str).encode(), crc)
            self._fingerprint = crc
        return self._fingerprint

    @property
    def epoch(self) -> int:
        return self.position // len(self.rows)

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def take(self, count: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.rows))
            out.append(self.rows[self._order_for(epoch)[index]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        # Rows prefetched for generation but not trained on are replayed after a resume.
        return {
            "position": self.position - self.pending,
            "seed": self.seed,
            "rows": len(self.rows),
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise DataError(
                f"checkpoint was made with data.seed={state['seed']}, config has {self.seed}"
            )
        self.position = int(state["position"])
        self.pending = 0
        if "fingerprint" in state and state["fingerprint"] != self.fingerprint:
            logger.warning(
                "the data changed since the checkpoint (%d rows then, %d now; their CRC-32s "
                "differ): the run goes on at row %d of the new data's order, so the prompts from "
                "here differ from an uninterrupted run's. Restore the old data to continue as "
                "that run would",
                state["rows"],
                len(self.rows),
                self.position,
            )
