"""What the Triton tests share: the list of (name, error, tolerance) checks their scripts print,
and running such a script under Triton's interpreter on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def assert_all(results: list[tuple[str, float, float]]) -> None:
    bad = [f"{name}: {err:.3g} > {tol:g}" for name, err, tol in results if not err <= tol]
    assert not bad, "\n".join(bad)


def run_under_interpreter(script: str) -> list[tuple[str, float, float]]:
    """Run ``script`` (a test file whose ``__main__`` prints its checks as JSON) with
    TRITON_INTERPRET=1, which must be set before triton is imported: hence a subprocess."""
    pytest.importorskip("triton")
    root = str(Path(__file__).resolve().parents[3])  # the script imports tests.learner.*
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
