"""Property-based fuzzing of the rollout server's whole OpenAPI (``make fuzz``).

Starts a real ``rollout-server`` CLI process (a tiny random model, an API key, small limits) on a
free loopback port under an address-space cap, and runs schemathesis over every operation of
its ``/openapi.json``: the examples, coverage and fuzzing phases (valid and invalid requests)
and the stateful phase, which follows the OpenAPI links (begin -> bucket -> commit or abort,
sleep -> wake_up). It fails on any 500 or undocumented 5xx (documented 501/503 pass), a status
code or body the OpenAPI does not describe, a request slower than ``--max-response-time``, a
server that died, and a server whose peak RSS passed ``--rss-cap-mb``. Before those passes, a
hostile pass (``hostile.py``) sends chat_template_kwargs, long text prompts and made-up HTTP
methods drawn by Hypothesis, under the same limits.

    .venv/bin/python tests/fuzz/run_fuzz.py --max-examples 40 --seed 0
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from hostile import hostile_pass  # tests/fuzz/hostile.py, beside this script

from grpo_common.net import free_port

API_KEY = "fuzz-key"
CHECKS = (
    "no_server_fault",  # tests/fuzz/st_hooks.py: 500s fail, documented 501/503 pass
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
)
# Small limits: the fuzzer's largest valid request stays cheap on a CPU. max_tokens admits the
# defaults of the request models (16 and 256), else no generation would pass validation.
SERVER_LIMITS = (
    "--max-tokens=256",
    "--max-n=2",
    "--max-batch-size=2",
    "--max-prompt-len=64",
    "--max-body-mb=1",
    "--max-json-body-mb=1",
    "--max-model-len=512",
    "--max-num-seqs=4",
)


class PeakRss:
    """Samples the server's peak resident memory (``VmHWM``) until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.sample()

    def sample(self) -> None:
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                self.peak_mb = max(self.peak_mb, int(line.split()[1]) / 1024)

    def stop(self) -> float:
        self.sample()
        self._stop.set()
        self._thread.join()
        return self.peak_mb


def start_server(model_dir: Path, port: int, as_cap_mb: int, log: Path) -> subprocess.Popen:
    def cap_memory() -> None:  # runs in the child before exec
        cap = as_cap_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {**os.environ, "ROLLOUT_API_KEY": API_KEY, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "rollout_server", "--model", str(model_dir), "--port", str(port)]
    cmd += [*SERVER_LIMITS, "--weights-dir", str(model_dir), "--shutdown-timeout=2"]
    cmd += ["--log-level=warning"]
    out = log.open("w")
    return subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=cap_memory
    )


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {API_KEY}"}
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server at {url} never became ready (exit code {proc.poll()})")


# Two passes. A /sleep that level 2 discards the weights leaves generation answering 503 until a
# weight update the fuzzer cannot build, so the first pass fuzzes every other operation with
# the weights served, and the second /sleep and /wake_up with the operations whose answers they
# change (the stateful phase follows the links sleep -> generate, checksum, wake_up).
# vLLM's RL routes come last, by themselves: a /pause holds every later generation until a
# /resume the fuzzer need not send, and /init_weight_transfer_engine waits (up to its timeout_s)
# for a trainer that never joins, so it is left to tests/rollout_server/test_native_routes.py.
SLEEP_ROUTES = "^/(sleep|wake_up)$"
NATIVE_ROUTES = (
    "^/(pause|resume|is_paused|start_weight_update|update_weights|finish_weight_update"
    "|get_world_size)$"
)
PASSES = {
    "awake": ["--exclude-path-regex", f"{SLEEP_ROUTES}|{NATIVE_ROUTES}|^/init_weight_transfer"],
    "sleep": ["--include-path-regex", "^/(sleep|wake_up|generate|weights/checksum|ready)$"],
    # no stateful phase: the OpenAPI links join other routes (sleep -> generate, ...)
    "native": ["--include-path-regex", NATIVE_ROUTES, "--phases", "examples,coverage,fuzzing"],
}


def run_schemathesis(
    url: str, args: argparse.Namespace, har: Path, scratch: str, filters: list[str]
) -> int:
    st = Path(sys.executable).parent / "schemathesis"
    cmd = [str(st), "run", f"{url}/openapi.json", "-H", f"Authorization: Bearer {API_KEY}"]
    cmd += filters
    cmd += ["--checks", ",".join(CHECKS)]
    if "--phases" not in filters:
        cmd += ["--phases", args.phases]
    cmd += ["--max-examples", str(args.max_examples), "--seed", str(args.seed)]
    cmd += ["--max-response-time", str(args.max_response_time)]
    cmd += ["--request-timeout", str(args.max_response_time * 3), "--workers", "1"]
    cmd += ["--report", "har", "--report-har-path", str(har), "--no-color"]
    cmd += ["--suppress-health-check", "all"]
    if args.max_time:
        cmd += ["--max-time", str(args.max_time)]
    hooks_dir = str(Path(__file__).resolve().parent)
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "st_hooks",
        "PYTHONPATH": os.pathsep.join(p for p in (hooks_dir, os.environ.get("PYTHONPATH")) if p),
    }
    # its caches (.schemathesis/, .hypothesis/) go to a scratch directory, not the checkout
    return subprocess.run(cmd, env=env, cwd=scratch, check=False).returncode


