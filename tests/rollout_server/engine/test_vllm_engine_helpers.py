"""The vLLM engine's translation layer, checked without vLLM (which needs a GPU machine).

The engine itself runs in tests/gpu/test_vllm_engine.py; here: the engine arguments, the
sampling parameters, the conversion of vLLM's completion objects, and import safety.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest

from rollout_server.engine.base import EngineError
from rollout_server.engine.vllm_engine import (
    WORKER_EXTENSION,
    engine_kwargs,
    sampling_kwargs,
    served_sampling_kwargs,
    supported_kwargs,
    supports_flat_logprobs,
    to_sample,
)
from rollout_server.protocol import SamplingParams
from rollout_server.settings import ServerSettings


def test_importing_the_engine_and_worker_does_not_import_vllm() -> None:
    code = (
        "import sys, rollout_server.engine.vllm_engine, rollout_server.engine.vllm_worker, "
        "learner.sync.nccl, learner.sync.zero3, learner.sync.ipc, rollout_server.cuda_ipc; "
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm'; "
        "assert 'deepspeed' not in sys.modules, 'deepspeed'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_engine_kwargs_from_settings() -> None:
    s = ServerSettings(model="/m", engine="vllm", gpu_memory_utilization=0.4, seed=7)
    kw = engine_kwargs(s)
    assert kw["model"] == "/m" and kw["dtype"] == "bfloat16"  # auto on GPU = bfloat16
    assert kw["gpu_memory_utilization"] == 0.4 and kw["seed"] == 7
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["enable_sleep_mode"] is True and "max_model_len" not in kw
    module, cls = WORKER_EXTENSION.rsplit(".", 1)
    ext = getattr(importlib.import_module(module), cls)
    for method in ("grpo_init_weight_group", "grpo_begin_update", "grpo_finish_update"):
        assert callable(getattr(ext, method)), method
    s2 = ServerSettings(model="/m", dtype="float16", max_model_len=1024, tensor_parallel_size=2)
    kw2 = engine_kwargs(s2)
    assert kw2["dtype"] == "float16" and kw2["max_model_len"] == 1024
    assert kw2["tensor_parallel_size"] == 2


def test_supported_kwargs_drops_what_this_vllm_does_not_know(caplog) -> None:
    @dataclasses.dataclass
    class OldArgs:
        model: str = ""
        seed: int = 0

    with caplog.at_level(logging.WARNING):
        out = supported_kwargs(OldArgs, {"model": "m", "seed": 1, "logprobs_mode": "x"})
    assert out == {"model": "m", "seed": 1}
    assert "logprobs_mode" in caplog.text


def test_sampling_kwargs() -> None:
    p = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        min_p=0.05,
        max_tokens=12,
        stop="###",
        stop_token_ids=[5],
        seed=3,
        repetition_penalty=1.1,
    )
    kw = sampling_kwargs(p, n=8)
    assert kw == {
        "n": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,  # 0 and -1 both mean "off"; -1 is accepted by every vLLM release
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "max_tokens": 12,
        "stop": ["###"],
        "stop_token_ids": [5],
        "ignore_eos": False,
        "seed": 3,
        "logprobs": 0,
        "skip_special_tokens": True,
    }
    plain = sampling_kwargs(SamplingParams(top_k=40), n=1)
    assert plain["top_k"] == 40 and plain["stop"] is None and plain["stop_token_ids"] is None
    assert sampling_kwargs(p, n=8, flat_logprobs=True) == kw | {"flat_logprobs": True}
    bare = p.model_copy(update={"logprobs": False})  # no log-probs asked: none computed
    assert sampling_kwargs(bare, n=8, flat_logprobs=True) == kw | {"logprobs": None}


def test_flat_logprobs_only_where_vllm_has_them() -> None:
    class New:  # vLLM's SamplingParams is a msgspec struct; >= 0.11 lists flat_logprobs
        __struct_fields__ = ("n", "logprobs", "flat_logprobs")

    class Old:
        __struct_fields__ = ("n", "logprobs")

    assert supports_flat_logprobs(New) and not supports_flat_logprobs(Old)


def test_served_sampling_kwargs_follow_the_installed_vllm(monkeypatch) -> None:
    """What the engine and the benchmarks' offline baselines send: flat log-probs only where
    the installed vLLM's SamplingParams has them (a stand-in module: vLLM is GPU-only here)."""
    import types

    p = SamplingParams(max_tokens=4)
    for fields, flat in ((("n", "flat_logprobs"), True), (("n",), False)):
        fake = types.ModuleType("vllm")
        fake.SamplingParams = type("SamplingParams", (), {"__struct_fields__": fields})
        monkeypatch.setitem(sys.modules, "vllm", fake)
        assert served_sampling_kwargs(p, n=2) == sampling_kwargs(p, n=2, flat_logprobs=flat)


