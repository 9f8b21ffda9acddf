"""Prompt data: JSONL, Parquet, CSV or JSON files, ``datasets`` directories, Hugging Face Hub ids.

The stream is a pure function of (seed, position): epoch ``e`` visits the rows in the order of a
permutation seeded with ``seed + e``. A checkpoint stores only ``position`` (rows consumed), so a
resumed run sees exactly the same prompts in the same order as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Files that ``datasets`` reads with one of its packaged builders (any other file is JSONL).
_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".arrow": "arrow"}
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_FILE_SUFFIXES = {*_BUILDERS, ".jsonl"}  # a path ending so is a file, never a Hub id


class DataError(ValueError):
    """The dataset cannot be read or lacks what the config asks for."""


@dataclass(frozen=True)
class PromptFormat:
    """How each row's prompt is built (``[data]``'s ``prompt_template``, ``system_prompt`` and
    ``chat``): the template is filled with the row's columns (``str.format`` syntax) and becomes
    a user message (``chat``) or plain text; a system prompt goes first in a chat prompt."""

    template: str | None = None
    system_prompt: str | None = None
    chat: bool = True

    @classmethod
    def of(cls, cfg: Any) -> PromptFormat:
        """From a ``DataConfig``."""
        return cls(cfg.prompt_template, cfg.system_prompt, cfg.chat)

    def apply(self, rows: list[dict[str, Any]], prompt_column: str, where: str) -> None:
        """Write each row's built prompt into ``prompt_column`` (in place)."""
        if self.template is None and self.system_prompt is None:
            return
        for i, row in enumerate(rows):
            if self.template is not None:
                try:
                    prompt: Any = self.template.format_map(row)
                except KeyError as e:
                    raise DataError(
                        f"{where} row {i} has no {e.args[0]!r} column, which data.prompt_template "
                        f"names (columns: {sorted(row)})"
                    ) from None
                except (IndexError, AttributeError, TypeError, ValueError) as e:
                    raise DataError(f"{where} row {i}: data.prompt_template: {e}") from None
                if self.chat:
                    prompt = [{"role": "user", "content": prompt}]
            elif prompt_column not in row:
                continue  # load_rows names the missing column
            else:
                prompt = row[prompt_column]
                if isinstance(prompt, str):
                    prompt = [{"role": "user", "content": prompt}]
            if self.system_prompt is not None and isinstance(prompt, list):
                if prompt and isinstance(prompt[0], dict) and prompt[0].get("role") == "system":
                    raise DataError(
                        f"{where} row {i}: {prompt_column!r} already starts with a system "
                        "message; unset data.system_prompt or drop the row's own"
                    )
                prompt = [{"role": "system", "content": self.system_prompt}, *prompt]
            row[prompt_column] = prompt


def load_rows(
    path: str | Path,
    prompt_column: str,
    *,
    allow_empty: bool = False,
    settings: tuple[str, str] = ("data.path", "data.prompt_column"),
    split: str = "train",
    subset: str | None = None,
    prompt_format: PromptFormat | None = None,
) -> list[dict[str, Any]]:
    """The rows of a dataset, each with a prompt that the rollout server would take
    (``allow_empty``: an empty prompt too, as SFT completions may have). ``path``: a JSONL,
    Parquet, CSV or JSON file, a ``datasets`` directory (saved by ``save_to_disk``, or data files
    laid out as on the Hub), or a Hub dataset id; ``split`` and ``subset`` (the dataset's config
    name) pick from the last two. ``settings``: the config fields of the path and the column,
    for the messages. ``prompt_format`` builds the prompts from the other columns first."""
    path_setting, column_setting = settings
    rows = read_rows(str(path), path_setting, split=split, subset=subset)
    if prompt_format is not None:
        prompt_format.apply(rows, prompt_column, str(path))
    check_prompts(rows, path, prompt_column, column_setting, allow_empty=allow_empty)
    return rows


def check_prompts(
    rows: list[dict[str, Any]],
    path: str | Path,
    prompt_column: str,
    column_setting: str,
    *,
    allow_empty: bool = False,
) -> None:
    """That every row has a prompt the rollout server would take (see ``load_rows``)."""
    for i, row in enumerate(rows):
        prompt = row.get(prompt_column)
        if prompt is None:
            raise DataError(
                f"{path} row {i} has no {prompt_column!r} column (columns: {sorted(row)}); "
                f"set {column_setting}"
                + ("" if column_setting.startswith("sft.") else ", or data.prompt_template")
            )
        if not isinstance(prompt, str | list):
            raise DataError(
                f"{path} row {i}: {prompt_column!r} must be text or a list of chat messages"
            )
        if prompt or not allow_empty:
            _check_prompt(prompt, f"{path} row {i}: {prompt_column!r}")


def read_rows(
    source: str, path_setting: str, *, split: str = "train", subset: str | None = None
) -> list[dict[str, Any]]:
    """The rows of ``source`` as they are (see ``load_rows``); at least one."""
    rows = _read(source, path_setting, split, subset)
    if not rows:
        raise DataError(f"{path_setting} {source} holds no rows")
    return rows


