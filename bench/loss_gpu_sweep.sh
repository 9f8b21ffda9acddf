#!/usr/bin/env bash
# Tuning sweep of the fused loss on one GPU (issue 6): the GPU tests of the loss kernels, then
# the per-chunk breakdown of `fused` for the forward kernel's pipelining variants and chunk
# sizes. Output: $OUT/sweep.txt (and the junit report). Usage, in the device run:
#   OUT=$OUT bash bench/loss_gpu_sweep.sh            # SWEEP_TESTS=0 skips the tests
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
B="python3 bench/bench_loss_gpu.py --breakdown --variants fused"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  if [ "${SWEEP_TESTS:-1}" = 1 ]; then
    timeout 300 python3 -m pytest -q -m gpu tests/learner/test_fused_loss.py \
      tests/learner/test_triton_kernel.py --junitxml="$OUT/gpu_tests_loss.xml" 2>&1 | tail -15
  fi
  for v in ${SWEEP_VARIANTS:-"1 1 0" "1 0 0" "0 1 0" "0 0 0" "1 0 1"}; do
    set -- $v
    echo "=== TMA_STORE=$1 FLATTEN=$2 WARP_SPEC=$3"
    GRPO_FUSED_TMA_STORE=$1 GRPO_FUSED_FLATTEN=$2 GRPO_FUSED_WARP_SPEC=$3 \
      timeout 120 $B --heads qwen3-0.6b --fused-chunk 1024 2>&1 | tail -14
  done
  for hc in ${SWEEP_CHUNKS:-"qwen3-0.6b 1536" "qwen3-0.6b 2048" "qwen3-8b 1024" "qwen3-8b 2048" "qwen3-8b 4096"}; do
    set -- $hc
    echo "=== defaults, $1 chunk $2"
    timeout 150 $B --heads "$1" --fused-chunk "$2" 2>&1 | tail -14
  done
} 2>&1 | tee "$OUT/sweep.txt"
