"""The trust-region and entropy-control losses users set beside GSPO: DPPO (Binary-TV and Binary-KL
trust regions, arXiv 2602.04879), Clip-Cov and KL-Cov (arXiv 2505.22617). Registered in
:data:`gspo.losses.LOSSES` (``--algo dppo_tv``, ``dppo_kl``, ``clip_cov``, ``kl_cov``), same contract
as every loss there: pure tensor functions of :class:`LossInputs` and their own parameters, returning a
:class:`LossOutput` (no config objects, no host syncs, no distributed calls).

Clip-Cov and KL-Cov pick a *fraction of the tokens they are given*: like verl's ``clip_cov`` /
``kl_cov``, whose selection is per micro-batch on each rank, the covariance's means and the number
selected are those of one call. They are therefore the two losses whose update depends on
``micro_batch_size`` and the number of ranks (every other loss is exactly the whole minibatch's);
with ``micro_batch_size 0`` on one rank one call holds the whole minibatch.
"""

from __future__ import annotations

import math

import torch

from gspo.loss_prologue import (
    MAX_LOG_RATIO,
    LossInputs,
    LossOutput,
    check_aggregation,
    clip_masks,
    token_clip_metrics,
    token_ratio_metrics,
)

Tensor = torch.Tensor


def _unit(inp: LossInputs) -> Tensor:
    """Exactly 1 on response tokens with d/d logp = 1 (0 and no gradient elsewhere): the surrogate
    sg(w) A (1 + logp - sg(logp)) has the REINFORCE gradient w A d logp and the value w A."""
    safe_logp_BT = torch.where(inp.valid_BT, inp.logp_BT, torch.zeros_like(inp.logp_BT))
    return 1.0 + (safe_logp_BT - safe_logp_BT.detach())


def _log_probs(logp_BT: Tensor, valid_BT: Tensor) -> Tensor:
    """Detached log-probs, 0 off the response and at most 0 (a log-probability: garbage above 0 or on
    padding cannot make a probability above 1 or a NaN)."""
    return torch.where(valid_BT, logp_BT.detach(), torch.zeros_like(logp_BT)).clamp(max=0.0)


# ----------------------------------------------------------------------------------------------
# DPPO (Divergence PPO, "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879)


def check_positive(**values: float) -> None:
    """Thresholds, fractions' bounds and caps that must be finite and > 0 (a zero trust region masks
    every token that moves; a zero cap zeroes every weight)."""
    for name, v in values.items():
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def binary_tv(logp_BT: Tensor, old_logp_BT: Tensor) -> Tensor:
    """Signed Binary-TV of each token, p_theta - p_old (|.| is the total variation between the
    Bernoulli distributions (p_old, 1 - p_old) and (p_theta, 1 - p_theta)); inputs: clamped
    log-probs (:func:`_log_probs`)."""
    return torch.exp(logp_BT) - torch.exp(old_logp_BT)


def binary_kl(logp_BT: Tensor, old_logp_BT: Tensor) -> Tensor:
    """Binary-KL of each token, KL((p_old, 1 - p_old) || (p_theta, 1 - p_theta)) =
    p_old log(p_old / p_theta) + (1 - p_old) log((1 - p_old) / (1 - p_theta)), from clamped log-probs.

    1 - p is taken as -expm1(log p) (exact near p = 1, where 1 - exp rounds to 0); the second term is
    0 where p_old = 1 (its limit) and +inf where p_theta = 1 > p_old. verl adds 1e-8 inside the second
    logarithm instead; the two differ only for 1 - p below ~1e-6."""
    p_old_BT = torch.exp(old_logp_BT)
    q_old_BT, q_BT = -torch.expm1(old_logp_BT), -torch.expm1(logp_BT)  # 1 - p
    second_BT = q_old_BT * (torch.log(q_old_BT) - torch.log(q_BT))
    second_BT = torch.where(q_old_BT > 0, second_BT, torch.zeros_like(second_BT))
    return p_old_BT * (old_logp_BT - logp_BT) + second_BT


def dppo_masks(
    inp: LossInputs, adv_BT: Tensor, divergence: str, delta_low: float, delta_high: float
) -> tuple[Tensor, Tensor]:
    """(low_BT, high_BT): the response tokens outside the trust region on the side their advantage
    pushes to, whose gradient DPPO drops. high: A > 0 and p_theta rose past the region (TV: p_theta -
    p_old > delta_high; KL: p_theta > p_old with Binary-KL > delta_high); low: A < 0 and p_theta fell
    past it (TV: p_theta - p_old < -delta_low; KL: p_theta < p_old with Binary-KL > delta_low). A
    token moving the other way (back towards pi_old's side) is never masked, as in PPO's clip."""
    logp_BT, old_BT = _log_probs(inp.logp_BT, inp.valid_BT), _log_probs(inp.old_logp_BT, inp.valid_BT)
    if divergence == "tv":
        d_BT = binary_tv(logp_BT, old_BT)
        high_BT, low_BT = d_BT > delta_high, d_BT < -delta_low
    else:
        kl_BT, rose_BT, fell_BT = binary_kl(logp_BT, old_BT), logp_BT > old_BT, logp_BT < old_BT
        high_BT, low_BT = rose_BT & (kl_BT > delta_high), fell_BT & (kl_BT > delta_low)
    return low_BT & (adv_BT < 0) & inp.valid_BT, high_BT & (adv_BT > 0) & inp.valid_BT


