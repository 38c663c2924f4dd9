"""Async partial rollouts (issue 34 item 4, ``partial_rollout_tokens``): a response that outlives a
weight update goes on under the next version with its tokens kept. Each token records the version
that drew it and that version's log-prob (checked against each version's own forward); GSPO's
sequence ratio uses them (closed form); a run is deterministic and resumes exactly with partial
batches in flight; what cannot follow is refused in one line."""

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo import Config, train
from gspo.data import left_pad
from gspo.errors import GspoError
from gspo.loss_prologue import loss_inputs
from gspo.losses import gspo_loss
from gspo.model.load import build_char_tokenizer, build_tiny_moe
from gspo.model.logprobs import response_logprobs
from gspo.rollout.hf import HFRolloutEngine
from gspo.rollout.partial import generate_partial

SPLIT, MAX_NEW = 3, 10


def _two_versions():
    """The tiny MoE (version 4) and the same model moved by noise (version 5)."""
    tok = build_char_tokenizer()
    v0 = build_tiny_moe(len(tok), seed=0).eval()
    v1 = copy.deepcopy(v0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return tok, v0, v1


def _logp(model, rb) -> torch.Tensor:
    p_ids, p_mask = left_pad(rb.prompt_ids, 0)
    with torch.no_grad():
        return response_logprobs(model, p_ids, p_mask, rb.response_ids_BT, rb.response_mask_BT)


@pytest.fixture(scope="module")
def spanning():
    tok, v0, v1 = _two_versions()
    model = copy.deepcopy(v0)  # the sampler's model: v0's weights, then v1's at the update
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    prompts = [tok(p, add_special_tokens=False).input_ids for p in ("rev:12=", "rev:345=", "rev:6789=")]
    rep = [p for p in prompts for _ in range(4)]
    loads = []

    def load_next():
        loads.append(1)
        with torch.no_grad():
            for a, b in zip(model.parameters(), v1.parameters(), strict=True):
                a.copy_(b)

    rb = generate_partial(
        eng, rep, MAX_NEW, 1.0, SPLIT, (tok.eos_token_id, tok.pad_token_id), (4, 5), load_next
    )
    head = HFRolloutEngine(
        copy.deepcopy(v0), tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0)
    )
    return rb, v0, v1, loads, head.generate(rep, SPLIT, 1.0)


def test_each_token_records_its_version_and_that_versions_logprob(spanning):
    rb, v0, v1, loads, head = spanning
    mask = rb.response_mask_BT.bool()
    ver = rb.sampler_version_BT
    spans = (ver == 5).any(-1)
    assert loads == [1] and 0 < int(spans.sum()) < len(spans)  # some rows outlived the update, some not
    n_B = rb.lengths_B
    for i in range(len(n_B)):
        want = [4] * min(int(n_B[i]), SPLIT) + [5] * max(int(n_B[i]) - SPLIT, 0)
        assert ver[i, : int(n_B[i])].tolist() == want and (ver[i, int(n_B[i]) :] == -1).all()
    assert (n_B[spans] > SPLIT).all() and (n_B[~spans] <= SPLIT).all()
    # the first SPLIT tokens are what version 4 alone samples with the same generator
    torch.testing.assert_close(rb.response_ids_BT[:, :SPLIT], head.response_ids_BT[:, :SPLIT], atol=0, rtol=0)
    lp0, lp1 = _logp(v0, rb), _logp(v1, rb)
    want_BT = torch.where(ver == 5, lp1, lp0)
    assert float((rb.sampler_logp_BT - want_BT)[mask].abs().max()) < 1e-5
    # and the versions disagree on the continued tokens (a log-prob from the wrong one would show)
    assert float((lp0 - lp1)[ver == 5].abs().max()) > 1e-2


