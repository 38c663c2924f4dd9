"""Train/inference mismatch correction: pure tensor functions.

When the responses come from a rollout engine, the log-probs it reports (``sampler_logp_BT``,
pi_sampler) differ from the trainer's own log-probs of the same tokens under the same weights
(``old_logp_BT``, pi_old): other kernels, precision, MoE routing. The losses' ratio is then taken
against the trainer's pi_old, and these functions correct (or drop) what pi_sampler != pi_old would
bias, with the per-token log-ratio

    d_it = old_logp_it - sampler_logp_it = log(pi_old / pi_sampler)   (response tokens only)

and its length-normalized sequence mean l_i = (1/|y_i|) sum_t d_it, rho_i = exp(l_i).

All outputs are detached (stop-gradient) and NaN-free: padding positions are set to 0 before any
arithmetic, so NaN/inf there cannot leak; rows without response tokens have l_i = 0 (rho_i = 1).
They plug into every loss in :mod:`gspo.losses` through its ``weight`` argument (a per-sequence
``[B]`` multiplier, or ``[B, T]`` for the losses that aggregate over tokens), or by AND-ing a 0/1
token mask into ``mask``::

    w_B = sequence_tis_weights(old_logp_BT, sampler_logp_BT, mask_BT, cap=2.0)
    out = LOSSES["gspo"](loss_inputs(logp_BT, old_logp_BT, mask_BT, adv_B, normalizer=n, weight=w_B))
    metrics = out.metrics | mismatch_metrics(old_logp_BT, sampler_logp_BT, mask_BT, tis_cap=2.0)

or, the way the trainer does, through the registry :data:`CORRECTIONS` (name -> function returning the
loss's weight, its token mask and these metrics)::

    weight, loss_mask_BT, metrics = CORRECTIONS["seq_tis"](old_logp_BT, sampler_logp_BT, mask_BT,
                                                           cap=2.0, lo=0.5, hi=2.0)

Metric keys: ``*_min`` / ``*_max`` are minima / maxima, keys ending in ``_tok`` are averages over
response tokens, all others averages over the sequences that have at least one response token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gspo.loss_prologue import MAX_LOG_RATIO, k3_kl, loss_inputs, ratio_stats, sequence_mean

Tensor = torch.Tensor


def _mismatch(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(d_BT, l_B, n_tok_B): detached masked per-token log-ratio (0 on padding), its per-row mean (0
    for empty rows) and the token counts, in at least float32: the losses' prologue, pi_old against
    pi_sampler."""
    inp = loss_inputs(old_logp.detach(), sampler_logp.detach(), mask.detach())
    return inp.log_r_BT, sequence_mean(inp.log_r_BT, inp.n_tok_B), inp.n_tok_B


def _check_bounds(lo: float, hi: float) -> None:
    if not (0 <= lo <= hi):
        raise ValueError(f"need 0 <= lo <= hi, got lo={lo!r}, hi={hi!r}")


def _check_cap(cap: float) -> None:
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")


