# syntax=docker/dockerfile:1
# The learner: accelerate + DeepSpeed ZeRO-3, with vLLM's NCCL wrapper for weight sync. Build
# from the repository root:
#   docker build -f deploy/learner.Dockerfile -t grpo-service/learner .
# A devel image: DeepSpeed compiles its CUDA ops (fused Adam...) on first use with nvcc, whose
# major version must equal the CUDA version of the installed torch.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/data/hf \
    NCCL_NVLS_ENABLE=0 \
    NCCL_CUMEM_ENABLE=0

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
        build-essential ninja-build ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip

WORKDIR /app
COPY pyproject.toml README.md ./
COPY rollout_server/ rollout_server/
COPY learner/ learner/
COPY rewards/ rewards/
RUN pip install ".[vllm,deepspeed]"
COPY deploy/ deploy/

ENTRYPOINT []
CMD ["accelerate", "launch", "--config_file", "deploy/accelerate/zero3.yaml", "-m", "learner", "--help"]
