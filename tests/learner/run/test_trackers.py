"""Experiment trackers (``run.report_to``): a real learner run reporting to W&B in offline mode,
read back from the run's own W&B log, then resumed into the same W&B run."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from learner.config import ConfigError, load_config
from learner.run.metrics import read_metrics
from tests.learner.demo_runs import DEMO, assert_setup_error, run_ok


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file (``run-<id>.wandb``): a 7-byte header,
    then LevelDB-log records (4-byte checksum, 2-byte length, 1-byte type) in 32 KiB blocks,
    a record split over blocks as first / middle / last parts."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts, out = 7, 32768, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # a block's padding
            pos += left
            continue
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a full record, or a split one's last part
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
            parts = []
    return out


def _history(path: Path) -> tuple[str, dict[str, str], list[dict[str, float]]]:
    """The run id, its config and its history rows, from one offline run file."""
    run_id, config, rows = "", {}, []
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id = r.run.run_id
            config.update({i.key: i.value_json for i in r.run.config.update})
        elif kind == "config":
            config.update({i.key: i.value_json for i in r.config.update})
        elif kind == "history":
            # a key W&B may split (one with a "." or "/") comes as nested_key parts
            items = r.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return run_id, config, rows


@pytest.mark.slow
def test_a_run_reports_to_wandb_and_its_resume_continues_the_same_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: W&B writes its log locally
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    sets = ('run.report_to=["wandb"]', "sampling.max_tokens=8", "run.checkpoint_every=2",
            'rollout.api_key="s3cret"')  # fmt: skip
    run_ok(run, "run.steps=2", *sets)
    [first] = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    run_id, config, rows = _history(first)
    assert run_id == (run / "tracker_run_id").read_text().strip()
    assert json.loads(config["grpo.loss_type"]) == "dapo"  # the config, flattened
    assert json.loads(config["run.report_to"]) == ["wandb"]
    assert json.loads(config["rollout.api_key"]) == "***"  # the config leaves the machine
    assert json.loads(config["sampling.max_tokens"]) == 8  # counts tokens: no secret
    logged = {int(r["_step"]): r for r in rows}
    assert sorted(logged) == [1, 2]
    for record in read_metrics(run):  # the same values as metrics.jsonl
        step = int(record["step"])
        assert logged[step]["reward/mean"] == pytest.approx(record["reward/mean"])
        assert logged[step]["loss"] == pytest.approx(record["loss"])
    run_ok(run, "run.steps=3", *sets, resume=True)
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0] == first
    again, _, rows = _history(files[1])
    assert again == run_id  # resumed into the same W&B run
    assert [int(r["_step"]) for r in rows] == [3]


def test_tracker_settings_are_checked_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.report_to\.0: Input should be 'wandb', 'mlflow'"):
        load_config(DEMO, ['run.report_to=["tensorboard"]'])  # run.tensorboard does that
    with pytest.raises(ConfigError, match=r"run\.tracker_kwargs: \['mlflow'\] not in run\.rep"):
        load_config(DEMO, ['run.report_to=["wandb"]', "run.tracker_kwargs={mlflow={a=1}}"])
    assert_setup_error(
        tmp_path / "run",
        'run.report_to=["swanlab"]',  # not installed here
        "run.report_to names 'swanlab', whose package is not installed: pip install swanlab",
    )
