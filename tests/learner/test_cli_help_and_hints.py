"""What ``python -m learner`` tells a newcomer: ``--help`` lists the subcommands with a line
each, ``eval --help`` explains ``--set``, and a config error suggests the fix (the field a typo
meant, the section a field belongs to, how to quote a list in ``--set``, a directory named as
the config), pointing at docs/configuration.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from learner.config import ConfigError, load_config
from tests.learner.demo_runs import DEMO, ROOT, learner_env


def learner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "learner", *args], env=learner_env(), capture_output=True,
        text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


def test_help_lists_each_subcommand_with_a_line_and_eval_help_explains_set() -> None:
    top = learner("--help")
    assert top.returncode == 0, top.stderr
    lines = top.stdout.splitlines()
    for name, words in [("sft", "supervised"), ("eval", "evaluate"), ("plot", "curves")]:
        assert any(line.split()[:1] == [name] and words in line for line in lines), top.stdout
    ev = learner("eval", "--help")
    assert ev.returncode == 0 and "usage: python -m learner eval" in ev.stdout
    assert "override one field" in ev.stdout and "docs/configuration.md" in ev.stdout
    assert "beside a --model directory" in ev.stdout
    plot = learner("plot", "--help")
    assert plot.returncode == 0 and "usage: python -m learner plot" in plot.stdout
    bare = learner()
    assert bare.returncode == 2 and "required: --config" in bare.stderr


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("optim.lrr=1e-3", "optim.lrr: unknown field — did you mean `lr`?"),
        ("lr=1e-3", "lr: unknown field — did you mean `optim.lr` or `sft.lr`"),
        ("grpo.lr=1e-3", "grpo.lr: unknown field — did you mean `optim.lr`"),
        ("model.lora.rr=8", "model.lora.rr: unknown field — did you mean `r`?"),
        ("tempreature=0.7", "did you mean `sampling.temperature` or `eval.temperature`?"),
        ('rewards=[{nmae="charset"}]', "rewards.0.nmae: unknown field — did you mean `name`?"),
        ("sampling.stop=stop", 'give a TOML list, e.g. stop = ["a", "b"]'),
    ],
)
def test_an_unknown_or_misplaced_field_suggests_the_right_one(override: str, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, [override])
    assert hint in str(info.value)
    assert "learner/config/__init__.py" not in str(info.value)


def test_unknown_fields_point_at_the_configuration_docs() -> None:
    with pytest.raises(ConfigError, match=r"\(see docs/configuration\.md\)"):
        load_config(DEMO, ["optim.zzzz=1"])
    assert (ROOT / "docs" / "configuration.md").is_file()


def test_a_list_the_shell_stripped_of_its_quotes_says_how_to_quote_it() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, ["sampling.stop=[</s>, END]"])
    assert "is not a TOML list" in str(info.value)
    assert """--set 'sampling.stop=["</s>", "END"]'""" in str(info.value)
    quoted = load_config(DEMO, ['sampling.stop=["</s>", "END"]'])  # what the hint says works
    assert quoted.sampling.stop == ["</s>", "END"]
    assert load_config(DEMO, ["sampling.stop=[]"]).sampling.stop == []


def test_the_cli_says_what_is_wrong_with_the_config_file_in_one_line(tmp_path: Path) -> None:
    proc = learner("--config", str(DEMO.parent))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == f"config file {DEMO.parent} is a directory: name a .toml file in it"  # fmt: skip
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"[model]\nname_or_path = 'tiny'\n# caf\xe9\n")
    proc = learner("--config", str(latin1))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"{latin1}:3 is not UTF-8 text (byte 0xe9)")
    proc = learner("--config", str(DEMO), "--set", "lr=1e-3")
    assert proc.returncode == 2 and "did you mean `optim.lr`" in proc.stderr, proc.stderr
