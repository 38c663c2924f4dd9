"""Policy-gradient losses: GSPO, GSPO-token, the GRPO baseline (and GRPO under GSPO's sequence mask),
SAPO, CISPO, GMPO, LUSPO and VESPO; DPPO, Clip-Cov and KL-Cov live in :mod:`gspo.losses_trust` and
are registered here too.

All functions are pure tensor-in/tensor-out: no config objects, no ``.item()`` host syncs and no
distributed calls. Shapes: ``B`` sequences, ``T`` response positions (padded). ``mask_BT`` is 1 on
response tokens and 0 on padding / prompt positions. Each loss takes :class:`LossInputs` (built by
:func:`loss_inputs`: the rows, advantages, normalizer and weight, with the compute dtype, token counts
and masked log-ratio every loss starts from) and its own parameters, and returns a
:class:`LossOutput`: ``loss``, a scalar to *minimize*, and ``metrics``, names -> detached 0-dim
tensors. :data:`LOSSES` holds each loss as a :class:`LossSpec` (its function, its parameters'
defaults, its aggregation, its kind of ratio); calling a spec fills in the defaults::

    out = LOSSES["gspo"](loss_inputs(logp_BT, old_logp_BT, mask_BT, adv_B))  # the paper's eps
    out = gspo_loss(loss_inputs(logp_BT, old_logp_BT, mask_BT, adv_B), eps_low=3e-4, eps_high=4e-4)

Normalization is explicit: ``normalizer`` is the number of sequences (GSPO, GSPO-token, SAPO, GMPO,
LUSPO, and the ``"seq_mean_token_mean"`` aggregation of GRPO, SAPO-token, CISPO and VESPO) or tokens
(their ``"token_mean"`` aggregation) that the *whole* optimizer step averages over. Passing the global count
lets gradient accumulation and data-parallel ranks sum their gradients into exactly the update a
single process would make on the full batch.

``weight`` (every loss, optional): a stop-gradient multiplier of each sequence's contribution, ``[B]``
(e.g. truncated importance-sampling weights or a 0/1 sequence mask from :mod:`gspo.correction`);
losses that aggregate over tokens also take ``[B, T]`` (one factor per token, applied before the
per-sequence / per-batch mean, so the denominators ``|y_i|`` and ``normalizer`` do not change).
``weight=None`` is exactly the unweighted loss. Metrics ignore ``weight``.

Metric keys (so that micro-batch values can be combined without knowing the loss): ``*_min`` /
``*_max`` are minima / maxima; ``clip_frac_tok*``, ``gate_tok_mean``, ``cov_frac_tok`` and ``approx_kl``
are averages over tokens; ``ratio_mean`` is an average over tokens exactly when the loss also returns
``seq_ratio_mean`` (its ``ratio_*`` are then token ratios; GRPO, SAPO-token, CISPO, GMPO); every other
key is an average over the sequences that have at least one response token (``cov_threshold``, a
number of the whole call, is combined over micro-batches the same way).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from gspo.loss_prologue import (
    MAX_LOG_RATIO,
    LossInputs,
    LossOutput,
    check_aggregation,
    clip_masks,
    k3_kl,
    log_ratio_limit,
    ratio_stats,
    sequence_clip_metrics,
    sequence_mean,
    token_clip_metrics,
    token_ratio_metrics,
    with_totals,
)
from gspo.losses_trust import clip_cov_loss, dppo_kl_loss, dppo_tv_loss, kl_cov_loss

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------------------
# GSPO (arXiv 2507.18071) and the GRPO baseline


def unused_token_ratio_extremes(inp: LossInputs) -> dict[str, Tensor]:
    """``tok_ratio_min`` / ``tok_ratio_max``: the token ratios a sequence-ratio loss does not use, so
    that their spread can be set beside a token-ratio loss's (GRPO's ``ratio_*``)."""
    tok_r_BT = torch.exp(inp.log_r_BT.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    tok = ratio_stats("tok_ratio", tok_r_BT, inp.valid_BT)
    return {k: tok[k] for k in ("tok_ratio_min", "tok_ratio_max")}


def gspo_loss(inp: LossInputs, *, eps_low: float, eps_high: float) -> LossOutput:
    """GSPO sequence-level clipped objective (arXiv 2507.18071, eq. 5-7).

    s_i = exp(mean_t(logp_it - old_logp_it)) over response tokens;
    loss = -(1/N) sum_i w_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i), N = B by default.

    ``inp``: ``[B]`` sequence advantages, an optional ``[B]`` weight (TIS weight, 0/1 mask).
    """
    obj_B, metrics = _clipped_sequence_objective(inp, eps_low, eps_high)
    return LossOutput(inp.sequence_loss(inp.weigh_sequences(obj_B)), metrics)


def _clipped_sequence_objective(
    inp: LossInputs, eps_low: float, eps_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO's per-sequence objective min(s_i A_i, clip(s_i) A_i) ``[B]`` and its metrics (GSPO, LUSPO)."""
    adv_B = inp.seq_advantages()
    log_s_B = sequence_mean(inp.log_r_BT, inp.n_tok_B).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    s_B = torch.exp(log_s_B)
    # rows without tokens have s = 1 and A = 0, so their objective is exactly 0
    obj_B = torch.minimum(s_B * adv_B, s_B.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_B)
    metrics = sequence_clip_metrics(inp, s_B, adv_B, eps_low, eps_high)
    metrics["approx_kl"] = k3_kl(inp.log_r_BT.detach(), inp.n_tok_B)
    metrics.update(unused_token_ratio_extremes(inp))
    return obj_B, metrics


