"""Find reward functions and environments by name, through Python entry points.

A plugin is any installed distribution that declares, in its ``pyproject.toml``::

    [project.entry-points."grpo_service.rewards"]
    my_reward = "my_pkg.rewards:my_reward"

    [project.entry-points."grpo_service.environments"]
    my_env = "my_pkg.envs:MyEnvironment"

This project registers its own built-ins the same way, so there is one lookup path for everything.
Nothing is imported until a name is loaded: listing is cheap and a broken plugin only fails when
it is used.

One name is not an entry point: ``openreward:<target>`` builds an environment that talks to a
server of the Open Reward Standard (see ``rewards.openreward_adapter``), so a config line like
``environment = "openreward:http://127.0.0.1:8080"`` is all it takes to train on one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rewards.env import Environment

REWARD_GROUP = "grpo_service.rewards"
ENVIRONMENT_GROUP = "grpo_service.environments"
OPENREWARD_PREFIX = "openreward:"

Kind = Literal["reward", "environment"]
_GROUPS: dict[Kind, str] = {"reward": REWARD_GROUP, "environment": ENVIRONMENT_GROUP}

RewardFn = Callable[..., Any]
"""``fn(prompts, completions, **columns) -> list[float | None]``, sync or async."""


class PluginError(Exception):
    """Base class of the registry's errors."""


class UnknownPluginError(PluginError, LookupError):
    """No reward or environment is registered under that name."""


class DuplicatePluginError(PluginError):
    """Two installed distributions register the same name in the same group."""


class InvalidPluginError(PluginError, TypeError):
    """The entry point loads, but not to the kind of object its group promises."""


@dataclass(frozen=True)
class Registered:
    """One entry point: what it is, its name, the distribution that declares it, and its target
    (``module:attribute``)."""

    kind: Kind
    name: str
    dist: str
    target: str


def _dist_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else "<unknown distribution>"


def _entries(kind: Kind) -> list[tuple[Registered, EntryPoint]]:
    """All entry points of a group, once each (the same distribution found twice on sys.path,
    e.g. an egg-info next to an editable install, is not a duplicate)."""
    seen: set[tuple[str, str, str]] = set()
    out = []
    for ep in entry_points(group=_GROUPS[kind]):
        reg = Registered(kind=kind, name=ep.name, dist=_dist_name(ep), target=ep.value)
        key = (reg.name, reg.dist.lower().replace("_", "-"), reg.target)
        if key not in seen:
            seen.add(key)
            out.append((reg, ep))
    return out


def list_registered(kind: Kind | None = None) -> list[Registered]:
    """Every registered reward and environment (or only one kind), sorted by kind then name.
    Duplicated names appear once per distribution; ``find_duplicates`` reports them."""
    kinds: list[Kind] = [kind] if kind else ["reward", "environment"]
    regs = [reg for k in kinds for reg, _ in _entries(k)]
    return sorted(regs, key=lambda r: (r.kind, r.name, r.dist))


def find_duplicates(kind: Kind | None = None) -> dict[tuple[Kind, str], list[Registered]]:
    """Names registered by more than one distribution, keyed by (kind, name)."""
    by_name: dict[tuple[Kind, str], list[Registered]] = {}
    for reg in list_registered(kind):
        by_name.setdefault((reg.kind, reg.name), []).append(reg)
    return {key: regs for key, regs in by_name.items() if len(regs) > 1}


def _resolve(kind: Kind, name: str) -> tuple[Registered, EntryPoint]:
    matches = [(reg, ep) for reg, ep in _entries(kind) if reg.name == name]
    if not matches:
        known = sorted({reg.name for reg, _ in _entries(kind)})
        hint = (
            f" For a server of the Open Reward Standard use '{OPENREWARD_PREFIX}<url or name>'."
            if kind == "environment"
            else ""
        )
        raise UnknownPluginError(
            f"no {kind} named {name!r} is registered (entry-point group {_GROUPS[kind]!r}). "
            f"Known {kind}s: {', '.join(known) or '(none)'}. Install the package that provides "
            f'it, or register it under [project.entry-points."{_GROUPS[kind]}"].{hint}'
        )
    if len(matches) > 1:
        where = ", ".join(f"{reg.dist} ({reg.target})" for reg, _ in matches)
        raise DuplicatePluginError(
            f"the {kind} name {name!r} is registered by more than one distribution: {where}. "
            f"Uninstall one of them or rename its entry point."
        )
    return matches[0]


def load_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``."""
    reg, ep = _resolve("reward", name)
    fn = ep.load()
    if not callable(fn) or inspect.isclass(fn):
        raise InvalidPluginError(
            f"reward {name!r} ({reg.target}, from {reg.dist}) is a {type(fn).__name__}, not a "
            f"function; point the entry point at fn(prompts, completions, **columns)."
        )
    return fn


def load_environment(name: str) -> type[Environment]:
    """The environment class registered as ``name``, or an adapter class for
    ``openreward:<url or hosted name>``."""
    from rewards.env import Environment

    if name.startswith(OPENREWARD_PREFIX):
        from rewards.openreward_adapter import openreward_environment

        return openreward_environment(name.removeprefix(OPENREWARD_PREFIX))
    reg, ep = _resolve("environment", name)
    cls = ep.load()
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise InvalidPluginError(
            f"environment {name!r} ({reg.target}, from {reg.dist}) is {cls!r}, not a subclass of "
            f"rewards.env.Environment; point the entry point at the class."
        )
    return cls