def _dppo(
    inp: LossInputs, divergence: str, delta_low: float, delta_high: float, max_weight: float, aggregation: str
) -> LossOutput:
    check_aggregation(aggregation)
    check_positive(delta_low=delta_low, delta_high=delta_high, max_weight=max_weight)
    adv_BT = inp.token_advantages()
    low_BT, high_BT = dppo_masks(inp, adv_BT, divergence, delta_low, delta_high)
    # the importance weight is a constant, truncated at C (verl: clip_ratio_c), log-ratio at +-20 as verl
    w_BT = torch.exp(inp.log_r_BT.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).clamp(max=max_weight)
    keep_BT = ~(low_BT | high_BT)
    obj_BT = torch.where(keep_BT, w_BT * adv_BT, torch.zeros_like(w_BT)) * _unit(inp) * inp.mask_BT
    loss = inp.token_loss(inp.weigh_tokens(obj_BT), aggregation)
    metrics = token_clip_metrics(inp, low_BT, high_BT)
    metrics.update(token_ratio_metrics(inp))
    return LossOutput(loss, metrics)


def dppo_tv_loss(
    inp: LossInputs, *, delta_low: float, delta_high: float, max_weight: float, aggregation: str
) -> LossOutput:
    """DPPO with the Binary-TV trust region (arXiv 2602.04879; verl ``dppo_tv``).

    Instead of clipping the ratio, each token keeps its gradient while its policy stays inside a trust
    region around pi_old, measured by a divergence of the token's own probability: a token with A > 0
    while p_theta - p_old <= delta_high, one with A < 0 while p_theta - p_old >= -delta_low
    (:func:`dppo_masks`). A kept token gets REINFORCE weighted by the truncated, stop-gradient
    importance weight w = sg(min(pi_theta / pi_old, C)); the value is the weighted advantage (as
    :func:`gspo.losses.cispo_loss`: sg(w) A (1 + logp - sg(logp))):

        ``"token_mean"`` (default, as verl): loss = -(1/N) sum_it m_it w_it A_it, N = tokens by default;
        ``"seq_mean_token_mean"``: -(1/N) sum_i (1/|y_i|) sum_t m_it w_it A_it, N = B by default;

    m_it = 0 outside the region, 1 inside. d loss / d logp_it = -(1/N) m_it w_it A_it (``/ (N |y_i|)``
    for seq_mean_token_mean). Unlike the ratio clip, a rare token may grow a hundredfold (a tiny
    change in probability) and a likely one may not lose much mass.

    ``delta_low``, ``delta_high``: the region's bounds on p_theta - p_old (the config's ``eps_low`` /
    ``eps_high``, as verl's clip_ratio_low / _high; default 0.15 each, verl's DPPO example for
    Qwen3-30B-A3B). ``max_weight``: C, the importance weight's cap (20, verl's fallback for
    clip_ratio_c in its DPPO losses). ``inp``: ``[B]`` or ``[B, T]`` advantages, an optional ``[B]``
    or ``[B, T]`` weight.

    Metrics: ``clip_frac_tok_high`` / ``_low``: the share of response tokens outside the region above
    (A > 0) / below (A < 0), per token and (``clip_frac_seq_*``) per sequence; ``ratio_*`` (tokens),
    ``seq_ratio_*``, ``approx_kl``.
    """
    return _dppo(inp, "tv", delta_low, delta_high, max_weight, aggregation)


def dppo_kl_loss(
    inp: LossInputs, *, delta_low: float, delta_high: float, max_weight: float, aggregation: str
) -> LossOutput:
    """DPPO with the Binary-KL trust region (arXiv 2602.04879; verl ``dppo_kl``): as
    :func:`dppo_tv_loss`, the region measured by KL((p_old, 1 - p_old) || (p_theta, 1 - p_theta))
    (:func:`binary_kl`): a token with A > 0 is dropped once p_theta > p_old with the KL above
    delta_high, one with A < 0 once p_theta < p_old with the KL above delta_low.

    ``delta_low``, ``delta_high``: KL thresholds (default 0.05 each, verl's DPPO example);
    ``max_weight``: C (20). Value, gradient, aggregations and metrics: :func:`dppo_tv_loss`'s.
    """
    return _dppo(inp, "kl", delta_low, delta_high, max_weight, aggregation)


