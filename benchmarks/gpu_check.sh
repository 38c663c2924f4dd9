#!/bin/bash
# One lent GPU's checks (issues 20, 31, 47, 57), run on a machine with one CUDA GPU:
#   bash benchmarks/gpu_check.sh [PART...]     PART: memory, train, phases, vllm, all (default all)
# (any working directory; results in $OUT, default /tmp/gpu_check; scratch in $WORK, default /tmp/gpu_check_work).
#
# Every command that can hang runs under `timeout -k $GRACE SECONDS` (GRACE default 10 s): past its
# budget it gets SIGTERM, and SIGKILL GRACE seconds later if it is still there (a process that handles
# SIGTERM gracefully, as gspo train does, is not given for ever). Budgets on one H100:
#   0. dependencies (nvidia-smi, CUDA torch, transformers, safetensors, yaml, gspo; vllm for the vllm
#      part), all named at once before anything runs, bounded too: $DEPS_S (default 90 s) in all
#   memory: update memory (benchmarks/memory_probe.py, 5 Qwen3 shapes, 30 s each), each measured peak
#      against `gspo plan`'s estimate of the same update: a peak more than $PLAN_MARGIN (default 0.15,
#      the memory model's stated accuracy) above the plan fails the step                         150 s
#   train: `gspo train` on the embedded default, 20 RL steps                                      70 s
#   phases: a random Qwen3-0.6B (make_random_model.py, 40 s), `gspo plan` (30 s), `gspo train` in bf16
#      with activation checkpointing, 4 RL steps of 16 x 8 rows (150 s), then gpu_phase_summary.py (10 s):
#      the start-up peak and each phase's measured peak beside the plan's, failing past $PLAN_MARGIN;
#      step time, tokens per second. The model is random and never emits EOS, so --max-new-tokens 256
#      is where every row ends: the step's length is bounded by the cap, not by chance.        230 s
#   vllm: the same random model (40 s, unless phases made it), `gspo plan` for vLLM's settings (30 s),
#      then benchmarks/gpu_vllm_check.py (180 s): vLLM through gspo's engine, the start check, a sample,
#      sleep (level 2: the memory it frees measured), an update, wake + weight sync, the log-prob check
#      again after the sleep/wake cycle (and that vLLM has the new weights), vLLM's KV cache beside the
#      plan's                                                                                   250 s
#   in all at most 90 + 150 + 70 + 230 + 250 = 790 s, plus GRACE per step: under a 10-minute limit a
#   command runs `memory train phases`, and `vllm` in a second one.
# Exit status: 2 when a dependency is missing or the dependency check itself does not finish (named,
# before any step runs), 1 when any step failed (each failure named at the end), 0 when every step passed.
#
# What this cannot prove about an 8-GPU node (one GPU, one process): NCCL across ranks (FSDP2's
# all-gathers and reduce-scatters, expert parallelism's all-to-all, the process group's timeout),
# vLLM's tensor parallelism and KV-cache preemption, more than one node, reading the real 30B/235B
# weights from the hub, and the start-up of 8 ranks each reading its own shards. The plan's start-up
# line is compared with one rank's start-up.
#
# Where the machine lacks some of gspo's dependencies, put their wheels in .whl/ (installed to /tmp/site).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/gpu_check}
WORK=${WORK:-/tmp/gpu_check_work}
GRACE=${GRACE:-10}
DEPS_S=${DEPS_S:-90}
PLAN_MARGIN=${PLAN_MARGIN:-0.15}
PARTS=" ${*:-all} "
for part in $PARTS; do
  case "$part" in all | memory | train | phases | vllm) ;; *)
    echo "gpu_check: unknown part '$part' (memory, train, phases, vllm, all)" >&2
    exit 2
    ;;
  esac