def count_requests(har: Path) -> dict[str, collections.Counter[int]]:
    """``{"POST /weights/begin": Counter({200: 12, 422: 30})}`` from the HAR report."""
    by_route: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    if not har.exists():
        return by_route
    for entry in json.loads(har.read_text())["log"]["entries"]:
        route = f"{entry['request']['method']} {urlsplit(entry['request']['url']).path}"
        by_route[route][entry["response"]["status"]] += 1
    return by_route


def print_table(by_route: dict[str, collections.Counter[int]]) -> None:
    width = max((len(r) for r in by_route), default=10)
    print(f"\n{'route':<{width}}  requests  statuses")
    for route in sorted(by_route):
        counts = by_route[route]
        statuses = " ".join(f"{code}:{n}" for code, n in sorted(counts.items()))
        print(f"{route:<{width}}  {sum(counts.values()):>8}  {statuses}")
    total = sum(sum(c.values()) for c in by_route.values())
    print(f"{'total':<{width}}  {total:>8}")


def stop_server(proc: subprocess.Popen) -> int | None:
    """SIGTERM and wait; the exit code, or None if the server had to be killed."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--max-examples", type=int, default=40, help="test cases per operation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--hostile-examples",
        type=int,
        default=150,
        help="requests of the hostile pass (tests/fuzz/hostile.py)",
    )
    p.add_argument("--phases", default="examples,coverage,fuzzing,stateful")
    p.add_argument("--max-time", type=int, default=0, help="seconds for the whole run (0: none)")
    p.add_argument("--max-response-time", type=float, default=10.0, help="seconds per request")
    p.add_argument("--as-cap-mb", type=int, default=6144, help="the server's address-space cap")
    p.add_argument("--rss-cap-mb", type=int, default=1536, help="fail above this peak RSS")
    p.add_argument(
        "--report",
        type=Path,
        default=Path(os.environ.get("FUZZ_REPORT", "runs/fuzz/report.json")),
        help="JSON summary (default $FUZZ_REPORT or runs/fuzz/report.json)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        model_dir = Path(tmp) / "tiny"
        subprocess.run(
            [sys.executable, "-m", "rollout_server.tiny", str(model_dir)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = args.report.with_suffix(".server.log")
        by_route: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        proc = start_server(model_dir, port, args.as_cap_mb, log)
        rss = PeakRss(proc.pid)
        try:
            wait_ready(proc, url)
            st_codes = {}
            hostile_problems, hostile_requests = hostile_pass(
                url,
                {"Authorization": f"Bearer {API_KEY}"},
                args.hostile_examples,
                args.seed,
                args.max_response_time,
            )
            for route, counts in hostile_requests.items():
                by_route[route].update(counts)
            for name, filters in PASSES.items():
                har = args.report.with_name(f"{args.report.stem}.{name}.har").resolve()
                st_codes[name] = run_schemathesis(url, args, har, tmp, filters)
                for route, counts in count_requests(har).items():
                    by_route[route].update(counts)
        finally:
            alive = proc.poll() is None
            peak_mb = rss.stop()
            exit_code = stop_server(proc)
    problems = list(hostile_problems)
    for name, code in st_codes.items():
        if code != 0:
            problems.append(f"schemathesis found failures in the {name} pass (exit code {code})")
    if not alive:
        problems.append(f"the server died during the run (exit code {exit_code}); see {log}")
    if peak_mb > args.rss_cap_mb:
        problems.append(f"the server's peak RSS {peak_mb:.0f} MB passed {args.rss_cap_mb} MB")
    print_table(by_route)
    report = {
        "passed": not problems,
        "problems": problems,
        "seed": args.seed,
        "max_examples": args.max_examples,
        "phases": args.phases.split(","),
        "checks": list(CHECKS),
        "seconds": round(time.monotonic() - started, 1),
        "server_peak_rss_mb": round(peak_mb, 1),
        "server_exit_code": exit_code,
        "requests": {r: {str(k): v for k, v in sorted(c.items())} for r, c in by_route.items()},
    }
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(f"peak RSS {peak_mb:.0f} MB; {report['seconds']} s; report: {args.report}")
    for problem in problems:
        print(f"FAIL: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
