"""Generation engines. Import them through ``load_engine`` so vLLM is only imported when used."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_server.engine.base import (
    Engine,
    EngineError,
    EngineInfo,
    SampleOutput,
    TensorMeta,
    UnsupportedError,
    WeightsError,
)

if TYPE_CHECKING:
    from rollout_server.settings import ServerSettings

ENGINES = ("transformers", "vllm")


def load_engine(name: str, settings: ServerSettings) -> Engine:
    """The engine called ``name``, imported only now (torch, transformers or vLLM load here)."""
    if name == "transformers":
        from rollout_server.engine.transformers_engine import TransformersEngine

        return TransformersEngine(settings)
    if name == "vllm":
        from rollout_server.engine.vllm_engine import VLLMEngine  # written with the vLLM issue

        return VLLMEngine(settings)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")


__all__ = [
    "ENGINES",
    "Engine",
    "EngineError",
    "EngineInfo",
    "SampleOutput",
    "TensorMeta",
    "UnsupportedError",
    "WeightsError",
    "load_engine",
]
