"""Generation engines. Import them through ``load_engine`` so vLLM is only imported when used."""

from __future__ import annotations

from rollout_server.engine.base import (
    Engine,
    EngineError,
    EngineInfo,
    SampleOutput,
    TensorMeta,
    UnsupportedError,
    WeightsError,
)

ENGINES = ("transformers", "vllm")

__all__ = [
    "ENGINES",
    "Engine",
    "EngineError",
    "EngineInfo",
    "SampleOutput",
    "TensorMeta",
    "UnsupportedError",
    "WeightsError",
]
