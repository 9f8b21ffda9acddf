"""Ending every process a benchmark started, with real processes: grandchildren that start Unix
sessions of their own (``setsid``, ``start_new_session=True``) after their parent exited, one
that ignores SIGTERM, one that strips the run marker from its environment, and one still
saving into its run directory when asked to stop. A process-group signal or a pid file reaches
none of them; the run marker in the environment and the process tree do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import proc_tree  # noqa: E402

# A launcher that starts a tree and exits: A in a session of its own (setsid) ignoring SIGTERM,
# A's child B in another new session; each writes its pid and session id.
TREE = r"""
import os, subprocess, sys, time
out = sys.argv[1]
b = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_DFL)  # A's SIG_IGN is inherited\n"
    "open(sys.argv[1], 'w').write(f'{os.getpid()} {os.getsid(0)}')\n"
    "time.sleep(300)\n"
)
a = (
    "import os, signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    f"subprocess.Popen([sys.executable, '-c', {b!r}, sys.argv[1] + '.b'], start_new_session=True)\n"
    "open(sys.argv[1] + '.a', 'w').write(f'{os.getpid()} {os.getsid(0)}')\n"
    "time.sleep(300)\n"
)
subprocess.Popen(["setsid", sys.executable, "-c", a, out])
deadline = time.time() + 60
while not (os.path.exists(out + ".a") and os.path.exists(out + ".b")):
    assert time.time() < deadline
    time.sleep(0.05)
"""


def _wait_for(path: Path, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.is_file() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return path.read_text()


def _marked(tag: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != proc_tree.MARK_ENV}
    return proc_tree.mark(env, tag)


def test_grandchildren_in_new_sessions_outlive_their_group_but_not_the_run(tmp_path):
    tag = f"test-tree-{os.getpid()}-{time.time_ns()}"
    out = tmp_path / "pids"
    launcher = subprocess.Popen(
        [sys.executable, "-c", TREE, str(out)], env=_marked(tag), start_new_session=True
    )
    assert launcher.wait(timeout=60) == 0  # the launcher is gone; its tree is not
    (a, a_sid), (b, b_sid) = (map(int, _wait_for(Path(f"{out}.{k}")).split()) for k in "ab")
    try:
        assert len({launcher.pid, a_sid, b_sid}) == 3  # three sessions
        # what a process-group stop reaches: the launcher's group, long empty
        with pytest.raises(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGTERM)
        assert proc_tree.alive(a) and proc_tree.alive(b)
        assert proc_tree.marker_of(b) == tag  # inherited through setsid and a new session
        assert {a, b} <= proc_tree.run_pids(tag)
        report = proc_tree.end_run(tag, grace_s=1.0)
        assert not proc_tree.alive(a) and not proc_tree.alive(b)
        assert {a, b} <= set(report["found"]) and report["left"] == []
        assert a in report["killed"] and b not in report["killed"]  # A ignored SIGTERM
        assert proc_tree.run_pids(tag) == set()
    finally:
        for pid in (a, b):
            if proc_tree.alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_descendant_without_the_marker_is_found_through_the_tree(tmp_path):
    tag = f"test-unmarked-{os.getpid()}-{time.time_ns()}"
    pid_file = tmp_path / "child"
    code = (
        "import os, subprocess, sys, time\n"
        "env = {k: v for k, v in os.environ.items() if k != 'GRPO_BENCH_RUN'}\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], env=env,"
        " start_new_session=True)\n"
        "open(sys.argv[1], 'w').write(str(c.pid))\n"
        "time.sleep(300)\n"
    )
    root = subprocess.Popen(
        [sys.executable, "-c", code, str(pid_file)], env=_marked(tag), start_new_session=True
    )
    child = int(_wait_for(pid_file))
    try:
        assert proc_tree.marker_of(child) is None
        assert child not in proc_tree.run_pids(tag)  # the marker alone misses it
        assert child in proc_tree.run_pids(tag, [root.pid])
        report = proc_tree.end_run(tag, [root.pid], grace_s=5.0)
        root.wait(timeout=10)
        assert not proc_tree.alive(child) and report["left"] == []
    finally:
        for p in (child, root.pid):
            if proc_tree.alive(p):
                os.kill(p, signal.SIGKILL)


SAVER = r"""
import os, signal, sys, time
run_dir = sys.argv[1]
def stop(signum, frame):
    time.sleep(1.5)  # still writing its checkpoint when asked to stop
    with open(os.path.join(run_dir, "checkpoint", "saved"), "w") as f:
        f.write("done")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
