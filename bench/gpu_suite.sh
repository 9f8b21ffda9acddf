#!/usr/bin/env bash
# The GPU checks in one command, run on the GPU machine (docs/benchmarks.md cites its runs):
#
#   OUT=/some/dir bash bench/gpu_suite.sh                     # every step that fits the budget
#   SUITE_STEPS="setup model tests" bash bench/gpu_suite.sh   # a subset, in this order
#
# Steps: setup (vLLM bundle from /tmp/parts into /tmp/site, project installed editable),
# model (random-weight Qwen3-0.6B-shaped model, kept in $WORK while the machine stays up),
# tests (pytest -m gpu; GPU_TESTS picks files, GPU_LANES="0,1|2,3" with one GPU_TESTS list per
# lane, split by |, runs the lanes side by side), bench_rollout (bench/bench_rollout_gpu.py), bench_loss
# (bench/bench_loss_gpu.py), e2e_colocated (end-to-end GRPO steps on GPU 0: TRL's GRPOTrainer
# with colocated vLLM, then ours colocated; ours only with E2E_TRL=0), e2e_split (ours over
# 2 GPUs: split synchronous, then split with rollout.max_staleness 1; E2E_ARGS="--modes split
# --no-prepare-sync" times the split step without a prepared sync). Each e2e step holds one
# comparison, both sides in one call and one JSON, ~4-5 min: the step's limit is shared out so
# that each side finishes inside it (TRL at most 45%; each of our modes its share less 60 s
# for the server's start). Neither is in the default list: SUITE_STEPS="setup model
# e2e_colocated", then a call with "setup model e2e_split" on the 2-GPU machine. memory (issue 7: peak learner
# memory and step time with each memory option on vs off, bench/bench_memory_options.py, one
# GPU, no rollout server, ~2.5 min), overlap (issue 7: bench_grpo_e2e.py in mode split twice,
# rollout.max_staleness 0 then 1, 12 steps each; needs the 2-GPU machine, ~4 min). Neither is
# in the default list: SUITE_STEPS="setup model memory overlap" SUITE_BUDGET_S=590 on the
# 2-GPU machine. 4-GPU layouts (issue 37, kind nvidia-h100-x4; E2E4_SHAPE qwen3-4b or
# qwen3-8b): model4 (the random-weight model of that shape, built on GPU 0, kept in $WORK),
# e2e4_colocated (TRL 1.16 GRPOTrainer on 4 processes, accelerate + ZeRO-3, vLLM colocated on
# every rank; then ours colocated on every rank: a sleeping vLLM server per ZeRO-3 rank, CUDA
# IPC sync), e2e4_split (ours on 2 learner GPUs + 2 server GPUs, NCCL: synchronous, then
# rollout.max_staleness 1; E2E4_ARGS="--split4-tp 2" for one TP-2 server), e2e4_verl (veRL's
# GRPO: a failed step where verl is not installed). One call each after "setup model4":
# SUITE_STEPS="setup model4", then "setup e2e4_colocated", "setup e2e4_split", "setup e2e4_verl"
# with SUITE_BUDGET_S=580 on the same warm machine (E2E4_STEPS steps, default 8, each side;
# E2E4_RANKS processes, default 4; E2E4_TRL_ARGS to TRL). native_sync (issue 40: our NCCL
# and IPC sync against vLLM's native weight-transfer engine, bench/bench_native_sync.py; nccl
# needs 2 GPUs; SUITE_STEPS="setup model native_sync"; with "model4" before it and
# NATIVE_SYNC_MODELS="$GRPO_GPU_MODEL $E2E4_MODEL", the 4B shape too). lora_sync (issue 40:
# LoRA adapter against merged sync on the model4 shape, bench/bench_lora_sync.py, 2 GPUs;
# SUITE_STEPS="setup model4 lora_sync"). Each step has its own time
# limit and its own log; a failing step does not stop the others; the whole run stays inside
# SUITE_BUDGET_S (steps that no longer fit are skipped and say so). The budget counts from this
# script's start and the machine's call limit from the call's: make the suite the whole command
# (its setup step runs .dev/bin/install.sh itself, inside the budget), with SUITE_BUDGET_S at
# least 20 s under the call's timeout_s; otherwise the machine cuts the call before the suite's
# own limits do. A step is ok only when its command exits 0, the result file it owes exists and
# that file records no failed part, missing baseline or failed test (bench/suite_report.py
# decides; its reason goes into summary.json); the suite exits 1 when any step is not ok.
# Results in $OUT (few files, as the device tool returns at most 8):
#   summary.json  steps (status, why, seconds, exit code), pytest's own test counts, verdicts
#   steps.tsv  the steps ended so far and the one running (kept current while the suite runs)
#   gpu_tests.xml  junit report of pytest -m gpu
#   bench_rollout_gpu.json  throughput / sleep / sync numbers
#   bench_e2e_colocated.json / bench_e2e_split.json  e2e_colocated: TRL vs ours colocated;
#                e2e_split: split vs overlap; median s/step and phases, verdicts, the run id
#                (rewritten as each mode ends: a cut call keeps the modes that finished)
#   bench_e2e4_colocated.json / bench_e2e4_split.json / bench_e2e4_verl.json  the 4-GPU layouts:
#                both sides, s/step and phases, tokens/s, MFU, peak memory per GPU, weight sync
#                vs bytes / NCCL bandwidth, the run id, verdicts
#   bench_memory_options.json  memory: peak bytes, step seconds, recompute probe per option
#   bench_overlap.json  overlap: synchronous vs overlapped split medians, the verdict
#   logs.tar.gz  every step log, server logs, the offline-baseline log, bench_loss outputs,
#                the two overlap runs' own result files
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/out}
WORK=${WORK:-/tmp/grpo-gpu}
LOGS=$WORK/logs
SUITE_STEPS=${SUITE_STEPS:-setup model tests bench_rollout bench_loss}
SUITE_BUDGET_S=${SUITE_BUDGET_S:-560}
mkdir -p "$OUT" "$LOGS"

