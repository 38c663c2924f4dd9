#!/bin/bash
# One GPU session's checks (issue 20), run from the repository root on a machine with one CUDA GPU:
#   1. peak memory of the policy update (benchmarks/memory_probe.py) for Qwen3 shapes, with and
#      without activation checkpointing, to check `gspo plan`'s memory model against;
#   2. `gspo train` on the embedded default, on the GPU, for 30 RL steps.
# `gpu_check.sh train` runs the second part alone. Results go to $OUT (memory_gpu.jsonl, train.log, metrics.jsonl). Needs gspo's dependencies; where
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
[ "${1:-}" = train ] || while read -r args; do
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
timeout 240 python3 -m gspo train --steps 30 --output-dir /tmp/gpu_runs --no-progress > "$OUT/train.log" 2>&1
echo "gspo train rc=$? after $(( $(date +%s) - t0 )) s"
tail -n 5 "$OUT/train.log"
cp /tmp/gpu_runs/*/metrics.jsonl "$OUT/" 2>/dev/null
exit 0
