"""Score a batch of completions with several weighted reward functions, safely.

Reward functions are user code: they raise, hang, return the wrong number of scores, NaN, or a
string. Each of these becomes either a ``RewardFunctionError`` that names the function or, under
an explicit failure policy, a recorded failure (the function's scores for the batch become None
or 0.0, and ``reward/<name>/failures`` says so). A bad reward never turns into a silent 0 copied
to every completion, and a hanging one never hangs the run: every call has a timeout.

Sync functions run in their own daemon thread (``rewards._threads``): one that never returns is
abandoned at the timeout without holding up later calls or interpreter exit. Async functions are
cancelled at the timeout; the built-in code reward kills its sandbox subprocess on cancellation.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rewards._threads import call_maybe_async

logger = logging.getLogger(__name__)

FailurePolicy = Literal["raise", "none", "zero"]
"""What a failing reward function does: raise ``RewardFunctionError``, score the batch as None
(abstain), or score it as 0.0. The last two are counted in ``reward/<name>/failures``."""


class RewardSpec(BaseModel):
    """One reward function of the mix: its registered name, weight, and extra keyword arguments.
    ``label`` names it in results and metrics (default: ``name``); set it when the same function
    appears twice with different kwargs."""

    model_config = ConfigDict(extra="forbid")

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = Field(default_factory=dict)
    label: str | None = None

    @property
    def key(self) -> str:
        return self.label or self.name


class RewardFunctionError(RuntimeError):
    """A reward function failed; ``function`` is its name in the mix."""

    def __init__(self, function: str, message: str) -> None:
        super().__init__(f"reward function {function!r}: {message}")
        self.function = function


class RewardTimeoutError(RewardFunctionError):
    """A reward function did not return within the runner's ``timeout_s``."""


class RewardOutputError(RewardFunctionError):
    """A reward function returned something other than one finite float or None per completion."""


@dataclass
class ScoreResult:
    """``total[i]``: weighted sum of the non-None scores of completion i (0.0 if every function
    abstained). ``per_function``: each function's scores, None = abstain or failed under policy
    "none". ``failures``: the error message of each function that failed in this call."""

    total: list[float]
    per_function: dict[str, list[float | None]]
    metrics: dict[str, float]
    failures: dict[str, str] = field(default_factory=dict)


def check_output(function: str, out: Any, n: int) -> list[float | None]:
    """Validate a reward function's output: a sequence of ``n`` finite numbers or None."""
    if isinstance(out, str | bytes) or not isinstance(out, Sequence):
        if not (hasattr(out, "tolist") and hasattr(out, "__len__")):  # numpy / torch 1-D
            raise RewardOutputError(
                function, f"returned {type(out).__name__}; return a list of {n} floats or None"
            )
        out = out.tolist()
    if len(out) != n:
        raise RewardOutputError(
            function, f"returned {len(out)} scores for {n} completions; return exactly one each"
        )
    scores: list[float | None] = []
    for i, v in enumerate(out):
        if v is None:
            scores.append(None)
            continue
        if not isinstance(v, numbers.Real):
            raise RewardOutputError(
                function, f"score {i} is {v!r} ({type(v).__name__}); use a float, or None"
            )
        if not math.isfinite(float(v)):
            raise RewardOutputError(
                function, f"score {i} is {float(v)}; scores must be finite (None to abstain)"
            )
        scores.append(float(v))
    return scores