# NVLink multicast stays off everywhere, subprocesses included.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_CUMEM_ENABLE=0  # learner and vLLM workers must agree (vLLM's workers use 0)
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export GRPO_GPU_MODEL=${GRPO_GPU_MODEL:-$WORK/qwen3-0.6b-shape} GRPO_GPU_LOG_DIR=$LOGS
# the same shape with its tokenizer's vocabulary: the GPU tests whose GRPO runs must train
export GRPO_GPU_TEXT_MODEL=${GRPO_GPU_TEXT_MODEL:-$WORK/qwen3-0.6b-text}
export E2E4_SHAPE=${E2E4_SHAPE:-qwen3-4b}
export E2E4_MODEL=${E2E4_MODEL:-$WORK/$E2E4_SHAPE-shape}  # the 4-GPU layouts' model
export GRPO_GPU_PIDFILE=$WORK/servers.pid  # rollout servers started by the steps (by pid)
# this run's id, in every benchmark's JSON: numbers are put side by side only within one run
export SUITE_RUN_ID=${SUITE_RUN_ID:-$(hostname)-$(date +%s)-$$}
export ROOT OUT WORK LOGS

START=$(date +%s)
STATUS_FILE=$WORK/steps.tsv
: > "$STATUS_FILE"

step_setup() {
  if [ ! -f /tmp/site/.done ]; then
    [ -d /tmp/parts ] || { echo "no /tmp/parts: carry the .dev parts and run .dev/bin/stash.sh first"; return 1; }
    bash .dev/bin/install.sh || return 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
  # bitsandbytes (QLoRA) is not in the bundle: a wheel carried in .dev/bnb is installed if there
  if ls .dev/bnb/bitsandbytes-*.whl >/dev/null 2>&1 && ! python3 -c "import bitsandbytes" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/bnb/bitsandbytes-*.whl || return 1
  fi
  # Pure-Python wheels the bundle lacks (fastapi-offline, which the server imports; math-verify
  # and its deps for the GSM8K config: pip download --no-deps -d .dev/extra ...), carried in
  # .dev/extra, go into /tmp/site too
  if ls .dev/extra/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/extra/*.whl || return 1
  fi
  # Wheels over the device tool's carry limit (ray, which vLLM's IPC weight-transfer engine
  # imports), split into parts carried by one call each (.dev/big1, .dev/big2, each call:
  # mkdir -p /tmp/big && cp .dev/bigK/* /tmp/big/) with their small dependencies: joined here
  # and installed into /tmp/site where that package does not import yet
  local part whl mod
  for part in /tmp/big/*.whl.part-00; do
    [ -f "$part" ] || continue
    whl=${part%.part-00}
    [ -f "$whl" ] || cat "$whl".part-* > "$whl" || return 1
  done
  for whl in /tmp/big/*.whl; do
    [ -f "$whl" ] || continue
    mod=$(basename "$whl"); mod=${mod%%-*}
    python3 -c "import $mod" 2>/dev/null \
      || python3 -m pip install -q --no-index --no-deps --target /tmp/site "$whl" \
      || echo "could not install $(basename "$whl"): what needs it will fail"
  done
  nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv
  nvidia-smi topo -m 2>/dev/null | head -20
  python3 - <<'EOF'
import torch, vllm, fastapi, pydantic, uvicorn
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print("vllm", vllm.__version__, "fastapi", fastapi.__version__, "pydantic", pydantic.__version__)
try:
    import ray
    print("ray", ray.__version__)
except Exception as e:
    print("ray unavailable (vLLM's IPC weight-transfer engine needs it):", e)
try:
    import deepspeed
    print("deepspeed", deepspeed.__version__)
except Exception as e:
    print("deepspeed unavailable:", e)
# the server and the learner import here, or every test fails alike on a missing package
import learner.trainer, rollout_server.app  # noqa: E401,F401
EOF
}

step_model() {
  if [ ! -f "$GRPO_GPU_TEXT_MODEL/config.json" ]; then
    python3 -c "import sys; from rollout_server.tiny import QWEN3_0_6B_SHAPE as s, save_tiny_model
save_tiny_model(sys.argv[1], seed=0, dtype='bfloat16', **{**s, 'vocab_size': None})" \
      "$GRPO_GPU_TEXT_MODEL.tmp" \
      && rm -rf "$GRPO_GPU_TEXT_MODEL" && mv "$GRPO_GPU_TEXT_MODEL.tmp" "$GRPO_GPU_TEXT_MODEL" \
      || return 1
  fi
  if [ -f "$GRPO_GPU_MODEL/config.json" ]; then echo "reusing $GRPO_GPU_MODEL"; return 0; fi
  python3 -m rollout_server.tiny "$GRPO_GPU_MODEL.tmp" --qwen3-0.6b-shape \
    && rm -rf "$GRPO_GPU_MODEL" && mv "$GRPO_GPU_MODEL.tmp" "$GRPO_GPU_MODEL"
}

tests_lane() {  # $1 lane number, $2 end time (epoch s), then its test files, one after another
  local lane=$1 end=$2 rc=0 k=0 f left; shift 2
  for f in "$@"; do
    left=$(( end - $(date +%s) ))
    [ "$left" -gt 20 ] || { echo "no time left for $f"; return 2; }
    echo "== lane $lane (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all}): $f"
    timeout -s INT -k 15 "$left" python3 -m pytest -m gpu "$f" -q -rfEs -p no:cacheprovider \
      --junitxml="$OUT/gpu_tests.$lane.$k.xml" -o junit_family=xunit2 || rc=$?
    k=$(( k + 1 ))
  done
  return $rc
}
export -f tests_lane

step_tests() {
  # GPU_TESTS: which tests (default all of tests/), e.g. "tests/gpu/test_ipc_sync.py"; a test
  # id (file::name) runs in a pytest process of its own.
  # One pytest process per test file: a file's in-process CUDA work (the caching allocator, an
  # in-process vLLM engine) must not hold the memory the next file's server asks for.
  # Lanes, on a host with more GPUs than one test needs: GPU_LANES="0,1|2,3" with
  # GPU_TESTS="a.py b.py|c.py" runs a.py then b.py on GPUs 0-1 while c.py runs on GPUs 2-3
  # (the tests count GPUs among those they see: gpu_common.visible_gpus).
  # SIGINT a little before the step's own limit: pytest then still prints why tests failed
  # (a SIGTERM from the step's timeout would cut it before its report).
  rm -f "$OUT"/gpu_tests*.xml  # the verdict reads this run's report only
  local end=$(( $(date +%s) + ${STEP_LIMIT:-420} - 25 )) rc=0 lane=0 files pids=() lanes tests
  IFS='|' read -r -a lanes <<< "${GPU_LANES:-}"
  IFS='|' read -r -a tests <<< "${GPU_TESTS:-tests}"
  [ "${#lanes[@]}" -gt 0 ] || lanes=("")
  [ "${#tests[@]}" -eq "${#lanes[@]}" ] \
    || { echo "GPU_TESTS has ${#tests[@]} lane(s), GPU_LANES ${#lanes[@]}: give one list per lane"; return 1; }
  for lane in "${!lanes[@]}"; do
    files=""  # a file or test id as given; a folder: its files with gpu tests, in pytest's order
    for f in ${tests[$lane]}; do
      if [ -f "$f" ] || [[ "$f" == *::* ]]; then files="$files $f"; continue; fi
      files="$files $(python3 -m pytest -m gpu "$f" -q --collect-only -p no:cacheprovider \
        | sed -n 's/::.*//p' | awk '!seen[$0]++')"
    done
    [ -n "${files// /}" ] || { echo "no gpu tests collected from ${tests[$lane]}"; return 1; }
    if [ -n "${lanes[$lane]}" ]; then
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=${lanes[$lane]} tests_lane "$lane" "$end" $files > "$LOGS/tests.lane$lane.log" 2>&1 &
    else
      # shellcheck disable=SC2086
      tests_lane "$lane" "$end" $files > "$LOGS/tests.lane$lane.log" 2>&1 &
    fi
    pids+=($!)
  done
  for lane in "${!pids[@]}"; do
    wait "${pids[$lane]}" || rc=$?
    cat "$LOGS/tests.lane$lane.log"
  done
  python3 bench/suite_report.py merge "$OUT/gpu_tests.xml" "$OUT"/gpu_tests.*.xml && rm -f "$OUT"/gpu_tests.*.xml
  return $rc
}

