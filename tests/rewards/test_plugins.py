"""Entry-point discovery with real installed packages.

The test writes three small distributions to a temporary directory and installs each with pip
(``--target``, so the shared virtualenv is untouched): one registers a reward and an
environment, another a reward whose name clashes with the first's, and the third makes a plugin
author's usual mistakes (a misspelt group, a module that fails to import, a target that does
not exist, a tool without a pydantic argument). Putting a target directory
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
    PluginImportError,
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

PLUGIN_BAD = """
from rewards.env import Environment, ToolResult, tool


def ok(prompts, completions, **columns):
    return [1.0] * len(completions)


class BadTool(Environment):
    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    def list_tasks(cls, split):
        return [{}]

    def get_prompt(self):
        return "Guess."

    @tool
    def guess(self, number: int) -> ToolResult:
        return ToolResult(text="?")
"""


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
    bad = _write_package(
        root,
        "grpo-bad-plugin",
        "grpo_bad_plugin",
        PLUGIN_BAD,
        '[project.entry-points."grpo_service.reward"]\n'  # the group misspelt
        'misgrouped = "grpo_bad_plugin:ok"\n'
        '[project.entry-points."grpo_service.rewards"]\n'
        'import_broken = "grpo_bad_plugin.broken:fn"\n'
        'attr_typo = "grpo_bad_plugin:okk"\n'
        '[project.entry-points."grpo_service.environments"]\n'
        'bad_tool = "grpo_bad_plugin:BadTool"\n',
    )
    (bad / "grpo_bad_plugin" / "broken.py").write_text("import not_installed_pkg\n")
    out = {"a": root / "site-a", "b": root / "site-b", "bad": root / "site-bad"}
    _pip_install(a, out["a"])
    _pip_install(b, out["b"])
    _pip_install(bad, out["bad"])
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


def test_a_misspelt_name_gets_the_close_one_suggested():
    with pytest.raises(UnknownPluginError, match="Did you mean 'math_accuracy'"):
        load_reward("math_acuracy")
    with pytest.raises(UnknownPluginError, match="Did you mean 'calculator'"):
        load_environment("calculater")


def test_a_name_under_a_misspelt_group_names_the_group_to_use(sites, monkeypatch):
    monkeypatch.syspath_prepend(str(sites["bad"]))
    with pytest.raises(UnknownPluginError) as info:
        load_reward("misgrouped")
    msg = str(info.value)
    assert "'misgrouped' (from grpo-bad-plugin) registered under the entry-point group " in msg
    assert "'grpo_service.reward', which is not read; the group must be " in msg
    assert "'grpo_service.rewards'" in msg

    out = _cli(sites["bad"])
    assert out.returncode == 1
    [line] = [x for x in out.stderr.splitlines() if "'misgrouped' (from grpo-bad-plugin)" in x]
    assert "registered under the entry-point group 'grpo_service.reward'" in line


def test_a_plugin_that_fails_to_import_is_one_line_naming_the_plugin(sites, monkeypatch):
    monkeypatch.syspath_prepend(str(sites["bad"]))
    with pytest.raises(PluginImportError) as info:
        load_reward("import_broken")
    msg = str(info.value)
    assert "reward 'import_broken' (grpo_bad_plugin.broken:fn, from grpo-bad-plugin)" in msg
    assert "failed to load: ModuleNotFoundError: No module named 'not_installed_pkg' at " in msg
    assert msg.split(" at ")[1].startswith(str(sites["bad"] / "grpo_bad_plugin" / "broken.py:1"))
    with pytest.raises(PluginImportError, match=r"has no attribute 'okk'\. Fix the module"):
        load_reward("attr_typo")


def test_an_environment_tool_without_a_pydantic_argument_fails_at_load(sites, monkeypatch):
    monkeypatch.syspath_prepend(str(sites["bad"]))
    with pytest.raises(InvalidPluginError) as info:
        load_environment("bad_tool")
    assert "environment 'bad_tool' (grpo_bad_plugin:BadTool, from grpo-bad-plugin): " in str(
        info.value
    )
    assert "tool BadTool.guess takes (number: int); a tool takes exactly one argument " in str(
        info.value
    )


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