def luspo_loss(inp: LossInputs, *, eps_low: float, eps_high: float) -> LossOutput:
    """LUSPO (Length-Unbiased Sequence Policy Optimization, arXiv 2602.05261): GSPO's clipped sequence
    objective, each sequence's term scaled by its length |y_i|:

        loss = -(1/N) sum_i w_i |y_i| min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i),  N = B by default.

    GSPO's gradient of a sequence is A_i s_i (1/|y_i|) sum_t d logp_it: the 1/|y_i| makes a long
    response's tokens weigh less than a short one's. Scaling by |y_i| cancels it, d loss / d logp_it =
    -(1/N) w_i A_i s_i on every unclipped token (0 on clipped ones): every token of the batch weighs the
    same, as in a token-sum. The ratio s_i and its clip stay GSPO's (length-normalized). The length
    is the token count of the row's own mask (``mask`` elementwise): padding never counts, whatever T.

    ``eps_low``, ``eps_high``: the sequence ratio's clip range (paper section 5.1: 2e-3 / 2.5e-3).
    ``inp``: ``[B]`` sequence advantages, an optional ``[B]`` weight.

    Metrics: GSPO's (clip fractions, ``ratio_*`` of s_i, ``approx_kl``, ``tok_ratio_min/max``).
    """
    obj_B, metrics = _clipped_sequence_objective(inp, eps_low, eps_high)
    return LossOutput(inp.sequence_loss(inp.weigh_sequences(obj_B * inp.n_tok_B)), metrics)


def gspo_token_loss(inp: LossInputs, *, eps_low: float, eps_high: float) -> LossOutput:
    """GSPO-token (paper eq. 13-14): per-token advantages, sequence-level ratio value.

    s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]: numerically s_i, but its gradient flows
    through each token's own log-prob. loss = -(1/N) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it).
    Equal to :func:`gspo_loss` in value and gradient when ``A_it = A_i``.

    ``inp``: ``[B, T]`` per-token advantages (a ``[B]`` tensor is broadcast over tokens), an optional
    ``[B]`` or ``[B, T]`` weight (see the module docstring).
    """
    adv_BT = inp.token_advantages()
    log_r_BT = inp.log_r_BT.detach()  # the ratio's value and the KL metric
    raw_log_s_B = sequence_mean(log_r_BT, inp.n_tok_B)
    log_s_B = raw_log_s_B.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    # the clamps pass no gradient outside [-MAX, MAX] (sequence) or +-lim (token, see
    # gspo.loss_prologue.loss_inputs); mirror that so GSPO-token == GSPO there too
    in_range_B = (raw_log_s_B >= -MAX_LOG_RATIO) & (raw_log_s_B <= MAX_LOG_RATIO)
    tok_ok_BT = (inp.logp_BT.detach() - inp.old_logp_BT).abs() <= log_ratio_limit(inp.logp_BT)
    grad_BT = inp.valid_BT & in_range_B[:, None] & tok_ok_BT
    safe_logp_BT = torch.where(grad_BT, inp.logp_BT, torch.zeros_like(inp.logp_BT))
    # value: exactly s_i on every token (x - sg[x] == 0, whereas (log_s + x) - x rounds at the scale
    # of |x|: ~1e-6 in float32 for logp ~ -20); gradient: s_i * d logp_it
    log_s_BT = log_s_B[:, None] + (safe_logp_BT - safe_logp_BT.detach())
    s_BT = torch.exp(log_s_BT)
    obj_BT = torch.minimum(s_BT * adv_BT, s_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_BT)
    obj_BT = inp.weigh_tokens(obj_BT)
    loss = inp.token_loss(obj_BT * inp.mask_BT, "seq_mean_token_mean")

    low_BT, high_BT = clip_masks(s_BT.detach(), adv_BT, eps_low, eps_high)
    n_tok = inp.mask_BT.sum().clamp(min=1)
    # a sequence counts as clipped when the majority of its tokens are (with A_it = A_i: all or none)
    low_B = (low_BT & inp.valid_BT).sum(-1) * 2 > inp.n_tok_B
    high_B = (high_BT & inp.valid_BT).sum(-1) * 2 > inp.n_tok_B
    n_seq = inp.has_tok_B.sum().clamp(min=1).to(inp.dtype)
    metrics = with_totals(
        {
            "clip_frac_tok_low": (low_BT & inp.valid_BT).sum() / n_tok,
            "clip_frac_tok_high": (high_BT & inp.valid_BT).sum() / n_tok,
            "clip_frac_seq_low": (low_B & inp.has_tok_B).sum() / n_seq,
            "clip_frac_seq_high": (high_B & inp.has_tok_B).sum() / n_seq,
        }
    )
    metrics.update(ratio_stats("ratio", torch.exp(log_s_B.detach()), inp.has_tok_B))
    metrics["approx_kl"] = k3_kl(log_r_BT, inp.n_tok_B)
    metrics.update(unused_token_ratio_extremes(inp))
    return LossOutput(loss, metrics)


