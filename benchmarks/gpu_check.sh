#!/bin/bash
# One GPU session's checks (issues 20, 31), run from the repository root on a machine with one CUDA GPU
# (under 10 minutes on an H200):
#   1. peak memory of the policy update (benchmarks/memory_probe.py) for Qwen3 shapes, with and
#      without activation checkpointing, to check `gspo plan`'s memory model against;
#   2. `gspo train` on the embedded default, on the GPU, for 30 RL steps;
#   3. `gspo train` on a randomly initialised Qwen3-0.6B shape (benchmarks/make_random_model.py) in
#      bf16 with activation checkpointing: the peak memory of each phase (rollout, update, sync: the
#      memory/* metrics) beside `gspo plan`'s estimate for the same config, step time, and tokens per
#      second of the rollout and of the update (benchmarks/gpu_phase_summary.py).
# `gpu_check.sh train` runs the second part alone, `gpu_check.sh phases` the third. Results go to $OUT (memory_gpu.jsonl, train.log, metrics.jsonl). Needs gspo's dependencies; where
# the machine lacks some, put their wheels in .whl/ (installed to /tmp/site first).
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
[ -n "${1:-}" ] || while read -r args; do
  [ -z "$args" ] && continue
  timeout 120 python3 benchmarks/memory_probe.py --device cuda $args >> "$OUT/memory_gpu.jsonl" 2>> "$OUT/memory_gpu.err" \
    || echo "FAILED: $args" | tee -a "$OUT/memory_gpu.err"
  echo "$(( $(date +%s) - t0 )) s: $args"
done <<'EOF'
--shape dense-0.6b --rows 8 --prompt 256 --response 1024
--shape dense-0.6b --rows 8 --prompt 256 --response 1024 --ac
--shape dense-0.6b --rows 8 --prompt 256 --response 1024 --micro 2
--shape dense-0.6b --rows 8 --prompt 256 --response 4096
--shape dense-0.6b --rows 8 --prompt 256 --response 4096 --ac
--shape dense-1.7b --rows 8 --prompt 256 --response 1024
--shape dense-1.7b --rows 8 --prompt 256 --response 1024 --ac
--shape moe-30b-a3b-4l --rows 8 --prompt 256 --response 1024
--shape moe-30b-a3b-4l --rows 8 --prompt 256 --response 1024 --ac
EOF
tail -n 3 "$OUT/memory_gpu.err" 2>/dev/null
if [ -z "${1:-}" ] || [ "$1" = train ]; then
  timeout 240 python3 -m gspo train --steps 30 --output-dir /tmp/gpu_runs --no-progress > "$OUT/train.log" 2>&1
  echo "gspo train rc=$? after $(( $(date +%s) - t0 )) s"
  tail -n 5 "$OUT/train.log"
  cp /tmp/gpu_runs/*/metrics.jsonl "$OUT/" 2>/dev/null
fi
if [ -z "${1:-}" ] || [ "$1" = phases ]; then
  # one process: FSDP2 needs 2 ranks here, so bf16 is the model's own dtype (the 1-rank equivalent)
  PHASE_ARGS="--model /tmp/qwen3-0.6b-random --sft-steps 0 --steps 6 --prompts-per-step 16 --group-size 8
    --max-new-tokens 1024 --max-prompt-tokens 64 --micro-batch-size 8 --eval-every 100 --eval-size 16
    --dtype bfloat16 --activation-checkpointing"
  timeout 60 python3 benchmarks/make_random_model.py --shape dense-0.6b --out /tmp/qwen3-0.6b-random \
    --dtype bfloat16 > "$OUT/phases_model.log" 2>&1 || echo "FAILED: make_random_model" | tee -a "$OUT/phases_model.log"
  # shellcheck disable=SC2086
  python3 -m gspo plan $PHASE_ARGS --gpus 1 --gpu-memory-gib 139.8 > "$OUT/phases_plan.txt" 2>&1
  # shellcheck disable=SC2086
  timeout 300 python3 -m gspo train $PHASE_ARGS --device cuda --output-dir /tmp/gpu_phase_runs --name q06 \
    --overwrite --no-progress > "$OUT/phases_train.log" 2>&1
  echo "phases: gspo train rc=$? after $(( $(date +%s) - t0 )) s"
  cp /tmp/gpu_phase_runs/q06/metrics.jsonl "$OUT/phases_metrics.jsonl" 2>/dev/null
  python3 benchmarks/gpu_phase_summary.py /tmp/gpu_phase_runs/q06 "$OUT/phases_plan.txt" | tee "$OUT/phases_summary.md"
fi
exit 0
