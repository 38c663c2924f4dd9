"""Policy-gradient losses: GSPO, GSPO-token and the GRPO baseline.

All functions are pure tensor-in/tensor-out: no config objects, no ``.item()`` host syncs and no
distributed calls. Shapes: ``B`` sequences, ``T`` response positions (padded). ``mask_BT`` is 1 on
response tokens and 0 on padding / prompt positions. Each loss returns ``(loss, metrics)`` where
``loss`` is a scalar to *minimize* and ``metrics`` maps names to detached 0-dim tensors.

Normalization is explicit: ``normalizer`` is the number of sequences (GSPO, GSPO-token, GRPO
"seq_mean_token_mean") or tokens (GRPO "token_mean") that the *whole* optimizer step averages over.
Passing the global count lets gradient accumulation and data-parallel ranks sum their gradients
into exactly the update a single process would make on the full batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Tensor = torch.Tensor

# exp(20) ~ 4.9e8: far outside any clip range, and finite in float16/bfloat16/float32.
MAX_LOG_RATIO = 20.0


def _compute_dtype(logp: Tensor, old_logp: Tensor) -> torch.dtype:
    """At least float32: bf16/fp16 cannot resolve ratios at GSPO's 1e-4 clip scale (ulp(1) = 2^-8
    in bf16) nor count more than 256 tokens exactly."""
    return torch.promote_types(torch.promote_types(logp.dtype, old_logp.dtype), torch.float32)


def _log_ratio_limit(logp_BT: Tensor) -> float:
    """Per-token bound on |log-ratio| such that a sum over ``T`` tokens cannot overflow.

    Far beyond anything real (3.4e38 / 2T in float32) and only reached when ``logp - old_logp``
    itself overflows; without it, +inf and -inf tokens in one row would sum to NaN.
    """
    return torch.finfo(logp_BT.dtype).max / (2 * max(logp_BT.shape[-1], 1))


def _masked_log_ratio(logp_BT: Tensor, old_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """log pi_theta - log pi_old with padding set to exactly 0 (so NaN/inf there cannot leak),
    clamped to +-:func:`_log_ratio_limit` (no gradient beyond it)."""
    lim = _log_ratio_limit(logp_BT)
    return torch.where(mask_BT.bool(), logp_BT - old_logp_BT, torch.zeros_like(logp_BT)).clamp(-lim, lim)


def sequence_log_ratio(logp_BT: Tensor, old_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Length-normalized sequence log-ratio ``(1/|y_i|) sum_t (logp - old_logp)`` -> ``[B]``.

    Rows with no response tokens get 0 (ratio 1). Not clamped; callers clamp before ``exp``.
    """
    n_tok_B = mask_BT.sum(-1).to(logp_BT.dtype)
    return _sequence_mean(_masked_log_ratio(logp_BT, old_logp_BT, mask_BT), n_tok_B)


def _sequence_mean(log_r_BT: Tensor, n_tok_B: Tensor) -> Tensor:
    """Per-row mean of a masked log-ratio (0 on padding) over its ``n_tok_B`` tokens; 0 for empty rows."""
    return log_r_BT.sum(-1) / n_tok_B.clamp(min=1)


def _k3(log_r_BT: Tensor, n_tok_B: Tensor) -> Tensor:
    """k3 estimator of KL(pi_old || pi_theta), e^r - 1 - r averaged over tokens (Schulman 2020), from
    a masked log-ratio (0 on padding, where k3 is 0)."""
    log_r_BT = log_r_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (torch.expm1(log_r_BT) - log_r_BT).sum() / n_tok_B.sum().clamp(min=1)


