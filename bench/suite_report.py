"""The GPU suite's verdicts (bench/gpu_suite.sh): whether each step is ok, and summary.json.

A step's exit code alone is not evidence: a benchmark whose every part raised can still exit 0,
and a pytest interrupted at its time limit leaves a junit report whose last test case is empty.
Each step is judged twice:

- ``valid``: the measurement ran completely: its command exited 0 (an e2e benchmark may exit 3,
  "valid, a target missed"), the result file it owes exists, and that file shows no failed
  part, missing or foreign baseline, failed test, weight mismatch or GPU held by another
  process;
- ``target_met``: every verdict the result file holds passes (None: the step has none, or
  none could be judged here).

Its status: ``ok`` (valid, no target missed), ``target_missed`` (valid, a verdict fails),
``failed`` (not valid) or ``timeout`` (not valid, cut by its time limit); ``why`` names each
problem and each missed target. Test counts are pytest's own totals (the ``<testsuite>``
attributes), never a count of ``<testcase>`` elements.

    python3 bench/suite_report.py verdict STEP RC --out OUT --work WORK
        # prints STATUS<TAB>VALID<TAB>TARGET_MET<TAB>WHY (true/false/-)
    python3 bench/suite_report.py summary STATUS_TSV --out OUT --budget S --start EPOCH
    python3 bench/suite_report.py merge OUT.xml PART.xml...   # one junit report of several

Standard library only: it runs with the system python3 of the GPU machine, before setup.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_common import run_problems  # standard library only, as this file

E2E_RUNS = ("trl", "colocated", "split", "overlap", "colocated4", "split4", "overlap4", "verl")
OURS = ("colocated", "split", "overlap", "colocated4", "split4", "overlap4")
# the baseline each 4-GPU comparison must carry: without it the step compared nothing
E2E4_BASELINES = {"e2e4_colocated": "trl", "e2e4_split": "trl", "e2e4_verl": "verl"}
E2E_STEPS = ("e2e_colocated", "e2e_split", "e2e4_colocated", "e2e4_split", "e2e4_verl")
EXIT_TARGET_MISSED = 3  # bench_grpo_e2e.py: measured completely, a verdict fails


def result_files(out: Path, work: Path) -> dict[str, Path]:
    """The file each step must leave behind (steps not listed owe none: setup, model)."""
    return {
        "tests": out / "gpu_tests.xml",
        "bench_rollout": out / "bench_rollout_gpu.json",
        "bench_loss": work / "bench_loss" / "loss_gpu.json",
        "e2e_colocated": out / "bench_e2e_colocated.json",
        "e2e_split": out / "bench_e2e_split.json",
        "e2e4_colocated": out / "bench_e2e4_colocated.json",
        "e2e4_split": out / "bench_e2e4_split.json",
        "e2e4_verl": out / "bench_e2e4_verl.json",
        "memory": out / "bench_memory_options.json",
        "overlap": out / "bench_overlap.json",
        "native_sync": out / "bench_native_sync.json",
        "lora_sync": out / "bench_lora_sync.json",
        "train_phase": out / "bench_train_phase.json",
    }


# -- pytest's totals ----------------------------------------------------------------------------


def junit_totals(path: Path) -> dict[str, Any]:
    """pytest's own counts from its junit report, and each test case's outcome.

    ``passed`` = tests - failures - errors - skipped of the ``<testsuite>`` elements: pytest
    counts only tests that reported a result. The ``<testcase>`` with no name that pytest
    writes for the test an interrupt cut is listed as ``interrupted``, never as a pass."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    cases: list[dict[str, Any]] = []
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key) or 0)
        cases += [_case(case) for case in suite.iter("testcase")]
    totals = {
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "error": counts["errors"],
        "skipped": counts["skipped"],
        "interrupted": sum(c["outcome"] == "interrupted" for c in cases),
    }
    return {"totals": totals, "cases": cases}


