"""The memory-options benchmark without a GPU: its CLI, the learner configs it builds (accepted by
the real ``LearnerConfig``), the batch and packing arithmetic by hand, the refusal without CUDA,
and one real ``--cpu-smoke`` run of every configuration through the learner's own step code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPT = BENCH / "bench_memory_options.py"
sys.path.insert(0, str(BENCH))

import bench_memory_options as mem  # noqa: E402


def test_help_is_fast_and_imports_no_torch():
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 10
    for flag in ("--out", "--model", "--cpu-smoke", "--configs", "--budget-s"):
        assert flag in out.stdout
    probe = (
        f"import sys; sys.path.insert(0, {str(BENCH)!r}); import bench_memory_options; "
        "print(sorted(m for m in ('torch', 'transformers', 'learner.config') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert loaded.stdout.strip() == "[]", loaded.stderr


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_without_cuda_it_refuses_and_names_the_cpu_smoke_mode(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "m.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "no CUDA GPU visible" in out.stderr and "--cpu-smoke" in out.stderr
    assert not (tmp_path / "m.json").exists()
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--configs", "baseline,lorra",
         "--out", str(tmp_path / "m.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "'lorra'" in bad.stderr and "fused_loss" in bad.stderr


def test_each_configuration_turns_on_exactly_its_option():
    base = mem.config_options("baseline")
    assert base == {
        "gradient_checkpointing": False, "activation_offloading": False, "lora": False,
        "packing": False, "fused_loss": False, "compile": False, "pad_to_multiple_of": 1,
        "lora_adapter_dtype": "float32", "lora_quantization": "none",
    }  # fmt: skip
    for opt in mem.OPTIONS:
        differs = {k for k, v in mem.config_options(opt).items() if v != base[k]}
        assert differs == {opt}
    for name, extra in (
        ("lora_adapter_model", "lora_adapter_dtype"),
        ("qlora", "lora_quantization"),
    ):
        differs = {k for k, v in mem.config_options(name).items() if v != base[k]}
        assert differs == {"lora", extra}  # LoRA variants: LoRA on, one LoRA setting changed
    assert all(mem.config_options("all_on")[k] for k in mem.MEMORY_OPTIONS)
    assert not mem.config_options("all_on")["compile"]
    differs = {k for k, v in mem.config_options("checkpointing_compile").items() if v != base[k]}
    assert differs == {"gradient_checkpointing", "compile"}
    differs = {k for k, v in mem.config_options("qlora_adapter_model").items() if v != base[k]}
    assert differs == {"lora", "lora_quantization", "lora_adapter_dtype"}
    assert set(mem.DEFAULT_CONFIGS) == {
        "baseline", *mem.MEMORY_OPTIONS, "lora_adapter_model", "qlora", "qlora_adapter_model",
        "all_on",
    }  # fmt: skip
    assert mem.DEFAULT_CONFIGS[0] == "baseline"  # the others are compared with it
    with pytest.raises(mem.BenchError, match="unknown configuration 'nope'"):
        mem.config_options("nope")


@pytest.mark.parametrize("name", list(mem.CONFIGS))
def test_learner_config_is_accepted_by_the_real_learner(name):
    from learner.config import LearnerConfig
    from learner.step.update import StepOptions

    options = mem.config_options(name)
    cfg = LearnerConfig.model_validate(
        mem.learner_config_dict(
            options, dtype="bfloat16", micro_batch_size=16, packing_tokens=13376
        )
    )
    assert cfg.model.dtype == "bfloat16"
    assert cfg.model.gradient_checkpointing is options["gradient_checkpointing"]
    assert (cfg.model.lora is not None) is options["lora"]
    if options["lora"]:
        assert (cfg.model.lora.r, cfg.model.lora.alpha) == (16, 32)
    opts = StepOptions.of(cfg)
    assert opts.activation_offloading is options["activation_offloading"]
    assert (opts.packing, opts.fused_loss) == (options["packing"], options["fused_loss"])
    assert opts.pad_to_multiple_of == options["pad_to_multiple_of"]
    assert (opts.micro_batch_size, opts.max_tokens_per_micro_batch) == (16, 13376)
    assert not opts.need_reference  # beta = 0: no reference model in any configuration


def test_batch_lengths_are_seeded_and_in_range_and_the_packing_budget_by_hand():
    a = mem.sequence_lengths(64, (128, 256), (256, 1024), seed=0)
    assert a == mem.sequence_lengths(64, (128, 256), (256, 1024), seed=0)
    assert a != mem.sequence_lengths(64, (128, 256), (256, 1024), seed=1)
    assert len(a) == 64 and all(128 <= p <= 256 and 256 <= c <= 1024 for p, c in a)
    assert len({c for _, c in a}) > 32  # varied lengths, not one padded shape
    # mean length (100+300 + 50+150) / 2 = 300; 4 x 300 = 1200 -> next multiple of 64 = 1216
    assert mem.packing_budget([(100, 300), (50, 150)], 4) == 1216
    # one micro-batch-size of 1 would be below the longest sequence (400): 400 -> 448
    assert mem.packing_budget([(100, 300), (50, 150)], 1) == 448


def _row(name: str, peak: int, **kw):
    return {"name": name, "options": mem.config_options(name), "status": "ok", "peak_bytes": peak,
            **kw}  # fmt: skip


def test_checks_compare_with_the_baseline_and_flag_checkpointing_that_recomputes_nothing():
    rows = [
        _row("baseline", 100, recomputes_activations=False),
        _row("gradient_checkpointing", 40, recomputes_activations=True),
        _row("fused_loss", 100, recomputes_activations=False),
        _row("all_on", 30, recomputes_activations=False),
        {"name": "lora", "options": mem.config_options("lora"), "status": "oom", "error": "x"},
    ]
    got = {c["check"]: c["ok"] for c in mem.checks(rows)}
    assert got == {
        "gradient_checkpointing lowers peak memory": True,
        "gradient_checkpointing: activations recomputed in the backward": True,
        "fused_loss lowers peak memory": False,  # equal is not lower
        "all_on lowers peak memory": True,
        "all_on: activations recomputed in the backward": False,
        "lora lowers peak memory": None,  # it did not run
    }
    assert all(c["ok"] is None for c in mem.checks(rows[1:]) if "peak" in c["check"])


def test_checks_flag_an_option_that_lowers_allocated_but_not_reserved_memory():
    rows = [
        _row("baseline", 100, peak_reserved_bytes=110),
        _row("activation_offloading", 13, peak_reserved_bytes=114),  # the first fixed GPU run
        _row("gradient_checkpointing", 40, peak_reserved_bytes=45),
        _row("packing", 90),  # a CPU run: no reserved figure, no reserved check
    ]
    got = {c["check"]: c["ok"] for c in mem.checks(rows)}
    assert got["activation_offloading lowers peak memory"] is True
    assert got["activation_offloading lowers peak reserved memory"] is False
    assert got["gradient_checkpointing lowers peak reserved memory"] is True
    assert "packing lowers peak reserved memory" not in got


def test_checks_time_a_speed_option_against_the_same_configuration_without_it():
    def row(name, peak, s):
        return _row(name, peak, step_s={"median": s}, loss=1.0, grad_norm=2.0)

    rows = [
        row("baseline", 100, 2.0),
        row("compile", 90, 1.5),
        row("gradient_checkpointing", 40, 3.0),
        row("checkpointing_compile", 45, 3.1),
    ]
    got = {c["check"]: c["ok"] for c in mem.checks(rows)}
    assert got["compile is faster than baseline"] is True
    assert got["checkpointing_compile is faster than gradient_checkpointing"] is False
    assert got["checkpointing_compile: gradient norm as baseline's"] is True  # a pure trade
    # recomputed inside the compiled backward, unseen by the layer probe: told by the peak
    key = "checkpointing_compile: activations recomputed in the backward (peak below compile's)"
    assert got[key] is True
    assert not any(k.startswith(("compile lowers", "checkpointing_compile lowers")) for k in got)
    alone = {c["check"]: c["ok"] for c in mem.checks(rows[1:2])}
    assert alone["compile is faster than the same without it"] is None  # nothing to compare


def test_checks_flag_a_memory_option_that_changes_the_gradients():
    """The first GPU run of activation offloading computed NaNs, and all_on (LoRA + offloading)
    a gradient norm 10^5 times LoRA's: both must fail, not pass on memory alone."""
    nums = dict(loss=4.3e-7, grad_norm=4.86e-5)
    rows = [
        _row("baseline", 100, **nums),
        _row("gradient_checkpointing", 40, loss=4.3e-7, grad_norm=4.87e-5),
        _row("activation_offloading", 6, loss=float("nan"), grad_norm=float("nan")),
        _row("lora", 120, loss=4.3e-7, grad_norm=5.6e-6),
        _row("all_on", 4, loss=4.3e-7, grad_norm=0.73),
        _row("qlora", 110, loss=4.6e-7, grad_norm=5.6e-6),
    ]
    got = {c["check"]: c["ok"] for c in mem.checks(rows) if "gradient norm" in c["check"]}
    assert got == {
        "baseline: finite loss and gradient norm": True,
        "gradient_checkpointing: finite loss and gradient norm": True,
        "gradient_checkpointing: gradient norm as baseline's": True,
        "activation_offloading: finite loss and gradient norm": False,
        "activation_offloading: gradient norm as baseline's": False,
        "lora: finite loss and gradient norm": True,
        "all_on: finite loss and gradient norm": True,
        "all_on: gradient norm as lora's": False,
        "qlora: finite loss and gradient norm": True,  # a different model: nothing to compare
    }


