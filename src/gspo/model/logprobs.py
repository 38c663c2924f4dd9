"""Token log-probs from final hidden states through the LM head, without materializing ``[N, V]`` logits.

:func:`logprobs_from_hidden` runs a chunked :class:`torch.autograd.Function`: the forward pass computes
the logits of ``chunk_size`` rows at a time (upcast to float32, divided by the temperature) and keeps
only each row's logsumexp; the backward pass recomputes each chunk's logits and turns them into
``grad_logits = g * (onehot(target) - softmax) / temperature`` in place, from which it accumulates the
hidden-state gradient (per chunk) and the LM-head gradient (float32 accumulator, cast to the weight's
dtype at the end). Peak extra memory is a few ``[chunk_size, V]`` float32 buffers plus, when the weight
needs a gradient, one ``[V, H]`` float32 accumulator. :func:`naive_logprobs_from_hidden` is the
reference that materializes the full logits.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 256


def naive_logprobs_from_hidden(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference: full ``[N, V]`` float32 logits, ``log_softmax`` and ``gather`` (``chunk_size`` unused)."""
    logits_NV = (hidden_NH @ weight_VH.T).float() / temperature
    logp_NV = torch.log_softmax(logits_NV, dim=-1)
    logp_N = logp_NV.gather(-1, targets_N[:, None]).squeeze(-1)
    if not return_entropy:
        return logp_N
    ent_N = -(logp_NV.exp() * logp_NV).sum(-1).detach()
    return logp_N, ent_N


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the softmax math: float32, or float64 for float64 inputs (exact tests, gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h_CH: torch.Tensor, weight_VH: torch.Tensor, temperature: float) -> torch.Tensor:
    """Upcast ``h @ W^T / temperature`` for one chunk; always a fresh tensor, safe to modify in place."""
    logits_CV = h_CH @ weight_VH.T
    logits_CV = logits_CV.to(_acc_dtype(logits_CV.dtype))  # no copy for float32: matmul output is fresh
    if temperature != 1.0:
        logits_CV.div_(temperature)
    return logits_CV


def _forward_chunks(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    chunk_size: int,
    temperature: float,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (target log-prob, logsumexp, entropy or None), float32 ``[N]``, chunk by chunk."""
    N = hidden_NH.shape[0]
    kw = dict(dtype=_acc_dtype(hidden_NH.dtype), device=hidden_NH.device)
    logp_N = torch.empty(N, **kw)
    lse_N = torch.empty(N, **kw)
    ent_N = torch.empty(N, **kw) if return_entropy else None
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        logits_CV = _chunk_logits(hidden_NH[s:e], weight_VH, temperature)
        lse_C = torch.logsumexp(logits_CV, dim=-1)
        lse_N[s:e] = lse_C
        logp_CV = logits_CV.sub_(lse_C[:, None])  # in place: the chunk buffer now holds log-probs
        logp_N[s:e] = logp_CV.gather(-1, targets_N[s:e, None]).squeeze(-1)
        if ent_N is not None:
            # -sum_v p_v log p_v (not lse - sum p z, which cancels badly for peaked rows)
            ent_N[s:e] = -logp_CV.exp().mul_(logp_CV).sum(-1)
        del logits_CV, logp_CV
    return logp_N, lse_N, ent_N


class _ChunkedLogprobs(torch.autograd.Function):
    """Chunked log softmax + gather through the LM head; saves only inputs and per-row logsumexp."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, chunk_size, temperature, return_entropy):
        logp_N, lse_N, ent_N = _forward_chunks(
            hidden_NH, weight_VH, targets_N, chunk_size, temperature, return_entropy
        )
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, lse_N)
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        if ent_N is None:
            return logp_N
        ctx.mark_non_differentiable(ent_N)
        return logp_N, ent_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp_N, *_grad_ent):
        hidden_NH, weight_VH, targets_N, lse_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w):
            return None, None, None, None, None, None
        chunk_size, temperature = ctx.chunk_size, ctx.temperature
        N = hidden_NH.shape[0]
        grad_h_NH = torch.empty_like(hidden_NH) if need_h else None
        acc = _acc_dtype(weight_VH.dtype)
        grad_w_VH = torch.zeros(weight_VH.shape, dtype=acc, device=weight_VH.device) if need_w else None
        if grad_logp_N is None:
            grad_logp_N = torch.zeros(N, dtype=acc, device=hidden_NH.device)
        g_N = grad_logp_N.to(acc) / temperature
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            h_CH = hidden_NH[s:e]
            g_C = g_N[s:e]
            # grad_logits = g * (onehot - softmax) / T, built in place on the recomputed logits
            gl_CV = _chunk_logits(h_CH, weight_VH, temperature)
            gl_CV.sub_(lse_N[s:e, None]).exp_().mul_(-g_C[:, None])
            gl_CV.scatter_add_(1, targets_N[s:e, None], g_C[:, None])
            if grad_h_NH is not None:
                torch.matmul(gl_CV.to(weight_VH.dtype), weight_VH, out=grad_h_NH[s:e])
            if grad_w_VH is not None:
                grad_w_VH.addmm_(gl_CV.T, h_CH.to(acc))
            del gl_CV
        if grad_w_VH is not None and grad_w_VH.dtype != weight_VH.dtype:
            grad_w_VH = grad_w_VH.to(weight_VH.dtype)
        return grad_h_NH, grad_w_VH, None, None, None, None


def logprobs_from_hidden(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ W^T / temperature)[target] for N flattened positions -> ``[N]`` float32.

    With ``return_entropy`` also returns the per-position entropy ``[N]`` (detached). Computed
    ``chunk_size`` rows at a time in forward and backward; the full ``[N, V]`` logits never exist.
    Float32/bfloat16/float16 inputs give float32 outputs; float64 inputs are kept in float64 throughout.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    temperature = float(temperature)
    if torch.is_grad_enabled() and (hidden_NH.requires_grad or weight_VH.requires_grad):
        return _ChunkedLogprobs.apply(hidden_NH, weight_VH, targets_N, chunk_size, temperature, return_entropy)
    with torch.no_grad():
        logp_N, _, ent_N = _forward_chunks(
            hidden_NH, weight_VH, targets_N, chunk_size, temperature, return_entropy
        )
    return logp_N if ent_N is None else (logp_N, ent_N)