def _accepted(fn: Callable, columns: dict[str, Any]) -> dict[str, Any]:
    """The columns ``fn`` can receive: all of them if it takes ``**kwargs``, else the named ones."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return columns
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return columns
    names = {p.name for p in params}
    return {k: v for k, v in columns.items() if k in names}


def _stats(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


class RewardRunner:
    """Run the reward mix on a batch: concurrently, each call under ``timeout_s``, every output
    checked, failures handled by ``policy``. ``funcs`` maps names to callables and takes
    precedence over the entry-point registry (tests, notebooks). ``failure_counts`` accumulates
    failed calls per function over the runner's lifetime."""

    def __init__(
        self,
        specs: Sequence[RewardSpec | dict[str, Any]],
        *,
        timeout_s: float = 30.0,
        policy: FailurePolicy = "raise",
        funcs: dict[str, Callable] | None = None,
    ) -> None:
        from rewards.registry import load_reward

        if policy not in ("raise", "none", "zero"):
            raise ValueError(f"policy={policy!r}; use 'raise', 'none' or 'zero'")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}; must be > 0 seconds")
        self.specs = [s if isinstance(s, RewardSpec) else RewardSpec(**s) for s in specs]
        if not self.specs:
            raise ValueError("no reward functions given; pass at least one RewardSpec")
        keys = [s.key for s in self.specs]
        if dup := sorted({k for k in keys if keys.count(k) > 1}):
            raise ValueError(f"reward functions {dup} appear twice; give each a distinct `label`")
        self.timeout_s = timeout_s
        self.policy: FailurePolicy = policy
        funcs = funcs or {}
        self.funcs = {s.key: funcs.get(s.name) or load_reward(s.name) for s in self.specs}
        self.failure_counts = dict.fromkeys(keys, 0)

    async def _one(self, spec: RewardSpec, prompts: list, completions: list[str], columns: dict):
        fn = self.funcs[spec.key]
        kwargs = {**_accepted(fn, columns), **spec.kwargs}  # a misspelt kwarg is an error
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                out = await call_maybe_async(fn, prompts, completions, **kwargs)
        except TimeoutError as e:
            if not deadline.expired():  # the function's own TimeoutError
                raise RewardFunctionError(spec.key, f"raised TimeoutError: {e}") from e
            raise RewardTimeoutError(
                spec.key, f"no result after {self.timeout_s:g} s (timeout_s); it was abandoned"
            ) from e
        except RewardFunctionError:
            raise
        except Exception as e:
            raise RewardFunctionError(spec.key, f"raised {type(e).__name__}: {e}") from e
        return check_output(spec.key, out, len(completions))

    async def score(
        self, prompts: list, completions: list[str], columns: dict[str, list] | None = None
    ) -> ScoreResult:
        """Score ``completions[i]`` (answering ``prompts[i]``, a string or chat messages) with
        every function; ``columns`` are per-completion dataset columns, passed by name."""
        columns = columns or {}
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions; pass one per completion")
        for name, col in columns.items():
            if name in ("prompts", "completions"):
                raise ValueError(f"column {name!r} clashes with a positional argument; rename it")
            if len(col) != n:
                raise ValueError(f"column {name!r} has {len(col)} rows for {n} completions")
        for spec in self.specs:
            if clash := sorted(set(spec.kwargs) & set(columns)):
                raise ValueError(f"reward {spec.key!r}: kwargs {clash} shadow dataset columns")

        async def timed(spec: RewardSpec) -> tuple[Any, float]:
            t0 = time.perf_counter()
            try:
                res: Any = await self._one(spec, prompts, completions, columns)
            except RewardFunctionError as e:
                res = e
            return res, time.perf_counter() - t0

        outcomes = await asyncio.gather(*(timed(s) for s in self.specs))
        per_function: dict[str, list[float | None]] = {}
        failures: dict[str, str] = {}
        metrics: dict[str, float] = {}
        for spec, (res, seconds) in zip(self.specs, outcomes, strict=True):
            key = spec.key
            if isinstance(res, RewardFunctionError):
                if self.policy == "raise":
                    raise res
                self.failure_counts[key] += 1
                failures[key] = str(res)
                logger.warning("%s; scored as %s (policy=%r)", res, self.policy, self.policy)
                res = [None] * n if self.policy == "none" else [0.0] * n
            per_function[key] = res
            values = [v for v in res if v is not None]
            if values:
                metrics[f"reward/{key}/mean"], metrics[f"reward/{key}/std"] = _stats(values)
            metrics[f"reward/{key}/none_frac"] = (n - len(values)) / n if n else 0.0
            metrics[f"reward/{key}/failures"] = float(key in failures)
            metrics[f"reward/{key}/seconds"] = seconds
        total = [
            sum(s.weight * v for s in self.specs if (v := per_function[s.key][i]) is not None)
            for i in range(n)
        ]
        if total:
            metrics["reward/total/mean"], metrics["reward/total/std"] = _stats(total)
        return ScoreResult(
            total=[float(t) for t in total],
            per_function=per_function,
            metrics=metrics,
            failures=failures,
        )