def _ratio_stats(prefix: str, ratio: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """Mean/min/max of ``ratio`` over ``valid`` entries (any shape); NaN-free when none are valid."""
    ratio = ratio.detach()
    n = valid.sum().clamp(min=1)
    big = torch.finfo(ratio.dtype).max
    any_valid = valid.any()
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    return {
        f"{prefix}_mean": torch.where(valid, ratio, 0).sum() / n,
        f"{prefix}_min": torch.where(any_valid, torch.where(valid, ratio, big).amin(), one),
        f"{prefix}_max": torch.where(any_valid, torch.where(valid, ratio, -big).amax(), one),
    }


def _clip_masks(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """Where the clipped branch wins the min (zero gradient): low side for A<0, high side for A>0."""
    low = (ratio < 1.0 - eps_low) & (adv < 0)
    high = (ratio > 1.0 + eps_high) & (adv > 0)
    return low, high


def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO sequence-level clipped objective (arXiv 2507.18071, eq. 5-7).

    s_i = exp(mean_t(logp_it - old_logp_it)) over response tokens;
    loss = -(1/N) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i), N = B by default.

    Args:
        logp: ``[B, T]`` token log-probs under the current policy (requires grad).
        old_logp: ``[B, T]`` token log-probs under pi_old (no grad).
        advantages: ``[B]`` sequence advantages.
        mask: ``[B, T]`` 1 for response tokens.
        normalizer: sequences averaged over by the whole optimizer step (default ``B``).
    """
    dtype = _compute_dtype(logp, old_logp)
    logp, old_logp = logp.to(dtype), old_logp.to(dtype)
    mask_BT = mask.to(dtype)
    n_tok_B = mask_BT.sum(-1)
    has_tok_B = n_tok_B > 0
    # rows without response tokens contribute 0; zeroing A there keeps a NaN A out of the gradient
    adv_B = torch.where(has_tok_B, advantages.to(logp.dtype), 0.0)
    log_r_BT = _masked_log_ratio(logp, old_logp, mask_BT)  # shared by the ratio and the KL metric
    log_s_B = _sequence_mean(log_r_BT, n_tok_B).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    s_B = torch.exp(log_s_B)
    # rows without tokens have s = 1 and A = 0, so their objective is exactly 0
    obj_B = torch.minimum(s_B * adv_B, s_B.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_B)
    n = logp.shape[0] if normalizer is None else normalizer
    loss = -obj_B.sum() / n
    metrics = _sequence_metrics(s_B, adv_B, n_tok_B, has_tok_B, eps_low, eps_high)
    metrics["approx_kl"] = _k3(log_r_BT.detach(), n_tok_B)
    return loss, metrics


def _sequence_metrics(
    s_B: Tensor, adv_B: Tensor, n_tok_B: Tensor, has_tok_B: Tensor, eps_low: float, eps_high: float
) -> dict[str, Tensor]:
    """Clip fractions for a sequence-level ratio, per sequence and weighted by tokens."""
    s_B = s_B.detach()
    low_B, high_B = _clip_masks(s_B, adv_B, eps_low, eps_high)
    # [low, high] x [sequences, tokens] in one product; rows without tokens weigh 0 in both columns
    w_B2 = torch.stack([has_tok_B.to(n_tok_B.dtype), n_tok_B], -1)
    frac_22 = torch.stack([low_B, high_B]).to(w_B2.dtype) @ w_B2 / w_B2.sum(0).clamp(min=1)
    (seq_low, tok_low), (seq_high, tok_high) = frac_22
    seq, tok = frac_22.sum(0)
    out = {
        "clip_frac_seq_low": seq_low,
        "clip_frac_seq_high": seq_high,
        "clip_frac_tok_low": tok_low,
        "clip_frac_tok_high": tok_high,
        "clip_frac_seq": seq,
        "clip_frac_tok": tok,
    }
    out.update(_ratio_stats("ratio", s_B, has_tok_B))
    return out


def gspo_token_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token (paper eq. 13-14): per-token advantages, sequence-level ratio value.

    s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]: numerically s_i, but its gradient flows
    through each token's own log-prob. loss = -(1/N) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it).
    Equal to :func:`gspo_loss` in value and gradient when ``A_it = A_i``.

    Args:
        advantages: ``[B, T]`` per-token advantages (a ``[B]`` tensor is broadcast over tokens).
    """
    dtype = _compute_dtype(logp, old_logp)
    logp, old_logp = logp.to(dtype), old_logp.to(dtype)
    mask_BT = mask.to(dtype)
    adv_BT = advantages.to(dtype)
    if adv_BT.dim() == 1:
        adv_BT = adv_BT[:, None].expand_as(logp)
    adv_BT = torch.where(mask_BT.bool(), adv_BT, torch.zeros_like(adv_BT))
    n_tok_B = mask_BT.sum(-1)
    has_tok_B = n_tok_B > 0
    log_r_BT = _masked_log_ratio(logp, old_logp, mask_BT).detach()  # the ratio's value and the KL metric
    raw_log_s_B = _sequence_mean(log_r_BT, n_tok_B)
    log_s_B = raw_log_s_B.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    # the clamps pass no gradient outside [-MAX, MAX] (sequence) or +-lim (token, see
    # _masked_log_ratio); mirror that so GSPO-token == GSPO there too
    in_range_B = (raw_log_s_B >= -MAX_LOG_RATIO) & (raw_log_s_B <= MAX_LOG_RATIO)
    tok_ok_BT = (logp.detach() - old_logp).abs() <= _log_ratio_limit(logp)
    grad_BT = mask_BT.bool() & in_range_B[:, None] & tok_ok_BT
    safe_logp_BT = torch.where(grad_BT, logp, torch.zeros_like(logp))
    # value: exactly s_i on every token (x - sg[x] == 0, whereas (log_s + x) - x rounds at the scale
    # of |x|: ~1e-6 in float32 for logp ~ -20); gradient: s_i * d logp_it
    log_s_BT = log_s_B[:, None] + (safe_logp_BT - safe_logp_BT.detach())
    s_BT = torch.exp(log_s_BT)
    obj_BT = torch.minimum(s_BT * adv_BT, s_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_BT)
    obj_B = (obj_BT * mask_BT).sum(-1) / n_tok_B.clamp(min=1)
    n = logp.shape[0] if normalizer is None else normalizer
    loss = -obj_B.sum() / n

    s_det_BT = s_BT.detach()
    valid_BT = mask_BT.bool()
    low_BT, high_BT = _clip_masks(s_det_BT, adv_BT, eps_low, eps_high)
    n_tok = mask_BT.sum().clamp(min=1)
    # a sequence counts as clipped when the majority of its tokens are (with A_it = A_i: all or none)
    low_B = (low_BT & valid_BT).sum(-1) * 2 > n_tok_B
    high_B = (high_BT & valid_BT).sum(-1) * 2 > n_tok_B
    n_seq = has_tok_B.sum().clamp(min=1).to(mask_BT.dtype)
    metrics = {
        "clip_frac_tok_low": (low_BT & valid_BT).sum() / n_tok,
        "clip_frac_tok_high": (high_BT & valid_BT).sum() / n_tok,
        "clip_frac_seq_low": (low_B & has_tok_B).sum() / n_seq,
        "clip_frac_seq_high": (high_B & has_tok_B).sum() / n_seq,
    }
    metrics["clip_frac_tok"] = metrics["clip_frac_tok_low"] + metrics["clip_frac_tok_high"]
    metrics["clip_frac_seq"] = metrics["clip_frac_seq_low"] + metrics["clip_frac_seq_high"]
    metrics.update(_ratio_stats("ratio", torch.exp(log_s_B.detach()), has_tok_B))
    metrics["approx_kl"] = _k3(log_r_BT, n_tok_B)
    return loss, metrics


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
    normalizer: float | Tensor | None = None,
    aggregation: str = "seq_mean_token_mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO baseline: per-token ratio w_it = pi_theta/pi_old with per-token clipping.

    aggregation:
        ``"seq_mean_token_mean"`` (GRPO paper): per-sequence token mean, then sum over sequences / N,
        N = B by default.
        ``"token_mean"`` (DAPO): sum over all tokens / N, N = number of response tokens by default.

    Args:
        advantages: ``[B]`` or ``[B, T]``.
    """
    if aggregation not in ("seq_mean_token_mean", "token_mean"):
        raise ValueError(f"aggregation must be 'seq_mean_token_mean' or 'token_mean', got {aggregation!r}")
    dtype = _compute_dtype(logp, old_logp)
    logp, old_logp = logp.to(dtype), old_logp.to(dtype)
    mask_BT = mask.to(dtype)
    valid_BT = mask_BT.bool()
    adv_BT = advantages.to(dtype)
    if adv_BT.dim() == 1:
        adv_BT = adv_BT[:, None].expand_as(logp)
    adv_BT = torch.where(valid_BT, adv_BT, torch.zeros_like(adv_BT))
    log_w_BT = _masked_log_ratio(logp, old_logp, mask_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    w_BT = torch.exp(log_w_BT)
    obj_BT = torch.minimum(w_BT * adv_BT, w_BT.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_BT) * mask_BT
    n_tok_B = mask_BT.sum(-1)
    has_tok_B = n_tok_B > 0
    if aggregation == "seq_mean_token_mean":
        n = logp.shape[0] if normalizer is None else normalizer
        loss = -(obj_BT.sum(-1) / n_tok_B.clamp(min=1)).sum() / n
    else:
        n = mask_BT.sum().clamp(min=1) if normalizer is None else normalizer
        loss = -obj_BT.sum() / n

    w_det_BT = w_BT.detach()
    low_BT, high_BT = _clip_masks(w_det_BT, adv_BT, eps_low, eps_high)
    low_BT, high_BT = low_BT & valid_BT, high_BT & valid_BT
    n_tok = mask_BT.sum().clamp(min=1)
    n_seq = has_tok_B.sum().clamp(min=1).to(mask_BT.dtype)
    # token-level clipping: fraction of each sequence's tokens clipped, averaged over sequences
    seq_low_B = low_BT.sum(-1) / n_tok_B.clamp(min=1)
    seq_high_B = high_BT.sum(-1) / n_tok_B.clamp(min=1)
    metrics = {
        "clip_frac_tok_low": low_BT.sum() / n_tok,
        "clip_frac_tok_high": high_BT.sum() / n_tok,
        "clip_frac_seq_low": seq_low_B.sum() / n_seq,
        "clip_frac_seq_high": seq_high_B.sum() / n_seq,
    }
    metrics["clip_frac_tok"] = metrics["clip_frac_tok_low"] + metrics["clip_frac_tok_high"]
    metrics["clip_frac_seq"] = metrics["clip_frac_seq_low"] + metrics["clip_frac_seq_high"]
    metrics.update(_ratio_stats("ratio", w_det_BT, valid_BT))
    s_B = torch.exp(sequence_log_ratio(logp.detach(), old_logp, mask_BT).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    metrics.update(_ratio_stats("seq_ratio", s_B, has_tok_B))
    metrics["approx_kl"] = _k3(log_w_BT.detach(), n_tok_B)  # log_w is the clamped masked log-ratio
    return loss, metrics


LossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

#: name -> (loss function, default eps_low, default eps_high)
LOSSES: dict[str, tuple[LossFn, float, float]] = {
    "gspo": (gspo_loss, 3e-4, 4e-4),
    "gspo_token": (gspo_token_loss, 3e-4, 4e-4),
    "grpo": (grpo_loss, 0.2, 0.27),
}
