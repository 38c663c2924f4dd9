"""A bf16 sampler beside a float32 trainer (the paper's inference/training precision mismatch)."""

import json

from gspo import Config, train
from gspo.resolve import pi_old_source


def test_bf16_sampler_is_a_synced_copy_and_its_mismatch_is_measured(tmp_path):
    """With ``rollout_dtype=bfloat16`` the HF engine samples from a bf16 copy: pi_old defaults to a
    trainer recompute, the mismatch is logged at bf16's size, and it stays there after updates (the
    copy follows the trainer; a stale copy would drift away as the weights move)."""
    cfg = Config(
        rollout_dtype="bfloat16", steps=4, sft_steps=60, eval_size=8, prompts_per_step=8, group_size=4,
        max_new_tokens=8, eval_every=0, threads=1, progress=False, lr=3e-3, output_dir=str(tmp_path),
    )  # fmt: skip
    assert pi_old_source(cfg) == "recompute"
    assert pi_old_source(Config()) == "rollout"
    res = train(cfg)
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    diffs = [r["mismatch/token_abs_logp_diff"] for r in rows]
    # Bounds from the precisions. The bf16 copy rounds each weight and each of the ~51 forward ops'
    # outputs by up to u = 2^-8 relative (the count in tests/test_distributed.py), a logit error of rms
    # u * sqrt(51 / 3) = 0.016 per unit of logit, which is what |d log p| follows. Lower bound 1e-4:
    # u / 40, while a float32 copy (2^-24 per rounding) would differ by ~1e-6. Upper bound 0.1: 6x that rms
    # for unit logits; a copy left stale after the warm start (no sync) is at 0.9, 1.4, 2.3 after 1, 2,
    # 3 updates. Measured: 0.002-0.016 (seeds 0-2, 4 steps each).
    assert all(1e-4 < d < 0.1 for d in diffs), diffs
    assert max(r["loss/grad_norm"] for r in rows) > 0
