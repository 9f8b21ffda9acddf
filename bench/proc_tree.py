"""Every process a benchmark started, found and ended whatever its process group or session.

torchrun's ranks and the rollout servers they embed start Unix sessions of their own, so
neither a process-group signal nor a pid file reaches them. Instead every child gets an
environment variable, ``GRPO_BENCH_RUN``, naming the run (``mark``): children inherit it, and
``setsid`` or a new session does not drop it. At the end the run's processes are those whose
``/proc/PID/environ`` carries that marker, or a marker under it (``RUN/child``), together with
every descendant of the processes handed in (``ptree``): each gets SIGTERM, what is left after
the grace period SIGKILL, and ``end_run`` returns once none is alive (their GPU memory is free,
their files closed).

    python3 bench/proc_tree.py stop RUN_ID [--grace 10]   # the GPU suite, after each step
    python3 bench/proc_tree.py list RUN_ID

Standard library only: the GPU suite runs it with the system python3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MARK_ENV = "GRPO_BENCH_RUN"
PROC = Path("/proc")


def mark(env: dict[str, str], tag: str) -> dict[str, str]:
    """``env`` with the run marker ``tag``; under a marker already there (the GPU suite's
    step), ``PARENT/tag``: ending the parent's run ends this one too."""
    parent = env.get(MARK_ENV)
    return {**env, MARK_ENV: f"{parent}/{tag}" if parent else tag}


def env_value(pid: int, name: str, proc: Path = PROC) -> str | None:
    """Variable ``name`` of ``pid``'s environment (as it was at exec), None without it or when
    it cannot be read (gone, a zombie, another user's)."""
    try:
        environ = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def marker_of(pid: int, proc: Path = PROC) -> str | None:
    """The run marker in ``pid``'s environment, None without one or when it cannot be read."""
    return env_value(pid, MARK_ENV, proc)


def _stat(pid: int, proc: Path = PROC) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid`` from /proc/PID/stat, None if it is gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[1])


def _pids(proc: Path = PROC) -> list[int]:
    return [int(d.name) for d in proc.iterdir() if d.name.isdigit()]


def alive(pid: int, proc: Path = PROC) -> bool:
    """Running or stopped, not a zombie (a zombie holds no memory and no file)."""
    st = _stat(pid, proc)
    return st is not None and st[0] not in ("Z", "X")


def _ancestors(pid: int, proc: Path = PROC) -> set[int]:
    out: set[int] = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        st = _stat(pid, proc)
        if st is None:
            break
        pid = st[1]
    return out


def descendants(roots: Iterable[int], proc: Path = PROC) -> set[int]:
    """Every live descendant of ``roots`` (children of children, any session), roots included
    while alive."""
    children: dict[int, list[int]] = {}
    for pid in _pids(proc):
        st = _stat(pid, proc)
        if st is not None:
            children.setdefault(st[1], []).append(pid)
    out: set[int] = set()
    todo = [p for p in roots if alive(p, proc)]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo += children.get(pid, [])
    return {p for p in out if alive(p, proc)}


def run_pids(tag: str, roots: Iterable[int] = (), proc: Path = PROC) -> set[int]:
    """The live processes of run ``tag``: its marker (or one under it) in their environment,
    or descended from ``roots``; never this process or one of its ancestors."""
    found = descendants(roots, proc)
    for pid in _pids(proc):
        m = marker_of(pid, proc)
        if m is not None and (m == tag or m.startswith(tag + "/")):
            found.add(pid)
    return {p for p in found if alive(p, proc)} - _ancestors(os.getpid(), proc)


def _signal(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _reap(pids: Iterable[int]) -> None:
    """Collect the ones that are this process's own children (else they stay zombies)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def end_run(
    tag: str, roots: Iterable[int] = (), grace_s: float = 10.0, kill_wait_s: float = 30.0
) -> dict[str, Any]:
    """End every process of run ``tag`` (``run_pids``): SIGTERM, SIGKILL whatever is alive
    after ``grace_s`` (new processes that appear meanwhile included), and wait up to
    ``kill_wait_s`` until none is. Returns what was found, killed and, if any, left alive."""
    roots = list(roots)
    found = run_pids(tag, roots)
    report: dict[str, Any] = {"tag": tag, "found": sorted(found), "killed": [], "left": []}
    if not found:
        return report
    _signal(found, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(found)
        live = run_pids(tag, roots)
        new = live - found
        if new:  # started while the others stopped (a launcher restarting a rank)
            found |= new
            _signal(new, signal.SIGTERM)
        if not live:
            return report
        time.sleep(0.1)
    deadline = time.monotonic() + kill_wait_s
    while time.monotonic() < deadline:
        _reap(found)
        live = run_pids(tag, roots)
        if not live:
            return report
        report["killed"] = sorted(set(report["killed"]) | live)
        found |= live
        _signal(live, signal.SIGKILL)
        time.sleep(0.1)
    report["left"] = sorted(run_pids(tag, roots))
    return report


def describe(pid: int, proc: Path = PROC) -> dict[str, Any]:
    """A process as the reports show it: pid, its command line (cut) and its run marker."""
    try:
        cmd = (
            (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        cmd = ""
    return {"pid": pid, "cmd": cmd.strip()[:200], "run": marker_of(pid, proc)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stop", help="end every process of a run; exit 1 if any outlives it")
    s.add_argument("tag")
    s.add_argument("--grace", type=float, default=10.0)
    ls = sub.add_parser("list", help="the processes of a run, one JSON object a line")
    ls.add_argument("tag")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for pid in sorted(run_pids(args.tag)):
            print(json.dumps(describe(pid)))
        return 0
    report = end_run(args.tag, grace_s=args.grace)
    if report["found"]:
        print(
            f"ended {len(report['found'])} process(es) of run {args.tag}"
            + (f", {len(report['killed'])} by SIGKILL" if report["killed"] else "")
            + (f"; still alive: {report['left']}" if report["left"] else "")
        )
    return 1 if report["left"] else 0


if __name__ == "__main__":
    sys.exit(main())