def _completion(token_ids, logprobs, finish_reason="stop", text="hi"):
    """The fields of vLLM's CompletionOutput that the engine reads (vLLM is not installed here);
    ``logprobs`` is one {token_id: Logprob} mapping per position, as vLLM returns with
    ``logprobs=0``."""
    positions = [
        {t: SimpleNamespace(logprob=lp)} for t, lp in zip(token_ids, logprobs, strict=True)
    ]
    return SimpleNamespace(
        index=0, token_ids=token_ids, logprobs=positions, text=text, finish_reason=finish_reason
    )


def test_to_sample() -> None:
    s = to_sample(_completion((4, 9, 2), [-0.5, -1.25, -0.0]))
    assert s.token_ids == [4, 9, 2] and s.logprobs == [-0.5, -1.25, -0.0]
    assert s.text == "hi" and s.finish_reason == "stop"
    assert to_sample(_completion([1], [-2.0], "length")).finish_reason == "length"
    assert to_sample(_completion([1], [-2.0], None)).finish_reason == "abort"
    broken = _completion([1, 2], [-1.0, -1.0])
    broken.logprobs = broken.logprobs[:1]
    with pytest.raises(EngineError, match="1 log-prob positions for 2 tokens"):
        to_sample(broken)
    broken.logprobs = None  # what vLLM returns for logprobs=None
    bare = to_sample(broken, logprobs=False)
    assert bare.token_ids == [1, 2] and bare.logprobs == [] and bare.finish_reason == "stop"


@dataclasses.dataclass
class _Flat:
    """The layout of vLLM's ``FlatLogprobs``: each position's entries are
    ``[start_indices[i], end_indices[i])`` of the flat lists, the sampled token first."""

    start_indices: list[int]
    end_indices: list[int]
    token_ids: list[int]
    logprobs: list[float]

    def __len__(self) -> int:
        return len(self.start_indices)


def test_to_sample_reads_flat_logprobs() -> None:
    flat = _Flat([0, 1, 3], [1, 3, 4], [4, 9, 7, 2], [-0.5, -1.25, -3.0, -0.0])
    c = _completion((4, 9, 2), [0, 0, 0])
    c.logprobs = flat
    assert to_sample(c).logprobs == [-0.5, -1.25, -0.0]
    flat.token_ids[1], flat.token_ids[2] = 7, 9  # the sampled token listed second
    assert to_sample(c).logprobs == [-0.5, -3.0, -0.0]
    flat.token_ids[2] = 8
    with pytest.raises(EngineError, match="no log-prob for token 9 at position 1"):
        to_sample(c)
    c.logprobs = _Flat([0], [1], [4], [-0.5])
    with pytest.raises(EngineError, match="1 log-prob positions for 3 tokens"):
        to_sample(c)


def test_checkpoint_metadata_agrees_with_the_config_metadata(tiny_model_dir) -> None:
    """The fallback (safetensors headers) and the meta-device model describe the same tensors;
    the checkpoint omits the tied lm_head, which the meta model lists as an alias."""
    from rollout_server.engine.vllm_engine import checkpoint_metadata, hf_weight_metadata

    files = checkpoint_metadata(tiny_model_dir, "float32")
    config = hf_weight_metadata(str(tiny_model_dir), "float32")
    assert set(config) - set(files) == {"lm_head.weight"}
    assert all(files[k] == config[k] for k in files)
    with pytest.raises(EngineError, match=r"no \.safetensors files"):
        checkpoint_metadata(tiny_model_dir / "nowhere", "float32")


def test_extra_vllm_args_from_the_cli_reach_the_engine_kwargs():
    from rollout_server.cli import build_parser, settings_from_args
    from rollout_server.engine.vllm_engine import engine_kwargs

    args = build_parser().parse_args(
        ["--model", "m", "--engine", "vllm", "--gpu-memory-utilization", "0.4",
         "--vllm-arg", "enforce_eager=true", "--vllm-arg", "max_num_batched_tokens=4096",
         "--vllm-arg", "kv_cache_dtype=fp8", "--vllm-arg", "gpu_memory_utilization=0.3"]
    )  # fmt: skip
    kwargs = engine_kwargs(settings_from_args(args))
    assert kwargs["enforce_eager"] is True
    assert kwargs["max_num_batched_tokens"] == 4096
    assert kwargs["kv_cache_dtype"] == "fp8"
    assert kwargs["gpu_memory_utilization"] == 0.3  # the explicit extra argument wins
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        settings_from_args(build_parser().parse_args(["--model", "m", "--vllm-arg", "oops"]))


def test_batch_limits_from_the_cli_reach_vllm_and_default_to_vllms_own():
    from rollout_server.cli import build_parser, settings_from_args
    from rollout_server.engine.vllm_engine import engine_kwargs

    base = ["--model", "m", "--engine", "vllm"]
    unset = engine_kwargs(settings_from_args(build_parser().parse_args(base)))
    assert "max_num_seqs" not in unset and "max_num_batched_tokens" not in unset
    args = build_parser().parse_args([*base, "--max-num-seqs", "512", "--max-batch-tokens", "8192"])
    kwargs = engine_kwargs(settings_from_args(args))
    assert kwargs["max_num_seqs"] == 512 and kwargs["max_num_batched_tokens"] == 8192