step_bench_rollout() {
  rm -f "$WORK/bench_rollout/bench_rollout_gpu.json"  # the verdict reads this run's file only
  python3 bench/bench_rollout_gpu.py --model "$GRPO_GPU_MODEL" --out "$WORK/bench_rollout/bench_rollout_gpu.json" ${BENCH_ROLLOUT_ARGS:-}
  local rc=$?
  cp "$WORK/bench_rollout/bench_rollout_gpu.json" "$OUT/" 2>/dev/null  # failed parts included
  return $rc
}

step_bench_loss() {
  rm -f "$WORK/bench_loss/loss_gpu.json"
  python3 bench/bench_loss_gpu.py --out-dir "$WORK/bench_loss"
}

e2e_ours() {  # bench_grpo_e2e.py: $1 step name, $2 seconds left for its $3 modes, then flags
  local name=$1 left=$2 modes=$3; shift 3
  local mode_limit=$(( left / modes - 60 ))  # each mode: its share, less the server's start
  [ "$mode_limit" -gt "${T_E2E_MODE:-190}" ] && mode_limit=${T_E2E_MODE:-190}
  python3 bench/bench_grpo_e2e.py --model "$GRPO_GPU_MODEL" --out "$OUT/bench_$name.json" \
    --log-dir "$LOGS/$name" --work-dir "$WORK/$name/runs" \
    --steps-colocated "${E2E_COLOCATED_STEPS:-20}" --steps-split "${E2E_SPLIT_STEPS:-20}" \
    --timeout "$mode_limit" --server-timeout 150 "$@" ${E2E_ARGS:-}
}
export -f e2e_ours

