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

import difflib
import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Literal

from rewards.errors import PluginError

if TYPE_CHECKING:
    from rewards.env import Environment

REWARD_GROUP = "grpo_service.rewards"
ENVIRONMENT_GROUP = "grpo_service.environments"
OPENREWARD_PREFIX = "openreward:"

Kind = Literal["reward", "environment"]
_GROUPS: dict[Kind, str] = {"reward": REWARD_GROUP, "environment": ENVIRONMENT_GROUP}

RewardFn = Callable[..., Any]
"""``fn(prompts, completions, **columns) -> list[float | None]``, sync or async."""


class UnknownPluginError(PluginError, LookupError):
    """No reward or environment is registered under that name."""


class DuplicatePluginError(PluginError):
    """Two installed distributions register the same name in the same group."""


class InvalidPluginError(PluginError, TypeError):
    """The entry point loads, but not to the kind of object its group promises, or an
    environment's tools are declared wrongly."""


class PluginImportError(PluginError, ImportError):
    """Importing an entry point's target failed (its module raised, or it has no such
    attribute)."""


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


def misplaced_groups() -> dict[str, list[Registered]]:
    """Entry points in groups that look like ours but are not (``grpo_service.reward``,
    ``grpo-service.rewards``, ...), keyed by that group: a typo in a plugin's ``pyproject.toml``
    that would otherwise only show as an unknown name."""
    ours = list(_GROUPS.values())
    out: dict[str, list[Registered]] = {}
    all_eps = entry_points()
    for group in sorted(all_eps.groups):
        if group in ours:
            continue
        close = difflib.get_close_matches(group.lower(), ours, n=1, cutoff=0.75)
        if not close and "grpo" not in group.lower():
            continue
        intended = close[0] if close else ""
        kind: Kind = "environment" if intended == ENVIRONMENT_GROUP else "reward"
        regs = {
            Registered(kind=kind, name=ep.name, dist=_dist_name(ep), target=ep.value)
            for ep in all_eps.select(group=group)
        }
        if regs:
            out[group] = sorted(regs, key=lambda r: (r.name, r.dist))
    return out


def misplaced_hint(group: str, regs: list[Registered]) -> str:
    """One line: which distribution registers what under a look-alike group, and the fix."""
    close = difflib.get_close_matches(group.lower(), list(_GROUPS.values()), n=1, cutoff=0.75)
    use = f"'{close[0]}'" if close else f"'{REWARD_GROUP}' or '{ENVIRONMENT_GROUP}'"
    what = ", ".join(f"{r.name!r} (from {r.dist})" for r in regs)
    return (
        f"{what} registered under the entry-point group {group!r}, which is not read; "
        f'the group must be {use}: fix [project.entry-points."..."] in pyproject.toml and '
        f"reinstall the package"
    )


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
        for group, regs in misplaced_groups().items():
            if mine := [r for r in regs if r.name == name]:
                raise UnknownPluginError(
                    f"no {kind} named {name!r} is registered: {misplaced_hint(group, mine)}"
                )
        known = sorted({reg.name for reg, _ in _entries(kind)})
        close = difflib.get_close_matches(name, known, n=1)
        did_you_mean = f" Did you mean {close[0]!r}?" if close else ""
        hint = (
            f" For a server of the Open Reward Standard use '{OPENREWARD_PREFIX}<url or name>'."
            if kind == "environment"
            else ""
        )
        raise UnknownPluginError(
            f"no {kind} named {name!r} is registered (entry-point group {_GROUPS[kind]!r}).{did_you_mean} "
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


def _load(reg: Registered, ep: EntryPoint) -> Any:
    """``ep.load()``, with an import failure in the plugin turned into one line that names the
    entry point, its distribution, and where in the plugin's code it failed."""
    try:
        return ep.load()
    except Exception as e:
        frames = [  # the plugin's own frames: not ours, not importlib's
            f
            for f in traceback.extract_tb(e.__traceback__)
            if "importlib" not in f.filename and f.filename != __file__
        ]
        where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        raise PluginImportError(
            f"{reg.kind} {reg.name!r} ({reg.target}, from {reg.dist}) failed to load: "
            f"{type(e).__name__}: {e}{where}. Fix the module or the entry point's target, or "
            f"install what it imports"
        ) from e


def load_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``."""
    reg, ep = _resolve("reward", name)
    fn = _load(reg, ep)
    if not callable(fn) or inspect.isclass(fn):
        raise InvalidPluginError(
            f"reward {name!r} ({reg.target}, from {reg.dist}) is a {type(fn).__name__}, not a "
            f"function; point the entry point at fn(prompts, completions, **columns)."
        )
    return fn


def load_environment(name: str) -> type[Environment]:
    """The environment class registered as ``name``, or an adapter class for
    ``openreward:<url or hosted name>``. A registered class's tools are checked here, so a
    wrongly declared one fails when the run starts, not in every episode."""
    from rewards.env import Environment, EnvironmentDefinitionError

    if name.startswith(OPENREWARD_PREFIX):
        from rewards.openreward_adapter import openreward_environment

        return openreward_environment(name.removeprefix(OPENREWARD_PREFIX))
    reg, ep = _resolve("environment", name)
    cls = _load(reg, ep)
    if not (inspect.isclass(cls) and issubclass(cls, Environment)):
        raise InvalidPluginError(
            f"environment {name!r} ({reg.target}, from {reg.dist}) is {cls!r}, not a subclass of "
            f"rewards.env.Environment; point the entry point at the class."
        )
    try:
        cls.check_definition()
    except EnvironmentDefinitionError as e:
        raise InvalidPluginError(
            f"environment {name!r} ({reg.target}, from {reg.dist}): {e}"
        ) from e
    return cls
