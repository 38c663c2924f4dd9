"""`gspo compare`: four variants from one warm start, a report with plots and the claims table."""

from gspo.compare import run_compare
from gspo.train.logger import read_metrics


def test_compare_writes_report(tmp_path):
    """A tiny compare run trains every variant from the same warm start and writes report.md + PNGs."""
    overrides = dict(
        steps=2,
        sft_steps=3,
        eval_size=8,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=8,
        eval_every=1,
        threads=1,
        progress=False,
    )
    report = run_compare(None, overrides, [0], ["gspo", "gspo_token", "grpo", "grpo_replay"], str(tmp_path))
    text = report.read_text()
    for v in ["gspo", "gspo_token", "grpo", "grpo_replay"]:
        assert f"| {v} |" in text
        rows = read_metrics(tmp_path / f"{v}-s0" / "metrics.jsonl")
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert "moe/volatility" in rows[1]
    # every variant starts RL from the same warm-started weights: identical initial accuracy
    accs = {
        read_metrics(tmp_path / f"{v}-s0" / "metrics.jsonl")[0]["eval/accuracy"]
        for v in ["gspo", "gspo_token", "grpo", "grpo_replay"]
    }
    assert len(accs) == 1
    assert "The paper's claims and this run" in text and "GRPO on MoE needs Routing Replay" in text
    for png in ["reward.png", "accuracy.png", "clip_fraction.png", "volatility.png"]:
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "warm-start-s0" / "config.json").exists()