def _case(case: ET.Element) -> dict[str, Any]:
    if not case.get("name"):
        return {"test": "?", "outcome": "interrupted", "seconds": float(case.get("time") or 0),
                "message": "no result: the run was cut during this test"}  # fmt: skip
    outcome, msg = "passed", ""
    for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        el = case.find(tag)
        if el is not None:
            outcome, msg = name, (el.get("message") or "")[:300]
            break
    return {
        "test": f"{case.get('classname')}::{case.get('name')}",
        "outcome": outcome,
        "seconds": float(case.get("time") or 0),
        "message": msg,
    }


# -- what a result file says about its step ------------------------------------------------------


def _json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} holds {type(data).__name__}, not an object")
    return data


def problems_tests(path: Path) -> list[str]:
    t = junit_totals(path)["totals"]
    out = [f"{t[k]} {k}" for k in ("failed", "error", "interrupted") if t[k]]
    if t["passed"] + t["failed"] + t["error"] == 0:
        out.append("no test ran")
    return out


def problems_bench_rollout(path: Path) -> list[str]:
    data = _json(path)
    return [
        f"part {k}: {v['error']}" for k, v in data.items() if isinstance(v, dict) and "error" in v
    ]


def problems_bench_loss(path: Path) -> list[str]:
    data = _json(path)
    return [
        f"{r['head']} {r['variant']} N={r['tokens']}: {r['error']}"
        for r in data.get("results", [])
        if r.get("error")
    ]


def problems_e2e(path: Path) -> list[str]:
    """A run that failed; one of ours whose weights or GPU holders fail their checks
    (``e2e_common.run_problems``); modes never run; an interrupt; a baseline not compared."""
    data = _json(path)
    out = [f"{k}: {(data[k] or {}).get('error', 'not ok')}" for k in E2E_RUNS
           if k in data and data[k] is not None and data[k].get("status") != "ok"]  # fmt: skip
    out += [f"{k}: {why}" for k in OURS if isinstance(data.get(k), dict)
            and data[k].get("status") == "ok" for why in run_problems(data[k])]  # fmt: skip
    out += [f"modes never run: {data['pending_modes']}"] if data.get("pending_modes") else []
    out += [f"interrupted: {data['interrupted']}"] if data.get("interrupted") else []
    out += [data["trl_note"]] if data.get("trl_note") else []
    return out


def problems_e2e4(step: str) -> Callable[[Path], list[str]]:
    """``problems_e2e``; the step's baseline (TRL, veRL) missing from the file is one too, and
    so is a failed NCCL bandwidth measurement (the weight-sync figures' bound)."""

    def problems(path: Path) -> list[str]:
        out = problems_e2e(path)
        baseline = E2E4_BASELINES.get(step)
        data = _json(path)
        if baseline and not isinstance(data.get(baseline), dict):
            out.append(f"no {baseline} baseline in {path.name}")
        bandwidth = data.get("bandwidth") or {}
        if bandwidth.get("status") == "error":  # the sync figures' bound is missing
            out.append(f"NCCL bandwidth: {bandwidth.get('error')}")
        return out

    return problems


def problems_memory(path: Path) -> list[str]:
    data = _json(path)
    return [f"{r['name']}: {r['status']}" for r in data.get("configs", []) if r["status"] != "ok"]


def problems_overlap(path: Path) -> list[str]:
    data = _json(path)
    out = [f"{k}: {data[k].get('error') or data[k].get('status')}"
           for k in ("synchronous", "overlap") if data[k].get("status") != "ok"]  # fmt: skip
    out += [data["note"]] if data.get("note") else []
    return out


def problems_native_sync(path: Path) -> list[str]:
    """Each run (model/transport) timed both sides: ours and vLLM's engine."""
    data = _json(path)
    if not data:
        return ["no transport was measured"]
    return [f"{t}: {side} not measured" for t, run in data.items()
            for side in ("ours", "vllm") if "median_s" not in run.get(side, {})]  # fmt: skip


