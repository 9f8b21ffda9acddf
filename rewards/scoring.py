"""Score a batch of completions with several weighted reward functions, safely.

Reward functions are user code: they raise, hang, return the wrong number of scores, NaN, or a
string, or even ``SystemExit``. Each of these becomes either a ``RewardFunctionError`` that names
the function or, under an explicit failure policy, a recorded failure (the function's scores for
the batch become None or 0.0, and ``reward/<name>/failures`` says so). A bad reward never turns
into a silent 0 copied to every completion, and a hanging one never hangs the run: every call has
a timeout.

Every call runs in its own daemon thread (``grpo_common.threads``), an ``async def`` on a fresh event
loop of that thread, so that not even a coroutine that blocks its loop can stall the caller's. A
call that does not return in time is abandoned (an async one is first cancelled on its loop: the
built-in code reward then kills its sandbox subprocess). Abandoned calls that never end would
pile up, one more each step, so past ``max_abandoned`` of one function still running the runner
stops with ``RewardStuckError`` whatever the policy. Spec kwargs are checked against the
function's parameters when the runner is built, so a misspelt one is not silently ignored.

Each call gets its own copy of the prompts, completions, columns and kwargs: a function that
changes them (``completions.clear()``) changes only what it sees, never what the others score.
Scores that are finite but so large that the batch's statistics overflow float32 (where the
advantages are computed: 1e308, or 1e20 beside 0) are bad output like NaN: the function that
contributes them fails, under the policy.
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import inspect
import logging
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from grpo_common.threads import AbandonedCalls, start_in_daemon_thread

logger = logging.getLogger(__name__)

FailurePolicy = Literal["raise", "none", "zero"]
"""What a failing reward function does: raise ``RewardFunctionError``, score the batch as None
(abstain), or score it as 0.0. The last two are counted in ``reward/<name>/failures``."""

FLOAT32_MAX = 3.4028234663852886e38
"""The rewards become a float32 tensor; their group means and stds must stay below this."""

MAX_ABANDONED_CALLS = 4
"""How many timed-out calls of one reward function may still be running, abandoned in their
threads, before the runner refuses to call it again (``RewardRunner(max_abandoned=...)``)."""


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


class RewardStuckError(RewardTimeoutError):
    """More than ``max_abandoned`` earlier calls of a reward function timed out and are still
    running; the runner does not start another. Raised whatever the failure policy: a run that
    leaks one more busy thread every step degrades without end."""


class RewardOutputError(RewardFunctionError):
    """A reward function returned something other than one finite float or None per completion."""


class RewardSpecError(ValueError):
    """A reward spec does not fit its function: kwargs the function has no parameter for."""

    def __init__(self, function: str, message: str) -> None:
        super().__init__(f"reward function {function!r}: {message}")
        self.function = function


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
        try:
            shown = float(v)
        except OverflowError:  # an int beyond any float
            raise RewardOutputError(
                function, f"score {i} is an int too large for a float; scores must be finite"
            ) from None
        if not math.isfinite(shown):
            raise RewardOutputError(
                function, f"score {i} is {shown}; scores must be finite (None to abstain)"
            )
        scores.append(float(v))
    return scores


def overflow(values: Sequence[float]) -> str | None:
    """Why a batch's rewards would overflow the float32 arithmetic of its advantages (a sum of
    magnitudes or of squared deviations from the mean beyond ``FLOAT32_MAX``), or None. Every
    group's sums are at most the batch's, so a batch that passes has finite group statistics."""
    if not values:
        return None
    if not all(math.isfinite(v) for v in values):
        return "weighted, they overflow to inf"
    largest = max(abs(v) for v in values)
    if largest > FLOAT32_MAX:
        return f"a score of {largest:.4g} is beyond float32's range ({FLOAT32_MAX:.4g})"
    magnitudes = math.fsum(abs(v) for v in values)  # finite: each below 3.5e38
    mean = math.fsum(values) / len(values)
    squares = math.fsum((v - mean) * (v - mean) for v in values)
    if magnitudes > FLOAT32_MAX:
        return f"their sum of magnitudes ({magnitudes:.4g}) is beyond float32's range"
    if squares > FLOAT32_MAX:
        return (
            f"their squared deviations from the mean add up to {squares:.4g}, beyond float32's "
            f"range ({FLOAT32_MAX:.4g}): the std of the advantages would be inf"
        )
    return None


_ATOMS = frozenset({str, bytes, int, float, bool, type(None)})


def _own_copy(value: Any) -> Any:
    """A copy of an argument for one reward call, so that what it changes no other call sees:
    lists and dicts copied all the way down, those of plain values (token ids, strings) at C
    speed; anything else deep-copied, or passed as it is where it cannot be (a lock, a client)."""
    kind = type(value)
    if kind in _ATOMS:
        return value
    if kind is list:
        return value.copy() if _ATOMS.issuperset(map(type, value)) else list(map(_own_copy, value))
    if kind is dict:
        if _ATOMS.issuperset(map(type, value.values())):
            return value.copy()
        return {k: _own_copy(v) for k, v in value.items()}
    try:
        return copy.deepcopy(value)
    except Exception:
        return value


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


def check_kwargs(function: str, fn: Callable, kwargs: dict[str, Any]) -> None:
    """Reject spec kwargs that are not keyword parameters of ``fn`` (the first two positional
    parameters take prompts and completions). A function that takes keywords only through
    ``**kwargs`` cannot be checked and accepts anything."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # not introspectable (a builtin): the call will tell
        return
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    named = [
        p.name
        for p in params
        if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) and p not in positional[:2]
    ]
    if not named and any(p.kind is P.VAR_KEYWORD for p in params):
        return
    unknown = sorted(set(kwargs) - set(named))
    if not unknown:
        return
    hints = [
        f"did you mean {close[0]!r} for {k!r}?"
        for k in unknown
        if (close := difflib.get_close_matches(k, named, n=1))
    ]
    takes = f"it takes {', '.join(named)}" if named else "it takes no keyword arguments"
    raise RewardSpecError(
        function,
        f"kwargs {unknown} are not parameters of {getattr(fn, '__name__', fn)}(); {takes}"
        + (f" ({' '.join(hints)})" if hints else ""),
    )


