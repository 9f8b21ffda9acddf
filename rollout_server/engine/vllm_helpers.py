"""The vLLM engine's pure helpers: what it sends to vLLM and what it makes of vLLM's answers.

The server's settings as engine arguments (``engine_kwargs``, ``supported_kwargs``), sampling
parameters as vLLM's (``sampling_kwargs``, ``served_sampling_kwargs``), a vLLM completion as a
``SampleOutput`` (``to_sample``), and the checkpoint names and shapes a learner's update is
validated against (``hf_weight_metadata``). Apart from ``vllm_engine`` (which re-exports them),
so that file holds the engine class; the benchmarks build their offline vLLM baselines from the
same functions. vLLM and transformers are imported only inside them.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_server.engine.base import EngineError, SampleOutput, TensorMeta

if TYPE_CHECKING:
    from rollout_server.protocol import SamplingParams
    from rollout_server.settings import ServerSettings

log = logging.getLogger(__name__)

WORKER_EXTENSION = "rollout_server.engine.vllm_worker.WeightSyncWorkerExtension"
_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def engine_kwargs(settings: ServerSettings) -> dict[str, Any]:
    """``AsyncEngineArgs``/``LLM`` keyword arguments for these settings (pure; the benchmark
    builds its offline ``LLM`` from the same dict so both sides run the same configuration)."""
    kwargs: dict[str, Any] = {
        "model": settings.model,
        "dtype": "bfloat16" if settings.dtype == "auto" else settings.dtype,
        "seed": settings.seed,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "data_parallel_size": settings.data_parallel_size,
        "enable_sleep_mode": settings.enable_sleep_mode,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "trust_remote_code": settings.trust_remote_code,
        "worker_extension_cls": WORKER_EXTENSION,
        "logprobs_mode": "processed_logprobs",
    }
    if settings.max_model_len is not None:
        kwargs["max_model_len"] = settings.max_model_len
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if settings.max_batch_tokens is not None:
        kwargs["max_num_batched_tokens"] = settings.max_batch_tokens
    if settings.served_model_name:
        kwargs["served_model_name"] = settings.served_model_name
    kwargs.update(getattr(settings, "vllm_engine_args", None) or {})
    return kwargs


def supported_kwargs(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop (with a warning) the arguments this vLLM release does not know, e.g.
    ``logprobs_mode`` before vLLM 0.10."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
    if names is None:
        return kwargs
    dropped = sorted(set(kwargs) - names)
    if dropped:
        log.warning("this vLLM does not support %s; running without them", dropped)
    return {k: v for k, v in kwargs.items() if k in names}


def sampling_kwargs(params: SamplingParams, n: int, flat_logprobs: bool = False) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keyword arguments for one request of ``n`` samples (pure).

    ``flat_logprobs`` (vLLM >= 0.11, see ``supports_flat_logprobs``): vLLM keeps the log-probs
    in a few flat lists instead of a dict and a ``Logprob`` object per token, which spares the
    garbage collector (``bench/probe_vllm_sampling.py``: the e2e batch 2.71 -> 2.03 s on an
    H100; 3-6 % on an H200, docs/benchmarks.md)."""
    kwargs = {
        "n": n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "max_tokens": params.max_tokens,
        "stop": list(params.stop) or None,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "ignore_eos": params.ignore_eos,
        "seed": params.seed,
        "logprobs": 0 if params.logprobs else None,  # 0: the sampled token's log-prob only
        "skip_special_tokens": True,
    }
    if flat_logprobs and params.logprobs:
        kwargs["flat_logprobs"] = True
    return kwargs


def supports_flat_logprobs(sampling_params_cls: type) -> bool:
    """Whether this vLLM's ``SamplingParams`` (a msgspec struct) has ``flat_logprobs``."""
    return "flat_logprobs" in getattr(sampling_params_cls, "__struct_fields__", ())


def served_sampling_kwargs(params: SamplingParams, n: int) -> dict[str, Any]:
    """``sampling_kwargs`` as the engine sends them to the installed vLLM (imports it): the one
    place that decides, so the benchmarks' offline baselines ask for what the server asks."""
    from vllm import SamplingParams as VLLMSamplingParams

    return sampling_kwargs(params, n, supports_flat_logprobs(VLLMSamplingParams))


def to_sample(completion: Any, logprobs: bool = True) -> SampleOutput:
    """One vLLM ``CompletionOutput`` as a ``SampleOutput``: ids, the sampled tokens' log-probs
    (none when the request did not ask for them: ``logprobs=False``)."""
    token_ids = [int(t) for t in completion.token_ids]
    reason = _FINISH.get(str(completion.finish_reason), "abort")
    if not logprobs:
        return SampleOutput(token_ids, [], completion.text, reason)  # type: ignore[arg-type]
    positions = completion.logprobs or []
    if len(positions) != len(token_ids):
        raise EngineError(
            f"vLLM returned {len(positions)} log-prob positions for {len(token_ids)} tokens"
        )
    if hasattr(positions, "start_indices"):  # vLLM's FlatLogprobs: no dict per position
        values = _flat_sampled_logprobs(positions, token_ids)
    else:
        values = [float(pos[t].logprob) for t, pos in zip(token_ids, positions, strict=True)]
    return SampleOutput(token_ids, values, completion.text, reason)  # type: ignore[arg-type]


def _flat_sampled_logprobs(flat: Any, token_ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs from a ``FlatLogprobs``: vLLM puts the sampled token first
    in each position's range (``logprobs=0`` asks for no others)."""
    ids, values = flat.token_ids, flat.logprobs
    out = []
    for pos, (tok, start, end) in enumerate(
        zip(token_ids, flat.start_indices, flat.end_indices, strict=True)
    ):
        i = start if start < end and ids[start] == tok else None
        if i is None:  # not first: look through the position's range
            i = next((j for j in range(start, end) if ids[j] == tok), None)
        if i is None:
            raise EngineError(f"vLLM returned no log-prob for token {tok} at position {pos}")
        out.append(float(values[i]))
    return out


def hf_weight_metadata(
    model: str, dtype: str, trust_remote_code: bool = False
) -> dict[str, TensorMeta]:
    """Checkpoint names and full shapes of the model's parameters (tied aliases included, with
    ``tied_to``), from its config on the meta device: no weights are read, nothing is allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:  # an architecture transformers cannot build: read the files
        if not Path(model).is_dir():
            raise EngineError(
                f"cannot describe the weights of {model!r} ({exc}); serve a local directory"
            ) from exc
        log.warning("weight metadata from the checkpoint files (%s)", exc)
        return checkpoint_metadata(Path(model), dtype)
    first = {id(p): name for name, p in meta.named_parameters()}  # a tied one: its first name
    return {
        name: TensorMeta(dtype, tuple(p.shape), None if first[id(p)] == name else first[id(p)])
        for name, p in meta.named_parameters(remove_duplicate=False)
    }


def checkpoint_metadata(model_dir: Path, dtype: str) -> dict[str, TensorMeta]:
    """Names and shapes from the safetensors headers of a model directory (nothing loaded)."""
    from safetensors import safe_open

    out: dict[str, TensorMeta] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                out[name] = TensorMeta(dtype, tuple(f.get_slice(name).get_shape()))
    if not out:
        raise EngineError(f"no .safetensors files in {model_dir} to describe its weights")
    return out
