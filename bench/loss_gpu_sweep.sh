#!/usr/bin/env bash
# Tuning sweep of the fused loss on one GPU: the GPU tests of the loss kernels, then
# the per-chunk breakdown of `fused` with and without anchored tiles (GRPO_FUSED_ANCHORED) and
# at several chunk sizes. Output: $OUT/sweep.txt (and the junit report). Usage:
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
    timeout 300 python3 -m pytest -q -m gpu tests/learner/loss/test_fused_loss.py \
      tests/learner/loss/test_triton_kernel.py --junitxml="$OUT/gpu_tests_loss.xml" 2>&1 | tail -15
  fi
  for a in 1 0; do
    for h in qwen3-0.6b qwen3-8b; do
      echo "=== GRPO_FUSED_ANCHORED=$a $h, default chunk"
      GRPO_FUSED_ANCHORED=$a timeout 150 $B --heads "$h" 2>&1 | tail -14
    done
  done
  for hc in ${SWEEP_CHUNKS:-"qwen3-0.6b 1024" "qwen3-0.6b 2048" "qwen3-8b 1024" "qwen3-8b 4096"}; do
    set -- $hc
    echo "=== $1 chunk $2"
    timeout 150 $B --heads "$1" --fused-chunk "$2" 2>&1 | tail -14
  done
} 2>&1 | tee "$OUT/sweep.txt"