def check_signature(function: str, fn: Callable) -> None:
    """Reject a function that cannot be called as ``fn(prompts, completions, ...)``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # not introspectable (a builtin): the call will tell
        return
    try:
        sig.bind_partial([], [])
    except TypeError:
        raise RewardSpecError(
            function,
            f"{getattr(fn, '__name__', fn)}{sig} cannot be called with (prompts, completions) "
            f"as its first two positional arguments; define it as "
            f"fn(prompts, completions, **columns)",
        ) from None


def required_columns(fn: Callable, kwargs: dict[str, Any]) -> list[str]:
    """The parameters of ``fn`` after (prompts, completions) that have no default and are not
    in the spec's kwargs: the dataset columns it cannot be called without."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    return [
        p.name
        for p in params
        if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
        and p not in positional[:2]
        and p.default is P.empty
        and p.name not in kwargs
    ]


def _being_cancelled() -> bool:
    """Whether the current task is being cancelled (as opposed to seeing a CancelledError that
    user code raised)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _stats(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) * (v - mean) for v in values) / len(values))


class RewardRunner:
    """Run the reward mix on a batch: concurrently, each call under ``timeout_s``, every output
    checked, failures handled by ``policy``. ``funcs`` maps names to callables and takes
    precedence over the entry-point registry (tests, notebooks). ``failure_counts`` accumulates
    failed calls per function over the runner's lifetime. ``max_abandoned``: how many timed-out
    calls of one function may still be running before ``score`` raises ``RewardStuckError``."""

    def __init__(
        self,
        specs: Sequence[RewardSpec | dict[str, Any]],
        *,
        timeout_s: float = 30.0,
        policy: FailurePolicy = "raise",
        funcs: dict[str, Callable] | None = None,
        max_abandoned: int = MAX_ABANDONED_CALLS,
    ) -> None:
        from rewards.registry import load_reward

        if policy not in ("raise", "none", "zero"):
            raise ValueError(f"policy={policy!r}; use 'raise', 'none' or 'zero'")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}; must be > 0 seconds")
        if max_abandoned < 0:
            raise ValueError(f"max_abandoned={max_abandoned}; must be >= 0 calls")
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
        for s in self.specs:
            check_signature(s.key, self.funcs[s.key])
            check_kwargs(s.key, self.funcs[s.key], s.kwargs)
        self.failure_counts = dict.fromkeys(keys, 0)
        self.max_abandoned = max_abandoned
        self._abandoned = AbandonedCalls()
        self._warned_all_none: set[str] = set()

    def check_columns(self, columns: Sequence[str]) -> None:
        """Raise ``RewardSpecError`` for a function with a parameter (no default, not in its
        kwargs) that names none of ``columns``, or kwargs that shadow a column: every call
        would fail."""
        for s in self.specs:
            if clash := sorted(set(s.kwargs) & set(columns)):
                raise RewardSpecError(
                    s.key,
                    f"kwargs {clash} have the names of data columns, which reach the function "
                    f"under those names: rename the kwargs (or the columns)",
                )
            if missing := [
                c for c in required_columns(self.funcs[s.key], s.kwargs) if c not in columns
            ]:
                fn = self.funcs[s.key]
                raise RewardSpecError(
                    s.key,
                    f"{getattr(fn, '__name__', fn)}() needs the column(s) {missing}, but the "
                    f"data's columns are {sorted(columns)}: add them to the data, pass them in "
                    f"the reward's kwargs, or give the parameters a default",
                )

    def still_running(self, key: str) -> int:
        """How many abandoned (timed-out or cancelled) calls of ``key`` have not returned yet."""
        return self._abandoned.running(key)

    async def _one(
        self, spec: RewardSpec, prompts: list, completions: list[str], columns: dict
    ) -> list[float | None]:
        fn = self.funcs[spec.key]
        kwargs = {**_accepted(fn, columns), **spec.kwargs}  # no clash: checked in score()
        kwargs = {k: _own_copy(v) for k, v in kwargs.items()}
        call = start_in_daemon_thread(fn, _own_copy(prompts), list(completions), **kwargs)
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                out = await call.future
        except TimeoutError as e:
            if not deadline.expired():  # the function's own TimeoutError
                raise RewardFunctionError(spec.key, f"raised TimeoutError: {e}") from e
            raise RewardTimeoutError(
                spec.key, f"no result after {self.timeout_s:g} s (timeout_s); it was abandoned"
            ) from e
        except RewardFunctionError:
            raise
        except asyncio.CancelledError as e:
            if _being_cancelled():  # the runner itself is cancelled: let it be
                raise
            raise RewardFunctionError(spec.key, f"raised CancelledError: {e}") from e
        except BaseException as e:  # SystemExit & co. from the function must not kill the loop
            raise RewardFunctionError(spec.key, f"raised {type(e).__name__}: {e}") from e
        finally:
            if call.future.cancelled():  # timed out or cancelled; its thread may run on
                self._abandoned.add(spec.key, call.thread)
        return check_output(spec.key, out, len(completions))

    def _failed(
        self, error: RewardFunctionError, n: int, failures: dict[str, str]
    ) -> list[float | None]:
        """A failed call under the policy: raised, or recorded and scored as None or 0.0."""
        if self.policy == "raise":
            raise error
        self.failure_counts[error.function] += 1
        failures[error.function] = str(error)
        logger.warning("%s; scored as %s (policy=%r)", error, self.policy, self.policy)
        return [None] * n if self.policy == "none" else [0.0] * n

    def _totals(self, per_function: dict[str, list[float | None]], n: int) -> list[float]:
        """Each completion's weighted sum of the non-None scores."""
        return [
            sum(s.weight * v for s in self.specs if (v := per_function[s.key][i]) is not None)
            for i in range(n)
        ]

    def _overflow_culprit(
        self, per_function: dict[str, list[float | None]], failures: dict[str, str]
    ) -> RewardSpec:
        """The function with the largest weighted score (among those that did not fail): the
        one to blame for a total that overflows."""

        def largest(spec: RewardSpec) -> float:
            values = [abs(spec.weight * v) for v in per_function[spec.key] if v is not None]
            return max(values, default=0.0)

        return max((s for s in self.specs if s.key not in failures), key=largest)

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
            if (running := self.still_running(spec.key)) > self.max_abandoned:
                raise RewardStuckError(
                    spec.key,
                    f"{running} earlier calls of {spec.key!r} are still running after timing out "
                    f"(more than max_abandoned={self.max_abandoned}), each holding a thread; not "
                    f"starting another. Fix the function so that it returns within timeout_s="
                    f"{self.timeout_s:g} s, or give it a larger scoring timeout_s",
                )

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
        seconds = {s.key: t for s, (_, t) in zip(self.specs, outcomes, strict=True)}
        for spec, (res, _) in zip(self.specs, outcomes, strict=True):
            per_function[spec.key] = (
                self._failed(res, n, failures) if isinstance(res, RewardFunctionError) else res
            )
        while (why := overflow(self._totals(per_function, n))) is not None:
            culprit = self._overflow_culprit(per_function, failures)
            error = RewardOutputError(
                culprit.key,
                f"its scores (weight {culprit.weight:g}) make the batch's rewards overflow: "
                f"{why}. Every group's advantages would be 0 or NaN; scale the scores down "
                "(rewards in [0, 1] or [-1, 1] train best)",
            )
            per_function[culprit.key] = self._failed(error, n, failures)
        metrics: dict[str, float] = {}
        for spec in self.specs:
            key, res = spec.key, per_function[spec.key]
            values = [v for v in res if v is not None]
            if n and not values and key not in failures and key not in self._warned_all_none:
                self._warned_all_none.add(key)
                logger.warning(
                    "reward %r returned None (abstained) for all %d completions of a batch, so it "
                    "gives no signal there; if that is not meant, check the columns it reads "
                    "(reward/%s/none_frac tracks it; this warning is shown once)",
                    key,
                    n,
                    key,
                )
            if values:
                metrics[f"reward/{key}/mean"], metrics[f"reward/{key}/std"] = _stats(values)
            metrics[f"reward/{key}/none_frac"] = (n - len(values)) / n if n else 0.0
            metrics[f"reward/{key}/failures"] = float(key in failures)
            metrics[f"reward/{key}/seconds"] = seconds[key]
        total = self._totals(per_function, n)
        if total:
            metrics["reward/total/mean"], metrics["reward/total/std"] = _stats(total)
        return ScoreResult(
            total=[float(t) for t in total],
            per_function=per_function,
            metrics=metrics,
            failures=failures,
        )
