"""The memory-options benchmark's configurations and the checks of their results (pure: no
torch; bench_memory_options.py imports them, and its CPU test reads them through that script):
the options and named configurations, each one's ``LearnerConfig``, the synthetic batch's
lengths and packing budget, the checks against the baseline, and the printed table.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

MEMORY_OPTIONS = (
    "gradient_checkpointing",
    "activation_offloading",
    "lora",
    "packing",
    "fused_loss",
)
# Options for speed alone (``model.compile``): checked for time against the same configuration
# without them, not for memory.
SPEED_OPTIONS = ("compile",)
OPTIONS = MEMORY_OPTIONS + SPEED_OPTIONS
BASELINE: dict[str, Any] = {k: False for k in OPTIONS} | {
    "pad_to_multiple_of": 1,
    "lora_adapter_dtype": "float32",
    "lora_quantization": "none",
}
# name -> what differs from the baseline; the default list: every option alone, "all_on" early and
# the slowest (offloading: every activation crosses PCIe twice) last, so a budget cut loses least.
CONFIGS: dict[str, dict[str, Any]] = {
    "baseline": {},
    **{k: {k: True} for k in OPTIONS},
    "pad_to_multiple_of": {"pad_to_multiple_of": 64},
    "lora_adapter_model": {"lora": True, "lora_adapter_dtype": "model"},
    "qlora": {"lora": True, "lora_quantization": "nf4"},  # needs bitsandbytes
    "qlora_adapter_model": {
        "lora": True,
        "lora_quantization": "nf4",
        "lora_adapter_dtype": "model",
    },
    "all_on": {k: True for k in MEMORY_OPTIONS},
    "checkpointing_compile": {"gradient_checkpointing": True, "compile": True},
}
DEFAULT_CONFIGS = (
    "baseline", "all_on", "gradient_checkpointing", "lora", "lora_adapter_model", "qlora",
    "qlora_adapter_model", "fused_loss", "packing", "activation_offloading",
)  # fmt: skip
LORA_RANK = 16


class BenchError(RuntimeError):
    """The benchmark cannot run here; the message says what to do."""


# -- what each configuration runs (pure) -----------------------------------------------------


def config_options(name: str) -> dict[str, Any]:
    if name not in CONFIGS:
        raise BenchError(f"unknown configuration {name!r}; choose from {list(CONFIGS)}")
    return BASELINE | CONFIGS[name]


def learner_config_dict(
    options: dict[str, Any],
    *,
    dtype: str,
    micro_batch_size: int,
    packing_tokens: int,
    attn_implementation: str | None = None,
) -> dict[str, Any]:
    """The ``LearnerConfig`` of one configuration as a dict. No data is read: [data] and
    [[rewards]] only satisfy the validator (the batch is synthetic)."""
    return {
        "model": {
            "dtype": dtype,
            "gradient_checkpointing": options["gradient_checkpointing"],
            "activation_offloading": options["activation_offloading"],
            "lora": {
                "r": LORA_RANK,
                "alpha": 2 * LORA_RANK,
                "adapter_dtype": options["lora_adapter_dtype"],
                "quantization": options["lora_quantization"],
            }
            if options["lora"]
            else None,
            "attn_implementation": attn_implementation,
            "compile": options["compile"],
        },
        "data": {"path": "unused: synthetic rollouts"},
        "rewards": [{"name": "length"}],
        "grpo": {
            "micro_batch_size": micro_batch_size,
            "packing": options["packing"],
            "max_tokens_per_micro_batch": packing_tokens,
            "pad_to_multiple_of": options["pad_to_multiple_of"],
            "fused_loss": options["fused_loss"],
        },
    }


def sequence_lengths(
    n: int, prompt: Sequence[int], completion: Sequence[int], seed: int
) -> list[tuple[int, int]]:
    """``n`` (prompt, completion) lengths, each uniform in its inclusive range, seeded."""
    rng = random.Random(seed)
    return [(rng.randint(*prompt), rng.randint(*completion)) for _ in range(n)]


def packing_budget(lengths: list[tuple[int, int]], micro_batch_size: int) -> int:
    """The packing token budget that holds as many real tokens as an average padded micro-batch
    (``micro_batch_size`` mean-length sequences), rounded up to a multiple of 64; at least the
    longest sequence, so no sequence gets a bin of its own for being too long."""
    mean = sum(p + c for p, c in lengths) / len(lengths)
    budget = max(micro_batch_size * mean, max(p + c for p, c in lengths))
    return int(-(-budget // 64) * 64)


def checks(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every configuration but the baseline: is its peak below the baseline's (a speed
    option: is its step faster than the same configuration without it)? And where gradient
    checkpointing is on: did the decoder layers really run again in the backward?"""
    base = next((r for r in results if r["name"] == "baseline" and r["status"] == "ok"), None)
    out = []
    for r in results:
        ok_run = r["status"] == "ok"
        if any(r["options"][k] for k in SPEED_OPTIONS):
            name = r["name"] + " is faster than {ref}"
            out.append(_below_the_same_without(r, results, SPEED_OPTIONS, "step_s", name))
        elif r["name"] != "baseline":
            peak = r.get("peak_bytes") if ok_run else None
            bound = base["peak_bytes"] if base else None
            out.append(
                {"check": f"{r['name']} lowers peak memory", "peak_bytes": peak,
                 "baseline_peak_bytes": bound,
                 "ok": None if peak is None or bound is None else peak < bound}
            )  # fmt: skip
            # What the process holds, too: offloading once cut the allocated peak by 87 %
            # while the reserved peak went up (blocks queued for their copies out).
            held = r.get("peak_reserved_bytes") if ok_run else None
            held_bound = base.get("peak_reserved_bytes") if base else None
            if held is not None and held_bound is not None:
                out.append(
                    {"check": f"{r['name']} lowers peak reserved memory",
                     "peak_reserved_bytes": held, "baseline_peak_reserved_bytes": held_bound,
                     "ok": held < held_bound}
                )  # fmt: skip
        if r["options"]["gradient_checkpointing"] and r["options"]["compile"]:
            name = r["name"] + ": activations recomputed in the backward (peak below {ref}'s)"
            off = ("gradient_checkpointing",)
            out.append(_below_the_same_without(r, results, off, "peak_bytes", name))
        elif r["options"]["gradient_checkpointing"]:
            seen = r.get("recomputes_activations") if ok_run else None
            out.append(
                {"check": f"{r['name']}: activations recomputed in the backward",
                 "layer_forwards_per_micro_batch": r.get("layer_forwards_per_micro_batch"),
                 "ok": seen}
            )  # fmt: skip
        if ok_run and "grad_norm" in r:
            out.extend(_numerics_checks(r, results))
    return out