def grpo_loss(inp: LossInputs, *, eps_low: float, eps_high: float, aggregation: str) -> LossOutput:
    """GRPO baseline: per-token ratio w_it = pi_theta/pi_old with per-token clipping.

    aggregation:
        ``"seq_mean_token_mean"`` (GRPO paper): per-sequence token mean, then sum over sequences / N,
        N = B by default.
        ``"token_mean"`` (DAPO): sum over all tokens / N, N = number of response tokens by default.

    ``inp``: ``[B]`` or ``[B, T]`` advantages, an optional ``[B]`` or ``[B, T]`` weight, e.g.
    IcePop's token weights (M(k) = k inside its band of token ratios, else 0).
    """
    check_aggregation(aggregation)
    adv_BT = inp.token_advantages()
    w_BT = torch.exp(inp.log_r_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    obj_BT = torch.minimum(w_BT * adv_BT, w_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_BT) * inp.mask_BT
    loss = inp.token_loss(inp.weigh_tokens(obj_BT), aggregation)
    metrics = token_clip_metrics(inp, *clip_masks(w_BT.detach(), adv_BT, eps_low, eps_high))
    metrics.update(token_ratio_metrics(inp))
    return LossOutput(loss, metrics)


def grpo_seq_mask_loss(inp: LossInputs, *, eps_low: float, eps_high: float, aggregation: str) -> LossOutput:
    """GRPO's token ratios under GSPO's sequence-level mask: an ablation that separates the two things
    GSPO changes (issue 46). Each token keeps its own unclipped ratio w_it = pi_theta/pi_old, as in
    GRPO; a sequence is dropped whole exactly where GSPO's clip would zero its gradient, i.e. where its
    sequence ratio s_i leaves [1 - eps_low, 1 + eps_high] on the side its advantage pushes to
    (s_i > 1 + eps_high with A_i > 0, s_i < 1 - eps_low with A_i < 0):

        loss = -agg_{i,t} m_i w_it A_i,   m_i = 0 on those sequences, 1 elsewhere.

    Defaults: GSPO's range (3e-4 / 4e-4) and GRPO's aggregation. ``inp``: ``[B]`` sequence advantages,
    an optional ``[B]`` or ``[B, T]`` weight. Metrics: GRPO's token ratio metrics (``ratio_*`` of
    w_it, ``seq_ratio_*`` of s_i, ``approx_kl``) and the fractions of sequences (and of their tokens)
    dropped, as ``clip_frac_*``.
    """
    check_aggregation(aggregation)
    adv_B = inp.seq_advantages()
    log_w_BT = inp.log_r_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    s_B = torch.exp(sequence_mean(inp.log_r_BT.detach(), inp.n_tok_B).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    low_B, high_B = clip_masks(s_B, adv_B, eps_low, eps_high)
    keep_B = ~(low_B | high_B)
    obj_BT = torch.exp(log_w_BT) * (adv_B * keep_B)[:, None] * inp.mask_BT
    loss = inp.token_loss(inp.weigh_tokens(obj_BT), aggregation)
    metrics = sequence_clip_metrics(inp, s_B, adv_B, eps_low, eps_high)
    metrics.update(token_ratio_metrics(inp))  # ratio_* of the token ratios the loss uses
    return LossOutput(loss, metrics)


# ----------------------------------------------------------------------------------------------
# SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347)


def _check_temperatures(tau_neg: float, tau_pos: float) -> None:
    if not (tau_neg > 0 and tau_pos > 0):
        raise ValueError(f"SAPO temperatures must be > 0, got tau_neg={tau_neg!r}, tau_pos={tau_pos!r}")


def _temperature(adv: Tensor, tau_neg: float, tau_pos: float) -> Tensor:
    """tau_pos where A > 0, tau_neg elsewhere (A = 0 contributes 0 whichever is used)."""
    return torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))


