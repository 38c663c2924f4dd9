"""The registered losses called on plain tensors, for the math tests: ``call("gspo", logp, old, adv,
mask)`` is ``LOSSES["gspo"](loss_inputs(logp, old, mask, adv))`` as ``(loss, metrics)``."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from gspo.loss_prologue import loss_inputs
from gspo.losses import LOSSES

Tensor = torch.Tensor


def call(
    name: str,
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *bounds: float,
    normalizer: float | Tensor | None = None,
    weight: Tensor | None = None,
    aggregation: str | None = None,
    **params: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss ``name`` with its defaults for what is not given; ``bounds``: the two parameters the
    config's eps_low / eps_high set (a clip range), or for a loss without one (SAPO's temperatures)
    its own parameters in order."""
    spec = LOSSES[name]
    params |= dict(zip(spec.eps or tuple(spec.params), bounds, strict=True)) if bounds else {}
    inp = loss_inputs(logp, old_logp, mask, advantages, normalizer=normalizer, weight=weight)
    out = spec(inp, aggregation, **params)
    return out.loss, out.metrics


def tensor_loss(name: str, **kw: object) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """:func:`call` of loss ``name`` as a function of (logp, old_logp, advantages, mask, ...)."""
    return functools.partial(call, name, **kw)