os.makedirs(os.path.join(run_dir, "checkpoint"), exist_ok=True)
open(os.path.join(run_dir, "ready"), "w").close()
time.sleep(300)
"""


def test_the_run_directory_is_free_once_end_run_returns(tmp_path):
    """end_run waits for a process still saving into the run directory: it has finished
    writing when end_run returns, so removing the directory races with nothing."""
    tag = f"test-saver-{os.getpid()}-{time.time_ns()}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    launcher = subprocess.Popen(
        ["setsid", sys.executable, "-c", SAVER, str(run_dir)], env=_marked(tag)
    )
    deadline = time.monotonic() + 60
    while not (run_dir / "ready").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    report = proc_tree.end_run(tag, grace_s=10.0)
    launcher.wait(timeout=5)
    assert (run_dir / "checkpoint" / "saved").read_text() == "done"
    assert report["killed"] == [] and report["left"] == [] and proc_tree.run_pids(tag) == set()
    shutil.rmtree(run_dir)
    time.sleep(0.3)
    assert not run_dir.exists()  # nothing wrote into it again


def test_the_marker_nests_and_reaches_an_embedded_servers_environment(monkeypatch):
    assert proc_tree.mark({}, "a")[proc_tree.MARK_ENV] == "a"
    nested = proc_tree.mark({proc_tree.MARK_ENV: "suite-1/e2e4_split"}, "bench-7-split4")
    assert nested[proc_tree.MARK_ENV] == "suite-1/e2e4_split/bench-7-split4"
    from learner.servers.embedded import server_env

    monkeypatch.setenv(proc_tree.MARK_ENV, "suite-1/e2e4_colocated/bench-7-colocated4")
    monkeypatch.setenv("LOCAL_RANK", "3")  # the launcher's variables go, the marker stays
    env = server_env({"CUDA_VISIBLE_DEVICES": "3"}, "key")
    assert env[proc_tree.MARK_ENV] == "suite-1/e2e4_colocated/bench-7-colocated4"
    assert "LOCAL_RANK" not in env


ORPHAN_TEST = """
import subprocess, sys
import pytest
pytestmark = pytest.mark.gpu

def test_leaves_an_orphan():
    # a server-like process in a session of its own, never stopped by the test
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", {token!r}],
                         start_new_session=True)
    open({pid_file!r}, "w").write(str(p.pid))
"""


def test_the_suite_ends_what_a_step_left_in_another_session(tmp_path):
    """The real bench/gpu_suite.sh: a step (here a GPU test) leaves a process in a session of
    its own; the suite ends it after the step, and says so in the step's log."""
    token = f"orphan-{time.time_ns()}"
    pid_file = tmp_path / "orphan.pid"
    test_file = tmp_path / "test_orphan.py"
    test_file.write_text(ORPHAN_TEST.format(token=token, pid_file=str(pid_file)))
    out, work = tmp_path / "out", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", proc_tree.MARK_ENV)}
    env |= {"PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}", "OUT": str(out),
            "WORK": str(work), "SUITE_STEPS": "tests", "SUITE_BUDGET_S": "300",
            "SUITE_RUN_ID": "sweep", "GPU_TESTS": str(test_file)}  # fmt: skip
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_suite.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    orphan = int(pid_file.read_text())
    try:
        summary = json.loads((out / "summary.json").read_text())
        assert summary["tests"]["passed"] == 1, proc.stdout[-3000:]
        assert not proc_tree.alive(orphan)
        log = (work / "runs" / "sweep" / "logs" / "tests.log").read_text()
        assert "ended 1 process(es) of run suite-sweep/tests" in log
    finally:
        if proc_tree.alive(orphan):
            os.kill(orphan, signal.SIGKILL)
