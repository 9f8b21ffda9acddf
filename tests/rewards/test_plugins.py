"""Entry-point discovery with real installed packages.

The test writes two small distributions to a temporary directory and installs each with pip
(``--target``, so the shared virtualenv is untouched): one registers a reward and an
environment, the other a reward whose name clashes with the first's. Putting a target directory
on ``sys.path`` is what makes its distributions visible to ``importlib.metadata``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rewards.builtin.calculator import CalculatorEnv
from rewards.builtin.math import math_accuracy
from rewards.episode import run_episodes
from rewards.registry import (
    DuplicatePluginError,
    InvalidPluginError,
    UnknownPluginError,
    list_registered,
    load_environment,
    load_reward,
)
from rewards.scoring import RewardRunner, RewardSpec

PLUGIN_A = '''
from pydantic import BaseModel

from rewards.env import Environment, ToolResult, tool


def exclaim(prompts, completions, **columns):
    return [float(c.count("!")) for c in completions]


def clash(prompts, completions, **columns):
    return [1.0] * len(completions)


not_a_function = 42


class Echo(BaseModel):
    text: str


class EchoEnv(Environment):
    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split):
        return [{"word": "ping"}]

    def get_prompt(self):
        return f"Say {self.task['word']} with the echo tool."

    @tool
    def echo(self, args: Echo) -> ToolResult:
        """Echo text back."""
        ok = args.text == self.task["word"]
        return ToolResult(text=args.text, reward=float(ok), finished=ok)
'''


def _write_package(root: Path, dist: str, module: str, code: str, entry_points: str) -> Path:
    pkg = root / dist
    (pkg / module).mkdir(parents=True)
    (pkg / module / "__init__.py").write_text(code)
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["setuptools>=61"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{dist}"
            version = "0.1.0"

            [tool.setuptools]
            packages = ["{module}"]
            """
        )
        + entry_points
    )
    return pkg


def _pip_install(pkg: Path, target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(pkg)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plugins")
    a = _write_package(
        root,
        "grpo-test-plugin",
        "grpo_test_plugin",
        PLUGIN_A,
        '[project.entry-points."grpo_service.rewards"]\n'
        'exclaim = "grpo_test_plugin:exclaim"\n'
        'clash = "grpo_test_plugin:clash"\n'
        'broken = "grpo_test_plugin:not_a_function"\n'
        '[project.entry-points."grpo_service.environments"]\n'
        'echo = "grpo_test_plugin:EchoEnv"\n',
    )
    b = _write_package(
        root,
        "grpo-other-plugin",
        "grpo_other_plugin",
        "def clash(prompts, completions, **columns):\n    return [0.0] * len(completions)\n",
        '[project.entry-points."grpo_service.rewards"]\nclash = "grpo_other_plugin:clash"\n',
    )
    out = {"a": root / "site-a", "b": root / "site-b"}
    _pip_install(a, out["a"])
    _pip_install(b, out["b"])
    return out


@pytest.fixture
def plugin_a(sites, monkeypatch):
    monkeypatch.syspath_prepend(str(sites["a"]))


def test_builtins_are_found_through_entry_points():
    assert load_reward("math_accuracy") is math_accuracy
    assert load_environment("calculator") is CalculatorEnv
    ours = {(r.kind, r.name) for r in list_registered() if r.dist == "grpo-service"}
    assert {("reward", n) for n in ("math_accuracy", "format", "length", "code")} <= ours
    assert ("environment", "calculator") in ours


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownPluginError, match="no reward named 'nope'") as info:
        load_reward("nope")
    assert "math_accuracy" in str(info.value) and "length" in str(info.value)
    assert isinstance(info.value, LookupError)
    with pytest.raises(UnknownPluginError, match=r"Known environments: .*calculator"):
        load_environment("nope")


async def test_plugin_reward_and_environment_are_discovered_and_used(plugin_a, chat, scripted):
    regs = {(r.kind, r.name): r for r in list_registered()}
    assert regs[("reward", "exclaim")].dist == "grpo-test-plugin"
    assert regs[("environment", "echo")].target == "grpo_test_plugin:EchoEnv"

    runner = RewardRunner([RewardSpec(name="exclaim"), RewardSpec(name="length", weight=0.0)])
    res = await runner.score(["q", "q"], ["hi!", "wow!!!"])
    assert res.per_function["exclaim"] == [1.0, 3.0] and res.total == [1.0, 3.0]

    env_cls = load_environment("echo")
    assert env_cls.__module__ == "grpo_test_plugin"
    model = scripted(
        {"Say ping": ['<tool_call>{"name": "echo", "arguments": {"text": "ping"}}</tool_call>']}
    )
    [episode] = await run_episodes(env_cls, env_cls.list_tasks("train"), model, chat, max_turns=2)
    assert episode.error is None and episode.finished and episode.reward == 1.0


def test_plugin_that_is_not_a_function_is_named(plugin_a):
    with pytest.raises(InvalidPluginError, match=r"'broken' \(grpo_test_plugin:not_a_function"):
        load_reward("broken")


def test_duplicate_names_name_both_distributions(sites, monkeypatch):
    monkeypatch.syspath_prepend(str(sites["a"]))
    monkeypatch.syspath_prepend(str(sites["b"]))
    with pytest.raises(DuplicatePluginError, match="'clash'") as info:
        load_reward("clash")
    assert "grpo-test-plugin" in str(info.value) and "grpo-other-plugin" in str(info.value)
    assert load_reward("exclaim")(["q"], ["!"]) == [1.0]  # other names are unaffected


def _cli(*paths: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}
    return subprocess.run(
        [sys.executable, "-m", "rewards", "list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_cli_lists_rewards_and_environments_with_their_distribution(sites):
    out = _cli(sites["a"])
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    assert ["reward", "exclaim", "grpo-test-plugin", "grpo_test_plugin:exclaim"] in rows
    assert ["environment", "echo", "grpo-test-plugin", "grpo_test_plugin:EchoEnv"] in rows
    assert ["reward", "math_accuracy", "grpo-service", "rewards.builtin.math:math_accuracy"] in rows

    dup = _cli(sites["a"], sites["b"])
    assert dup.returncode == 1
    assert "reward 'clash' is registered by several distributions" in dup.stderr
    assert "grpo-other-plugin" in dup.stderr and "grpo-test-plugin" in dup.stderr
