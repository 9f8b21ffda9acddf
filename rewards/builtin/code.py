"""Code reward: run the completion's Python code against tests in a sandboxed subprocess.

Never in the learner's process. Each completion runs in a fresh ``python -I`` process in its own
session (process group) and temporary directory, which first lowers its own resource limits
(address space, CPU seconds, file size, no core dumps) and only then reads the code. The parent
enforces a wall-clock limit and kills the whole process group when it passes, when the process
ends (stray children), or when the call is cancelled — so neither a busy loop, a sleep, a signal
handler, nor a forked child outlives its limit.

Tests are Python snippets (typically ``assert`` lines) run one by one after the code, in the
same namespace. The score is the fraction of tests that passed. Results are data: each passing
test is reported on stdout tagged with a random nonce the code under test does not know, so
printing "passed" does not pass; ``sys.exit()`` in the code fails the tests instead of skipping
them. This is a guard against accidents and reward hacking, not a security boundary: the code can
still read files and use the network; run untrusted code inside a container.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from rewards.text import extract_code

_HARNESS = r"""
import json, os, resource, sys

def _limit(res, value, slack=0):
    _, hard = resource.getrlimit(res)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
        slack = min(slack, hard - value)
    resource.setrlimit(res, (value, value + slack))

def _main():
    mem, cpu, fsize = (int(a) for a in sys.argv[1:4])
    _limit(resource.RLIMIT_AS, mem)
    _limit(resource.RLIMIT_CPU, cpu, 1)  # SIGXCPU, then SIGKILL
    _limit(resource.RLIMIT_FSIZE, fsize)
    _limit(resource.RLIMIT_CORE, 0)
    job = json.loads(sys.stdin.read())
    nonce, code, tests = job["nonce"], job["code"], job["tests"]
    del job
    report = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    ns = {"__name__": "solution", "__builtins__": __builtins__}

    def run(src, name):
        try:
            exec(compile(src, name, "exec"), ns)
            return True
        except BaseException:
            return False

    ok = run(code, "<solution>")
    for i, test in enumerate(tests):
        if ok and run(test, "<test %d>" % i):
            report.write("%s %d\n" % (nonce, i))
            report.flush()
    report.write("%s done\n" % nonce)
    report.flush()

_main()
"""


@dataclass
class ExecutionResult:
    """What one sandboxed run did. ``timed_out``: killed at the wall-clock limit;
    ``completed``: the harness reached the end of the tests."""

    passed: int
    total: int
    timed_out: bool
    completed: bool
    returncode: int | None

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_python_tests(
    code: str, tests: list[str], *, timeout_s: float = 5.0, memory_mb: int = 1024
) -> ExecutionResult:
    """Run ``code`` then each test in a fresh limited subprocess; never raises for what the
    code does."""
    nonce = secrets.token_hex(16)
    cpu_s = math.ceil(timeout_s) + 1
    with tempfile.TemporaryDirectory(prefix="grpo-code-") as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.txt")
        with open(job_path, "w") as f:
            json.dump({"nonce": nonce, "code": code, "tests": tests}, f)
        # Files, not pipes: a child that escapes the process group cannot hold a pipe open
        # and make us wait for EOF.
        with open(job_path) as fin, open(out_path, "w") as fout:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-c", _HARNESS,
                str(memory_mb * 2**20), str(cpu_s), str(16 * 2**20),
                stdin=fin, stdout=fout, stderr=subprocess.DEVNULL,
                cwd=tmp, env={"PATH": os.defpath, "LANG": "C.UTF-8"},
                start_new_session=True,
            )  # fmt: skip
            timed_out = False
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                timed_out = True
            finally:  # also on cancellation: nothing of the run survives
                _kill_group(proc.pid)
                await proc.wait()
        with open(out_path, errors="replace") as f:
            lines = [line.split() for line in f.read().splitlines()]
    tagged = [parts[1] for parts in lines if len(parts) == 2 and parts[0] == nonce]
    passed = len({t for t in tagged if t.isdigit() and int(t) < len(tests)})
    return ExecutionResult(
        passed=passed,
        total=len(tests),
        timed_out=timed_out,
        completed="done" in tagged,
        returncode=proc.returncode,
    )


def _as_tests(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("["):
            try:
                value = json.loads(stripped)
            except json.JSONDecodeError:
                return [value]
        else:
            return [value] if stripped else None
    tests = [str(t) for t in value]
    return tests or None


async def code_reward(
    prompts: list,
    completions: list[str],
    *,
    tests_column: str = "tests",
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_workers: int | None = None,
    **columns: Any,
) -> list[float | None]:
    """Registered as ``code``. The ``tests`` column (renamed with ``tests_column``) holds, per
    sample, a list of test snippets, a JSON list of them, or one string of test code; None or
    empty means not applicable. ``timeout_s`` and ``memory_mb`` limit each completion's run;
    ``max_workers`` runs at once (default: the CPU count)."""
    if tests_column not in columns:
        raise KeyError(
            f"code_reward needs the tests in column {tests_column!r}, but the columns are "
            f"{sorted(columns)}; set kwargs.tests_column to the right one"
        )
    sem = asyncio.Semaphore(max_workers or os.cpu_count() or 1)

    async def one(completion: str, raw_tests: Any) -> float | None:
        tests = _as_tests(raw_tests)
        if tests is None:
            return None
        async with sem:
            result = await run_python_tests(
                extract_code(completion), tests, timeout_s=timeout_s, memory_mb=memory_mb
            )
        return result.score

    pairs = zip(completions, columns[tests_column], strict=True)
    return list(await asyncio.gather(*(one(c, t) for c, t in pairs)))