def problems_lora_sync(path: Path) -> list[str]:
    """Both modes measured on every transport, the adapter served by the server."""
    rows = _json(path).get("rows", [])
    if not rows:
        return ["no transport was measured"]
    modes = {
        t: {r["mode"] for r in rows if r["transport"] == t} for t in {r["transport"] for r in rows}
    }
    out = [f"{t}: {sorted({'merged', 'adapter'} - m)} not measured" for t, m in modes.items()
           if m != {"merged", "adapter"}]  # fmt: skip
    out += [f"{r['transport']}: the server served no adapter after the adapter syncs"
            for r in rows if r["mode"] == "adapter" and not r.get("served_lora_rank")]  # fmt: skip
    return out


def problems_train_phase(path: Path) -> list[str]:
    """Every variant ran, the baseline (plain transformers) and today's layout among them."""
    verdict = _json(path).get("verdict") or {}
    return [] if verdict.get("valid") else [str(verdict.get("why_not_valid") or "no verdict")]


PROBLEMS: dict[str, Callable[[Path], list[str]]] = {
    "train_phase": problems_train_phase,
    "lora_sync": problems_lora_sync,
    "native_sync": problems_native_sync,
    "tests": problems_tests,
    "bench_rollout": problems_bench_rollout,
    "bench_loss": problems_bench_loss,
    "e2e_colocated": problems_e2e,
    "e2e_split": problems_e2e,
    **{step: problems_e2e4(step) for step in ("e2e4_colocated", "e2e4_split", "e2e4_verl")},
    "memory": problems_memory,
    "overlap": problems_overlap,
}


def _verdict_targets(data: dict[str, Any]) -> list[tuple[str, bool | None]]:
    return [(v["check"], v.get("ok")) for v in data.get("verdicts", [])]


def _rollout_targets(data: dict[str, Any]) -> list[tuple[str, bool | None]]:
    word = {"PASS": True, "FAIL": False}
    return [(v["what"].strip(), word.get(v.get("target"))) for v in data.get("verdicts", [])]


def _memory_targets(data: dict[str, Any]) -> list[tuple[str, bool | None]]:
    return [(c["check"], c.get("ok")) for c in data.get("checks", [])]


def _train_phase_targets(data: dict[str, Any]) -> list[tuple[str, bool | None]]:
    v = data.get("verdict") or {}
    return [(f"best training-phase MFU >= {v.get('target_mfu')}", v.get("target_met"))]


# the target verdicts each step's result file holds: (what, passed; None where not judged)
TARGETS: dict[str, Callable[[dict[str, Any]], list[tuple[str, bool | None]]]] = {
    "train_phase": _train_phase_targets,
    "bench_rollout": _rollout_targets,
    **dict.fromkeys(E2E_STEPS, _verdict_targets),
    "overlap": _verdict_targets,
    "memory": _memory_targets,
}


def step_judgement(step: str, rc: int, out: Path, work: Path) -> dict[str, Any]:
    """``{status, valid, target_met, why}`` of a step (the module docstring says how)."""
    why: list[str] = []
    if rc != 0 and not (step in E2E_STEPS and rc == EXIT_TARGET_MISSED):
        why.append(
            f"exit code {rc}" + (" (pytest interrupted)" if step == "tests" and rc == 2 else "")
        )
    targets: list[tuple[str, bool | None]] = []
    path = result_files(out, work).get(step)
    if path is not None:
        if not path.is_file():
            why.append(f"no result file {path.name}")
        else:
            try:
                why += PROBLEMS[step](path)
                if step in TARGETS:
                    targets = TARGETS[step](_json(path))
            except (ValueError, KeyError, TypeError, AttributeError, ET.ParseError) as e:
                why.append(f"unreadable {path.name}: {type(e).__name__}: {e}")
    missed = [name for name, ok in targets if ok is False]
    judged = [ok for _, ok in targets if ok is not None]
    target_met = (not missed) if judged else None
    valid = not why
    if missed:
        why.append("target not met: " + "; ".join(missed))
    if not valid:
        status = "timeout" if rc in (124, 137) else "failed"
    else:
        status = "target_missed" if missed else "ok"
    return {"status": status, "valid": valid, "target_met": target_met,
            "why": "; ".join(why)[:1000]}  # fmt: skip