# -- one real run of every configuration on CPU ------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory") / "smoke.json"
    proc = subprocess.run(
        # the budget is for the GPU machine's call limit: here every configuration must run,
        # however slow the CI host (10 of them took 142 s on one, cut at 150 s by the default)
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out), "--steps", "2",
         "--budget-s", "1200", "--jobs", "2"],
        capture_output=True, text=True, timeout=1300, cwd=ROOT,
    )  # fmt: skip
    return proc, out


@pytest.mark.slow
def test_cpu_smoke_runs_and_reports_every_configuration(smoke):
    proc, out = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["bench"] == "memory_options" and report["mode"] == "cpu-smoke"
    assert report["dtype"] == "float32" and "--cpu-smoke" in report["command"]
    b = report["batch"]
    assert b["sequences"] == 8 and b["micro_batch_size"] == 4
    lengths = mem.sequence_lengths(8, (8, 16), (8, 32), seed=0)
    assert b["total_tokens"] == sum(p + c for p, c in lengths)
    assert b["loss_tokens"] == sum(c for _, c in lengths)
    assert b["max_tokens_per_micro_batch"] == mem.packing_budget(lengths, 4)
    rows = {r["name"]: r for r in report["configs"]}
    assert list(rows) == list(mem.DEFAULT_CONFIGS)
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r.get("error"))
        assert r["options"] == mem.config_options(name)
        assert r["memory_metric"].startswith("ru_maxrss") and r["peak_bytes"] >= 0
        assert r["step_start_bytes"] is None and r["host_maxrss_bytes"] > 0
        assert len(r["step_s"]["all"]) == 3 and r["step_s"]["warmup"] == 1
        assert r["step_s"]["median"] > 0 and r["trained_tokens_per_s"] > 0
        # every loss token is trained once, whatever the layout
        assert r["tokens_trained"] == b["loss_tokens"]
        assert r["loss"] == r["loss"] and r["grad_norm"] > 0  # finite loss, a real gradient
        assert r["layer_forwards_per_micro_batch"] >= 1
        assert r["full_logits_bytes"] > 0 and r["versions"]["torch"] != "-"
        assert r["device_name"] == "cpu"
        padded = r["tokens_padded"]
        if r["options"]["packing"]:
            assert padded == b["total_tokens"]  # padding-free
        else:
            assert r["micro_batches"] == 2 and padded >= b["total_tokens"]
    # LoRA r=16 on every linear of 2 tiny layers (hidden 64, q/o 64->64, k/v 64->32, MLP 128):
    # r * (in + out) = 16 * (128 + 96 + 96 + 128 + 3 * 192) = 16384 a layer
    assert rows["lora"]["trainable_params"] == 2 * 16384
    assert rows["baseline"]["trainable_params"] == rows["baseline"]["params"]
    names = [c["check"] for c in report["checks"]]
    assert "packing lowers peak memory" in names and "baseline lowers peak memory" not in names
    for name in mem.DEFAULT_CONFIGS:
        assert name in proc.stdout  # the table
    assert "results:" in proc.stdout


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_the_layers_in_the_backward(smoke):
    """The probe counts a decoder layer's calls: twice per micro-batch when checkpointed (forward
    and recompute in the backward), once otherwise. A model left in eval mode makes HF skip the
    checkpointing silently; this caught it."""
    proc, out = smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in json.loads(out.read_text())["configs"]}
    for name, r in rows.items():
        expected = 2.0 if r["options"]["gradient_checkpointing"] else 1.0
        assert r["layer_forwards_per_micro_batch"] == expected, name
