"""The example reward package, ``examples/reward_plugin``: pip builds and installs it as a user
would (into a ``--target`` directory, so the shared virtualenv is untouched; putting it on
``PYTHONPATH`` is what makes its entry point visible), the registry lists its reward, and the
learner trains the demo task with it, ``examples/reward_plugin/train.toml`` as shipped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reward_plugin"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package installed by pip. Built from a copy (pip builds in the source tree) beside a
    run directory and a config folder, where setuptools' flat-layout discovery would refuse to
    guess which top-level folder is the package."""
    src = tmp_path_factory.mktemp("src") / "reward_plugin"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "runs"))
    (src / "runs" / "vowel_variety").mkdir(parents=True)
    (src / "configs").mkdir()
    target = tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
    proc = subprocess.run([*pip, str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(site)}


def test_the_installed_package_registers_its_reward(site):
    out = subprocess.run(
        [sys.executable, "-m", "rewards", "list"],
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    (line,) = [ln for ln in out.splitlines() if "vowel_variety" in ln]
    assert line.split() == [
        "reward",
        "vowel_variety",
        "vowel-rewards",
        "vowel_rewards:vowel_variety",
    ]


def test_the_reward_counts_the_allowed_letters_used(site):
    sys.path.insert(0, str(site))
    try:
        from vowel_rewards import vowel_variety
    finally:
        sys.path.remove(str(site))
    songs = ["aeiou", "aaaa", "ae ae", "xyz", ""]
    allowed = ["aeiou", "aeiou", "aeiou", "aeiou", None]
    assert vowel_variety([""] * 5, songs, allowed=allowed) == [1.0, 0.2, 0.4, 0.0, None]
    assert vowel_variety([""] * 5, songs, min_count=2, allowed=allowed) == [0, 0.2, 0.4, 0, None]


@pytest.mark.slow
def test_the_learner_trains_the_demo_task_with_it(site, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "learner", "--config", str(EXAMPLE / "train.toml"),
         "--run-dir", str(run_dir), "--set", "run.steps=3", "--set", "run.progress_bar=false"],
        env=_env(site), cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0.0 <= r["reward/vowel_variety/mean"] <= 1.0
        assert r["reward/vowel_variety/none_frac"] == 0.0  # every demo row has `allowed`
        assert r["reward/vowel_variety/failures"] == 0.0
