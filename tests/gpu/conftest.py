"""Fixtures of the GPU tests (run on the GPU machine with ``pytest -m gpu``; deselected elsewhere).

The helpers live in bench/gpu_common.py, shared with the GPU benchmarks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


@pytest.fixture(scope="session")
def vllm_ready() -> None:
    from gpu_common import gpu_count

    if gpu_count() == 0:
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (pip install -e .[vllm])")


@pytest.fixture(scope="session")
def qwen3_dir(vllm_ready) -> Path:
    """The random-weight Qwen3-0.6B-shaped model ($GRPO_GPU_MODEL, or written once here)."""
    from gpu_common import qwen3_model_dir

    return qwen3_model_dir()


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where server logs go: $GRPO_GPU_LOG_DIR (the suite points it under $OUT), else tmp."""
    path = os.environ.get("GRPO_GPU_LOG_DIR")
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        return Path(path)
    return tmp_path_factory.mktemp("gpu-logs")


@pytest.fixture(scope="session")
def qwen3_text_dir(vllm_ready) -> Path:
    """The Qwen3-0.6B shape with its tokenizer's vocabulary ($GRPO_GPU_TEXT_MODEL, or written once
    here): the model of the GRPO runs that must train, whose text rewards vary between samples
    (``gpu_common.qwen3_text_model_dir`` says why the full-vocabulary model's do not)."""
    from gpu_common import qwen3_text_model_dir

    return qwen3_text_model_dir()