def _soft_gate(log_r: Tensor, tau: Tensor) -> Tensor:
    """f(r) = (4/tau) sigmoid(tau (r - 1)) from log r, so df/d log r = 4 sigmoid(x) sigmoid(-x) r.

    x = tau * (exp(log r) - 1), not expm1 (whose autograd slope expm1 + 1 loses the relative precision
    of small r). For x > 0 it is written (4/tau) (1 - sigmoid(-x)): the autograd slope
    sigmoid(.) (1 - sigmoid(.)) is then taken of the small sigmoid, so the gradient keeps its relative
    precision where the gate has decayed (x >= -tau, so the other tail is never deep).
    """
    x = tau * (torch.exp(log_r) - 1.0)
    c = 4.0 / tau
    return torch.where(x > 0, c - c * torch.sigmoid(-x), c * torch.sigmoid(x))


def _gate_slope(log_r: Tensor, tau: Tensor) -> Tensor:
    """g = 4 sigmoid(x) sigmoid(-x) in (0, 1]: SAPO's gradient relative to the unclipped one (1 at r = 1)."""
    x = tau * (torch.exp(log_r) - 1.0)
    return 4.0 * torch.sigmoid(x) * torch.sigmoid(-x)


def _gate_metrics(inp: LossInputs, g_BT: Tensor) -> dict[str, Tensor]:
    """Mean of the gate g over tokens and over sequences (of each sequence's token mean), and its minimum."""
    valid_BT = inp.valid_BT
    g_BT = torch.where(valid_BT, g_BT.detach(), torch.zeros_like(g_BT))
    n_seq = inp.has_tok_B.sum().clamp(min=1).to(inp.n_tok_B.dtype)
    one = torch.ones((), dtype=g_BT.dtype, device=g_BT.device)
    return {
        "gate_tok_mean": g_BT.sum() / inp.n_tok_B.sum().clamp(min=1),
        "gate_seq_mean": (g_BT.sum(-1) / inp.n_tok_B.clamp(min=1)).sum() / n_seq,
        "gate_min": torch.where(valid_BT.any(), torch.where(valid_BT, g_BT, one).amin(), one),
    }


def sapo_loss(inp: LossInputs, *, tau_neg: float, tau_pos: float) -> LossOutput:
    """SAPO's soft gate applied to GSPO's sequence ratio (sequence-level SAPO).

    SAPO (arXiv 2511.20347) replaces the hard clip by f(r) = (4/tau) sigmoid(tau (r - 1)) and maximizes
    f(r) A; tau = tau_pos for A > 0 and tau_neg for A < 0 (tau_neg > tau_pos damps negative updates
    faster). Here r is the GSPO sequence ratio s_i = exp(mean_t(logp_it - old_logp_it)):

        loss = -(1/N) sum_i w_i f(s_i) A_i,  N = B by default (sequences).

    d loss / d logp_it = -(1/N) w_i A_i g_i s_i / |y_i| with the gate g_i = 4 sigmoid(x_i) sigmoid(-x_i),
    x_i = tau (s_i - 1): g = 1 at s_i = 1, so on-policy the gradient is GSPO's (and the plain
    sequence-level policy gradient); it decays smoothly instead of stopping at a clip edge. The value
    at s = 1 is (2/tau) A, not A (the paper's f). The paper's own form is token-level:
    :func:`sapo_token_loss`.

    ``tau_neg``, ``tau_pos``: the temperatures for A < 0 and A > 0 (paper: 1.05, 1.0).
    ``inp``: ``[B]`` sequence advantages, an optional ``[B]`` weight.

    Metrics: ``gate_seq_mean`` / ``gate_tok_mean`` (g over sequences / weighted by tokens), ``gate_min``;
    ``ratio_*`` of s_i; ``approx_kl``.
    """
    _check_temperatures(tau_neg, tau_pos)
    adv_B = inp.seq_advantages()
    log_s_B = sequence_mean(inp.log_r_BT, inp.n_tok_B).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    tau_B = _temperature(adv_B, tau_neg, tau_pos)
    obj_B = _soft_gate(log_s_B, tau_B) * adv_B  # rows without tokens: A = 0
    loss = inp.sequence_loss(inp.weigh_sequences(obj_B))

    log_s_B = log_s_B.detach()
    metrics = _gate_metrics(inp, _gate_slope(log_s_B, tau_B)[:, None].expand(inp.valid_BT.shape))
    metrics.update(ratio_stats("ratio", torch.exp(log_s_B), inp.has_tok_B))
    metrics["approx_kl"] = k3_kl(inp.log_r_BT.detach(), inp.n_tok_B)
    return LossOutput(loss, metrics)


