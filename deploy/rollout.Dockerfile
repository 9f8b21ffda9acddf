# syntax=docker/dockerfile:1
# The rollout server: FastAPI + vLLM on CUDA GPUs. Build from the repository root:
#   docker build -f deploy/rollout.Dockerfile -t grpo-service/rollout .
# vLLM pins its torch (which bundles the CUDA runtime); the base image only needs to match the
# host driver. Keep CUDA_IMAGE's major CUDA version equal to that torch build's.
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/data/hf \
    NCCL_NVLS_ENABLE=0 \
    NCCL_CUMEM_ENABLE=0 \
    VLLM_WORKER_MULTIPROC_METHOD=spawn

# gcc and the Python headers: Triton compiles small launchers at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ \
        ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip

WORKDIR /app
COPY pyproject.toml README.md ./
COPY rollout_server/ rollout_server/
COPY learner/ learner/
COPY rewards/ rewards/
RUN pip install ".[vllm]"
COPY deploy/healthcheck.py deploy/healthcheck.py

EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=10s --start-period=600s --retries=5 \
    CMD ["python3", "/app/deploy/healthcheck.py", "http://127.0.0.1:8000/ready"]
ENTRYPOINT ["rollout-server", "--engine", "vllm"]
CMD ["--help"]