step_e2e_colocated() {
  # TRL 1.16 first (vLLM in its process, GPU 0), then ours colocated (server and learner on
  # GPU 0, sleep mode), in one call: a TRL run that fails or is missing fails the step.
  local d=$WORK/e2e_colocated rc t0=$SECONDS trl_limit=$(( STEP_LIMIT * 45 / 100 ))
  rm -rf "$d" && mkdir -p "$d" "$LOGS/e2e_colocated"
  if [ "${E2E_TRL:-1}" = 0 ]; then e2e_ours e2e_colocated "$STEP_LIMIT" 1 --modes colocated; return $?; fi
  [ "$trl_limit" -gt "${T_E2E_TRL:-200}" ] && trl_limit=${T_E2E_TRL:-200}
  echo "-- trl (limit ${trl_limit}s, ${E2E_TRL_STEPS:-20} steps) -> $LOGS/e2e_colocated/trl.log"
  timeout -k 10 "$trl_limit" python3 bench/bench_trl_grpo.py --model "$GRPO_GPU_MODEL" \
    --out "$d/trl.json" --steps "${E2E_TRL_STEPS:-20}" ${E2E_TRL_ARGS:-} > "$LOGS/e2e_colocated/trl.log" 2>&1
  rc=$?
  echo "-- trl: rc $rc"; tail -n 8 "$LOGS/e2e_colocated/trl.log"
  [ -f "$d/trl.json" ] || echo "{\"status\": \"error\", \"error\": \"TRL run: rc $rc (timeout: 124/137), see logs/e2e_colocated/trl.log\"}" > "$d/trl.json"
  e2e_ours e2e_colocated $(( STEP_LIMIT - (SECONDS - t0) - 20 )) 1 --modes colocated \
    --trl-json "$d/trl.json"
}