done
wants() { [[ "$PARTS" == *" all "* || "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUT" "$WORK"

# bounded SECONDS CMD...: CMD under SIGTERM after SECONDS, SIGKILL GRACE seconds later (rc 124 / 137)
bounded() {
  local secs=$1
  shift
  timeout -k "$GRACE" "$secs" "$@"
}

# ---- 0. dependencies: all named at once, before any step runs, each probe bounded
missing=()
command -v timeout >/dev/null 2>&1 || {
  echo "gpu_check: missing: timeout (coreutils) -- nothing was run" | tee "$OUT/FAILED" >&2
  exit 2
}
deps_end=$(($(date +%s) + DEPS_S))
left() { echo $((deps_end - $(date +%s) > 1 ? deps_end - $(date +%s) : 1)); }
command -v nvidia-smi >/dev/null 2>&1 || missing+=("nvidia-smi (no NVIDIA driver on PATH)")
if ! command -v python3 >/dev/null 2>&1; then
  missing+=("python3")
else
  if ls .whl/*.whl >/dev/null 2>&1; then
    bounded "$(left)" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || missing+=("the wheels in .whl/ (pip install failed or timed out)")
    export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$ROOT/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  modules="torch transformers safetensors yaml gspo"
  if wants vllm; then modules="$modules vllm"; fi
  rc=0
  py_missing=$(GPU_CHECK_MODULES="$modules" bounded "$(left)" python3 - <<'EOF'
import importlib
import os
gone = []
for m in os.environ["GPU_CHECK_MODULES"].split():
    try:
        importlib.import_module(m)
    except Exception as e:  # noqa: BLE001 (any failure to import is a missing dependency here)
        gone.append(f"python module {m} ({type(e).__name__})")
if "torch" not in " ".join(gone):
    import torch
    if not torch.cuda.is_available():
        gone.append(f"a CUDA device for torch {torch.__version__} (torch.cuda.is_available() is False)")
print("; ".join(gone))
EOF
  ) || rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    py_missing="the dependency check itself: python3 did not finish within DEPS_S = $DEPS_S s"
  elif [ "$rc" -ne 0 ]; then
    py_missing="python3 cannot run (rc $rc)"
  fi
  [ -z "$py_missing" ] || missing+=("$py_missing")
fi
if [ ${#missing[@]} -eq 0 ]; then
  bounded "$(left)" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/gpu.txt" 2>&1 ||
    missing+=("a working nvidia-smi (it failed or did not finish)")
fi
if [ ${#missing[@]} -gt 0 ]; then
  msg=$(printf '%s; ' "${missing[@]}")
  echo "gpu_check: missing: ${msg%; } -- nothing was run" | tee "$OUT/FAILED" >&2
  exit 2
fi
cat "$OUT/gpu.txt"
{ bounded 60 python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" ||
  true; } | tee -a "$OUT/gpu.txt"
GPU_GIB=$(awk -F', ' 'NR == 2 {printf "%.1f", $2 / 1024}' "$OUT/gpu.txt") # "name, 81559 MiB, driver"

t0=$(date +%s)
failed=()
exec 3>&1 4>&2 # the steps' own progress lines, whatever a step's output is redirected to
# step NAME SECONDS CMD...: run CMD bounded; a failure (or a timeout: rc 124, 137 once killed) is recorded, not fatal
step() {
  local name=$1 budget=$2 rc=0
  shift 2
  bounded "$budget" "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    local why="rc $rc"
    if [ "$rc" -eq 124 ]; then why="over its ${budget} s"; fi
    if [ "$rc" -eq 137 ]; then why="over its ${budget} s, killed ${GRACE} s after SIGTERM"; fi
    failed+=("$name ($why)")
    echo "FAILED: $name ($why)" >&4
  fi
  echo "$(($(date +%s) - t0)) s: $name rc=$rc" >&3
}

# ---- memory: the update's measured peak against the plan's
if wants memory; then
  : >"$OUT/memory_gpu.jsonl"
  while read -r args; do
    # shellcheck disable=SC2086
    step "memory_probe $args" 30 python3 benchmarks/memory_probe.py --device cuda --plan-margin "$PLAN_MARGIN" \
      $args >>"$OUT/memory_gpu.jsonl" 2>>"$OUT/memory_gpu.err" </dev/null
  done <<'EOF'
--shape dense-0.6b --rows 8 --prompt 256 --response 1024
--shape dense-0.6b --rows 8 --prompt 256 --response 1024 --ac
--shape dense-1.7b --rows 8 --prompt 256 --response 1024 --ac
--shape moe-30b-a3b-4l --rows 8 --prompt 256 --response 1024
--shape moe-30b-a3b-4l --rows 8 --prompt 256 --response 1024 --ac
EOF
fi

# ---- train: gspo train on the embedded default
if wants train; then
  step "gspo train (embedded default)" 70 python3 -m gspo train --steps 20 --device cuda \
    --output-dir "$WORK/runs" --name default --overwrite --no-progress >"$OUT/train.log" 2>&1
  tail -n 5 "$OUT/train.log"
  cp "$WORK/runs/default/metrics.jsonl" "$OUT/" 2>/dev/null || true
fi

# the random Qwen3-0.6B the phases and vllm parts run on (made once)
MODEL="$WORK/qwen3-0.6b-random"
if { wants phases || wants vllm; } && [ ! -f "$MODEL/config.json" ]; then
  step "make_random_model" 40 python3 benchmarks/make_random_model.py --shape dense-0.6b \
    --out "$MODEL" --dtype bfloat16 >"$OUT/phases_model.log" 2>&1
fi

# ---- phases: per-phase memory (start-up included) and speed beside the plan
if wants phases; then
  # one process: FSDP2 needs 2 ranks here, so bf16 is the model's own dtype (the 1-rank equivalent)
  PHASE_ARGS=(--model "$MODEL" --sft-steps 0 --steps 4 --prompts-per-step 16 --group-size 8
    --max-new-tokens 256 --max-prompt-tokens 64 --micro-batch-size 8 --eval-every 100 --eval-size 16
    --dtype bfloat16 --activation-checkpointing)
  step "gspo plan" 30 python3 -m gspo plan "${PHASE_ARGS[@]}" --gpus 1 --gpu-memory-gib "$GPU_GIB" \
    >"$OUT/phases_plan.txt" 2>&1
  step "gspo train (phases)" 150 python3 -m gspo train "${PHASE_ARGS[@]}" --device cuda \
    --output-dir "$WORK/phase_runs" --name q06 --overwrite --no-progress >"$OUT/phases_train.log" 2>&1
  cp "$WORK/phase_runs/q06/metrics.jsonl" "$OUT/phases_metrics.jsonl" 2>/dev/null || true
  step "gpu_phase_summary (measured against the plan)" 10 python3 benchmarks/gpu_phase_summary.py \
    "$WORK/phase_runs/q06" "$OUT/phases_plan.txt" --max-over-plan "$PLAN_MARGIN" >"$OUT/phases_summary.md" 2>&1
  cat "$OUT/phases_summary.md"
fi

# ---- vllm: gspo's vLLM engine, the log-prob check after a sleep/wake cycle
if wants vllm; then
  VLLM_ARGS=(--model "$MODEL" --rollout-engine vllm --rollout-dtype bfloat16 --max-prompt-tokens 64
    --max-new-tokens 64 --vllm-gpu-memory-utilization 0.3)
  step "gspo plan (vllm)" 30 python3 -m gspo plan "${VLLM_ARGS[@]}" --gpus 1 --gpu-memory-gib "$GPU_GIB" \
    >"$OUT/vllm_plan.txt" 2>&1
  step "gpu_vllm_check (sleep/wake, log-probs)" 180 python3 benchmarks/gpu_vllm_check.py "$MODEL" \
    --plan "$OUT/vllm_plan.txt" --utilization 0.3 >"$OUT/vllm.json" 2>"$OUT/vllm.log"
  cat "$OUT/vllm.json"
  grep -h "gpu_vllm_check:\|Available KV cache memory\|GPU KV cache size" "$OUT/vllm.log" || true
  grep -h "^vLLM KV cache per rank" "$OUT/vllm_plan.txt" || true
fi

echo "gpu_check: $(($(date +%s) - t0)) s in all"
if [ ${#failed[@]} -gt 0 ]; then
  msg=$(printf '%s; ' "${failed[@]}")
  echo "gpu_check: ${#failed[@]} step(s) FAILED: ${msg%; }" | tee "$OUT/FAILED" >&2
  exit 1
fi
echo "gpu_check: every step passed"
