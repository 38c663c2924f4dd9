"""Bad input to issue 35's options through the command line (``gspo train``): OPSM's threshold, VESPO's
kernel options on other losses and a clip range on VESPO, the sampler's top-k / top-p; issue 58's:
DPPO's thresholds, Clip-Cov's / KL-Cov's fractions, band and penalty, MaxRL with a negative penalty. Each is one
line on stderr naming the config field, exit 2, no traceback, and nothing written (no run folder)."""

from __future__ import annotations

import cli_helpers
import pytest

import gspo.launch
from gspo.cli import main

CASES = [
    (["--opsm-threshold", "-1"], "opsm_threshold"),
    (["--opsm-threshold", "nan"], "opsm_threshold"),
    (["--opsm-threshold", "inf"], "opsm_threshold"),
    (["--algo", "vespo", "--eps-low", "0.1"], "eps_low"),
    (["--algo", "vespo", "--eps-high", "0.1"], "eps_high"),
    (["--vespo-k-pos", "2", "--algo", "gspo"], "vespo_k_pos"),
    (["--algo", "luspo", "--vespo-lambda-neg", "1"], "vespo_lambda_neg"),
    (["--algo", "vespo", "--vespo-lambda-pos", "0"], "vespo_lambda_pos"),
    (["--algo", "vespo", "--vespo-k-neg", "-1"], "vespo_k_neg"),
    (["--algo", "luspo", "--aggregation", "token_mean"], "aggregation"),
    (["--algo", "luspo", "--eps-low", "1.5"], "eps_low"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-p", "-0.5"], "top_p"),
    (["--top-p", "nan"], "top_p"),
    (["--top-k", "-1"], "top_k"),
    (["--top-k", "1.5"], "top_k"),
    # issue 58: DPPO's thresholds, Clip-Cov's / KL-Cov's fractions and band, MaxRL's rewards
    (["--algo", "dppo_tv", "--eps-low", "0"], "eps_low"),
    (["--algo", "dppo_kl", "--eps-high", "0"], "eps_high"),
    (["--algo", "dppo_tv", "--eps-high", "-0.1"], "eps_high"),
    (["--algo", "clip_cov", "--clip-cov-ratio", "0"], "clip_cov_ratio"),
    (["--algo", "clip_cov", "--clip-cov-ratio", "1"], "clip_cov_ratio"),
    (["--algo", "clip_cov", "--clip-cov-ratio", "-0.5"], "clip_cov_ratio"),
    (["--algo", "kl_cov", "--kl-cov-ratio", "1.5"], "kl_cov_ratio"),
    (["--algo", "kl_cov", "--kl-cov-ratio", "nan"], "kl_cov_ratio"),
    (["--algo", "kl_cov", "--kl-cov-coef", "-1"], "kl_cov_coef"),
    (["--algo", "clip_cov", "--clip-cov-lb", "5"], "clip_cov_lb"),
    (["--algo", "clip_cov", "--clip-cov-ub", "0.5"], "clip_cov_ub"),
    (["--algo", "clip_cov", "--eps-low", "1.5"], "eps_low"),
    (["--algo", "kl_cov", "--eps-low", "0.1"], "eps_low"),
    (["--algo", "grpo", "--clip-cov-ratio", "0.1"], "clip_cov_ratio"),
    (["--algo", "clip_cov", "--kl-cov-ratio", "0.1"], "kl_cov_ratio"),
    (["--adv-scale", "maxrl", "--overlong-buffer", "4"], "adv_scale"),
    (["--adv-scale", "max_rl"], "adv_scale"),
]


class _Accepted(Exception):
    """Raised instead of training: the command accepted a config it must refuse."""


@pytest.mark.parametrize("args, field", CASES, ids=lambda a: " ".join(a) if isinstance(a, list) else a)
def test_bad_option_is_one_line_naming_the_field(args, field, tmp_path, capsys, monkeypatch):
    def accepted(cfg):
        raise _Accepted(f"gspo train {' '.join(args)} was accepted")

    monkeypatch.setattr(gspo.launch, "train", accepted)  # a missed refusal fails fast, never trains
    out = tmp_path / "runs"
    assert main(["train", *args, "--output-dir", str(out)]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert err.startswith("gspo: error:") and "\n" not in err, err
    assert f"'{field}'" in err, err
    assert "Traceback" not in cap.err + cap.out
    assert not out.exists()


def test_real_command_refuses_in_one_line(tmp_path):
    """The installed command in a process of its own: exit status 2, stderr exactly one line (one
    case: every other refusal runs in-process above, through the same ``main``)."""
    args, field = ["--opsm-threshold", "-1"], "opsm_threshold"
    p = cli_helpers.gspo(
        "train", *args, "--steps", "1", "--sft-steps", "0", "--output-dir", str(tmp_path), timeout=120
    )
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gspo: error: config field '{field}'"), p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    assert not any(tmp_path.iterdir())