def _read(source: str, path_setting: str, split: str, subset: str | None) -> list[dict[str, Any]]:
    path = Path(source)
    section = path_setting.split(".")[0]
    if path.is_file() and path.suffix.lower() not in _BUILDERS:
        return _read_jsonl(path)
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a dependency
        raise DataError(f"{path_setting} {source}: install `datasets` to read it") from e
    if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "state.json")):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(
                    f"{path_setting} {source} holds splits {list(ds)}, not {split!r}: set "
                    f"{section}.split"
                )
            ds = ds[split]
        return ds.to_list()
    if path.is_file():  # one file: datasets names its only split "train"
        kwargs: dict[str, Any] = {"data_files": str(path), "split": "train"}
        builder = _BUILDERS[path.suffix.lower()]
    elif path.is_dir() or (_HUB_ID.fullmatch(source) and path.suffix.lower() not in _FILE_SUFFIXES):
        kwargs, builder = {"name": subset, "split": split}, source
    else:
        raise DataError(
            f"{path_setting} {source} does not exist (looked at {path.resolve()}; a relative path "
            "is read next to the config file if it is there, else from the working directory)"
        )
    # A local source is converted afresh into a cache of its own: datasets' cache key for a
    # local directory ignores where it lies and what it holds (two directories of one name
    # read as the first one's rows), and ranks reading at once must not share a half-written
    # cache. Hub datasets use the shared cache (keyed by the repository's commit).
    cache_dir = tempfile.mkdtemp(prefix="grpo-data-") if path.exists() else None
    try:
        return datasets.load_dataset(builder, cache_dir=cache_dir, **kwargs).to_list()
    except Exception as e:  # datasets raises many kinds; each becomes one line naming the fix
        if path.is_file() and _decode_failed(e):  # which line: datasets does not say
            _check_utf8(path)
        raise DataError(_load_error(source, path, path_setting, section, e)) from e
    finally:
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)


def _load_error(source: str, path: Path, path_setting: str, section: str, e: Exception) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines()] or [type(e).__name__]
    message = lines[0]
    if "Config name is missing" in message or "BuilderConfig" in message:
        return f"{path_setting} {source}: {' '.join(lines[:2])} Set {section}.subset"
    if "Unknown split" in message:
        return f"{path_setting} {source}: {message} Set {section}.split"
    if path.exists():
        return f"{path_setting} {source} could not be read: {type(e).__name__}: {message}"
    return (
        f"{path_setting} {source} is not a local file or directory (looked at {path.resolve()}) "
        f"and could not be loaded from the Hugging Face Hub ({type(e).__name__}: {message}); "
        "fix the path, or reach the Hub (HF_HUB_OFFLINE unset, network, HF_TOKEN for a gated "
        "dataset), or download it first and give its directory"
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open("rb") as f:  # bytes: each line decoded as UTF-8 whatever the locale says
        for lineno, raw in enumerate(f, 1):
            line = _utf8_line(path, lineno, raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno} is not valid JSON: {e}") from e
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno} must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _utf8_line(path: Path, lineno: int, raw: bytes) -> str:
    """One line of a text file (a byte-order mark at the start of the file dropped), or a
    ``DataError`` naming the file, the line and the byte that is not UTF-8."""
    try:
        return raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:
        column = len(raw[: e.start].decode("utf-8", errors="replace")) + 1
        raise DataError(
            f"{path}:{lineno} is not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column}): "
            f"{path.suffix.lstrip('.').upper() or 'the data'} must be UTF-8; convert the file, "
            "e.g. `iconv -f latin1 -t utf-8 FILE > NEW` for Latin-1 text"
        ) from None


def _check_utf8(path: Path) -> None:
    """A ``DataError`` naming the first line of ``path`` that is not UTF-8, if one is."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            _utf8_line(path, lineno, raw)


def _decode_failed(e: BaseException) -> bool:
    """Whether ``e`` or an error it came from is a failure to decode UTF-8 (a
    ``UnicodeDecodeError``, or pyarrow's ``Invalid octet in UTF-8 sequence``)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, UnicodeDecodeError) or "utf-8" in str(cur).lower():
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


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
    """An endless, seeded, resumable stream of rows over epochs.

    ``take_refill`` draws from a second seeded pass over the same rows with its own position
    (DAPO's dynamic sampling tops a step up from it): the main order, which rows prefetched for
    later steps already hold, stays as it is, and both positions are checkpointed exactly."""

    def __init__(self, rows: list[dict[str, Any]], *, seed: int, shuffle: bool) -> None:
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        self.pending = 0  # rows taken for generations not trained on yet (overlap)
        self.refill_position = 0
        self._orders: dict[str, tuple[int, list[int]]] = {}  # pass -> (epoch, order)
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

    def _order_for(self, epoch: int, kind: str = "main") -> list[int]:
        cached = self._orders.get(kind)  # each pass keeps its current epoch's order
        if cached is None or cached[0] != epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                seed = self.seed + epoch if kind == "main" else f"{kind}:{self.seed}:{epoch}"
                random.Random(seed).shuffle(order)
            cached = self._orders[kind] = (epoch, order)
        return cached[1]

    def _take(self, count: int, start: int, kind: str) -> list[dict[str, Any]]:
        out = []
        for position in range(start, start + count):
            epoch, index = divmod(position, len(self.rows))
            out.append(self.rows[self._order_for(epoch, kind)[index]])
        return out

    def take(self, count: int) -> list[dict[str, Any]]:
        out = self._take(count, self.position, "main")
        self.position += count
        return out

    def take_refill(self, count: int) -> list[dict[str, Any]]:
        """``count`` rows of the refill pass (its own seeded order; unshuffled data: the rows
        in order, as the main pass)."""
        out = self._take(count, self.refill_position, "refill")
        self.refill_position += count
        return out

    def state_dict(self) -> dict[str, int]:
        # Rows prefetched for generation but not trained on are replayed after a resume.
        return {
            "position": self.position - self.pending,
            "refill_position": self.refill_position,
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
        self.refill_position = int(state.get("refill_position", 0))  # older checkpoints: none
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