step_e2e_split() {
  # Ours over 2 GPUs (server GPU 1, ZeRO-3 learner GPU 0, NCCL sync): synchronous, then
  # overlapped (rollout.max_staleness 1), in one call and one JSON with the verdict.
  rm -rf "$WORK/e2e_split" && mkdir -p "$LOGS/e2e_split"
  e2e_ours e2e_split $(( STEP_LIMIT - 20 )) 2 --modes split,overlap
}

step_model4() {
  # the 4-GPU layouts' model: $E2E4_SHAPE's published sizes, random bf16 weights drawn on GPU 0
  if [ -f "$E2E4_MODEL/config.json" ]; then echo "reusing $E2E4_MODEL"; return 0; fi
  CUDA_VISIBLE_DEVICES=0 python3 bench/gpu_common.py build-model --shape "$E2E4_SHAPE" "$E2E4_MODEL.tmp" \
    && rm -rf "$E2E4_MODEL" && mv "$E2E4_MODEL.tmp" "$E2E4_MODEL"
}

e2e4_ours() {  # bench_grpo_e2e.py on the 4-GPU model: $1 step, $2 seconds left, $3 per-mode limit, then flags
  local name=$1 left=$2 mode_limit=$3; shift 3
  echo "-- ours $* (limit ${mode_limit}s per mode, ${left}s left)"
  python3 bench/bench_grpo_e2e.py --model "$E2E4_MODEL" --model-shape "$E2E4_SHAPE" \
    --out "$OUT/bench_$name.json" --log-dir "$LOGS/$name" --work-dir "$WORK/$name/runs" \
    --steps-colocated "${E2E4_STEPS:-8}" --steps-split "${E2E4_STEPS:-8}" \
    --timeout "$mode_limit" --server-timeout "${E2E4_SERVER_TIMEOUT:-240}" "$@" ${E2E4_ARGS:-}
}
export -f e2e4_ours

