"""Off-policy sequence masking (OPSM, DeepSeek-V3.2): the mask in closed form, through every loss, in
the trainer's update, and its bad input; the random sequence drop (an ablation) the same way."""

from __future__ import annotations

import copy

import pytest
import torch
from test_losses import ATOL, F64, VARIANTS, _grad, _normalizer, _token_batch

from gspo.config import Config
from gspo.correction import off_policy_sequence_mask, with_opsm, with_random_drop
from gspo.errors import GspoError


def _case():
    """Rows: D = mean(sampler - logp) of 0.7, 0.7, 0.3, 0.7, (empty); A = -1, +1, -1, -0.2, -1."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=F64)
    logp = torch.tensor(
        [[-1.0, -2.0, 9.0], [-0.5, -0.4, -0.3], [-2.0, 9.0, 9.0], [-1.0] * 3, [-1.0] * 3], dtype=F64
    )
    d = torch.tensor(
        [[0.5, 0.9, 0.0], [0.7, 0.7, 0.7], [0.3, 0.0, 0.0], [1.4, 0.7, 0.0], [5.0] * 3], dtype=F64
    )
    sampler = torch.where(mask.bool(), logp + d, torch.full_like(logp, float("nan")))  # NaN on padding
    adv = torch.tensor([-1.0, 1.0, -1.0, -0.2, -1.0], dtype=F64)
    return logp.requires_grad_(True), sampler, adv, mask


def test_mask_hand_computed():
    """Dropped: A < 0 and D > delta (rows 0 and 3 at delta 0.5); kept: A > 0 (row 1), D <= delta (row 2),
    no tokens (row 4, D = 0); at delta 0.7 D = 0.7 is kept (strict >); NaN padding never leaks."""
    logp, sampler, adv, mask = _case()
    keep = off_policy_sequence_mask(logp, sampler, adv, mask, 0.5)
    assert keep.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0] and not keep.requires_grad
    assert off_policy_sequence_mask(logp, sampler, adv, mask, 0.7).tolist() == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert off_policy_sequence_mask(logp, sampler, adv, mask, 0.0).tolist() == [0.0, 1.0, 0.0, 0.0, 1.0]
    _, metrics = with_opsm(None, logp, sampler, adv, mask, 0.5)
    assert abs(metrics["opsm_frac_seq"].item() - 2 / 4) < ATOL
    assert abs(metrics["opsm_frac_tok"].item() - (2 + 3) / 9) < ATOL


def test_divergence_is_against_the_current_policy():
    """D compares the sampler with pi_theta (logp), so a policy that moved away masks, one that did not,
    does not: the same sampler log-probs, two policies."""
    logp, sampler, adv, mask = _case()
    assert off_policy_sequence_mask(logp, sampler, adv, mask, 0.5)[0] == 0
    moved_back = torch.where(mask.bool(), sampler, logp.detach())  # pi_theta == pi_sampler: D = 0
    assert off_policy_sequence_mask(moved_back, sampler, adv, mask, 0.5).tolist() == [1.0] * 5


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_masked_sequences_get_no_gradient_in_every_loss(name):
    """Every loss with OPSM's weight: masked rows get exactly zero gradient, the others exactly the
    unmasked loss's, the normalizer unchanged (a masked row still counts, as in TRL and DeepSeek's
    1/G); combined with an existing [B] or [B, T] weight it multiplies it."""
    fn = VARIANTS[name]
    logp, old, adv, mask = _token_batch(seed=30, scale=0.4)
    sampler = old + torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0], dtype=F64)[:, None]  # D ~ 1 on rows 0-2, 4
    n = _normalizer(name, mask)
    weight, _ = with_opsm(None, logp, sampler, adv, mask, 0.5)
    dropped = (adv < 0) & (torch.tensor([1, 1, 1, 0, 1]) == 1)
    assert dropped.any() and torch.equal(weight == 0, dropped)
    g = _grad(fn(logp, old, adv, mask, normalizer=n, weight=weight)[0], logp)
    g0 = _grad(fn(logp, old, adv, mask, normalizer=n)[0], logp)
    assert torch.all(g[dropped] == 0)
    assert torch.allclose(g[~dropped], g0[~dropped], atol=ATOL, rtol=0)
    tis = torch.linspace(0.5, 1.5, 5, dtype=F64)
    for w in (tis, tis[:, None].expand(5, 5).clone()):
        combined, _ = with_opsm(w, logp, sampler, adv, mask, 0.5)
        want = w * (weight if w.dim() == 1 else weight[:, None])
        assert torch.equal(combined, want)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_threshold_out_of_range(bad):
    logp, sampler, adv, mask = _case()
    with pytest.raises(ValueError, match="OPSM threshold"):
        off_policy_sequence_mask(logp, sampler, adv, mask, bad)
    with pytest.raises(GspoError, match="opsm_threshold"):
        Config(opsm_threshold=bad).validate()


def _update(model, tok, sampler_shift_B, adv_B, **kw):
    """One policy_update of 8 sampled rows (SGD, lr 0.1) -> (the updated copy, its metrics)."""
    from step_helpers import plan_update

    from gspo.data import TrainBatch, left_pad
    from gspo.rollout.hf import HFRolloutEngine
    from gspo.training.update import policy_update

    prompts = [tok(f"rev:{n}=").input_ids for n in [1, 12, 123, 1234, 9, 98, 987, 9876]]
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    rb = eng.generate(prompts, 6, temperature=1.0)
    ids, pmask = left_pad(prompts, tok.pad_token_id)
    sampler = rb.sampler_logp_BT + sampler_shift_B[:, None] * rb.response_mask_BT
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = Config(prompts_per_step=1, group_size=8, num_minibatches=1, log_volatility=False, **kw)
    data = TrainBatch(ids, pmask, rb.response_ids_BT, rb.response_mask_BT, sampler, adv_B)
    return m, policy_update(m, opt, sched, data, plan_update(cfg.validate(), m, True), 1)


def _same(m1, m2) -> bool:
    return all(
        torch.allclose(a, b, atol=1e-7, rtol=0) for a, b in zip(m1.parameters(), m2.parameters(), strict=True)
    )


def test_update_with_opsm_equals_the_update_without_the_masked_rows(tiny_moe):
    """policy_update with --opsm-threshold 0.5 on a batch whose sampler log-probs sit 1 nat/token above
    the policy on half the rows: it logs the masked share and makes exactly the update of the same
    batch with those rows' advantages set to 0 (their sequences still counted in the normalizer)."""
    model, tok = tiny_moe
    shifted = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.bool)  # D = 1 on the shifted rows
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, -0.5, 0.5, -2.0, 2.0])
    dropped = shifted & (adv < 0)
    m1, met = _update(model, tok, shifted, adv, opsm_threshold=0.5, old_logp="recompute")
    m2, _ = _update(model, tok, shifted, torch.where(dropped, 0.0, adv), old_logp="recompute")
    assert abs(met["mismatch/opsm_frac_seq"] - dropped.sum().item() / 8) < 1e-9
    assert _same(m1, m2)
    m3, _ = _update(model, tok, shifted, adv, old_logp="recompute")  # without OPSM the rows move it
    assert not _same(m1, m3)


