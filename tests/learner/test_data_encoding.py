"""Data files that are not UTF-8: one line naming the file, the line and the byte (exit 2 from
the CLI, before any model loads), whichever reader takes the file; a UTF-8 byte-order mark is
no error."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.data.prompts import DataError, read_rows
from tests.learner.demo_runs import assert_setup_error

LATIN1 = {
    "jsonl": b'{"prompt": "ok"}\n{"prompt": "caf\xe9 au lait"}\n',
    "csv": b"prompt\ncaf\xe9 au lait\nok\n",
    "json": b'[{"prompt": "ok"},\n {"prompt": "caf\xe9 au lait"}]\n',
}


@pytest.mark.parametrize("suffix", sorted(LATIN1))
def test_a_file_that_is_not_utf8_names_its_line(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"latin1.{suffix}"
    path.write_bytes(LATIN1[suffix])
    with pytest.raises(DataError) as info:
        read_rows(str(path), "data.path")
    message = str(info.value)
    assert message.startswith(f"{path}:2 is not UTF-8 text (byte 0xe9 at column ")
    assert "iconv" in message and "\n" not in message


def test_a_byte_order_mark_is_read_as_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes('\ufeff{"prompt": "café"}\n{"prompt": "b"}\n'.encode())
    assert read_rows(str(path), "data.path") == [{"prompt": "café"}, {"prompt": "b"}]


def test_the_learner_stops_at_setup_naming_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(LATIN1["jsonl"])
    assert_setup_error(
        tmp_path / "run", f"data.path={str(path)!r}", f"{path}:2 is not UTF-8 text (byte 0xe9"
    )