def step_verdict(step: str, rc: int, out: Path, work: Path) -> tuple[str, str]:
    """``(status, why)`` of ``step_judgement``."""
    j = step_judgement(step, rc, out, work)
    return j["status"], j["why"]


# -- summary.json ------------------------------------------------------------------------------


_FLAG = {"true": True, "false": False}


def read_steps(status_file: Path) -> list[dict[str, Any]]:
    """The suite's steps.tsv: ``STEP STATUS SECONDS RC [VALID TARGET_MET WHY]`` a line (the
    last three absent for a step never run)."""
    steps = []
    for line in status_file.read_text().splitlines():
        name, status, secs, rc, *rest = line.split("\t")
        valid, target, why = [*rest, "-", "-", ""][:3] if len(rest) >= 2 else ("-", "-", "")
        steps.append({"step": name, "status": status, "seconds": int(secs), "rc": rc,
                      "valid": _FLAG.get(valid, False), "target_met": _FLAG.get(target),
                      "why": why})  # fmt: skip
    return steps


def _e2e_section(data: dict[str, Any]) -> dict[str, Any]:
    medians = {}
    for k in E2E_RUNS:
        run = data.get(k)
        if isinstance(run, dict):
            ok = run.get("status") == "ok"
            medians[k] = run["summary"]["step_s"]["median"] if ok else run.get("error")
    figures = {k: data[k]["figures"] for k in E2E_RUNS
               if isinstance(data.get(k), dict) and "figures" in data[k]}  # fmt: skip
    ours = {k: data[k] for k in OURS if isinstance(data.get(k), dict)}
    weights = {k: (r.get("weights") or {}).get("match") for k, r in ours.items()}
    holders = {k: (r.get("gpu_holders") or {}).get("problems") for k, r in ours.items()}
    return {"verdicts": data.get("verdicts", []), "median_step_s": medians,
            "run": data.get("run"), "served_weights_match": weights,
            "gpu_holder_problems": holders,
            **({"figures": figures} if figures else {})}  # fmt: skip


def _rollout_section(data: dict[str, Any]) -> dict[str, Any]:
    return {"verdicts": data.get("verdicts", []),
            "errors": {k: v["error"] for k, v in data.items()
                       if isinstance(v, dict) and "error" in v}}  # fmt: skip


def _memory_section(data: dict[str, Any]) -> dict[str, Any]:
    options = {
        r["name"]: {"status": r["status"], "peak_gb": round(r["peak_bytes"] / 1e9, 3),
                    "step_s": round(r["step_s"]["median"], 3),
                    "recomputes": r.get("recomputes_activations")}
        if r["status"] == "ok" else {"status": r["status"], "error": str(r.get("error"))[:300]}
        for r in data.get("configs", [])}  # fmt: skip
    return {"options": options, "checks": {c["check"]: c["ok"] for c in data.get("checks", [])}}


def _overlap_section(data: dict[str, Any]) -> dict[str, Any]:
    return {"verdicts": data.get("verdicts", []),
            "median_step_s": {k: data[k]["median_step_s"] or data[k]["error"]
                              for k in ("synchronous", "overlap")},
            "ran_ahead": data.get("overlap_ran_ahead")}  # fmt: skip


# summary.json key -> the result file in $OUT and what is taken from it
SECTIONS: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "bench_rollout": ("bench_rollout_gpu.json", _rollout_section),
    "e2e_colocated": ("bench_e2e_colocated.json", _e2e_section),
    "e2e_split": ("bench_e2e_split.json", _e2e_section),
    "e2e4_colocated": ("bench_e2e4_colocated.json", _e2e_section),
    "e2e4_split": ("bench_e2e4_split.json", _e2e_section),
    "e2e4_verl": ("bench_e2e4_verl.json", _e2e_section),
    "memory": ("bench_memory_options.json", _memory_section),
    "overlap": ("bench_overlap.json", _overlap_section),
}


