"""Token log-probs from final hidden states through the LM head, without materializing ``[N, V]`` logits.

:func:`logprobs_from_hidden` runs a chunked :class:`torch.autograd.Function`: the forward pass computes
the logits of ``chunk_size`` rows at a time (upcast to float32, divided by the temperature) and keeps
only each row's logsumexp; the backward pass recomputes each chunk's logits and turns them into
``grad_logits = g * (onehot(target) - softmax) / temperature`` in place, from which it accumulates the
hidden-state gradient (per chunk) and the LM-head gradient (float32 accumulator, cast to the weight's
dtype at the end). Each pass reuses one preallocated ``[chunk_size, V]`` float32 buffer (two with
entropy, plus one in the weight's dtype for bfloat16), so peak extra memory is about that buffer plus,
when the weight needs a gradient, one ``[V, H]`` float32 accumulator. Cost: one extra ``N x V x H``
matmul versus plain autograd (the logits are recomputed in backward).

With a frozen weight (e.g. LoRA) the hidden gradient is row-separable,
``g_n * ((onehot - softmax) @ W)_n / temperature``, so the forward pass computes
``(onehot - softmax) @ W`` (``[N, H]``) and backward only rescales it by ``g / temperature``: no
recompute, the same two matmuls as plain autograd. Under ``no_grad`` (or when no input needs a
gradient) only the forward chunks run. :func:`naive_logprobs_from_hidden` is the reference that
materializes the full logits.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 512


def truncation_mask(z_NV: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor | None:
    """The support a top-k / top-p sampler draws from, ``[N, V]`` bool (None: no truncation).

    ``z_NV`` are the logits after temperature. top-k keeps every token whose logit is at least the
    k-th largest (0: off); top-p then keeps the smallest set of the most likely tokens whose
    probability (renormalized over the top-k set) reaches ``top_p`` (1: off), and always the most
    likely one. The rule of transformers' and vLLM's samplers; the sampler (:mod:`gspo.rollout.hf`)
    and the trainer's log-probs call this one function, so pi_theta and pi_old are distributions over
    the same truncated support (DeepSeek-V3.2's "keep sampling mask"). Costs a sort of each row.
    """
    V = z_NV.shape[-1]
    truncate_k, truncate_p = 0 < top_k < V, top_p < 1.0
    if not (truncate_k or truncate_p):
        return None
    keep_NV = torch.ones(z_NV.shape, dtype=torch.bool, device=z_NV.device)
    if truncate_k:
        keep_NV = z_NV >= z_NV.topk(top_k, dim=-1).values[:, -1:]
    if truncate_p:
        z_sorted, order = z_NV.masked_fill(~keep_NV, float("-inf")).sort(-1)  # ascending
        drop_sorted = z_sorted.softmax(-1).cumsum(-1) <= 1.0 - top_p
        drop_sorted[:, -1] = False  # the most likely token stays
        keep_NV = keep_NV & ~torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return keep_NV


def truncate_logits(
    z_NV: torch.Tensor, top_k: int, top_p: float, targets_N: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``z_NV`` with every token outside the sampler's support (:func:`truncation_mask`) set to -inf,
    in place, and that support (None: unchanged). ``targets_N`` are always kept: a token the sampler
    drew is in its support, and the trainer's logits may put a near-tie at the edge on the other side
    (a difference of rounding, never -inf log-probs)."""
    if not (0 < top_k < z_NV.shape[-1] or top_p < 1.0):  # no truncation (truncation_mask's None)
        return z_NV, None
    keep_NV = truncation_mask(z_NV, top_k, top_p)
    if targets_N is not None:
        keep_NV.scatter_(-1, targets_N[:, None], True)
    return z_NV.masked_fill_(~keep_NV, float("-inf")), keep_NV


def naive_logprobs_from_hidden(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    return_entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference: full ``[N, V]`` float32 logits, ``log_softmax`` and ``gather`` (``chunk_size`` unused)."""
    return logprobs_from_logits(hidden_NH @ weight_VH.T, targets_N, temperature, return_entropy, top_k, top_p)


def logprobs_from_logits(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits / temperature)[target]`` in float32 (+ the entropy, detached); with
    ``top_k`` / ``top_p``, over the sampler's truncated support, renormalized (:func:`truncate_logits`)."""
    z_NV = logits_NV.float() / temperature
    keep_NV = None
    if top_k > 0 or top_p < 1.0:
        with torch.no_grad():
            _, keep_NV = truncate_logits(z_NV.detach().clone(), top_k, top_p, targets_N)
        if keep_NV is not None:
            z_NV = z_NV.masked_fill(~keep_NV, float("-inf"))
    logp_NV = torch.log_softmax(z_NV, dim=-1)
    logp_N = logp_NV.gather(-1, targets_N[:, None]).squeeze(-1)
    if not return_entropy:
        return logp_N
    plogp_NV = logp_NV.exp() * logp_NV
    if keep_NV is not None:  # 0 * -inf outside the support
        plogp_NV = torch.where(keep_NV, plogp_NV, torch.zeros_like(plogp_NV))
    ent_N = -plogp_NV.sum(-1).detach()
    return logp_N, ent_N


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the softmax math: float32, or float64 for float64 inputs (exact tests, gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


class _ChunkBuffers:
    """Reusable ``[chunk_size, V]`` buffers, so no chunk allocates (and page-faults in) fresh memory.

    ``z`` holds the upcast logits of a chunk; ``raw`` (only when the weight is not already in the
    accumulation dtype, e.g. bfloat16) the matmul output in the weight's dtype; ``aux`` a second upcast
    buffer for the entropy. The last, shorter chunk uses the leading rows of each buffer.
    """

    def __init__(self, rows: int, weight_VH: torch.Tensor, entropy: bool = False):
        V = weight_VH.shape[0]
        acc = _acc_dtype(weight_VH.dtype)
        kw = dict(device=weight_VH.device)
        self.z = torch.empty(rows, V, dtype=acc, **kw)
        self.raw = torch.empty(rows, V, dtype=weight_VH.dtype, **kw) if weight_VH.dtype != acc else None
        self.aux = torch.empty(rows, V, dtype=acc, **kw) if entropy else None

    def logits(self, h_CH: torch.Tensor, weight_VH: torch.Tensor, temperature: float) -> torch.Tensor:
        """Upcast ``h @ W^T / temperature`` of one chunk, written into (a prefix of) ``z``."""
        C = h_CH.shape[0]
        z_CV = self.z[:C]
        if self.raw is None:
            torch.mm(h_CH, weight_VH.T, out=z_CV)
        else:
            raw_CV = self.raw[:C]
            torch.mm(h_CH, weight_VH.T, out=raw_CV)
            z_CV.copy_(raw_CV)
        if temperature != 1.0:
            z_CV.div_(temperature)
        return z_CV

    def matmul_w(self, a_CV: torch.Tensor, weight_VH: torch.Tensor, out: torch.Tensor) -> None:
        """``out = a @ W`` for an upcast ``[C, V]`` chunk, cast to the weight's dtype first (as autograd)."""
        if self.raw is not None:
            a_CV = self.raw[: a_CV.shape[0]].copy_(a_CV)
        torch.mm(a_CV, weight_VH, out=out)


def _forward_chunks(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    chunk_size: int,
    temperature: float,
    return_entropy: bool,
    dlogp_dh_NH: torch.Tensor | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row (target log-prob, logsumexp, entropy or None), float32 ``[N]``, chunk by chunk.

    If ``dlogp_dh_NH`` (``[N, H]``, the weight's dtype) is given, it is filled with
    ``(onehot(target) - softmax) @ W``, i.e. ``temperature * d logp_n / d hidden_n``: the hidden-state
    gradient factors per row as ``g_n * that / temperature``, so with a frozen weight the backward pass
    needs no logits recompute.
    """
    N = hidden_NH.shape[0]
    kw = dict(dtype=_acc_dtype(hidden_NH.dtype), device=hidden_NH.device)
    logp_N = torch.empty(N, **kw)
    lse_N = torch.empty(N, **kw)
    ent_N = torch.empty(N, **kw) if return_entropy else None
    bufs = _ChunkBuffers(min(chunk_size, N), weight_VH, entropy=return_entropy) if N else None
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        z_CV = bufs.logits(hidden_NH[s:e], weight_VH, temperature)
        _, keep_CV = truncate_logits(z_CV, top_k, top_p, targets_N[s:e])  # -inf outside the support
        tgt_C = z_CV.gather(-1, targets_N[s:e, None]).squeeze(-1)
        m_C = z_CV.amax(-1)
        y_CV = z_CV.sub_(m_C[:, None])  # in place: y = z - max <= 0
        if ent_N is None:
            p_CV = y_CV.exp_()  # unnormalized probabilities e^y, in place
            sum_C = p_CV.sum(-1)
        else:
            p_CV = torch.exp(y_CV, out=bufs.aux[: e - s])  # e^y in the second buffer, y kept
            sum_C = p_CV.sum(-1)
            if keep_CV is not None:  # -inf * 0 outside the support
                y_CV.masked_fill_(~keep_CV, 0.0)
            # H = log S - sum_v e^y y / S with S = sum_v e^y; y <= 0 keeps this well conditioned
            ent_N[s:e] = sum_C.log() - y_CV.mul_(p_CV).sum(-1) / sum_C
        lse_C = m_C + sum_C.log()
        lse_N[s:e] = lse_C
        logp_N[s:e] = tgt_C - lse_C
        if dlogp_dh_NH is not None:
            # onehot - softmax, in place on e^y, then one [C, V] x [V, H] matmul
            p_CV.mul_(-sum_C.reciprocal()[:, None])
            p_CV.scatter_add_(1, targets_N[s:e, None], torch.ones_like(p_CV[:, :1]))
            bufs.matmul_w(p_CV, weight_VH, out=dlogp_dh_NH[s:e])
    return logp_N, lse_N, ent_N


class _ChunkedLogprobs(torch.autograd.Function):
    """Chunked log softmax + gather through the LM head.

    Saves the inputs, the per-row logsumexp and, with a frozen weight, the ``[N, H]`` hidden-gradient
    factor; never anything of size ``N x V``.
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, chunk_size, temperature, return_entropy, top_k, top_p):
        # Frozen weight: the hidden gradient is row-separable, so compute it here (one matmul) instead
        # of recomputing the logits in backward (two matmuls). Costs that matmul even if no backward runs.
        dlogp_dh_NH = None
        if ctx.needs_input_grad[0] and not ctx.needs_input_grad[1]:
            dlogp_dh_NH = torch.empty(hidden_NH.shape, dtype=weight_VH.dtype, device=hidden_NH.device)
        logp_N, lse_N, ent_N = _forward_chunks(
            hidden_NH,
            weight_VH,
            targets_N,
            chunk_size,
            temperature,
            return_entropy,
            dlogp_dh_NH,
            top_k,
            top_p,
        )
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, lse_N, dlogp_dh_NH)
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        ctx.truncation = (top_k, top_p)
        if ent_N is None:
            return logp_N
        ctx.mark_non_differentiable(ent_N)
        return logp_N, ent_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp_N, *_grad_ent):
        hidden_NH, weight_VH, targets_N, lse_N, dlogp_dh_NH = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 6  # chunk_size, temperature, return_entropy, top_k, top_p (and targets)
        if not (need_h or need_w):
            return None, None, *none
        chunk_size, temperature = ctx.chunk_size, ctx.temperature
        N = hidden_NH.shape[0]
        acc = _acc_dtype(weight_VH.dtype)
        if grad_logp_N is None:
            grad_logp_N = torch.zeros(N, dtype=acc, device=hidden_NH.device)
        g_N = grad_logp_N.to(acc) / temperature
        if dlogp_dh_NH is not None:  # frozen weight: hidden gradient precomputed in forward
            grad_h_NH = (dlogp_dh_NH.to(acc) * g_N[:, None]).to(hidden_NH.dtype)
            return grad_h_NH, None, *none
        grad_h_NH = torch.empty_like(hidden_NH) if need_h else None
        grad_w_VH = torch.zeros(weight_VH.shape, dtype=acc, device=weight_VH.device) if need_w else None
        bufs = _ChunkBuffers(min(chunk_size, N), weight_VH) if N else None
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            h_CH = hidden_NH[s:e]
            g_C = g_N[s:e]
            # grad_logits = g * (onehot - softmax) / T, built in place on the recomputed logits
            gl_CV = bufs.logits(h_CH, weight_VH, temperature)
            truncate_logits(gl_CV, *ctx.truncation, targets_N[s:e])  # the forward's support, recomputed
            gl_CV.sub_(lse_N[s:e, None]).exp_().mul_(-g_C[:, None])
            gl_CV.scatter_add_(1, targets_N[s:e, None], g_C[:, None])
            if grad_h_NH is not None:
                bufs.matmul_w(gl_CV, weight_VH, out=grad_h_NH[s:e])
            if grad_w_VH is not None:
                grad_w_VH.addmm_(gl_CV.T, h_CH.to(acc))
        if grad_w_VH is not None and grad_w_VH.dtype != weight_VH.dtype:
            grad_w_VH = grad_w_VH.to(weight_VH.dtype)
        return grad_h_NH, grad_w_VH, *none


def logprobs_from_hidden(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    return_entropy: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ W^T / temperature)[target] for N flattened positions -> ``[N]`` float32.

    ``top_k`` / ``top_p``: over the sampler's truncated support, renormalized (:func:`truncate_logits`;
    the support is piecewise constant in the logits, so the gradient is the truncated softmax's).

    With ``return_entropy`` also returns the per-position entropy ``[N]`` (detached). Computed
    ``chunk_size`` rows at a time in forward and backward; the full ``[N, V]`` logits never exist.
    Float32/bfloat16/float16 inputs give float32 outputs; float64 inputs are kept in float64 throughout.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    temperature = float(temperature)
    if torch.is_grad_enabled() and (hidden_NH.requires_grad or weight_VH.requires_grad):
        return _ChunkedLogprobs.apply(
            hidden_NH, weight_VH, targets_N, chunk_size, temperature, return_entropy, top_k, top_p
        )
    with torch.no_grad():
        logp_N, _, ent_N = _forward_chunks(
            hidden_NH, weight_VH, targets_N, chunk_size, temperature, return_entropy, None, top_k, top_p
        )
    return logp_N if ent_N is None else (logp_N, ent_N)
