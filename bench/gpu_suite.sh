#!/usr/bin/env bash
# The GPU benchmarks and GPU tests in one command, on a machine with NVIDIA GPUs where the
# project is installed with its GPU extras:
#
#   pip install -e ".[vllm,deepspeed]"
#   pip install trl==1.16.0 liger-kernel==0.8.5        # optional: the TRL and Liger baselines
#   SUITE_STEPS="setup model tests bench_rollout" bash bench/gpu_suite.sh
#
# SUITE_STEPS lists the steps, run in that order (default: setup model tests bench_rollout
# bench_loss). Each step has its own time limit and log; a failing step does not stop the
# others; the whole run stays inside SUITE_BUDGET_S seconds (default 560; steps that no longer
# fit are skipped and say so). GPUs are numbered as CUDA_VISIBLE_DEVICES shows them.
#
# Steps:
#   setup          checks that the project and its GPU dependencies import; installs nothing
#   model          random-weight Qwen3-0.6B-shaped models (bf16) in $WORK, built once
#   model4         the same at E2E4_SHAPE (qwen3-4b, default, or qwen3-8b), built on GPU 0
#   tests          the GPU tests (pytest -m gpu), one pytest per file; GPU_TESTS picks files or
#                  test ids; GPU_LANES="0,1|2,3" with one GPU_TESTS list per lane ("a.py|b.py")
#                  runs the lanes side by side
#   bench_rollout  rollout server throughput (HTTP against offline vLLM), sleep mode, NCCL
#                  weight sync against bytes / measured bandwidth (bench/bench_rollout_gpu.py)
#   bench_loss     the chunked loss against Liger's (bench/bench_loss_gpu.py)
#   e2e_colocated  end-to-end GRPO steps on GPU 0: TRL's GRPOTrainer with colocated vLLM, then
#                  ours colocated (E2E_TRL=0: ours alone) (bench/bench_grpo_e2e.py)
#   e2e_split      ours over 2 GPUs: split synchronous, then overlapped (max_staleness 1)
#   memory         peak learner memory and step time per memory option (one GPU)
#   train_phase    the learner's training phase alone on the model4 shape: ms per step, MFU
#                  and peak memory per layout (ZeRO stage, recompute, compiled layers, fused
#                  loss) against plain transformers (bench/bench_train_phase.py; TRAIN_PHASE_ARGS,
#                  TRAIN_PHASE_RANKS processes a variant, default 1)
#   overlap        split with max_staleness 0, then 1: is overlap faster (2 GPUs)
#   trl4           TRL 1.16 GRPOTrainer on 4 GPUs (ZeRO-3, vLLM colocated on every rank), once
#                  per suite run: the baseline of e2e4_colocated and e2e4_split
#   e2e4_colocated ours on 4 GPUs, a sleeping vLLM server per ZeRO-3 rank (CUDA IPC sync),
#                  beside TRL (run here when this suite run has no TRL result yet)
#   e2e4_split     ours with 2 learner GPUs and 2 server GPUs (NCCL): synchronous, then
#                  max_staleness 1 (E2E4_ARGS="--split4-tp 2": one TP-2 server), beside TRL
#   e2e4_verl      veRL's GRPO on the same workload, where verl is installed
#   native_sync    our NCCL and IPC weight sync against vLLM's weight-transfer engine
#   lora_sync      LoRA adapter sync against merged sync on the model4 shape (2 GPUs)
#
# One suite run may span several invocations: give them the same SUITE_RUN_ID (default: a new
# one per invocation). Results are put side by side only within one suite run: the 4-GPU
# layouts are compared with the TRL result of their own run, e.g.
#   export SUITE_RUN_ID=4b-$(date +%s)
#   SUITE_STEPS="setup model4 trl4" bash bench/gpu_suite.sh
#   SUITE_STEPS="setup e2e4_colocated" bash bench/gpu_suite.sh
#   SUITE_STEPS="setup e2e4_split" bash bench/gpu_suite.sh
# Per-step settings: T_<STEP> (its time limit, s), E2E_ARGS / E2E4_ARGS (more flags for
# bench_grpo_e2e.py), E2E_TRL_ARGS / E2E4_TRL_ARGS (for bench_trl_grpo.py), E2E4_STEPS (8),
# E2E4_RANKS (4), E2E_FINISH_TIMEOUT / E2E4_FINISH_TIMEOUT (40 / 90: s the learner has after
# its last step to save the final model whose weights are compared with the served ones),
# MEMORY_ARGS, OVERLAP_ARGS, BENCH_ROLLOUT_ARGS, NATIVE_SYNC_MODELS, LORA_SYNC_MODEL; the step
# functions below say what each takes.
#
# Every process a step starts carries the suite run's marker in its environment
# (GRPO_BENCH_RUN; bench/proc_tree.py) and is ended after the step, whatever its process group
# or session. A step is judged by bench/suite_report.py: valid (its command and result file
# show a complete measurement: no failed part, missing or foreign baseline, failed test, served
# weights unequal to the learner's, or GPU held by another process) and target met (every
# verdict in its result passes); its status is ok, target_missed, failed (not valid) or
# timeout. The suite exits 1 when any step is not ok.
#
# Results in $OUT (default ./out):
#   summary.json   each step: status, valid, target_met, why, seconds, exit code; pytest's
#                  test counts; each result file's verdicts, medians and figures
#   steps.tsv      the steps ended so far and the one running (kept current)
#   gpu_tests.xml  the junit report of the GPU tests
#   bench_rollout_gpu.json, bench_memory_options.json, bench_overlap.json,
#   bench_native_sync.json, bench_lora_sync.json, bench_train_phase.json    each benchmark's own
#                  result
#   bench_e2e_<step>.json, bench_e2e4_<step>.json   both sides of each comparison: s/step and
#                  phases, tokens/s, MFU, peak memory per GPU, weight sync against bytes /
#                  bandwidth, served against learner weights, which process held which GPU
#                  before and after each run, the suite run id, the verdicts
#   bench_trl4.json  the 4-GPU TRL result of this suite run
#   logs.tar.gz    this suite run's logs only (every step's, the servers', the baselines')
# Models and per-run work files stay in $WORK (default /tmp/grpo-gpu).
#
# Contributors without network on the GPU machine: a wheel bundle split into parts in
# /tmp/parts (WHEEL_PARTS) is installed into /tmp/site by the setup step, with .dev/bin/install.sh,
# when the dependencies do not import.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/out}
WORK=${WORK:-/tmp/grpo-gpu}
SUITE_STEPS=${SUITE_STEPS:-setup model tests bench_rollout bench_loss}
SUITE_BUDGET_S=${SUITE_BUDGET_S:-560}
WHEEL_PARTS=${WHEEL_PARTS:-/tmp/parts}
# this run's id, in every benchmark's JSON: numbers are put side by side only within one run
SUITE_RUN_ID=${SUITE_RUN_ID:-$(hostname)-$(date +%s)-$$}
SUITE_RUN_ID=$(printf '%s' "$SUITE_RUN_ID" | tr -c 'A-Za-z0-9._-' '_')
# this run's own files (logs, per-step work): never another run's in its archive
RUN_WORK=$WORK/runs/$SUITE_RUN_ID
LOGS=$RUN_WORK/logs
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
# every process a step starts carries this marker (and the step's name under it): the
# suite ends them after the step, whatever their process group or session (bench/proc_tree.py)
export GRPO_BENCH_RUN=suite-$SUITE_RUN_ID
export SUITE_RUN_ID ROOT OUT WORK RUN_WORK LOGS WHEEL_PARTS