def summary(steps: list[dict[str, Any]], out: Path, budget: int, start: int) -> dict[str, Any]:
    """The steps' statuses (``ok``: every step ok), pytest's totals and each result file's
    verdicts; a file that cannot be read is reported in its section, never a crash."""
    s: dict[str, Any] = {"steps": steps, "total_s": int(time.time()) - start, "budget_s": budget}
    s["ok"] = bool(steps) and all(x["status"] == "ok" for x in steps)
    junit = out / "gpu_tests.xml"
    if junit.is_file():
        try:
            t = junit_totals(junit)
            s["tests"], s["test_cases"] = t["totals"], t["cases"]
        except ET.ParseError as e:
            s["tests"] = {"error": f"unreadable gpu_tests.xml: {e}"}
    for key, (name, section) in SECTIONS.items():
        if (out / name).is_file():
            try:
                s[key] = section(_json(out / name))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                s[key] = {"error": f"unreadable {name}: {type(e).__name__}: {e}"}
    return s


def merge_junit(parts: list[Path], dest: Path) -> None:
    """The ``<testsuite>`` elements of several junit reports under one ``<testsuites>`` (the
    GPU tests run one file per pytest process); a part that is missing or unreadable (its
    process killed before it wrote one) becomes a suite of one error naming it."""
    root = ET.Element("testsuites")
    for part in parts:
        try:
            got = ET.parse(part).getroot()
        except (OSError, ET.ParseError) as e:
            suite = ET.SubElement(root, "testsuite", name=part.stem, tests="1", errors="1")
            suite.set("failures", "0")
            suite.set("skipped", "0")
            case = ET.SubElement(suite, "testcase", classname=part.stem, name="report")
            ET.SubElement(case, "error", message=f"no junit report: {type(e).__name__}: {e}")
            continue
        root.extend([got] if got.tag == "testsuite" else got.findall("testsuite"))
    ET.ElementTree(root).write(dest, encoding="utf-8", xml_declaration=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verdict", help="a step's status and why, tab-separated")
    v.add_argument("step")
    v.add_argument("rc", type=int)
    v.add_argument("--out", type=Path, required=True)
    v.add_argument("--work", type=Path, required=True)
    m = sub.add_parser("summary", help="summary.json from the steps' status file")
    m.add_argument("status_file", type=Path)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--budget", type=int, required=True)
    m.add_argument("--start", type=int, required=True)
    j = sub.add_parser("merge", help="one junit report of several")
    j.add_argument("dest", type=Path)
    j.add_argument("parts", type=Path, nargs="+")
    n = sub.add_parser("join-native", help="bench_native_sync's runs, one per transport")
    n.add_argument("dest", type=Path)
    n.add_argument("parts", type=Path, nargs="*")
    args = p.parse_args(argv)
    if args.cmd == "join-native":
        runs = [json.loads(f.read_text()) for f in args.parts if f.is_file()]
        # one entry per model and transport: "qwen3-0.6b-shape/nccl"
        runs_by = {f"{Path(r['model']).name}/{r['transport']}": r for r in runs}
        args.dest.write_text(json.dumps(runs_by, indent=1))
        return 0
    if args.cmd == "merge":
        merge_junit(args.parts, args.dest)
        return 0
    if args.cmd == "verdict":
        j = step_judgement(args.step, args.rc, args.out, args.work)
        flag = {True: "true", False: "false", None: "-"}
        line = f"{j['status']}\t{flag[j['valid']]}\t{flag[j['target_met']]}\t{j['why']}"
        print(line.replace("\n", " "))
        return 0
    s = summary(read_steps(args.status_file), args.out, args.budget, args.start)
    (args.out / "summary.json").write_text(json.dumps(s, indent=2))
    print(json.dumps({k: v for k, v in s.items() if k != "test_cases"}, indent=1))
    for c in s.get("test_cases", []):
        if c["outcome"] != "passed":
            print(f"{c['outcome'].upper():11} {c['test']}: {c['message']}")
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