def sapo_token_loss(inp: LossInputs, *, tau_neg: float, tau_pos: float, aggregation: str) -> LossOutput:
    """SAPO as published (arXiv 2511.20347): the soft gate on token ratios.

    r_it = exp(logp_it - old_logp_it), f(r) = (4/tau) sigmoid(tau (r - 1)), tau = tau_pos if A_it > 0
    else tau_neg; objective per token f(r_it) A_it, aggregated like :func:`grpo_loss`:

        ``"seq_mean_token_mean"`` (the paper, default): -(1/N) sum_i (1/|y_i|) sum_t w_it f(r_it) A_it,
        N = B by default; ``"token_mean"``: -(1/N) sum_it w_it f(r_it) A_it, N = tokens by default.

    d loss / d logp_it = -(1/N) w_it A_it g_it r_it / |y_i| (``/ N`` for token_mean), g = 4 sigmoid(x)
    sigmoid(-x), x = tau (r - 1); on-policy g = r = 1, the plain token-level policy gradient (GRPO's).

    ``tau_neg``, ``tau_pos``: the temperatures for A < 0 and A > 0 (paper: 1.05, 1.0).
    ``inp``: ``[B]`` or ``[B, T]`` advantages, an optional ``[B]`` or ``[B, T]`` weight.

    Metrics: ``gate_tok_mean`` / ``gate_seq_mean`` (g over tokens / per-sequence token mean over
    sequences), ``gate_min``; ``ratio_*`` (tokens), ``seq_ratio_*``, ``approx_kl``.
    """
    check_aggregation(aggregation)
    _check_temperatures(tau_neg, tau_pos)
    adv_BT = inp.token_advantages()
    log_w_BT = inp.log_r_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    tau_BT = _temperature(adv_BT, tau_neg, tau_pos)
    obj_BT = _soft_gate(log_w_BT, tau_BT) * adv_BT * inp.mask_BT
    loss = inp.token_loss(inp.weigh_tokens(obj_BT), aggregation)

    metrics = _gate_metrics(inp, _gate_slope(log_w_BT.detach(), tau_BT))
    metrics.update(token_ratio_metrics(inp))
    return LossOutput(loss, metrics)


# ----------------------------------------------------------------------------------------------
# CISPO (MiniMax-M1, arXiv 2506.13585)


