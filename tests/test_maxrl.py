"""MaxRL's advantage scale (``--adv-scale maxrl``, arXiv 2602.02710): hand values, the
maximum-likelihood identity it exists for, non-binary rewards, the groups whose mean is 0 or below,
and the refusal of negative rewards (at config time where the penalty makes them, at run time in one
line). Its closed form beside the other scales: tests/test_advantages.py; properties:
tests/test_properties.py."""

from __future__ import annotations

import math

import pytest
import torch
from cli_helpers import one_line

from gspo.advantages import check_maxrl_rewards, group_advantages, maxrl_advantages
from gspo.errors import GspoError

F64 = torch.float64


def test_hand_values():
    """(r - mean) / mean per group: one success in four -> (3, -1, -1, -1); half -> (-1, -1, 1, 1);
    all successes or none -> 0; with the default eps 1e-6 the divisor is mean + 1e-6."""
    r = torch.tensor([[1.0, 0, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=F64)
    want = [[3.0, -1, -1, -1], [-1.0, -1, 1, 1], [0.0] * 4, [0.0] * 4]
    assert torch.equal(group_advantages(r, "maxrl", 0.0), torch.tensor(want, dtype=F64))
    got = group_advantages(r, "maxrl")
    want_eps = torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=F64) / (0.25 + 1e-6)  # 3 - 1.2e-5, ...
    assert torch.allclose(got[0], want_eps, atol=1e-14, rtol=0)
    assert torch.equal(maxrl_advantages(r, 0.0), group_advantages(r, "maxrl", 0.0))


def test_binary_rewards_give_the_maximum_likelihood_gradient():
    """For 0/1 rewards, (1/G) sum_j A_j g_j equals the mean of the score g over the successes minus
    its mean over the group (the paper's estimator of grad log p(success)). MaxRL's advantages are
    GRPO's times sqrt((1 - p) / p), p the group's success rate: a hard prompt (small p) weighs more."""
    g = torch.Generator().manual_seed(0)
    for successes in ([0], [1, 5], [0, 2, 3, 4, 6, 7], [0, 1, 2, 3, 4, 5, 6]):
        G = 8
        r = torch.zeros(1, G, dtype=F64)
        r[0, successes] = 1.0
        score = torch.randn(G, 5, generator=g, dtype=F64)  # stand-ins for grad log pi(y_j)
        a = group_advantages(r, "maxrl", 0.0)[0]
        got = (a[:, None] * score).sum(0) / G
        want = score[successes].mean(0) - score.mean(0)
        assert torch.allclose(got, want, atol=1e-12, rtol=0)
        p = len(successes) / G
        grpo = group_advantages(r, "group", 0.0)[0]
        assert torch.allclose(a, grpo * math.sqrt((1 - p) / p), atol=1e-12, rtol=0)


def test_non_binary_rewards_are_relative_to_the_mean_and_scale_free():
    """Partial credit (0.5, 1, 0, 0.5), mean 0.5: (0, 1, -1, 0); A(c r) == A(r) for c > 0 (eps = 0);
    rewards >= 0 keep A in [-1, G - 1]."""
    r = torch.tensor([[0.5, 1.0, 0.0, 0.5], [0.1, 0.2, 0.3, 0.4]], dtype=F64)
    got = group_advantages(r, "maxrl", 0.0)
    assert torch.allclose(got[0], torch.tensor([0.0, 1.0, -1.0, 0.0], dtype=F64), atol=1e-15, rtol=0)
    assert torch.allclose(got[1], torch.tensor([-0.6, -0.2, 0.2, 0.6], dtype=F64), atol=1e-15, rtol=0)
    for c in (3.0, 1e-20, 1e20):
        assert torch.allclose(group_advantages(r * c, "maxrl", 0.0), got, atol=1e-14, rtol=0)
    assert ((got >= -1) & (got <= 3)).all()


def test_groups_whose_mean_is_zero_or_negative_get_zero():
    """Mean 0: all rewards 0 (nothing to learn, as equal rewards) or, with a negative reward, +-1;
    mean below 0: a flipped sign would push failures up, so A = 0 too. A positive mean with a negative
    reward is still (r - m) / m (the command refuses such rewards before: below)."""
    r = torch.tensor([[0.0, 0, 0], [-1.0, 1, 0], [-1.0, 0.5, 0], [-1.0, 2, 2]], dtype=F64)
    got = group_advantages(r, "maxrl", 0.0)
    assert torch.equal(got[:3], torch.zeros(3, 3, dtype=F64))
    assert torch.allclose(got[3], torch.tensor([-2.0, 1.0, 1.0], dtype=F64), atol=1e-15, rtol=0)
    assert torch.isfinite(group_advantages(r, "maxrl")).all()


def test_negative_rewards_are_refused_naming_the_reward_and_the_sample():
    check_maxrl_rewards(torch.tensor([0.0, 1.0, 0.5]), "r")
    with pytest.raises(
        GspoError, match=r"reward function my:fn: sample 2's reward is -0.5, but adv_scale 'maxrl'"
    ):
        check_maxrl_rewards(torch.tensor([0.0, 1.0, -0.5, -1.0]), "my:fn")


FAST = [
    "--sft-steps", "0", "--steps", "1", "--eval-size", "2", "--prompts-per-step", "2", "--group-size", "2",
    "--num-minibatches", "1", "--max-new-tokens", "4", "--eval-every", "0", "--threads", "1", "--no-progress",
    "--adv-scale", "maxrl",
]  # fmt: skip


def test_a_negative_reward_stops_a_maxrl_run_in_one_line(tmp_path, capsys, monkeypatch):
    """Through ``gspo train``: a reward function returning -1 for a sample stops the run at its first
    step, one line naming the function, exit 2; the same run with 0/1 rewards trains."""
    (tmp_path / "r.py").write_text(
        "def neg(p, c, a):\n    return [-1.0] + [1.0] * (len(c) - 1)\n\n"
        "def ok(p, c, a):\n    return [float(i % 2) for i in range(len(c))]\n"
    )
    monkeypatch.chdir(tmp_path)
    out = ["--output-dir", str(tmp_path / "o")]
    line = one_line(capsys, ["train", *FAST, *out, "--name", "neg", "--reward", "r.py:neg"], "r.py:neg")
    assert "sample 0's reward is -1, but adv_scale 'maxrl'" in line
    from gspo.cli import main

    assert main(["train", *FAST, *out, "--name", "ok", "--reward", "r.py:ok"]) == 0