step_e2e4_colocated() {
  # TRL 1.16 on all 4 GPUs first (accelerate + ZeRO-3, a colocated vLLM engine per rank), then
  # ours colocated on every rank, in one call and one JSON: a TRL run that fails or is missing
  # fails the step. Ours has what is left, its servers' start included (the ranks start them).
  local d=$WORK/e2e4_colocated rc t0=$SECONDS trl_limit=$(( STEP_LIMIT * 45 / 100 )) port
  rm -rf "$d" && mkdir -p "$d" "$LOGS/e2e4_colocated"
  [ "$trl_limit" -gt "${T_E2E4_TRL:-250}" ] && trl_limit=${T_E2E4_TRL:-250}
  port=$(python3 -c "from grpo_common.net import free_port; print(free_port())")
  echo "-- trl x${E2E4_RANKS:-4} (limit ${trl_limit}s, ${E2E4_STEPS:-8} steps) -> $LOGS/e2e4_colocated/trl.log"
  timeout -k 10 "$trl_limit" python3 -m accelerate.commands.launch \
    --config_file deploy/accelerate/zero3.yaml --num_processes "${E2E4_RANKS:-4}" \
    --main_process_port "$port" bench/bench_trl_grpo.py --model "$E2E4_MODEL" \
    --model-shape "$E2E4_SHAPE" --out "$d/trl.json" --steps "${E2E4_STEPS:-8}" \
    ${E2E4_TRL_ARGS:-} > "$LOGS/e2e4_colocated/trl.log" 2>&1
  rc=$?
  echo "-- trl: rc $rc"; tail -n 8 "$LOGS/e2e4_colocated/trl.log"
  [ -f "$d/trl.json" ] || echo "{\"status\": \"error\", \"error\": \"TRL run (4 processes): rc $rc (timeout: 124/137), see logs/e2e4_colocated/trl.log\"}" > "$d/trl.json"
  local left=$(( STEP_LIMIT - (SECONDS - t0) - 20 ))
  e2e4_ours e2e4_colocated "$left" $(( left - 60 )) --modes colocated4 \
    --ranks "${E2E4_RANKS:-4}" --trl-json "$d/trl.json"
}

step_e2e4_split() {
  # Ours disaggregated on the 4 GPUs (learners on GPUs 0-1 under ZeRO-3, a server on each of
  # GPUs 2-3, or one TP-2 server over both, NCCL sync): synchronous, then
  # rollout.max_staleness 1, in one call and one JSON. Each mode: its half, less the NCCL
  # bandwidth probe and its servers' start (up to --server-timeout, loaded with the learners).
  rm -rf "$WORK/e2e4_split" && mkdir -p "$LOGS/e2e4_split"
  local left=$(( STEP_LIMIT - 20 ))
  e2e4_ours e2e4_split "$left" $(( left / 2 - 100 )) --modes split4,overlap4
}

step_e2e4_verl() {
  # veRL's GRPO on the same GPUs and model where it is installed (the wheel bundle has no
  # verl or ray, and the GPU machine no network): otherwise a failed run saying so.
  mkdir -p "$LOGS/e2e4_verl"
  e2e4_ours e2e4_verl $(( STEP_LIMIT - 20 )) $(( STEP_LIMIT - 40 )) --modes verl --no-bandwidth
}