def cispo_loss(inp: LossInputs, *, eps_low: float, eps_high: float, aggregation: str) -> LossOutput:
    """CISPO: REINFORCE on every token, weighted by the stop-gradient clipped IS ratio.

    MiniMax-M1 (arXiv 2506.13585, eq. 4-5): J = 1/(sum_i |y_i|) sum_i sum_t sg(r^_it) A_it
    log pi_theta(y_it), r^_it = clip(r_it, 1 - eps_low, 1 + eps_high), r_it = pi_theta / pi_old. Unlike
    PPO/GRPO no token loses its gradient: clipping only bounds its weight. This function returns the
    surrogate with the same gradient whose *value* is the clipped-IS estimate of the objective,

        ``"token_mean"`` (the paper, default): loss = -(1/N) sum_it w_it r^_it A_it, N = tokens by default;
        ``"seq_mean_token_mean"``: -(1/N) sum_i (1/|y_i|) sum_t w_it r^_it A_it, N = B by default,

    (sg(r^) A * (1 + logp - sg(logp)) instead of sg(r^) A * logp: the value does not depend on the size
    of log pi and cannot overflow). d loss / d logp_it = -(1/N) w_it r^_it A_it (``/ (N |y_i|)`` for
    seq_mean_token_mean); on-policy r^ = 1: token-mean REINFORCE, equal to GRPO's on-policy gradient.

    ``eps_low``: lower IS-weight clip 1 - eps_low. Default 1.0, i.e. no lower bound (the paper sets
    eps_low^IS "to a large value" and only tunes the upper one). ``eps_high``: upper IS-weight clip
    1 + eps_high. The paper does not state its eps_high^IS; the default 0.28 is DAPO's clip-higher
    value, as in open re-implementations (e.g. Trinity-RFT); Tinker's CISPO caps the weight much
    higher, at 4 (eps_high = 3). ``inp``: ``[B]`` or ``[B, T]`` advantages, an optional ``[B]`` or
    ``[B, T]`` weight.

    Metrics: ``clip_frac_tok_low`` / ``_high``: tokens whose IS weight was raised to the floor / capped
    at the ceiling (whatever the sign of A; their gradient is kept), per token and (``clip_frac_seq_*``)
    per sequence; ``ratio_*`` (tokens), ``seq_ratio_*``, ``approx_kl``.
    """
    check_aggregation(aggregation)
    adv_BT = inp.token_advantages()
    r_BT = torch.exp(inp.log_r_BT.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # the weight is a constant
    w_hat_BT = r_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    safe_logp_BT = torch.where(inp.valid_BT, inp.logp_BT, torch.zeros_like(inp.logp_BT))
    unit_BT = 1.0 + (safe_logp_BT - safe_logp_BT.detach())  # exactly 1, d/d logp = 1
    obj_BT = w_hat_BT * adv_BT * unit_BT * inp.mask_BT
    loss = inp.token_loss(inp.weigh_tokens(obj_BT), aggregation)

    metrics = token_clip_metrics(inp, r_BT < 1.0 - eps_low, r_BT > 1.0 + eps_high)
    metrics.update(token_ratio_metrics(inp))
    return LossOutput(loss, metrics)


# ----------------------------------------------------------------------------------------------
# GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673)


def gmpo_loss(inp: LossInputs, *, eps_low: float, eps_high: float) -> LossOutput:
    """GMPO: the geometric mean of token-wise clipped token ratios times the sequence advantage.

    arXiv 2507.20673: J = (1/G) sum_i { prod_t |min(r_it A_i, clip(r_it, e^-eps_low, e^eps_high) A_i)| }
    ^(1/|y_i|) sgn(A_i). In log space, with l_it = logp_it - old_logp_it:

        c_it = min(l_it, eps_high) if A_i > 0,  max(l_it, -eps_low) if A_i < 0  (PPO's pessimistic side),
        loss = -(1/N) sum_i w_i A_i exp(mean_t c_it),  N = B by default (sequences).

    d loss / d logp_it = -(1/N) w_i A_i S_i / |y_i| on tokens that are not clipped (0 on clipped ones),
    S_i = exp(mean_t c_it). On-policy S_i = 1: GSPO's value and gradient. Without active clipping
    S_i = s_i, GSPO's sequence ratio: GMPO differs from GSPO only in clipping tokens (in log space)
    instead of the sequence ratio.

    ``eps_low``, ``eps_high``: log-space token clip range, r_it in [e^-eps_low, e^eps_high] (paper
    default (e^-0.4, e^0.4)). ``inp``: ``[B]`` sequence advantages, an optional ``[B]`` weight.

    Metrics: token clip fractions as in GRPO (``clip_frac_tok_high``: A > 0 and l > eps_high;
    ``_low``: A < 0 and l < -eps_low), per token and per sequence; ``ratio_*`` (tokens),
    ``seq_ratio_*`` (s_i, unclipped), ``approx_kl``.
    """
    adv_B = inp.seq_advantages()
    log_r_det_BT = inp.log_r_BT.detach()
    high_BT = (adv_B > 0)[:, None] & (log_r_det_BT > eps_high) & inp.valid_BT
    low_BT = (adv_B < 0)[:, None] & (log_r_det_BT < -eps_low) & inp.valid_BT
    # the clip bound replaces l where it is the pessimistic side; there is no gradient then
    c_BT = torch.where(high_BT, eps_high, torch.where(low_BT, -eps_low, inp.log_r_BT))
    log_S_B = sequence_mean(c_BT, inp.n_tok_B).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    obj_B = adv_B * torch.exp(log_S_B)  # rows without tokens: A = 0
    loss = inp.sequence_loss(inp.weigh_sequences(obj_B))

    metrics = token_clip_metrics(inp, low_BT, high_BT)
    metrics.update(token_ratio_metrics(inp))
    return LossOutput(loss, metrics)


# ----------------------------------------------------------------------------------------------
# VESPO (Variational Sequence-level Soft Policy Optimization, arXiv 2602.10693)

#: VESPO's floor of the sequence log-ratio, log(1e-8) (as the published code): the kernel is then
#: ~e^(lambda - 18.4 k), 0 for every practical purpose
VESPO_MIN_LOG_W = math.log(1e-8)


def check_vespo_shape(k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float) -> None:
    """The kernel W^k e^(lambda (1 - W)) needs k >= 0 and lambda > 0 (else it grows without bound)."""
    for name, v in (("k_pos", k_pos), ("k_neg", k_neg)):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"VESPO {name} must be a finite number >= 0, got {v!r}")
    for name, v in (("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"VESPO {name} must be a finite number > 0, got {v!r}")


def vespo_kernel(
    log_w_B: Tensor, adv_B: Tensor, k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float
) -> Tensor:
    """phi(W) = W^k e^(lambda (1 - W)) from log W (already clamped), (k, lambda) by the sign of A
    (A >= 0: the ``_pos`` pair). phi(1) = 1; computed in log space, lambda + k log W - lambda W."""
    nonneg_B = adv_B >= 0
    full = lambda v: torch.full_like(log_w_B, v)  # noqa: E731  (in log W's dtype: no float32 rounding of k)
    k_B = torch.where(nonneg_B, full(k_pos), full(k_neg))
    lam_B = torch.where(nonneg_B, full(lambda_pos), full(lambda_neg))
    return torch.exp(lam_B + k_B * log_w_B - lam_B * torch.exp(log_w_B))


def vespo_loss(
    inp: LossInputs, *, k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float, aggregation: str
) -> LossOutput:
    """VESPO: REINFORCE on every token, each sequence's gradient scaled by a smooth kernel of its
    *unnormalized* sequence ratio (no clip, no 1/|y_i| inside the ratio).

    W_i = pi_theta(y_i) / pi_old(y_i) = exp(sum_t (logp_it - old_logp_it)) (token log-ratios clamped
    to +-20, log W_i to [log 1e-8, 20]), phi_i = sg(W_i^k e^(lambda (1 - W_i))), (k, lambda) =
    (k_pos, lambda_pos) for A_i >= 0 else (k_neg, lambda_neg). phi(1) = 1 and phi peaks at W = k/lambda,
    so on-policy this is the plain policy gradient and far-off-policy sequences fade smoothly. The
    surrogate's value is the weighted advantage (as :func:`cispo_loss`: sg(phi) A (1 + logp - sg(logp))):

        ``"token_mean"`` (default, as TRL): loss = -(1/N) sum_it w_it phi_i A_i, N = tokens by default;
        ``"seq_mean_token_mean"``: -(1/N) sum_i (1/|y_i|) sum_t w_it phi_i A_i, N = B by default.

    d loss / d logp_it = -(1/N) w_it phi_i A_i (``/ (N |y_i|)`` for seq_mean_token_mean).

    ``k_pos``, ``lambda_pos``, ``k_neg``, ``lambda_neg``: the kernel's power and decay for A >= 0 /
    A < 0 (the paper's c1, c2; defaults 2, 3, 3, 2 as TRL); VESPO has no clip range. ``inp``: ``[B]``
    sequence advantages, an optional ``[B]`` or ``[B, T]`` weight.

    Metrics: ``gate_*`` are phi (the gradient relative to plain REINFORCE: ``gate_seq_mean`` over
    sequences, ``gate_tok_mean`` weighted by tokens, ``gate_min``); ``ratio_*`` of W_i; ``approx_kl``;
    ``tok_ratio_min/max``.
    """
    check_aggregation(aggregation)
    check_vespo_shape(k_pos, lambda_pos, k_neg, lambda_neg)
    adv_B = inp.seq_advantages()
    log_r_BT = inp.log_r_BT.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # 0 on padding
    log_w_B = log_r_BT.sum(-1).clamp(VESPO_MIN_LOG_W, MAX_LOG_RATIO)
    phi_B = vespo_kernel(log_w_B, adv_B, k_pos, lambda_pos, k_neg, lambda_neg)
    safe_logp_BT = torch.where(inp.valid_BT, inp.logp_BT, torch.zeros_like(inp.logp_BT))
    unit_BT = 1.0 + (safe_logp_BT - safe_logp_BT.detach())  # exactly 1, d/d logp = 1
    obj_BT = (phi_B * adv_B)[:, None] * unit_BT * inp.mask_BT
    loss = inp.token_loss(inp.weigh_tokens(obj_BT), aggregation)

    metrics = _gate_metrics(inp, phi_B[:, None].expand(inp.valid_BT.shape))
    metrics.update(ratio_stats("ratio", torch.exp(log_w_B), inp.has_tok_B))
    metrics["approx_kl"] = k3_kl(inp.log_r_BT.detach(), inp.n_tok_B)
    metrics.update(unused_token_ratio_extremes(inp))
    return LossOutput(loss, metrics)


# ----------------------------------------------------------------------------------------------
# the registry: every fact about a loss in one record

LossFn = Callable[..., LossOutput]


@dataclass(frozen=True)
class LossSpec:
    """One loss: its function and what the trainer and the config need to know about it.

    Calling a spec runs its function with its defaults for the parameters not given:
    ``LOSSES["grpo"](inp, eps_high=0.28)``.
    """

    fn: LossFn  # fn(inp: LossInputs, **params[, aggregation=...]) -> LossOutput
    params: Mapping[str, float]  # its own parameters and their defaults (the papers'), in order
    #: its default aggregation (the normalizer counts sequences for "seq_mean_token_mean", tokens
    #: for "token_mean"); None: it takes none and its normalizer counts sequences
    aggregation: str | None = None
    token_ratio: bool = False  # its own ratio is per token, so its ``ratio_mean`` is a token mean
    #: the two parameters the config's ``eps_low`` / ``eps_high`` set (none: SAPO, VESPO, KL-Cov have no range)
    eps: tuple[str, ...] = ("eps_low", "eps_high")

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    def __call__(self, inp: LossInputs, aggregation: str | None = None, **params: float) -> LossOutput:
        return self.fn(inp, **self.resolve(aggregation, **params))

    def resolve(self, aggregation: str | None = None, **params: float) -> dict[str, float | str]:
        """Every keyword of its function: ``params`` over the defaults, and the aggregation (a loss
        that takes none refuses one)."""
        unknown = params.keys() - self.params.keys()
        if unknown:
            raise TypeError(f"{self.fn.__name__} takes no parameter {sorted(unknown)}")
        out: dict[str, float | str] = {**self.params, **params}
        if self.aggregation is not None:
            out["aggregation"] = aggregation or self.aggregation
        elif aggregation is not None:
            raise ValueError(f"{self.fn.__name__} takes no aggregation (its normalizer is fixed)")
        return out


SEQ_MEAN, TOKEN_MEAN = "seq_mean_token_mean", "token_mean"
GSPO_EPS = {"eps_low": 3e-4, "eps_high": 4e-4}
SAPO_TEMPERATURES = {"tau_neg": 1.05, "tau_pos": 1.0}  # arXiv 2511.20347; not a clip range
DPPO_TV = {"delta_low": 0.15, "delta_high": 0.15}  # trust-region thresholds, not a ratio's clip range
DPPO_KL = {"delta_low": 0.05, "delta_high": 0.05}

#: name (``--algo``) -> its loss, with the papers' parameters
LOSSES: dict[str, LossSpec] = {
    "gspo": LossSpec(gspo_loss, GSPO_EPS),
    "gspo_token": LossSpec(gspo_token_loss, GSPO_EPS),
    "grpo": LossSpec(grpo_loss, {"eps_low": 0.2, "eps_high": 0.27}, SEQ_MEAN, token_ratio=True),
    # GRPO's token ratios, GSPO's sequence mask and range (an ablation: grpo_seq_mask_loss)
    "grpo_seq_mask": LossSpec(grpo_seq_mask_loss, GSPO_EPS, SEQ_MEAN, token_ratio=True),
    "sapo": LossSpec(sapo_loss, SAPO_TEMPERATURES, eps=()),
    "sapo_token": LossSpec(sapo_token_loss, SAPO_TEMPERATURES, SEQ_MEAN, token_ratio=True, eps=()),
    # IS-weight clip [1 - 1.0, 1 + 0.28]: no lower bound (arXiv 2506.13585); upper: see cispo_loss
    "cispo": LossSpec(cispo_loss, {"eps_low": 1.0, "eps_high": 0.28}, TOKEN_MEAN, token_ratio=True),
    # log-space token clip [-0.4, 0.4], i.e. ratios in (e^-0.4, e^0.4) (arXiv 2507.20673)
    "gmpo": LossSpec(gmpo_loss, {"eps_low": 0.4, "eps_high": 0.4}, token_ratio=True),
    # the sequence ratio's clip range 2e-3 / 2.5e-3 (arXiv 2602.05261, section 5.1)
    "luspo": LossSpec(luspo_loss, {"eps_low": 2e-3, "eps_high": 2.5e-3}),
    # no clip range: its kernel's shape (the paper's c1, c2; TRL's defaults)
    "vespo": LossSpec(
        vespo_loss, {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}, TOKEN_MEAN, eps=()
    ),
    # DPPO (arXiv 2602.04879): eps_low / eps_high set the trust region's thresholds (verl's
    # clip_ratio_low / _high); TV 0.15 and KL 0.05 from verl's DPPO example, the weight cap C = 20
    # (verl's clip_ratio_c fallback in its DPPO losses), token_mean (verl's loss_agg_mode default)
    "dppo_tv": LossSpec(dppo_tv_loss, {**DPPO_TV, "max_weight": 20.0}, TOKEN_MEAN, True, tuple(DPPO_TV)),
    "dppo_kl": LossSpec(dppo_kl_loss, {**DPPO_KL, "max_weight": 20.0}, TOKEN_MEAN, True, tuple(DPPO_KL)),
    # Clip-Cov / KL-Cov (arXiv 2505.22617): verl's defaults (PolicyLossConfig: ratios 2e-4, band
    # (1, 5), ppo_kl_coef 0.1; actor clip_ratio 0.2 both sides), token_mean; KL-Cov has no clip range
    "clip_cov": LossSpec(
        clip_cov_loss,
        {"eps_low": 0.2, "eps_high": 0.2, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
        TOKEN_MEAN,
        token_ratio=True,
    ),
    "kl_cov": LossSpec(kl_cov_loss, {"kl_cov_ratio": 2e-4, "kl_cov_coef": 0.1}, TOKEN_MEAN, True, eps=()),
}