def test_gspo_sequence_ratio_uses_each_tokens_own_version(spanning):
    """With the policy at version 5 and pi_old the sampler's log-probs, s_i = exp(sum over the tokens
    version 4 drew of (log pi_5 - log pi_4) / |y_i|): the continued tokens contribute exactly 0."""
    rb, v0, v1, _, _ = spanning
    mask = rb.response_mask_BT.float()
    lp0, lp1 = _logp(v0, rb), _logp(v1, rb)
    logp = lp1.clone().requires_grad_(True)
    adv = torch.linspace(-1.0, 1.0, len(mask))
    out = gspo_loss(loss_inputs(logp, rb.sampler_logp_BT, mask, adv), eps_low=1e6, eps_high=1e6)
    out.loss.backward()
    n_B = mask.sum(-1)
    head_BT = (rb.sampler_version_BT == 4).float()
    s_B = torch.exp(((lp1 - lp0) * head_BT).sum(-1) / n_B)
    # unclipped: d loss / d logp_it = -A_i s_i / (|y_i| B) on every token of row i
    want = -(adv * s_B / n_B / len(n_B))[:, None] * mask
    torch.testing.assert_close(logp.grad, want, atol=1e-6, rtol=1e-5)
    one_version = torch.exp(((lp1 - lp0) * mask).sum(-1) / n_B)  # as if version 4 drew every token
    spans = (rb.sampler_version_BT == 5).any(-1)
    assert float((one_version - s_B)[spans].abs().max()) > 1e-3


TINY = dict(
    steps=6, sft_steps=5, eval_size=4, prompts_per_step=4, group_size=4, max_new_tokens=MAX_NEW, eval_every=0,
    save_every=3, threads=1, progress=False, warmup_steps=64, async_staleness=2, partial_rollout_tokens=SPLIT,
    reward=f"{Path(__file__).with_name('fixture_rewards.py')}:length_parity",
)  # fmt: skip


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]


@pytest.mark.slow  # the slow tier (an end-to-end run of ~20 s here): CI runs it
def test_partial_run_is_deterministic_and_resumes_exactly(tmp_path):
    """Step t's batch spans versions t-3 and t-2 (K = 2; steps 1 and 2 have no second version yet);
    two runs agree exactly, and a run killed after step 3 with partial batches in flight (steps 4
    and 5) resumes to the same weights, sampling step 6 across versions 3 and 4 again."""
    full = train(Config(name="run", output_dir=str(tmp_path), **TINY))
    rows = _rows(full.run_dir)
    assert [r["async/staleness"] for r in rows] == [0, 1, 2, 2, 2, 2]
    assert [r["async/partial_rows"] > 0 for r in rows] == [False, False, True, True, True, True]
    assert all(1 < r["async/token_staleness"] < 2 for r in rows[2:])  # tokens of t-3 and of t-2
    again = train(Config(name="again", output_dir=str(tmp_path), **TINY))
    for (k, v), w in zip(full.model.state_dict().items(), again.model.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)
    ckpts = full.run_dir / "checkpoints"
    shutil.rmtree(ckpts / "step-000006")
    (ckpts / "latest").write_text("step-000003")
    shutil.rmtree(full.run_dir / "final")
    resumed = train(Config(name="run", output_dir=str(tmp_path), resume=True, **TINY))
    for (k, v), w in zip(again.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)


@pytest.mark.parametrize(
    "extra, why",
    [
        (dict(async_staleness=0), "needs async_staleness"),
        (dict(max_new_tokens=SPLIT), "below max_new_tokens"),
        (dict(env="calculator"), "trajectory"),
        (dict(dynamic_sampling=True), "rounds"),
    ],
)
def test_what_partial_rollouts_refuse_is_one_line(extra, why):
    settings = dict(async_staleness=1, partial_rollout_tokens=SPLIT, max_new_tokens=MAX_NEW) | extra
    with pytest.raises(GspoError, match=rf"config field 'partial_rollout_tokens': .*{why}") as e:
        Config(**settings).validate()
    assert "\n" not in str(e.value)


def test_cli_flag_runs_and_logs_the_share_of_partial_rows(tmp_path):
    cmd = [sys.executable, "-m", "gspo", "train", "--async-staleness", "1", "--partial-rollout-tokens", "2",
           "--steps", "2", "--sft-steps", "5", "--eval-size", "4", "--prompts-per-step", "4", "--group-size",
           "4", "--threads", "1", "--no-progress", "--save-every", "0", "--output-dir", str(tmp_path)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _rows(next(tmp_path.iterdir()))
    assert "async/partial_rows" in rows[-1] and "async/token_staleness" in rows[-1]