step_native_sync() {
  # ours against vLLM's native weight-transfer engine, NCCL (2 GPUs) and IPC, same model; each
  # model of NATIVE_SYNC_MODELS (default the 0.6B shape; "$GRPO_GPU_MODEL $E2E4_MODEL" after
  # model4 for the 4B too), the result file rejoined after every run (a cut step keeps them)
  local gpus m t rc=0
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  for m in ${NATIVE_SYNC_MODELS:-$GRPO_GPU_MODEL}; do
    for t in nccl ipc; do
      [ "$t" = nccl ] && [ "$gpus" -lt 2 ] && { echo "nccl: needs 2 GPUs, skipped"; continue; }
      echo "-- $(basename "$m") $t"
      python3 bench/bench_native_sync.py --model "$m" --transport "$t" \
        --out "$WORK/native_sync/$(basename "$m")_$t.json" || rc=$?
      python3 bench/suite_report.py join-native "$OUT/bench_native_sync.json" "$WORK"/native_sync/*.json
    done
  done
  return $rc
}

step_lora_sync() {
  # issue 40: LoRA adapter against merged weight sync (bench/bench_lora_sync.py): bytes and time
  # per sync and the server's generation tok/s, the learner on GPU 0, a vLLM server with
  # --enable-lora on GPU 1; LORA_SYNC_MODEL (default the model4 shape), LORA_SYNC_TRANSPORTS
  # (default nccl,http), LORA_SYNC_R (default 64)
  python3 bench/bench_lora_sync.py --model "${LORA_SYNC_MODEL:-$E2E4_MODEL}" --dtype bfloat16 \
    --r "${LORA_SYNC_R:-64}" --device cuda:0 --server-gpu 1 \
    --transports "${LORA_SYNC_TRANSPORTS:-nccl,http}" --syncs 3 --prompts 64 --tokens 128 \
    --repeats 3 --server-arg=--engine=vllm --server-arg=--enable-lora \
    --server-arg=--max-lora-rank=64 --server-arg=--gpu-memory-utilization=0.5 \
    --server-arg=--dtype=bfloat16 --out "$OUT/bench_lora_sync.json"
}

step_memory() {
  # Peak learner memory (max_memory_allocated) and step time per memory option, one learner
  # step of the real code path on a fixed synthetic batch, a fresh process per configuration;
  # no configuration starts after MEMORY_BUDGET_S.
  rm -f "$WORK/memory/bench_memory_options.json"
  CUDA_VISIBLE_DEVICES=${MEMORY_GPU:-0} python3 bench/bench_memory_options.py \
    --model "$GRPO_GPU_MODEL" --out "$WORK/memory/bench_memory_options.json" \
    --budget-s "${MEMORY_BUDGET_S:-150}" ${MEMORY_ARGS:-}
  local rc=$?
  cp "$WORK/memory/bench_memory_options.json" "$OUT/" 2>/dev/null
  return $rc
}

step_overlap() {
  # Overlap vs synchronous: bench_grpo_e2e.py in mode split (server GPU 1, ZeRO-3 learner
  # GPU 0, NCCL sync) with rollout.max_staleness 0, then 1, the same steps each; both medians
  # and the verdict "overlap faster than synchronous" go into bench_overlap.json.
  local d=$WORK/overlap s rc=0 limit=${T_OVERLAP_RUN:-150}
  rm -rf "$d" && mkdir -p "$d" "$LOGS/overlap"
  for s in 0 1; do
    echo "-- max_staleness $s (limit ${limit}s, ${OVERLAP_STEPS:-12} steps)"
    timeout -k 15 $(( limit + 40 )) python3 bench/bench_grpo_e2e.py --model "$GRPO_GPU_MODEL" \
      --modes split --split-max-staleness "$s" --steps-split "${OVERLAP_STEPS:-12}" \
      --out "$d/staleness$s.json" --log-dir "$LOGS/overlap/staleness$s" \
      --work-dir "$d/runs$s" --timeout "$limit" --server-timeout 120 ${OVERLAP_ARGS:-} || rc=1
    stop_leftover_servers
  done
  python3 - "$d/staleness0.json" "$d/staleness1.json" "$OUT/bench_overlap.json" <<'EOF' || rc=1
import sys
sys.path.insert(0, "bench")
from e2e_common import write_overlap_report
write_overlap_report(*sys.argv[1:])
EOF
  cp "$d"/staleness*.json "$LOGS/overlap/" 2>/dev/null
  return $rc
}

stop_leftover_servers() {
  # A timed-out step leaves its rollout servers (own sessions) holding GPU memory: end each
  # recorded server's process group (its pid is the group id: started with a new session).
  [ -f "$GRPO_GPU_PIDFILE" ] || return 0
  while read -r pid; do
    if kill -0 "$pid" 2>/dev/null; then
      echo "   stopping leftover rollout server $pid"
      kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
    fi
  done < "$GRPO_GPU_PIDFILE"
  : > "$GRPO_GPU_PIDFILE"
}
export -f stop_leftover_servers  # step_overlap calls it between its two runs

limit_for() {  # seconds allowed for a step: its own limit, capped by what is left of the budget
  local own
  case $1 in
    setup) own=${T_SETUP:-240} ;;
    model) own=${T_MODEL:-120} ;;
    tests) own=${T_TESTS:-420} ;;
    bench_rollout) own=${T_BENCH_ROLLOUT:-420} ;;
    bench_loss) own=${T_BENCH_LOSS:-240} ;;
    e2e_colocated) own=${T_E2E_COLOCATED:-480} ;;
    e2e_split) own=${T_E2E_SPLIT:-480} ;;
    memory) own=${T_MEMORY:-200} ;;
    model4) own=${T_MODEL4:-240} ;;
    e2e4_colocated) own=${T_E2E4_COLOCATED:-540} ;;
    e2e4_split) own=${T_E2E4_SPLIT:-540} ;;
    e2e4_verl) own=${T_E2E4_VERL:-120} ;;
    overlap) own=${T_OVERLAP:-420} ;;
    native_sync) own=${T_NATIVE_SYNC:-480} ;;
    lora_sync) own=${T_LORA_SYNC:-480} ;;
    *) own=60 ;;
  esac
  local left=$(( SUITE_BUDGET_S - ($(date +%s) - START) - 15 ))
  echo $(( own < left ? own : left ))
}

for step in $SUITE_STEPS; do
  if ! declare -F "step_$step" >/dev/null; then
    printf '%s\tunknown\t0\t-\n' "$step" >> "$STATUS_FILE"; continue
  fi
  limit=$(limit_for "$step")
  if [ "$limit" -lt 30 ]; then
    echo "== $step: skipped (budget: ${limit}s left)"
    printf '%s\tskipped_budget\t0\t-\n' "$step" >> "$STATUS_FILE"; continue
  fi
  echo "== $step (limit ${limit}s) -> $LOGS/$step.log"
  t0=$(date +%s)
  # which steps ended and which one runs, in $OUT at once: a call cut by the machine's limit
  # (no signal reaches this script) still says how far it got
  { cat "$STATUS_FILE"; printf '%s\trunning_since_%ss\t-\t-\n' "$step" "$(( t0 - START ))"; } > "$OUT/steps.tsv"
  # A subshell per step: `timeout` needs a command; exported functions reach it via bash -c.
  export -f "step_$step"
  export STEP_LIMIT=$limit
  timeout -k 15 "$limit" bash -c "step_$step" > "$LOGS/$step.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  # the verdict from the exit code and the step's result file (bench/suite_report.py)
  verdict=$(python3 bench/suite_report.py verdict "$step" "$rc" --out "$OUT" --work "$WORK") \
    || verdict=$(printf 'failed\tbench/suite_report.py could not judge the step')
  st=${verdict%%$'\t'*}; why=${verdict#*$'\t'}
  printf '%s\t%s\t%s\t%s\t%s\n' "$step" "$st" "$secs" "$rc" "$why" >> "$STATUS_FILE"
  cp "$STATUS_FILE" "$OUT/steps.tsv"
  echo "== $step: $st in ${secs}s (rc $rc)${why:+: $why}"
  tail -n 25 "$LOGS/$step.log" | sed 's/^/   | /'
  stop_leftover_servers
  # setup exports PYTHONPATH inside its subshell; make it visible to the next steps too
  [ "$step" = setup ] && [ -d /tmp/site ] && case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
done


tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs $( [ -d "$WORK/bench_loss" ] && echo bench_loss ) \
  $( [ -d "$WORK/bench_rollout" ] && echo bench_rollout ) 2>/dev/null

python3 bench/suite_report.py summary "$STATUS_FILE" --out "$OUT" --budget "$SUITE_BUDGET_S" --start "$START"
