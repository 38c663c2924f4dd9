#!/bin/bash
# One lent GPU's checks (issues 20, 31, 47), run on a machine with one CUDA GPU: `bash benchmarks/gpu_check.sh`
# (any working directory; results in $OUT, default /tmp/gpu_check; scratch in $WORK, default /tmp/gpu_check_work).
#
# Budget: <= 8 minutes in all on one H100 (a lent GPU gives 15 minutes of device time, 10 per command),
# each step under its own `timeout`:
#   0. dependencies (nvidia-smi, CUDA torch, transformers, safetensors, yaml, gspo)           ~10 s, no timeout
#   1. update memory (benchmarks/memory_probe.py, 5 Qwen3 shapes, 30 s each) beside `gspo plan`   150 s
#   2. `gspo train` on the embedded default, 20 RL steps                                           70 s
#   3. phases: a random Qwen3-0.6B (make_random_model.py, 40 s), `gspo plan` (30 s), then `gspo train`
#      in bf16 with activation checkpointing, 4 RL steps of 16 x 8 rows (150 s): the start-up peak and
#      each phase's peak (memory/*) beside the plan's, step time, tokens per second
#      (gpu_phase_summary.py, 10 s). The model is random and never emits EOS, so --max-new-tokens 256
#      is where every row ends: the step's length is bounded by the cap, not by chance.          230 s
#   in all at most 10 + 150 + 70 + 230 = 460 s (7.7 minutes)
# `gpu_check.sh train` runs step 2 alone, `gpu_check.sh phases` step 3 alone.
# Exit status: 2 when a dependency is missing (named, before anything runs), 1 when any step failed
# (each failure named at the end), 0 when every step passed.
#
# What this cannot prove about an 8-GPU node (one GPU, one process): NCCL across ranks (FSDP2's
# all-gathers and reduce-scatters, expert parallelism's all-to-all, the process group's timeout),
# vLLM (its sleep/wake cycle, the start check, weight sync into it, KV-cache preemption: vLLM is not
# run here), more than one node, reading the real 30B/235B weights from the hub, and the start-up of
# 8 ranks each reading its own shards. The plan's start-up line is compared with one rank's start-up.
#
# Where the machine lacks some of gspo's dependencies, put their wheels in .whl/ (installed to /tmp/site).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-/tmp/gpu_check}
WORK=${WORK:-/tmp/gpu_check_work}
PART=${1:-all}
case "$PART" in all | train | phases) ;; *) echo "gpu_check: unknown part '$PART' (all, train, phases)" >&2; exit 2 ;; esac
mkdir -p "$OUT" "$WORK"

# ---- 0. dependencies: all named at once, before any step runs
missing=()
command -v nvidia-smi >/dev/null 2>&1 || missing+=("nvidia-smi (no NVIDIA driver on PATH)")
command -v timeout >/dev/null 2>&1 || missing+=("timeout (coreutils)")
if ! command -v python3 >/dev/null 2>&1; then
  missing+=("python3")
else
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$ROOT/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  py_missing=$(python3 - <<'EOF'
import importlib
gone = []
for m in ("torch", "transformers", "safetensors", "yaml", "gspo"):
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
  ) || py_missing="python3 cannot run"
  [ -z "$py_missing" ] || missing+=("$py_missing")
fi
if [ ${#missing[@]} -gt 0 ]; then
  msg=$(printf '%s; ' "${missing[@]}")
  echo "gpu_check: missing: ${msg%; } -- nothing was run" | tee "$OUT/FAILED" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

t0=$(date +%s)
failed=()
exec 3>&1 4>&2 # the steps' own progress lines, whatever a step's output is redirected to
# step NAME SECONDS CMD...: run CMD under its budget; a failure (or a timeout, rc 124) is recorded, not fatal
step() {
  local name=$1 budget=$2 rc=0
  shift 2
  timeout "$budget" "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    local why="rc $rc"
    if [ "$rc" -eq 124 ]; then why="over its ${budget} s"; fi
    failed+=("$name ($why)")
    echo "FAILED: $name ($why)" >&4
  fi
  echo "$(($(date +%s) - t0)) s: $name rc=$rc" >&3
}

# ---- 1. update memory against the plan's model
if [ "$PART" = all ]; then
  : >"$OUT/memory_gpu.jsonl"
  while read -r args; do
    # shellcheck disable=SC2086
    step "memory_probe $args" 30 python3 benchmarks/memory_probe.py --device cuda $args \
      >>"$OUT/memory_gpu.jsonl" 2>>"$OUT/memory_gpu.err" </dev/null
  done <<'EOF'
--shape dense-0.6b --rows 8 --prompt 256 --response 1024
--shape dense-0.6b --rows 8 --prompt 256 --response 1024 --ac
--shape dense-1.7b --rows 8 --prompt 256 --response 1024 --ac
--shape moe-30b-a3b-4l --rows 8 --prompt 256 --response 1024
--shape moe-30b-a3b-4l --rows 8 --prompt 256 --response 1024 --ac
EOF
fi

# ---- 2. gspo train on the embedded default
if [ "$PART" = all ] || [ "$PART" = train ]; then
  step "gspo train (embedded default)" 70 python3 -m gspo train --steps 20 --device cuda \
    --output-dir "$WORK/runs" --name default --overwrite --no-progress >"$OUT/train.log" 2>&1
  tail -n 5 "$OUT/train.log"
  cp "$WORK/runs/default/metrics.jsonl" "$OUT/" 2>/dev/null || true
fi

# ---- 3. per-phase memory (start-up included) and speed beside the plan
if [ "$PART" = all ] || [ "$PART" = phases ]; then
  # one process: FSDP2 needs 2 ranks here, so bf16 is the model's own dtype (the 1-rank equivalent)
  PHASE_ARGS=(--model "$WORK/qwen3-0.6b-random" --sft-steps 0 --steps 4 --prompts-per-step 16 --group-size 8
    --max-new-tokens 256 --max-prompt-tokens 64 --micro-batch-size 8 --eval-every 100 --eval-size 16
    --dtype bfloat16 --activation-checkpointing)
  step "make_random_model" 40 python3 benchmarks/make_random_model.py --shape dense-0.6b \
    --out "$WORK/qwen3-0.6b-random" --dtype bfloat16 >"$OUT/phases_model.log" 2>&1
  step "gspo plan" 30 python3 -m gspo plan "${PHASE_ARGS[@]}" --gpus 1 \
    --gpu-memory-gib "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1 |
      awk '{printf "%.1f", $1 / 1024}')" >"$OUT/phases_plan.txt" 2>&1
  step "gspo train (phases)" 150 python3 -m gspo train "${PHASE_ARGS[@]}" --device cuda \
    --output-dir "$WORK/phase_runs" --name q06 --overwrite --no-progress >"$OUT/phases_train.log" 2>&1
  cp "$WORK/phase_runs/q06/metrics.jsonl" "$OUT/phases_metrics.jsonl" 2>/dev/null || true
  step "gpu_phase_summary" 10 python3 benchmarks/gpu_phase_summary.py "$WORK/phase_runs/q06" \
    "$OUT/phases_plan.txt" >"$OUT/phases_summary.md" 2>&1
  cat "$OUT/phases_summary.md"
fi

echo "gpu_check: $(($(date +%s) - t0)) s in all"
if [ ${#failed[@]} -gt 0 ]; then
  msg=$(printf '%s; ' "${failed[@]}")
  echo "gpu_check: ${#failed[@]} step(s) FAILED: ${msg%; }" | tee "$OUT/FAILED" >&2
  exit 1
fi
echo "gpu_check: every step passed"