def test_opsm_under_the_default_old_logp_compares_the_sampler_with_this_forward(tiny_moe):
    """Issue 57 gap 3: under ``old_logp=rollout`` (the default) pi_old *is* the sampler's log-probs,
    so OPSM fed pi_old instead of this forward's log-probs would never mask. GSPO with a range no
    ratio here leaves (eps_low 0.99): the update with OPSM is exactly the update with the masked
    rows' advantages set to 0, and ``mismatch/opsm_frac_seq`` / ``_tok`` are logged."""
    model, tok = tiny_moe
    shifted = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.bool)
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, -0.5, 0.5, -2.0, 2.0])
    dropped = shifted & (adv < 0)
    wide = dict(old_logp="rollout", eps_low=0.99, eps_high=100.0)
    m1, met = _update(model, tok, shifted, adv, opsm_threshold=0.5, **wide)
    assert "mismatch/opsm_frac_seq" in met and "mismatch/opsm_frac_tok" in met, sorted(met)
    assert abs(met["mismatch/opsm_frac_seq"] - dropped.sum().item() / 8) < 1e-9
    assert 0 < met["mismatch/opsm_frac_tok"] < 1
    m2, _ = _update(model, tok, shifted, torch.where(dropped, 0.0, adv), **wide)
    assert _same(m1, m2)
    m3, _ = _update(model, tok, shifted, adv, **wide)  # without OPSM the rows move it
    assert not _same(m1, m3)


def test_random_drop_hand_computed():
    """Dropped: the rows whose draw is below p, whatever their advantage; the share counts rows with
    tokens only; an existing [B] or [B, T] weight is multiplied; p = 0 keeps every row."""
    logp, sampler, adv, mask = _case()
    u = torch.tensor([0.1, 0.5, 0.29, 0.3, 0.0], dtype=F64)
    keep, metrics = with_random_drop(None, u, mask, 0.3)
    assert keep.tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert abs(metrics["random_drop_frac_seq"].item() - 2 / 4) < ATOL  # row 4 has no tokens
    assert with_random_drop(None, u, mask, 0.0)[0].tolist() == [1.0] * 5
    w = torch.linspace(0.5, 1.5, 5, dtype=F64)
    assert torch.equal(with_random_drop(w, u, mask, 0.3)[0], w * keep)
    assert torch.equal(
        with_random_drop(w[:, None].expand(5, 3), u, mask, 0.3)[0], (w[:, None] * keep[:, None]).expand(5, 3)
    )


def test_update_with_random_drop_equals_the_update_without_the_drawn_rows(tiny_moe):
    """--random-seq-drop 0.5 through policy_update: the rows dropped are those whose torch.rand draw
    (the global generator, right before the loss) falls below 0.5, and the update equals the one with
    those rows' advantages set to 0; the logged share is theirs; out of [0, 1] is one config error."""
    model, tok = tiny_moe
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, -0.5, 0.5, -2.0, 2.0])
    none = torch.zeros(8, dtype=torch.bool)
    torch.manual_seed(5)
    dropped = torch.rand(8) < 0.5
    assert 0 < dropped.sum() < 8
    torch.manual_seed(5)
    m1, met = _update(model, tok, none, adv, random_seq_drop=0.5)
    m2, _ = _update(model, tok, none, torch.where(dropped, 0.0, adv))
    assert abs(met["mismatch/random_drop_frac_seq"] - dropped.sum().item() / 8) < 1e-9
    assert _same(m1, m2)
    assert not _same(m1, _update(model, tok, none, adv)[0])
    with pytest.raises(GspoError, match="random_seq_drop"):
        Config(random_seq_drop=1.5).validate()