START=$(date +%s)
STATUS_FILE=$RUN_WORK/steps.tsv
: > "$STATUS_FILE"

export GPU_MODULES="torch vllm deepspeed fastapi uvicorn pydantic httpx transformers accelerate"

missing_modules() {  # the modules of $GPU_MODULES that do not import, and the project's own
  python3 - $GPU_MODULES <<'EOF'
import importlib.util, os, sys
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.getcwd()]  # the installed copy
missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]
missing += [m for m in ("learner", "rollout_server") if importlib.util.find_spec(m) is None]
print(" ".join(missing))
EOF
}

install_wheel_bundle() {  # the offline path: wheels from $WHEEL_PARTS into /tmp/site
  if [ ! -f /tmp/site/.done ]; then
    bash .dev/bin/install.sh || return 1
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
  # bitsandbytes (QLoRA), carried in .dev/bnb, where it does not import
  if ls .dev/bnb/bitsandbytes-*.whl >/dev/null 2>&1 && ! python3 -c "import bitsandbytes" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/bnb/bitsandbytes-*.whl || return 1
  fi
  # pure-Python wheels the bundle lacks, carried in .dev/extra
  if ls .dev/extra/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/extra/*.whl || return 1
  fi
  # wheels carried split into parts in /tmp/big (NAME.whl.part-00, -01, ...): joined and
  # installed where that package does not import yet
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
}

export -f missing_modules install_wheel_bundle

step_setup() {
  local missing
  missing=$(missing_modules)
  if [ -z "$missing" ]; then
    echo "setup: the project and its GPU dependencies import: nothing to install"
  elif [ -d "$WHEEL_PARTS" ]; then
    echo "setup: not importable: $missing; installing the wheel bundle from $WHEEL_PARTS"
    install_wheel_bundle || return 1
  else
    echo "setup: not importable: $missing. Install the project with its GPU extras: pip install -e \".[vllm,deepspeed]\" (and, for the TRL and Liger baselines, pip install trl==1.16.0 liger-kernel==0.8.5)"
    return 1
  fi
  nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv
  nvidia-smi topo -m 2>/dev/null | head -20
  python3 - <<'EOF'
import torch, vllm, fastapi, pydantic, uvicorn
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print("vllm", vllm.__version__, "fastapi", fastapi.__version__, "pydantic", pydantic.__version__)
for name in ("deepspeed", "ray", "trl", "liger_kernel"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(f"{name} unavailable ({type(e).__name__}: {e}): what needs it will fail")
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
  rm -f "$RUN_WORK/bench_rollout/bench_rollout_gpu.json"  # the verdict reads this run's file only
  python3 bench/bench_rollout_gpu.py --model "$GRPO_GPU_MODEL" --out "$RUN_WORK/bench_rollout/bench_rollout_gpu.json" ${BENCH_ROLLOUT_ARGS:-}
  local rc=$?
  cp "$RUN_WORK/bench_rollout/bench_rollout_gpu.json" "$OUT/" 2>/dev/null  # failed parts included
  return $rc
}

step_bench_loss() {
  rm -f "$RUN_WORK/bench_loss/loss_gpu.json"
  python3 bench/bench_loss_gpu.py --out-dir "$RUN_WORK/bench_loss"
}

end_marked() {  # $1: a marker under this step's; every process carrying it ends (proc_tree.py)
  python3 bench/proc_tree.py stop "$1" --grace "${2:-10}"
}
export -f end_marked

e2e_ours() {  # bench_grpo_e2e.py: $1 step name, $2 seconds left for its $3 modes, then flags
  local name=$1 left=$2 modes=$3 finish=${E2E_FINISH_TIMEOUT:-40}; shift 3
  # each mode: its share, less the server's start and the learner's final save
  local mode_limit=$(( left / modes - 60 - finish ))
  [ "$mode_limit" -gt "${T_E2E_MODE:-190}" ] && mode_limit=${T_E2E_MODE:-190}
  python3 bench/bench_grpo_e2e.py --model "$GRPO_GPU_MODEL" --out "$OUT/bench_$name.json" \
    --log-dir "$LOGS/$name" --work-dir "$RUN_WORK/$name/runs" \
    --steps-colocated "${E2E_COLOCATED_STEPS:-20}" --steps-split "${E2E_SPLIT_STEPS:-20}" \
    --timeout "$mode_limit" --server-timeout 150 --finish-timeout "$finish" "$@" ${E2E_ARGS:-}
}
export -f e2e_ours

step_e2e_colocated() {
  # TRL 1.16 first (vLLM in its process, GPU 0), then ours colocated (server and learner on
  # GPU 0, sleep mode), in one call: a TRL run that fails or is missing fails the step.
  local d=$RUN_WORK/e2e_colocated rc t0=$SECONDS trl_limit=$(( STEP_LIMIT * 45 / 100 ))
  rm -rf "$d" && mkdir -p "$d" "$LOGS/e2e_colocated"
  if [ "${E2E_TRL:-1}" = 0 ]; then e2e_ours e2e_colocated "$STEP_LIMIT" 1 --modes colocated; return $?; fi
  [ "$trl_limit" -gt "${T_E2E_TRL:-200}" ] && trl_limit=${T_E2E_TRL:-200}
  echo "-- trl (limit ${trl_limit}s, ${E2E_TRL_STEPS:-20} steps) -> $LOGS/e2e_colocated/trl.log"
  GRPO_BENCH_RUN=$GRPO_BENCH_RUN/trl timeout -k 10 "$trl_limit" python3 bench/bench_trl_grpo.py \
    --model "$GRPO_GPU_MODEL" --out "$d/trl.json" --steps "${E2E_TRL_STEPS:-20}" \
    ${E2E_TRL_ARGS:-} > "$LOGS/e2e_colocated/trl.log" 2>&1
  rc=$?
  end_marked "$GRPO_BENCH_RUN/trl"  # its vLLM workers, before ours start on that GPU
  echo "-- trl: rc $rc"; tail -n 8 "$LOGS/e2e_colocated/trl.log"
  [ -f "$d/trl.json" ] || echo "{\"status\": \"error\", \"error\": \"TRL run: rc $rc (timeout: 124/137), see logs/e2e_colocated/trl.log\"}" > "$d/trl.json"
  e2e_ours e2e_colocated $(( STEP_LIMIT - (SECONDS - t0) - 20 )) 1 --modes colocated \
    --trl-json "$d/trl.json"
}

step_e2e_split() {
  # Ours over 2 GPUs (server GPU 1, ZeRO-3 learner GPU 0, NCCL sync): synchronous, then
  # overlapped (rollout.max_staleness 1), in one call and one JSON with the verdict.
  rm -rf "$RUN_WORK/e2e_split" && mkdir -p "$LOGS/e2e_split"
  e2e_ours e2e_split $(( STEP_LIMIT - 20 )) 2 --modes split,overlap
}

step_model4() {
  # the 4-GPU layouts' model: $E2E4_SHAPE's published sizes, random bf16 weights drawn on GPU 0
  if [ -f "$E2E4_MODEL/config.json" ]; then echo "reusing $E2E4_MODEL"; return 0; fi
  CUDA_VISIBLE_DEVICES=0 python3 bench/gpu_common.py build-model --shape "$E2E4_SHAPE" "$E2E4_MODEL.tmp" \
    && rm -rf "$E2E4_MODEL" && mv "$E2E4_MODEL.tmp" "$E2E4_MODEL"
}

E2E4_FINISH_TIMEOUT=${E2E4_FINISH_TIMEOUT:-90}  # the learner's last checkpoint and final model
export E2E4_FINISH_TIMEOUT

e2e4_ours() {  # bench_grpo_e2e.py on the 4-GPU model: $1 step, $2 seconds left, $3 per-mode limit, then flags
  local name=$1 left=$2 mode_limit=$3; shift 3
  echo "-- ours $* (limit ${mode_limit}s per mode, ${left}s left)"
  python3 bench/bench_grpo_e2e.py --model "$E2E4_MODEL" --model-shape "$E2E4_SHAPE" \
    --out "$OUT/bench_$name.json" --log-dir "$LOGS/$name" --work-dir "$RUN_WORK/$name/runs" \
    --steps-colocated "${E2E4_STEPS:-8}" --steps-split "${E2E4_STEPS:-8}" \
    --timeout "$mode_limit" --server-timeout "${E2E4_SERVER_TIMEOUT:-240}" \
    --finish-timeout "$E2E4_FINISH_TIMEOUT" "$@" ${E2E4_ARGS:-}
}
export -f e2e4_ours

TRL4_JSON=$RUN_WORK/trl4/trl.json  # the 4-GPU TRL baseline: one per suite run
export TRL4_JSON

trl4_ok() {  # whether this suite run already has a 4-GPU TRL result that finished
  python3 -c "import json, sys; sys.exit(json.load(open(sys.argv[1])).get('status') != 'ok')" \
    "$TRL4_JSON" 2>/dev/null
}
export -f trl4_ok

run_trl4() {  # $1: time limit (s). TRL 1.16 on the 4 GPUs, its result in $TRL4_JSON and $OUT
  local limit=$1 rc port log=$LOGS/trl4/trl.log
  mkdir -p "$(dirname "$TRL4_JSON")" "$LOGS/trl4" && rm -f "$TRL4_JSON"
  port=$(python3 -c "from grpo_common.net import free_port; print(free_port())")
  echo "-- trl x${E2E4_RANKS:-4} (limit ${limit}s, ${E2E4_STEPS:-8} steps) -> $log"
  GRPO_BENCH_RUN=$GRPO_BENCH_RUN/trl4 timeout -k 10 "$limit" python3 -m accelerate.commands.launch \
    --config_file deploy/accelerate/zero3.yaml --num_processes "${E2E4_RANKS:-4}" \
    --main_process_port "$port" bench/bench_trl_grpo.py --model "$E2E4_MODEL" \
    --model-shape "$E2E4_SHAPE" --out "$TRL4_JSON" --steps "${E2E4_STEPS:-8}" \
    ${E2E4_TRL_ARGS:-} >> "$log" 2>&1
  rc=$?
  end_marked "$GRPO_BENCH_RUN/trl4"  # every rank and vLLM worker, before ours start
  echo "-- trl: rc $rc"; tail -n 8 "$log"
  [ -f "$TRL4_JSON" ] || echo "{\"status\": \"error\", \"error\": \"TRL run (4 processes): rc $rc (timeout: 124/137), see logs/trl4/trl.log\"}" > "$TRL4_JSON"
  cp "$TRL4_JSON" "$OUT/bench_trl4.json"
  return $rc
}
export -f run_trl4

step_trl4() {
  # TRL 1.16 GRPOTrainer on all 4 GPUs (accelerate + ZeRO-3, a colocated vLLM engine per
  # rank), once per suite run: e2e4_colocated and e2e4_split of this SUITE_RUN_ID compare
  # with it (bench_grpo_e2e.py refuses a result of another run or workload)
  if trl4_ok; then echo "this suite run has its TRL result: $TRL4_JSON"; cp "$TRL4_JSON" "$OUT/bench_trl4.json"; return 0; fi
  run_trl4 $(( STEP_LIMIT - 10 ))
}

step_e2e4_colocated() {
  # Ours colocated on every rank of the 4 GPUs beside this suite run's TRL result, in one
  # JSON: TRL runs here first when the run has none yet (trl4), then ours has what is left,
  # its servers' start included (the ranks start them). A TRL run that failed fails the step.
  local t0=$SECONDS trl_limit=$(( STEP_LIMIT * 45 / 100 ))
  rm -rf "$RUN_WORK/e2e4_colocated" && mkdir -p "$LOGS/e2e4_colocated"
  [ "$trl_limit" -gt "${T_E2E4_TRL:-250}" ] && trl_limit=${T_E2E4_TRL:-250}
  if trl4_ok; then echo "-- TRL: this suite run's result, $TRL4_JSON"; else run_trl4 "$trl_limit"; fi
  local left=$(( STEP_LIMIT - (SECONDS - t0) - 20 ))
  e2e4_ours e2e4_colocated "$left" $(( left - 60 - E2E4_FINISH_TIMEOUT )) --modes colocated4 \
    --ranks "${E2E4_RANKS:-4}" --trl-json "$TRL4_JSON"
}

step_e2e4_split() {
  # Ours disaggregated on the 4 GPUs (learners on GPUs 0-1 under ZeRO-3, a server on each of
  # GPUs 2-3, or one TP-2 server over both, NCCL sync): synchronous, then
  # rollout.max_staleness 1, in one JSON beside this suite run's TRL result (step trl4 makes
  # it; without it the step has no baseline and is not valid). Each mode: its half, less the
  # NCCL bandwidth probe, its servers' start and the learner's final save.
  rm -rf "$RUN_WORK/e2e4_split" && mkdir -p "$LOGS/e2e4_split"
  trl4_ok || echo "-- no TRL result in this suite run ($TRL4_JSON): run step trl4 first with SUITE_RUN_ID=$SUITE_RUN_ID"
  local left=$(( STEP_LIMIT - 20 ))
  e2e4_ours e2e4_split "$left" $(( left / 2 - 100 - E2E4_FINISH_TIMEOUT )) \
    --modes split4,overlap4 --trl-json "$TRL4_JSON"
}

step_e2e4_verl() {
  # veRL's GRPO on the same GPUs and model where verl and ray are installed; otherwise a
  # failed run saying so.
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
        --out "$RUN_WORK/native_sync/$(basename "$m")_$t.json" || rc=$?
      python3 bench/suite_report.py join-native "$OUT/bench_native_sync.json" "$RUN_WORK"/native_sync/*.json
    done
  done
  return $rc
}

step_lora_sync() {
  # LoRA adapter against merged weight sync (bench/bench_lora_sync.py): bytes and time
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
  rm -f "$RUN_WORK/memory/bench_memory_options.json"
  CUDA_VISIBLE_DEVICES=${MEMORY_GPU:-0} python3 bench/bench_memory_options.py \
    --model "$GRPO_GPU_MODEL" --out "$RUN_WORK/memory/bench_memory_options.json" \
    --budget-s "${MEMORY_BUDGET_S:-150}" ${MEMORY_ARGS:-}
  local rc=$?
  cp "$RUN_WORK/memory/bench_memory_options.json" "$OUT/" 2>/dev/null
  return $rc
}

step_train_phase() {
  # The training phase per layout, each variant in processes of its own (accelerate launch),
  # against plain transformers on the same per-GPU work; needs model4's model.
  rm -f "$RUN_WORK/train_phase/bench_train_phase.json"
  mkdir -p "$RUN_WORK/train_phase"
  python3 bench/bench_train_phase.py --model "$E2E4_MODEL" \
    --out "$RUN_WORK/train_phase/bench_train_phase.json" --ranks "${TRAIN_PHASE_RANKS:-1}" \
    ${TRAIN_PHASE_ARGS:-}
  local rc=$?
  cp "$RUN_WORK/train_phase/bench_train_phase.json" "$OUT/" 2>/dev/null
  return $rc
}

step_overlap() {
  # Overlap vs synchronous: bench_grpo_e2e.py in mode split (server GPU 1, ZeRO-3 learner
  # GPU 0, NCCL sync) with rollout.max_staleness 0, then 1, the same steps each; both medians
  # and the verdict "overlap faster than synchronous" go into bench_overlap.json.
  local d=$RUN_WORK/overlap s rc=0 limit=${T_OVERLAP_RUN:-150}
  rm -rf "$d" && mkdir -p "$d" "$LOGS/overlap"
  for s in 0 1; do
    echo "-- max_staleness $s (limit ${limit}s, ${OVERLAP_STEPS:-12} steps)"
    timeout -k 15 $(( limit + 40 + 2 * ${E2E_FINISH_TIMEOUT:-40} )) python3 bench/bench_grpo_e2e.py --model "$GRPO_GPU_MODEL" \
      --modes split --split-max-staleness "$s" --steps-split "${OVERLAP_STEPS:-12}" \
      --out "$d/staleness$s.json" --log-dir "$LOGS/overlap/staleness$s" \
      --work-dir "$d/runs$s" --timeout "$limit" --server-timeout 120 \
      --finish-timeout "${E2E_FINISH_TIMEOUT:-40}" ${OVERLAP_ARGS:-} || rc=1
    end_marked "$GRPO_BENCH_RUN"  # what the run left (this step's own shell is spared)
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
    train_phase) own=${T_TRAIN_PHASE:-560} ;;
    model4) own=${T_MODEL4:-240} ;;
    trl4) own=${T_TRL4:-300} ;;
    e2e4_colocated) own=${T_E2E4_COLOCATED:-540} ;;
    e2e4_split) own=${T_E2E4_SPLIT:-580} ;;
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
  GRPO_BENCH_RUN=$GRPO_BENCH_RUN/$step timeout -k 15 "$limit" bash -c "step_$step" > "$LOGS/$step.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - t0 ))
  # every process the step started, in whatever session, ends before the next step
  end_marked "$GRPO_BENCH_RUN/$step" >> "$LOGS/$step.log" 2>&1
  # valid / target met from the exit code and the step's result file (bench/suite_report.py)
  verdict=$(python3 bench/suite_report.py verdict "$step" "$rc" --out "$OUT" --work "$RUN_WORK") \
    || verdict=$(printf 'failed\tfalse\t-\tbench/suite_report.py could not judge the step')
  st=${verdict%%$'\t'*}; rest=${verdict#*$'\t'}; why=${rest#*$'\t'*$'\t'}
  printf '%s\t%s\t%s\t%s\t%s\n' "$step" "$st" "$secs" "$rc" "$rest" >> "$STATUS_FILE"
  cp "$STATUS_FILE" "$OUT/steps.tsv"
  echo "== $step: $st in ${secs}s (rc $rc)${why:+: $why}"
  tail -n 25 "$LOGS/$step.log" | sed 's/^/   | /'

  # setup exports PYTHONPATH inside its subshell; make it visible to the next steps too
  [ "$step" = setup ] && [ -d /tmp/site ] && case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
done


# this suite run's logs only: earlier runs on the same machine keep theirs under $WORK/runs
tar -czf "$OUT/logs.tar.gz" -C "$RUN_WORK" logs $( [ -d "$RUN_WORK/bench_loss" ] && echo bench_loss ) \
  $( [ -d "$RUN_WORK/bench_rollout" ] && echo bench_rollout ) 2>/dev/null

python3 bench/suite_report.py summary "$STATUS_FILE" --out "$OUT" --budget "$SUITE_BUDGET_S" --start "$START"
