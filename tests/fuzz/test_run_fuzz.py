"""The fuzz job's own setup (``make fuzz``): one short run, the examples phase only and a short
hostile pass, against a real server, so a broken runner, hook or server start fails ``make test`` and not only CI's
fuzz step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).with_name("run_fuzz.py")


def test_a_short_fuzz_run_passes_and_reports(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    cmd = [sys.executable, str(RUNNER), "--max-examples=1", "--phases=examples"]
    cmd += ["--hostile-examples=20"]
    proc = subprocess.run(
        [*cmd, f"--report={report}"], capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["passed"] and not result["problems"]
    assert result["requests"]["POST /generate"].get("200", 0) >= 1, result["requests"]
    assert result["requests"]["hostile: made-up method"], result["requests"]  # the hostile pass
    assert 0 < result["server_peak_rss_mb"] < 1536
    assert (tmp_path / "report.awake.har").exists() and (tmp_path / "report.sleep.har").exists()
