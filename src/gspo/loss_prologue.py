"""The prologue every loss in :mod:`gspo.losses` shares: compute dtype, mask, token counts and the
masked log-ratio (:func:`loss_inputs`, :class:`LossInputs`), and the clip / ratio metrics built from
them. Pure tensor functions (also used by :mod:`gspo.correction`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor

# exp(20) ~ 4.9e8: far outside any clip range, and finite in float16/bfloat16/float32.
MAX_LOG_RATIO = 20.0


def log_ratio_limit(logp_BT: Tensor) -> float:
    """Per-token bound on |log-ratio| such that a sum over ``T`` tokens cannot overflow.

    Far beyond anything real (3.4e38 / 2T in float32) and only reached when ``logp - old_logp``
    itself overflows; without it, +inf and -inf tokens in one row would sum to NaN.
    """
    return torch.finfo(logp_BT.dtype).max / (2 * max(logp_BT.shape[-1], 1))


def sequence_mean(log_r_BT: Tensor, n_tok_B: Tensor) -> Tensor:
    """Per-row mean of a masked log-ratio (0 on padding) over its ``n_tok_B`` tokens; 0 for empty rows."""
    return log_r_BT.sum(-1) / n_tok_B.clamp(min=1)


def k3_kl(log_r_BT: Tensor, n_tok_B: Tensor) -> Tensor:
    """k3 estimator of KL(pi_old || pi_theta), e^r - 1 - r averaged over tokens (Schulman 2020), from
    a masked log-ratio (0 on padding, where k3 is 0)."""
    log_r_BT = log_r_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (torch.expm1(log_r_BT) - log_r_BT).sum() / n_tok_B.sum().clamp(min=1)


def ratio_stats(prefix: str, ratio: Tensor, valid: Tensor) -> dict[str, Tensor]:
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


# ----------------------------------------------------------------------------------------------
# the shared prologue

AGGREGATIONS = ("seq_mean_token_mean", "token_mean")


@dataclass(frozen=True)
class LossOutput:
    """What a loss returns: the scalar to minimize and its metrics (keys: the docstring of
    :mod:`gspo.losses`). Defined here, below every loss module, so that each can return it."""

    loss: Tensor
    metrics: dict[str, Tensor]


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be 'seq_mean_token_mean' or 'token_mean', got {aggregation!r}")


@dataclass(frozen=True)
class LossInputs:
    """Everything a loss takes besides its own parameters: the rows, their advantages, the optimizer
    step's normalizer and an optional weight, with what every loss computes first from them, in the
    compute dtype (at least float32, see :func:`loss_inputs`). ``log_r_BT`` carries ``logp``'s
    gradient; the rest is constant."""

    logp_BT: Tensor  # log pi_theta
    old_logp_BT: Tensor  # log pi_old
    mask_BT: Tensor  # 1.0 on response tokens, 0.0 elsewhere
    valid_BT: Tensor  # mask_BT as bool
    n_tok_B: Tensor  # |y_i|: response tokens per row
    has_tok_B: Tensor  # rows with at least one response token
    log_r_BT: Tensor  # logp - old_logp, exactly 0 on padding, clamped to +-log_ratio_limit
    advantages: Tensor | None = None  # [B] or [B, T] as given (None: a log-ratio only, gspo.correction)
    normalizer: float | Tensor | None = None  # sequences or tokens the whole step averages over
    weight: Tensor | None = None  # [B] or [B, T] stop-gradient multiplier (module docstring of gspo.losses)

    @property
    def dtype(self) -> torch.dtype:
        return self.logp_BT.dtype

    def _advantages(self) -> Tensor:
        if self.advantages is None:
            raise ValueError("a loss needs advantages: loss_inputs(logp, old_logp, mask, advantages)")
        return self.advantages.to(self.logp_BT.dtype)

    def seq_advantages(self) -> Tensor:
        """``[B]`` advantages, 0 on rows without tokens (their objective is exactly 0, and a NaN A
        there cannot reach the gradient)."""
        return torch.where(self.has_tok_B, self._advantages(), 0.0)

    def token_advantages(self) -> Tensor:
        """``[B]`` or ``[B, T]`` advantages as ``[B, T]``, 0 on padding (a NaN there cannot leak)."""
        adv_BT = self._advantages()
        if adv_BT.dim() == 1:
            adv_BT = adv_BT[:, None].expand(self.valid_BT.shape)
        return torch.where(self.valid_BT, adv_BT, torch.zeros_like(adv_BT))

    def weigh_sequences(self, obj_B: Tensor) -> Tensor:
        """``obj_B`` times the ``[B]`` stop-gradient weight (0 on rows without tokens); None: unchanged."""
        if self.weight is None:
            return obj_B
        B = self.has_tok_B.shape[0]
        if self.weight.dim() != 1 or self.weight.shape[0] != B:
            raise ValueError(
                f"weight must have shape [B] = [{B}] for a sequence-level loss, got {tuple(self.weight.shape)}"
            )
        w_B = self.weight.detach().to(self.dtype)
        return obj_B * torch.where(self.has_tok_B, w_B, torch.zeros_like(w_B))

    def weigh_tokens(self, obj_BT: Tensor) -> Tensor:
        """``obj_BT`` times the ``[B]`` (per sequence) or ``[B, T]`` (per token) stop-gradient weight,
        0 on padding; None: unchanged."""
        if self.weight is None:
            return obj_BT
        w = self.weight.detach().to(self.dtype)
        if w.dim() == 1 and w.shape[0] == self.valid_BT.shape[0]:
            w = w[:, None].expand(self.valid_BT.shape)
        elif w.shape != self.valid_BT.shape:
            raise ValueError(
                f"weight must have shape [B] or [B, T] = {list(self.valid_BT.shape)}, got {tuple(w.shape)}"
            )
        return obj_BT * torch.where(self.valid_BT, w, torch.zeros_like(w))

    def sequence_loss(self, obj_B: Tensor) -> Tensor:
        """-(1/N) sum_i obj_i, N = B by default."""
        n = obj_B.shape[0] if self.normalizer is None else self.normalizer
        return -obj_B.sum() / n

    def token_loss(self, obj_BT: Tensor, aggregation: str) -> Tensor:
        """Loss from a per-token objective that is 0 on padding: per-sequence token mean summed over
        sequences / N (N = B by default), or sum over all tokens / N (N = tokens by default)."""
        if aggregation == "seq_mean_token_mean":
            return self.sequence_loss(obj_BT.sum(-1) / self.n_tok_B.clamp(min=1))
        n = self.mask_BT.sum().clamp(min=1) if self.normalizer is None else self.normalizer
        return -obj_BT.sum() / n


def loss_inputs(
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    advantages: Tensor | None = None,
    *,
    normalizer: float | Tensor | None = None,
    weight: Tensor | None = None,
) -> LossInputs:
    """The inputs of every loss (and of :mod:`gspo.correction`, pi_old against pi_sampler, without
    advantages). ``logp`` / ``old_logp`` ``[B, T]`` token log-probs under pi_theta (with grad) and
    pi_old; ``mask`` ``[B, T]`` 1 on response tokens; ``advantages`` ``[B]`` (or ``[B, T]`` for the
    losses with token advantages); ``normalizer``: the sequences or tokens the whole optimizer step
    averages over (default: this batch's); ``weight``: see the module docstring of :mod:`gspo.losses`."""
    # at least float32: bf16/fp16 cannot resolve ratios at GSPO's 1e-4 clip scale (ulp(1) = 2^-8 in
    # bf16) nor count more than 256 tokens exactly
    dtype = torch.promote_types(torch.promote_types(logp.dtype, old_logp.dtype), torch.float32)
    logp_BT, old_logp_BT, mask_BT = logp.to(dtype), old_logp.to(dtype), mask.to(dtype)
    n_tok_B, valid_BT, lim = mask_BT.sum(-1), mask_BT.bool(), log_ratio_limit(logp_BT)
    # padding set to exactly 0 (NaN/inf there cannot leak), clamped (no gradient beyond the limit)
    log_r_BT = torch.where(valid_BT, logp_BT - old_logp_BT, torch.zeros_like(logp_BT)).clamp(-lim, lim)
    return LossInputs(
        logp_BT, old_logp_BT, mask_BT, valid_BT, n_tok_B, n_tok_B > 0, log_r_BT, advantages, normalizer, weight
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# metrics shared by several losses


def clip_masks(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """Where the clipped branch wins the min (zero gradient): low side for A<0, high side for A>0."""
    low = (ratio < 1.0 - eps_low) & (adv < 0)
    high = (ratio > 1.0 + eps_high) & (adv > 0)
    return low, high


def with_totals(out: dict[str, Tensor]) -> dict[str, Tensor]:
    """Adds ``clip_frac_tok`` / ``clip_frac_seq``, the sums of their low and high sides."""
    out["clip_frac_tok"] = out["clip_frac_tok_low"] + out["clip_frac_tok_high"]
    out["clip_frac_seq"] = out["clip_frac_seq_low"] + out["clip_frac_seq_high"]
    return out


def token_clip_metrics(inp: LossInputs, low_BT: Tensor, high_BT: Tensor) -> dict[str, Tensor]:
    """Fractions of tokens clipped low / high, over all tokens and per sequence (then averaged over
    sequences), for a loss that clips token by token."""
    low_BT, high_BT = low_BT & inp.valid_BT, high_BT & inp.valid_BT
    n_tok = inp.n_tok_B.sum().clamp(min=1)
    n_seq = inp.has_tok_B.sum().clamp(min=1).to(inp.n_tok_B.dtype)
    seq_low_B = low_BT.sum(-1) / inp.n_tok_B.clamp(min=1)
    seq_high_B = high_BT.sum(-1) / inp.n_tok_B.clamp(min=1)
    return with_totals(
        {
            "clip_frac_tok_low": low_BT.sum() / n_tok,
            "clip_frac_tok_high": high_BT.sum() / n_tok,
            "clip_frac_seq_low": seq_low_B.sum() / n_seq,
            "clip_frac_seq_high": seq_high_B.sum() / n_seq,
        }
    )


def token_ratio_metrics(inp: LossInputs) -> dict[str, Tensor]:
    """Token ratio stats (``ratio_*``), sequence ratio s_i stats (``seq_ratio_*``) and the k3 KL."""
    log_r_BT = inp.log_r_BT.detach()
    log_w_BT = log_r_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    out = ratio_stats("ratio", torch.exp(log_w_BT), inp.valid_BT)
    s_B = torch.exp(sequence_mean(log_r_BT, inp.n_tok_B).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    out.update(ratio_stats("seq_ratio", s_B, inp.has_tok_B))
    out["approx_kl"] = k3_kl(log_w_BT, inp.n_tok_B)
    return out


def sequence_clip_metrics(
    inp: LossInputs, s_B: Tensor, adv_B: Tensor, eps_low: float, eps_high: float
) -> dict[str, Tensor]:
    """Clip fractions for a sequence-level ratio, per sequence and weighted by tokens; its stats."""
    s_B = s_B.detach()
    low_B, high_B = clip_masks(s_B, adv_B, eps_low, eps_high)
    # [low, high] x [sequences, tokens] in one product; rows without tokens weigh 0 in both columns
    w_B2 = torch.stack([inp.has_tok_B.to(inp.n_tok_B.dtype), inp.n_tok_B], -1)
    frac_22 = torch.stack([low_B, high_B]).to(w_B2.dtype) @ w_B2 / w_B2.sum(0).clamp(min=1)
    names = ("seq_low", "tok_low", "seq_high", "tok_high", "seq", "tok")
    out = {f"clip_frac_{k}": v for k, v in zip(names, [*frac_22.flatten(), *frac_22.sum(0)], strict=True)}
    out.update(ratio_stats("ratio", s_B, inp.has_tok_B))
    return out