def sequence_tis_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Sequence-level truncated importance sampling on the length-normalized ratio.

    weight_i = min(rho_i, cap), rho_i = exp((1/|y_i|) sum_t (old_logp_it - sampler_logp_it)) -> ``[B]``,
    detached; 1 for rows without response tokens. Pass it as a loss's ``weight``: it multiplies that
    sequence's loss term, hence its gradient, exactly. There is no published default for the
    length-normalized ratio (it is much closer to 1 than a token ratio); token-level TIS uses cap = 2
    (Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL training").

    Args:
        old_logp: ``[B, T]`` the trainer's log-probs of the sampled tokens under pi_old.
        sampler_logp: ``[B, T]`` the rollout engine's log-probs of the same tokens.
        mask: ``[B, T]`` 1 on response tokens.
        cap: truncation C > 0 (``math.inf``: plain sequence-level importance sampling).
    """
    _check_cap(cap)
    _, l_B, _ = _mismatch(old_logp, sampler_logp, mask)
    return torch.exp(l_B).clamp(max=cap)  # exp may give inf (l > 88 in float32): clamped to cap


def sequence_mask(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, lo: float, hi: float) -> Tensor:
    """Sequence-level masking (rejection) on the length-normalized ratio.

    keep_i = 1 if lo <= rho_i <= hi else 0 -> ``[B]`` 0/1 (float), detached; rows without response
    tokens have rho_i = 1 and are kept when 1 is in range (they contribute 0 anyway). Pass it as
    ``weight`` (the dropped sequences still count in the caller's normalizer), alone or multiplied into
    TIS weights.
    """
    _check_bounds(lo, hi)
    d_BT, l_B, _ = _mismatch(old_logp, sampler_logp, mask)
    rho_B = torch.exp(l_B)  # inf or 0 at the extremes: compares correctly
    return ((rho_B >= lo) & (rho_B <= hi)).to(d_BT.dtype)


def token_mask(
    old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, lo: float = 0.5, hi: float = 5.0
) -> Tensor:
    """Token-level masking (IcePop, Ring-1T arXiv 2510.18855): keep tokens with lo <= k_it <= hi.

    k_it = pi_old(y_it) / pi_sampler(y_it) = exp(old_logp_it - sampler_logp_it). Returns ``[B, T]`` 0/1
    (float), 0 on padding, detached. Defaults [0.5, 5] are IcePop's [alpha, beta].

    Two ways to use it with a token-aggregating loss (GRPO, SAPO-token, CISPO, GSPO-token):
    ``weight=keep_BT`` drops the tokens and keeps the denominators (|y_i|, the normalizer), as in
    IcePop's objective; ``mask=mask_BT * keep_BT`` removes them from the denominators as well (and,
    for GSPO / SAPO / GMPO, from the sequence ratio's mean).
    """
    _check_bounds(lo, hi)
    d_BT, _, _ = _mismatch(old_logp, sampler_logp, mask)
    k_BT = torch.exp(d_BT)
    return (mask.detach().bool() & (k_BT >= lo) & (k_BT <= hi)).to(d_BT.dtype)


def mismatch_metrics(
    old_logp: Tensor,
    sampler_logp: Tensor,
    mask: Tensor,
    *,
    estimators: bool = True,
    abs_diff: bool = False,
    tis_cap: float | None = None,
    seq_bounds: tuple[float, float] | None = None,
    token_bounds: tuple[float, float] | None = None,
    token_tis_cap: float | None = None,
) -> dict[str, Tensor]:
    """Train/inference mismatch statistics -> dict of detached 0-dim tensors.

    With d_it = old_logp_it - sampler_logp_it (tokens sampled from pi_sampler), l_i its per-sequence
    mean, rho = e^l, k = e^d:

    - ``estimators`` (default True):
      ``mismatch_k1_tok``: mean over tokens of -d (k1 estimate of KL(pi_sampler || pi_old) per token);
      ``mismatch_k3_tok``: mean over tokens of k - 1 - d (k3 estimate, >= 0 termwise);
      ``mismatch_k1_seq``: mean over sequences of -l_i (the same per-token KL, averaging each
      sequence's tokens first); ``mismatch_k3_seq``: mean over sequences of rho_i - 1 - l_i;
      ``mismatch_ratio_tok_min`` / ``_max`` (k), ``mismatch_ratio_seq`` / ``_seq_min`` / ``_seq_max`` (rho).
    - ``abs_diff``: ``token_abs_logp_diff`` (each sequence's mean |d_it|, averaged over sequences) and
      ``seq_abs_logp_diff`` (mean over sequences of |l_i|): the trainer logs these wherever it knows its
      own pi_old, whatever the correction.
    - ``tis_cap`` given (:func:`sequence_tis_weights`): ``tis_weight_seq`` (mean weight),
      ``tis_trunc_frac_seq`` / ``tis_trunc_frac_tok`` (share of sequences with rho_i > cap, and of
      tokens in them).
    - ``seq_bounds=(lo, hi)`` (:func:`sequence_mask`): ``seq_mask_frac_seq`` / ``seq_mask_frac_tok``
      (share of sequences dropped, and of tokens in them).
    - ``token_bounds=(lo, hi)`` (:func:`token_mask`, IcePop): ``tok_mask_frac_tok``
      (share of tokens dropped) and ``tok_mask_frac_seq`` (each sequence's dropped share, averaged).
    - ``token_tis_cap`` given (token-level TIS, min(k_it, cap)): ``tok_tis_trunc_frac_tok`` /
      ``tok_tis_trunc_frac_seq`` (share of tokens with k > cap; per sequence, averaged).

    Only rows with response tokens count; with none at all every mean is 0 and min/max are 1.
    """
    d_BT, l_B, n_tok_B = _mismatch(old_logp, sampler_logp, mask)
    rows = _Rows.of(mask.detach().bool(), n_tok_B)
    k_BT, rho_B = torch.exp(d_BT), torch.exp(l_B)
    out: dict[str, Tensor] = {}
    if estimators:
        out |= _estimators(d_BT, l_B, n_tok_B, rows.valid_BT, rows.has_tok_B, rows.seq_mean(-l_B), rows.n_tok)
    if abs_diff:
        out |= _abs_diff(d_BT, l_B, n_tok_B)
    if tis_cap is not None:
        _check_cap(tis_cap)
        out["tis_weight_seq"] = rows.seq_mean(rho_B.clamp(max=tis_cap))
        out["tis_trunc_frac_seq"], out["tis_trunc_frac_tok"] = rows.seq_frac(rho_B > tis_cap)
    if seq_bounds is not None:
        lo, hi = seq_bounds
        _check_bounds(lo, hi)
        out["seq_mask_frac_seq"], out["seq_mask_frac_tok"] = rows.seq_frac(~((rho_B >= lo) & (rho_B <= hi)))
    if token_bounds is not None:
        lo, hi = token_bounds
        _check_bounds(lo, hi)
        out["tok_mask_frac_tok"], out["tok_mask_frac_seq"] = rows.tok_frac(~((k_BT >= lo) & (k_BT <= hi)))
    if token_tis_cap is not None:
        _check_cap(token_tis_cap)
        out["tok_tis_trunc_frac_tok"], out["tok_tis_trunc_frac_seq"] = rows.tok_frac(k_BT > token_tis_cap)
    return out


def _abs_diff(d_BT: Tensor, l_B: Tensor, n_tok_B: Tensor) -> dict[str, Tensor]:
    """``abs_diff`` of :func:`mismatch_metrics` from :func:`_mismatch`'s (d_BT, l_B, n_tok_B): its own
    function, as the default correction ("none") logs these alone, every step."""
    has_tok_B = n_tok_B > 0
    n_seq = has_tok_B.sum().clamp(min=1).to(n_tok_B.dtype)
    tok_B, seq_B = d_BT.abs().sum(-1) / n_tok_B.clamp(min=1), l_B.abs()
    return {
        "token_abs_logp_diff": torch.where(has_tok_B, tok_B, torch.zeros_like(tok_B)).sum() / n_seq,
        "seq_abs_logp_diff": torch.where(has_tok_B, seq_B, torch.zeros_like(seq_B)).sum() / n_seq,
    }


@dataclass(frozen=True)
class _Rows:
    """Means and shares over the response tokens, and over the sequences that have any."""

    valid_BT: Tensor
    n_tok_B: Tensor
    has_tok_B: Tensor
    n_tok: Tensor
    n_seq: Tensor

    @staticmethod
    def of(valid_BT: Tensor, n_tok_B: Tensor) -> _Rows:
        has_tok_B = n_tok_B > 0
        n_seq = has_tok_B.sum().clamp(min=1).to(n_tok_B.dtype)
        return _Rows(valid_BT, n_tok_B, has_tok_B, n_tok_B.sum().clamp(min=1), n_seq)

    def seq_mean(self, x_B: Tensor) -> Tensor:
        return torch.where(self.has_tok_B, x_B, torch.zeros_like(x_B)).sum() / self.n_seq

    def tok_frac(self, bad_BT: Tensor) -> tuple[Tensor, Tensor]:
        """(share of tokens, each sequence's share averaged over sequences)"""
        bad_BT = (bad_BT & self.valid_BT).to(self.n_tok_B.dtype)
        return bad_BT.sum() / self.n_tok, self.seq_mean(bad_BT.sum(-1) / self.n_tok_B.clamp(min=1))

    def seq_frac(self, bad_B: Tensor) -> tuple[Tensor, Tensor]:
        """(share of sequences, share of the tokens in them)"""
        bad_B = (bad_B & self.has_tok_B).to(self.n_tok_B.dtype)
        return bad_B.sum() / self.n_seq, (bad_B * self.n_tok_B).sum() / self.n_tok


def _estimators(
    d_BT: Tensor,
    l_B: Tensor,
    n_tok_B: Tensor,
    valid_BT: Tensor,
    has_tok_B: Tensor,
    k1_seq: Tensor,
    n_tok: Tensor,
) -> dict[str, Tensor]:
    """KL estimates and ratio ranges of :func:`mismatch_metrics` (``estimators``)."""
    l_clamped_B = l_B.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    n_seq = has_tok_B.sum().clamp(min=1).to(n_tok_B.dtype)
    k3_B = torch.expm1(l_clamped_B) - l_clamped_B
    out = {
        "mismatch_k1_tok": -d_BT.sum() / n_tok,
        "mismatch_k3_tok": k3_kl(d_BT, n_tok_B),
        "mismatch_k1_seq": k1_seq,
        "mismatch_k3_seq": torch.where(has_tok_B, k3_B, torch.zeros_like(k3_B)).sum() / n_seq,
    }
    tok = ratio_stats("r", torch.exp(d_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)), valid_BT)
    out["mismatch_ratio_tok_min"], out["mismatch_ratio_tok_max"] = tok["r_min"], tok["r_max"]
    seq = ratio_stats("r", torch.exp(l_clamped_B), has_tok_B)
    out["mismatch_ratio_seq"] = seq["r_mean"]
    out["mismatch_ratio_seq_min"], out["mismatch_ratio_seq_max"] = seq["r_min"], seq["r_max"]
    return out


# ----------------------------------------------------------------------------------------------
# off-policy sequence masking (OPSM, DeepSeek-V3.2 technical report)


def off_policy_sequence_mask(
    logp: Tensor, sampler_logp: Tensor, advantages: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """OPSM: drop the sequences that are both bad (A_i < 0) and far off-policy -> keep ``[B]`` 0/1.

    D_i = (1/|y_i|) sum_t (sampler_logp_it - sg(logp_it)), the mean per-token log-ratio of the policy
    that sampled y_i (pi_sampler: the rollout engine, an older policy under async rollouts) against the
    current one, pi_theta, on response tokens only (a k1 estimate of KL(pi_sampler || pi_theta) per
    token). keep_i = 0 iff A_i < 0 and D_i > threshold. Detached, NaN-free (padding is zeroed first;
    rows without tokens have D_i = 0 and are kept). Unlike :func:`sequence_mask` it compares with
    pi_theta (it moves during the update: each micro-batch decides with its own training forward), so
    it sees both the sampler mismatch and the policy's drift since sampling. Pass it as the loss's
    ``weight`` (dropped sequences still count in the normalizer), e.g. through :func:`with_opsm`.
    """
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"OPSM threshold must be a finite number >= 0, got {threshold!r}")
    d_BT, D_B, n_tok_B = _mismatch(sampler_logp, logp, mask)
    adv_B = torch.where(n_tok_B > 0, advantages.detach().to(d_BT.dtype), torch.zeros_like(D_B))
    return (~((adv_B < 0) & (D_B > threshold))).to(d_BT.dtype)


def with_opsm(
    weight: Tensor | None,
    logp: Tensor,
    sampler_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    threshold: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """A loss's ``weight`` (None, ``[B]`` or ``[B, T]``) times the OPSM keep mask, and its metrics:
    ``opsm_frac_seq`` / ``opsm_frac_tok`` (share of sequences dropped, and of the tokens in them)."""
    keep_B = off_policy_sequence_mask(logp, sampler_logp, advantages, mask, threshold)
    n_tok_B = mask.detach().to(keep_B.dtype).sum(-1)
    dropped_B = (1 - keep_B) * (n_tok_B > 0)
    metrics = {
        "opsm_frac_seq": dropped_B.sum() / (n_tok_B > 0).sum().clamp(min=1),
        "opsm_frac_tok": (dropped_B * n_tok_B).sum() / n_tok_B.sum().clamp(min=1),
    }
    return _times_keep(weight, keep_B), metrics


def with_random_drop(
    weight: Tensor | None, u_B: Tensor, mask: Tensor, p: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """A loss's ``weight`` (None, ``[B]`` or ``[B, T]``) with each sequence whose uniform draw
    ``u_B`` is below ``p`` dropped, whatever its ratio or advantage: an ablation that drops the share
    of sequences GSPO's clip drops, but at random (docs/stability). Metric: ``random_drop_frac_seq``."""
    has_B = mask.detach().sum(-1) > 0
    keep_B = (u_B >= p).to(mask.dtype)
    dropped = ((1 - keep_B) * has_B).sum() / has_B.sum().clamp(min=1)
    return _times_keep(weight, keep_B), {"random_drop_frac_seq": dropped}


def _times_keep(weight: Tensor | None, keep_B: Tensor) -> Tensor:
    if weight is None:
        return keep_B
    w = weight.detach()
    return w * (keep_B if w.dim() == 1 else keep_B[:, None]).to(w.dtype)


# ----------------------------------------------------------------------------------------------
# registry: one entry per ``mismatch_correction`` setting

#: (old_logp, sampler_logp, mask, *, cap, lo, hi) -> (the loss's ``weight`` or None, the loss's
#: ``mask``, :func:`mismatch_metrics` for that correction, ``abs_diff`` included)
CorrectionFn = Callable[..., tuple[Tensor | None, Tensor, dict[str, Tensor]]]


def abs_logp_diff(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """:func:`mismatch_metrics`'s ``abs_diff`` alone: what the trainer logs of the mismatch where no
    correction reports it."""
    return _abs_diff(*_mismatch(old_logp, sampler_logp, mask))


def _no_correction(
    old: Tensor, sampler: Tensor, mask: Tensor, *, cap: float, lo: float, hi: float
) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    return None, mask, abs_logp_diff(old, sampler, mask)


def _seq_tis(
    old: Tensor, sampler: Tensor, mask: Tensor, *, cap: float, lo: float, hi: float
) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    weight_B = sequence_tis_weights(old, sampler, mask, cap)
    return weight_B, mask, mismatch_metrics(old, sampler, mask, abs_diff=True, tis_cap=cap)


def _seq_mask(
    old: Tensor, sampler: Tensor, mask: Tensor, *, cap: float, lo: float, hi: float
) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    keep_B = sequence_mask(old, sampler, mask, lo, hi)
    return keep_B, mask, mismatch_metrics(old, sampler, mask, abs_diff=True, seq_bounds=(lo, hi))


def _token_mask(
    old: Tensor, sampler: Tensor, mask: Tensor, *, cap: float, lo: float, hi: float
) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    # IcePop: masked tokens leave the loss as padding does (denominators included)
    loss_mask_BT = mask * token_mask(old, sampler, mask, lo, hi).to(mask.dtype)
    return None, loss_mask_BT, mismatch_metrics(old, sampler, mask, abs_diff=True, token_bounds=(lo, hi))


#: name -> correction (the values of ``Config.mismatch_correction``): ``cap`` is the TIS truncation,
#: ``[lo, hi]`` the band of kept ratios; each entry reads only what it needs.
CORRECTIONS: dict[str, CorrectionFn] = {
    "none": _no_correction,
    "seq_tis": _seq_tis,
    "seq_mask": _seq_mask,
    "token_mask": _token_mask,
}