# ----------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language
# Models", arXiv 2505.22617)


def check_fraction(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0 < value < 1):
        raise ValueError(f"{name} must be a fraction in (0, 1), got {value!r}")


def token_covariance(inp: LossInputs, adv_BT: Tensor) -> Tensor:
    """Each response token's term of the covariance between advantage and log-prob,
    (A_it - mean A)(log pi_theta(y_it) - mean log pi_theta), the means over the call's response
    tokens; detached, 0 off the response. The paper's sign: large where a likely token has a high
    advantage (or an unlikely one a low advantage), the tokens that drive entropy down.

    The means are sums of x / n (no overflow near the dtype's maximum); overflow of the product is
    clamped to the dtype's range."""
    n = inp.n_tok_B.sum().clamp(min=1)
    logp_BT = _log_probs(inp.logp_BT, inp.valid_BT)
    adv_BT = adv_BT.detach()
    c_adv_BT = torch.where(inp.valid_BT, adv_BT - (adv_BT / n).sum(), torch.zeros_like(adv_BT))
    c_logp_BT = torch.where(inp.valid_BT, logp_BT - (logp_BT / n).sum(), torch.zeros_like(logp_BT))
    big = torch.finfo(logp_BT.dtype).max
    return torch.nan_to_num(c_adv_BT * c_logp_BT, nan=0.0, posinf=big, neginf=-big)


def select_top(cov_BT: Tensor, pool_BT: Tensor, fraction: float, n_tok: Tensor) -> Tensor:
    """The k tokens of ``pool_BT`` with the largest ``cov_BT``, k = max(1, floor(fraction * n_tok))
    (verl's count; fewer when the pool is smaller). No host sync: k stays a tensor and a token's
    rank comes from a stable sort (ties by position)."""
    key = torch.where(pool_BT, cov_BT, torch.full_like(cov_BT, -math.inf)).flatten()
    order = torch.argsort(key, descending=True, stable=True)
    rank_BT = torch.argsort(order).view(cov_BT.shape)  # the inverse permutation: each token's rank
    k = torch.floor(fraction * n_tok.double()).clamp(min=1)  # float64: python's int(fraction * n), as verl
    return pool_BT & (rank_BT < k)


def _cov_metrics(inp: LossInputs, cov_BT: Tensor, selected_BT: Tensor) -> dict[str, Tensor]:
    """``cov_frac_tok``: the share of response tokens selected; ``cov_threshold``: the smallest
    covariance among them, the one a token had to reach (0 when none was selected)."""
    big = torch.finfo(cov_BT.dtype).max
    lowest = torch.where(selected_BT, cov_BT, torch.full_like(cov_BT, big)).amin()
    return {
        "cov_frac_tok": selected_BT.sum() / inp.n_tok_B.sum().clamp(min=1),
        "cov_threshold": torch.where(selected_BT.any(), lowest, torch.zeros_like(lowest)),
    }