# Options that trade memory or time for nothing else: the step must compute the same gradients.
PURE_TRADES = ("gradient_checkpointing", "activation_offloading", "packing", "fused_loss",
               "pad_to_multiple_of", "compile")  # fmt: skip
GRAD_NORM_RTOL = 0.05


def _below_the_same_without(
    r: dict[str, Any], results: list[dict[str, Any]], off: tuple[str, ...], key: str, check: str
) -> dict[str, Any]:
    """Is ``r``'s ``key`` (``step_s``: its median) below that of the run of these ``results``
    with the same options but ``off`` turned off? ``check`` names it, with ``{ref}`` for that run
    (a speed option: faster; compiled checkpointed layers, whose recompute inside the compiled
    backward the layer probe cannot see: a lower peak)."""
    without = r["options"] | {k: False for k in off}
    ref = next((x for x in results if x["options"] == without and x["status"] == "ok"), None)

    def value(x: dict[str, Any] | None) -> float | None:
        if x is None or x["status"] != "ok":
            return None
        return x[key]["median"] if key == "step_s" else x.get(key)

    mine, theirs = value(r), value(ref)
    return {
        "check": check.format(ref=ref["name"] if ref else "the same without it"),
        key: mine,
        f"reference_{key}": theirs,
        "ok": None if mine is None or theirs is None else mine < theirs,
    }


def _numerics_checks(r: dict[str, Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A finite loss and gradient norm; and where the configuration differs from another one
    of this run only by pure trades (all_on vs lora, offloading vs baseline), the same gradient
    norm as that one: a memory option must not change what is learned."""
    loss, norm = r.get("loss"), r.get("grad_norm")
    finite = all(isinstance(x, (int, float)) and math.isfinite(x) for x in (loss, norm))
    out = [{"check": f"{r['name']}: finite loss and gradient norm", "loss": loss,
            "grad_norm": norm, "ok": finite}]  # fmt: skip
    plain = {k: (BASELINE[k] if k in PURE_TRADES else v) for k, v in r["options"].items()}
    ref = next(
        (x for x in results
         if x is not r and x["status"] == "ok" and x["options"] == plain and "grad_norm" in x),
        None,
    )  # fmt: skip
    if ref is not None and plain != r["options"]:
        ok = finite and abs(norm - ref["grad_norm"]) <= GRAD_NORM_RTOL * abs(ref["grad_norm"])
        out.append(
            {"check": f"{r['name']}: gradient norm as {ref['name']}'s", "grad_norm": norm,
             "reference_grad_norm": ref["grad_norm"], "ok": ok}
        )  # fmt: skip
    return out


def table(results: list[dict[str, Any]], unit: float, unit_name: str) -> str:
    head = (
        f"{'config':24} {'status':8} {'peak ' + unit_name:>9} {'vs base':>7} "
        f"{'start ' + unit_name:>9} {'s/step':>7} {'µbatch':>6} {'padded':>7} {'recompute':>9}"
    )
    lines = [head, "-" * len(head)]
    base = next((r for r in results if r["name"] == "baseline" and r["status"] == "ok"), None)
    for r in results:
        if r["status"] != "ok":
            last = (str(r.get("error", "")).strip().splitlines() or [""])[-1]
            lines.append(f"{r['name']:24} {r['status']:8} {last[:100]}")
            continue
        ratio = f"{r['peak_bytes'] / base['peak_bytes']:.2f}" if base else "-"
        start = r.get("step_start_bytes")
        lines.append(
            f"{r['name']:24} {'ok':8} {r['peak_bytes'] / unit:>9.2f} {ratio:>7} "
            f"{'-' if start is None else format(start / unit, '.2f'):>9} "
            f"{r['step_s']['median']:>7.3f} {r['micro_batches']:>6} {r['tokens_padded']:>7} "
            f"{r.get('recomputes_activations', '-')!s:>9}"
        )
    return "\n".join(lines)
