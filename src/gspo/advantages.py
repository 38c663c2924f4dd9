"""Group-relative advantages (pure tensor functions)."""

from __future__ import annotations

import torch

from gspo.errors import GspoError

SCALES = ("group", "batch", "none", "maxrl")


def _center(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """x - mean(x), two-pass so the result sums to ~0 even when |mean| >> spread."""
    keep = dim is not None
    c = x - (x.mean(dim=dim, keepdim=True) if keep else x.mean())
    return c - (c.mean(dim=dim, keepdim=True) if keep else c.mean())


def _pop_std(centered: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Population std of already-centered values, rescaled so squaring cannot overflow."""
    keep = dim is not None
    amax = centered.abs().amax(dim=dim, keepdim=True) if keep else centered.abs().amax()
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    rms = (centered / safe).pow(2).mean(dim=dim, keepdim=True) if keep else (centered / safe).pow(2).mean()
    return amax * rms.sqrt()


def _pow2_scale(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """Power of two ``2^k <= max|x| < 2^(k+1)`` (1 where max|x| is 0 or not finite).

    Dividing by it is exact, and it maps the values into ``[-2, 2]`` so that sums cannot overflow near
    ``finfo.max`` and subnormal rewards keep their relative precision.
    """
    amax = x.abs().amax(dim=dim, keepdim=True) if dim is not None else x.abs().amax()
    ok = (amax > 0) & torch.isfinite(amax)
    _, exp = torch.frexp(torch.where(ok, amax, torch.ones_like(amax)))
    return torch.where(ok, torch.ldexp(torch.ones_like(amax), exp - 1), torch.ones_like(amax))


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """A_ij = (r_ij - mean_j r_ij) / (std + eps) for ``rewards`` of shape ``[num_groups, G]``.

    scale:
        ``"group"``: divide by each group's std (GRPO/GSPO, paper eq. 6).
        ``"batch"``: divide by the std of the whole batch (less noisy for small G; Dr.GRPO-style
        centering is kept per group).
        ``"none"``: center only; ``"maxrl"``: divide by the group's mean reward (:func:`maxrl_advantages`).
    std is the population std (correction 0), so G = 1 gives A = 0, not NaN. A group whose rewards
    are all equal has zero centered rewards and therefore A = 0 exactly for every scale. For finite
    rewards the "group"/"batch" results are finite over the whole float range (they are computed in
    power-of-two rescaled units, which is exact); "none" is finite whenever the centered value is.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    rewards_NG = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if rewards_NG.numel() == 0:
        return rewards_NG.clone()
    if scale == "maxrl":
        return maxrl_advantages(rewards_NG, eps)
    unit_N1 = _pow2_scale(rewards_NG, dim=1)
    centered_NG = _center(rewards_NG / unit_N1, dim=1)  # in units of unit_N1
    # sum/G rounds (e.g. seven float32 0.1s), so force exact zeros for groups of equal rewards
    equal_N1 = (rewards_NG == rewards_NG[:, :1]).all(dim=1, keepdim=True)
    centered_NG = torch.where(equal_N1, torch.zeros_like(centered_NG), centered_NG)
    if scale == "none":
        return centered_NG * unit_N1
    if scale == "group":
        std_N1 = _pop_std(centered_NG, dim=1)
        # (c u) / (std u + eps) == c / (std + eps / u); eps / u = inf (u tiny) correctly gives ~0
        denom = std_N1 + torch.full_like(unit_N1, eps) / unit_N1  # not eps * (1/u): 0 * inf
    else:
        unit = _pow2_scale(rewards_NG, dim=None)
        std = _pop_std(_center(rewards_NG / unit, dim=None), dim=None)
        # (c u_N) / (std U + eps) == c (u_N / U) / (std + eps / U); u_N / U <= 1 is a power of two
        centered_NG = centered_NG * (unit_N1 / unit)
        denom = std + torch.full_like(unit, eps) / unit
    # denom == 0 only when the std is 0 (all centered rewards are 0): avoid 0/0 when eps == 0
    return centered_NG / torch.where(denom > 0, denom, torch.ones_like(denom))


def maxrl_advantages(rewards_NG: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """MaxRL's advantages (arXiv 2602.02710, "p-normalisation"): each group's centered rewards divided
    by its mean reward instead of its std, A_ij = (r_ij - m_i) / (m_i + eps), for ``rewards_NG`` of
    shape ``[num_groups, G]`` (float32 or wider). TRL, prime-rl and the authors' verl code divide the
    same way, each with its own small eps.

    For 0/1 rewards this turns the pass@1 gradient into the maximum-likelihood one: with eps = 0,
    (1/G) sum_j A_ij grad log pi(y_ij) is the mean of grad log pi over the group's successes minus
    its mean over the whole group. The rewards must be >= 0 (``gspo train`` refuses others, see
    :func:`check_maxrl_rewards`); then A_ij = r_ij / m_i - 1 lies in [-1, G - 1] and is finite over
    the whole float range. Other non-negative rewards (partial credit) give each reward's excess over
    the mean relative to the mean, invariant to rescaling the rewards, but the maximum-likelihood
    reading holds for 0/1 rewards only (the paper's setting). A group whose mean reward is 0 (every
    reward 0: no success to learn from) gets A = 0, as a group of equal rewards does; so does one
    whose mean is negative (only possible with negative rewards), rather than a flipped sign.
    """
    unit_N1 = _pow2_scale(rewards_NG, dim=1)  # exact rescaling, as in group_advantages
    scaled_NG = rewards_NG / unit_N1
    equal_N1 = (rewards_NG == rewards_NG[:, :1]).all(dim=1, keepdim=True)
    centered_NG = torch.where(equal_N1, torch.zeros_like(scaled_NG), _center(scaled_NG, dim=1))
    mean_N1 = scaled_NG.mean(dim=1, keepdim=True)
    # (c u) / (m u + eps) == c / (m + eps / u); a mean <= 0 divides by inf: A = 0
    denom_N1 = torch.where(mean_N1 > 0, mean_N1 + torch.full_like(unit_N1, eps) / unit_N1, torch.inf)
    return centered_NG / denom_N1


def check_maxrl_rewards(rewards_B: torch.Tensor, name: str) -> None:
    """``adv_scale`` ``maxrl`` divides by each group's mean reward: a negative reward (whose group's
    mean may be 0 or below, flipping or exploding every advantage) stops the run in one line."""
    bad = (rewards_B < 0).nonzero()
    if len(bad):
        i = int(bad[0])
        raise GspoError(
            f"reward function {name}: sample {i}'s reward is {float(rewards_B[i]):g}, but adv_scale 'maxrl' "
            "divides by the group's mean reward and needs rewards >= 0 (0/1 in the paper)"
        )


def overlong_penalty(len_B: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), added to the reward:

        0                                  if |y| <= max_len - buffer
        factor * ((max_len - buffer) - |y|) / buffer    inside the last ``buffer`` tokens
        -factor                            if |y| >= max_len (the response was cut off)

    ``buffer = 0`` disables it (all zeros)."""
    if buffer <= 0:
        return torch.zeros_like(len_B, dtype=torch.float32)
    over_B = (len_B.float() - (max_len - buffer)).clamp(min=0, max=buffer)
    return -factor * over_B / buffer


def check_finite_rewards(
    rewards_B: torch.Tensor, penalty_B: torch.Tensor, name: str, overlong_penalty: float
) -> None:
    """Rewards as trained (float32, overlong penalty added) must be finite: an inf would make every
    advantage NaN and every update be skipped, blaming the learning rate."""
    bad = (~rewards_B.isfinite()).nonzero()
    if len(bad):
        i = int(bad[0])
        raise GspoError(
            f"reward function {name}: sample {i}'s reward plus the overlong penalty ({float(penalty_B[i]):g}, "
            f"overlong_penalty={overlong_penalty:g}) is {float(rewards_B[i])} in float32, the rewards' "
            "training dtype"
        )