def clip_cov_loss(
    inp: LossInputs,
    *,
    eps_low: float,
    eps_high: float,
    clip_cov_ratio: float,
    clip_cov_lb: float,
    clip_cov_ub: float,
    aggregation: str,
) -> LossOutput:
    """Clip-Cov (arXiv 2505.22617, section 5; verl ``clip_cov``): GRPO's clipped token objective with
    the gradient of a few high-covariance tokens detached, against entropy collapse.

    cov_it = (A_it - mean A)(logp_it - mean logp) over the call's tokens (:func:`token_covariance`).
    Among the tokens that PPO's clip leaves unclipped and whose covariance lies in (clip_cov_lb,
    clip_cov_ub), k = max(1, floor(clip_cov_ratio * n)) are selected (n: the call's response tokens)
    and contribute neither value nor gradient:

        loss = -agg_{i,t} (1 - c_it) min(r_it A_it, clip(r_it, 1 - eps_low, 1 + eps_high) A_it),

    c_it = 1 on the selected tokens, ``agg`` as :func:`gspo.losses.grpo_loss` (``"token_mean"`` by
    default, as verl). verl draws the k tokens at random among those in the band; here they are the k
    with the largest covariance in it, so a loss stays a function of its inputs (no generator inside
    a loss, every run reproducible from its seed). The selection is per call (the module docstring).

    ``eps_low``, ``eps_high``: the ratio's clip range (0.2 / 0.2: verl's clip_ratio default, which the
    paper's recipes keep). ``clip_cov_ratio``: the fraction selected (2e-4), ``clip_cov_lb`` /
    ``clip_cov_ub``: the covariance band (1, 5): verl's defaults. ``inp``: ``[B]`` or ``[B, T]``
    advantages, an optional ``[B]`` or ``[B, T]`` weight (applied after the selection, which ignores it).

    Metrics: ``cov_frac_tok`` (the share of tokens detached), ``cov_threshold`` (the smallest
    selected covariance; per call, combined over micro-batches as a mean weighted by sequences);
    GRPO's clip fractions and ratio metrics.
    """
    check_aggregation(aggregation)
    check_fraction("clip_cov_ratio", clip_cov_ratio)
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"clip_cov_lb must be below clip_cov_ub, got {clip_cov_lb!r} >= {clip_cov_ub!r}")
    adv_BT = inp.token_advantages()
    r_BT = torch.exp(inp.log_r_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    low_BT, high_BT = clip_masks(r_BT.detach(), adv_BT, eps_low, eps_high)
    cov_BT = token_covariance(inp, adv_BT)
    band_BT = (cov_BT > clip_cov_lb) & (cov_BT < clip_cov_ub)
    pool_BT = inp.valid_BT & ~(low_BT | high_BT) & band_BT
    selected_BT = select_top(cov_BT, pool_BT, clip_cov_ratio, inp.n_tok_B.sum())
    obj_BT = torch.minimum(r_BT * adv_BT, r_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_BT)
    obj_BT = torch.where(selected_BT, torch.zeros_like(obj_BT), obj_BT) * inp.mask_BT
    loss = inp.token_loss(inp.weigh_tokens(obj_BT), aggregation)
    metrics = token_clip_metrics(inp, low_BT, high_BT)
    metrics.update(token_ratio_metrics(inp))
    metrics.update(_cov_metrics(inp, cov_BT, selected_BT))
    return LossOutput(loss, metrics)


def kl_cov_loss(inp: LossInputs, *, kl_cov_ratio: float, kl_cov_coef: float, aggregation: str) -> LossOutput:
    """KL-Cov (arXiv 2505.22617, section 5; verl ``kl_cov``): the unclipped token policy gradient,
    with a KL penalty on the few tokens of the highest covariance, against entropy collapse.

    The k = max(1, floor(kl_cov_ratio * n)) response tokens with the largest cov_it
    (:func:`token_covariance`; n: the call's response tokens) are selected; on them the objective
    pays kl_cov_coef |log r_it|:

        loss = -agg_{i,t} (r_it A_it - beta c_it |log r_it|),  r_it = pi_theta / pi_old,

    c_it = 1 on the selected tokens, beta = ``kl_cov_coef``, ``agg`` as :func:`gspo.losses.grpo_loss`
    (``"token_mean"`` by default, as verl). No ratio clip (as verl's kl_cov): the penalty is its only
    trust region. d loss / d logp_it = -(1/N) (r_it A_it - beta c_it sign(log r_it)) for token_mean.
    log r is clamped to +-20 as in every loss here (verl leaves it unclamped). The selection is per
    call (the module docstring).

    ``kl_cov_ratio``: the fraction selected (2e-4: verl's default; the paper's 7B recipe uses 2e-3);
    ``kl_cov_coef``: beta (0.1: verl's ``ppo_kl_coef`` default; the paper's recipes use 1). No clip
    range. ``inp``: ``[B]`` or ``[B, T]`` advantages, an optional ``[B]`` or ``[B, T]`` weight.

    Metrics: ``cov_frac_tok`` (the share of tokens penalised), ``cov_threshold`` (the smallest
    selected covariance); ``ratio_*`` (tokens), ``seq_ratio_*``, ``approx_kl``.
    """
    check_aggregation(aggregation)
    check_fraction("kl_cov_ratio", kl_cov_ratio)
    if not (math.isfinite(kl_cov_coef) and kl_cov_coef >= 0):
        raise ValueError(f"kl_cov_coef must be a finite number >= 0, got {kl_cov_coef!r}")
    adv_BT = inp.token_advantages()
    log_r_BT = inp.log_r_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    cov_BT = token_covariance(inp, adv_BT)
    selected_BT = select_top(cov_BT, inp.valid_BT, kl_cov_ratio, inp.n_tok_B.sum())
    penalty_BT = torch.where(selected_BT, kl_cov_coef * log_r_BT.abs(), torch.zeros_like(log_r_BT))
    obj_BT = (torch.exp(log_r_BT) * adv_BT - penalty_BT) * inp.mask_BT
    loss = inp.token_loss(inp.weigh_tokens(obj_BT), aggregation)
    metrics = token_ratio_metrics(inp)
    metrics.update(_cov_metrics(inp, cov_BT, selected_BT))
    return LossOutput(loss, metrics)
