"""Token log-probs of responses under a causal LM, computed only at response positions.

Three input layouts (:data:`LAYOUTS`), same log-probs and gradients; each sequence is its real
tokens, prompt then response, with position ids counting from 0 at its first prompt token:

- ``rows``: every row's real tokens are moved to the left of its own row, padding to the right end.
  Causal attention never looks right, so no attention mask is needed (sdpa runs its plain causal
  kernel) and the width is the longest *real* sequence, not the longest prompt plus the longest
  response.
- ``packed``: the real tokens of every row are concatenated into one ``[1, N]`` row with position
  ids restarting at 0 per sequence and no attention mask; transformers then builds a block-diagonal
  causal mask from the position ids, so no layer spends compute on padding and sequences cannot
  attend to each other (cheap with flash attention's varlen kernels, costly with a dense mask).
- ``shared_prefix``: rows with the same prompt (the G samples of a group) become one sequence,
  ``[prompt, response_1, ..., response_G]``, under a 4D mask in which each response sees the prompt
  and its own earlier tokens only, and whose position ids continue from the prompt for every
  response. The prompt is computed once per group instead of G times; its keys and values collect
  the gradients of all G responses, exactly the sum the separate rows would give. Needs a model that
  takes a ready 4D additive mask (:func:`takes_additive_mask`); falls back to ``rows`` when no two
  rows share a prompt or the mask would exceed :data:`SHARED_PREFIX_MAX_MASK` entries (its attention
  is dense, so it pays off for short sequences, not for thousands of tokens).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from gspo.compat import transformers_model
from gspo.model.lm_head import (
    DEFAULT_CHUNK_SIZE,
    logprobs_from_hidden,
    logprobs_from_logits,
)
from gspo.model.unwrap import ModelWrapper, unwrap

LAYOUTS = ("rows", "packed", "shared_prefix")
SHARED_PREFIX_MAX_MASK = 1 << 22  # entries of the [U, L, L] mask (16 MiB in float32)
# up to this many logits (N x V, 4 MiB in float32) plain autograd through the LM head is faster than
# the chunked kernel, whose fixed per-call cost (~0.2 ms on a CPU) then dominates; memory is immaterial
PLAIN_HEAD_MAX_LOGITS = 1 << 20


def position_ids_from_mask(attention_mask_BL: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a left-padded prompt sees the same RoPE as an unpadded one."""
    return (attention_mask_BL.long().cumsum(-1) - 1).clamp(min=0)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean "may attend" -> the additive form attention adds to its scores: 0, or dtype's minimum."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )


def attn_implementation(model: PreTrainedModel) -> str:
    """The attention kernel the model runs (``sdpa``, ``eager``, ``flash_attention_2``, ...): a private
    transformers name, read in :mod:`gspo.compat.transformers_model`; ``tests/test_update.py`` pins
    that it follows ``set_attn_implementation``."""
    return transformers_model.attn_implementation(model)


# probe answers per model object: (probe name, key) -> bool; entries go with the model
_PROBES: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, str], bool]] = weakref.WeakKeyDictionary()


def _probed(model: PreTrainedModel, name: str, key: str, probe: Callable[[PreTrainedModel], bool]) -> bool:
    """``probe(model)``, run once per model and ``(name, key)``, then the cached answer."""
    cache = _PROBES.setdefault(model, {})
    if (name, key) not in cache:
        cache[(name, key)] = probe(model)
    return cache[(name, key)]


def _agree(
    model: PreTrainedModel,
    run: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    tol: float,
    errors: tuple[type[Exception], ...] = (Exception,),
) -> bool:
    """``run()`` in eval mode gives ``(ref, got)`` that must agree within ``tol`` relative to ``ref``
    (5e-2 for half precision); a raised ``errors`` is a no."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ref, got = run()
        if model.dtype not in (torch.float32, torch.float64):
            tol = 5e-2
        return bool((ref - got).abs().max() <= tol * max(1.0, float(ref.abs().max())))
    except errors:  # a model that rejects the probed inputs outright
        return False
    finally:
        model.train(was_training)


def takes_additive_mask(model: PreTrainedModel) -> bool:
    """True when a ready 4D additive mask means to the model what its own mask from a 2D padding
    mask does (:func:`_additive_mask_probe`, once per model and attention implementation)."""
    impl = transformers_model.attn_implementation(model)
    return _probed(model, "additive_mask", impl, _additive_mask_probe)


def _additive_mask_probe(model: PreTrainedModel) -> bool:
    """sdpa or eager attention, full attention in every layer (no sliding window), and a probe (two
    tiny left-padded rows, both ways) agrees. The probe catches what the config does not tell, e.g.
    ALiBi biases built from the 2D mask."""
    cfg = model.config
    if attn_implementation(model) not in ("sdpa", "eager"):
        return False
    types = getattr(cfg, "layer_types", None)
    if types is not None and not all(t == "full_attention" for t in types):
        return False
    if types is None and getattr(cfg, "sliding_window", None) is not None:
        return False

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        dev = next(model.parameters()).device
        ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]], device=dev) % model.config.vocab_size
        mask_BL = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], device=dev)
        see_BLL = torch.ones((5, 5), dtype=torch.bool, device=dev).tril() & mask_BL.bool()[:, None, :]
        pos = position_ids_from_mask(mask_BL)
        logits = [
            model(input_ids=ids, attention_mask=m, position_ids=pos).logits[:, -1].float()
            for m in (mask_BL, additive_mask(see_BLL[:, None], model.dtype))
        ]
        return logits[0], logits[1]

    return _agree(model, run, tol=1e-3)


def shared_prefix_is_exact(model: PreTrainedModel) -> bool:
    """True when the model takes 4D masks (:func:`takes_additive_mask`) and a probe (three tiny rows,
    two sharing a prompt, in eval mode; once per model and attention implementation) gives the same
    log-probs in the ``shared_prefix`` layout as in ``rows``: a model that ignores ``position_ids`` or
    rebuilds its own mask is caught here instead of training on wrong log-probs."""
    if not takes_additive_mask(model):
        return False

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        dev, V = next(model.parameters()).device, model.config.vocab_size
        p_ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]], device=dev) % V
        p_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]], device=dev)
        r_ids = torch.tensor([[10, 11, 12], [13, 0, 0], [14, 15, 0]], device=dev) % V
        r_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], device=dev)
        rows = response_logprobs(model, p_ids, p_mask, r_ids, r_mask, layout="rows")
        return rows, response_logprobs(model, p_ids, p_mask, r_ids, r_mask, layout="shared_prefix")

    return _probed(model, "shared_prefix", attn_implementation(model), lambda m: _agree(m, run, tol=1e-3))


@dataclass
class Layout:
    """Model inputs for one batch plus where its response tokens sit.

    ``pred_pos`` holds flat indices into the ``[R, L]`` hidden states of the positions that predict
    each response token (row-major over ``response_mask_BT``). ``response_pos_RL`` marks the response
    tokens' own positions (for per-token statistics such as MoE routing). ``attention_mask_R1LL`` is
    None (plain causal) except for ``shared_prefix``, where it is additive: 0 where a query may look,
    the dtype's minimum elsewhere.
    """

    input_ids_RL: torch.Tensor
    position_ids_RL: torch.Tensor
    pred_pos: torch.Tensor
    response_pos_RL: torch.Tensor
    attention_mask_R1LL: torch.Tensor | None = None


def make_layout(
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    layout: str = "rows",
    mask_dtype: torch.dtype = torch.float32,
    obs_mask_BT: torch.Tensor | None = None,
) -> Layout:
    """Model inputs of prompts + responses in ``layout`` (one of :data:`LAYOUTS`). ``obs_mask_BT``
    (multi-turn trajectories) marks observation tokens between the model's: they are in the sequence
    (the model's later tokens see them) but nothing predicts them: no log-prob, no gradient."""
    args = (prompt_ids_BP, prompt_mask_BP, response_ids_BT, response_mask_BT)
    if layout == "shared_prefix":
        lay = _shared_prefix_layout(*args, mask_dtype, obs_mask_BT)
        if lay is not None:
            return lay
    elif layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return _flat_layout(*args, obs_mask_BT, packed=layout == "packed")


def _flat_layout(
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    obs_mask_BT: torch.Tensor | None,
    packed: bool,
) -> Layout:
    """The ``rows`` layout, or with ``packed`` the ``packed`` one."""
    ids_BL = torch.cat([prompt_ids_BP, response_ids_BT], 1)
    real_BT = response_mask_BT if obs_mask_BT is None else response_mask_BT.bool() | obs_mask_BT.bool()
    mask_BL = torch.cat([prompt_mask_BP.bool(), real_BT.bool()], 1)
    resp_BL = torch.cat([torch.zeros_like(prompt_mask_BP), response_mask_BT], 1).bool()
    if packed:
        flat_ids = ids_BL[mask_BL][None]  # [1, N] real tokens, row after row
        pos = position_ids_from_mask(mask_BL)[mask_BL][None]
        resp_N = resp_BL[mask_BL]
        pred = resp_N.nonzero().squeeze(-1) - 1  # every response token has a prompt token before it
        return Layout(flat_ids, pos, pred, resp_N[None])
    # rows: real token k of a row goes to column k of that row, padding to the right end
    B = ids_BL.shape[0]
    col_BL = mask_BL.long().cumsum(-1) - 1
    L = int(mask_BL.sum(-1).max()) if B else 0
    row_BL = torch.arange(B, device=ids_BL.device)[:, None].expand_as(ids_BL)
    r, c = row_BL[mask_BL], col_BL[mask_BL]
    ids_RL = torch.zeros((B, L), dtype=ids_BL.dtype, device=ids_BL.device)  # any valid id as filler
    ids_RL[r, c] = ids_BL[mask_BL]
    resp_RL = torch.zeros((B, L), dtype=torch.bool, device=ids_BL.device)
    resp_RL[r, c] = resp_BL[mask_BL]
    # hidden at column k predicts the token at column k+1 (row-major, as response_mask_BT selects)
    pred = resp_RL.view(-1).nonzero().squeeze(-1) - 1
    pos_RL = torch.arange(L, device=ids_BL.device).expand(B, L)
    return Layout(ids_RL, pos_RL, pred, resp_RL)


def _shared_prefix_layout(
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    mask_dtype: torch.dtype,
    obs_mask_BT: torch.Tensor | None = None,
) -> Layout | None:
    """One sequence per distinct prompt: ``[prompt, responses of its rows in row order]``; None when
    no prompt is shared or the mask would be too large. Index arithmetic only (no per-row loop).
    A response's observation tokens (``obs_mask_BT``) are in its segment but predict nothing."""
    dev = prompt_ids_BP.device
    B = prompt_ids_BP.shape[0]
    keyed_BP = torch.where(prompt_mask_BP.bool(), prompt_ids_BP, -1)  # padding cannot tell prompts apart
    group: dict[tuple[int, ...], int] = {}  # prompt -> its sequence (on the host: B small rows)
    grp = [group.setdefault(tuple(r), len(group)) for r in keyed_BP.tolist()]
    U = len(group)
    if U == B:
        return None
    grp_B = torch.tensor(grp, device=dev)
    uniq_UP = torch.tensor(list(group), dtype=keyed_BP.dtype, device=dev)
    real_UP = uniq_UP >= 0
    plen_U = real_UP.sum(-1)
    real_BT = response_mask_BT.bool() if obs_mask_BT is None else response_mask_BT.bool() | obs_mask_BT.bool()
    rank_BT = real_BT.long().cumsum(-1) - 1  # t-th real response token of its row
    rb, rt = real_BT.nonzero(as_tuple=True)  # response tokens, row-major
    rk = rank_BT[rb, rt]
    rlen_B = torch.bincount(rb, minlength=B)
    rtot_U = torch.zeros_like(plen_U).index_add_(0, grp_B, rlen_B)
    L = int((plen_U + rtot_U).max())
    if U * L * L > SHARED_PREFIX_MAX_MASK:
        return None
    # row b's responses start after its prompt and the responses of the earlier rows of its group
    order = torch.argsort(grp_B, stable=True)  # group-major, row order within a group
    before_B = torch.empty_like(rlen_B)
    before_B[order] = rlen_B[order].cumsum(0) - rlen_B[order]  # response tokens of all earlier rows
    start_B = plen_U[grp_B] + before_B - (rtot_U.cumsum(0) - rtot_U)[grp_B]
    ru, rc = grp_B[rb], start_B[rb] + rk  # sequence and column of each response token
    pu, pp = real_UP.nonzero(as_tuple=True)
    pj = (real_UP.long().cumsum(-1) - 1)[pu, pp]  # j-th real prompt token (any padding side)
    ids_UL = torch.zeros((U, L), dtype=prompt_ids_BP.dtype, device=dev)  # any valid id as filler
    pos_UL = torch.zeros((U, L), dtype=torch.long, device=dev)
    seg_UL = torch.full((U, L), -1, dtype=torch.long, device=dev)  # 0: prompt, b + 1: row b's response
    ids_UL[pu, pj], pos_UL[pu, pj], seg_UL[pu, pj] = uniq_UP[pu, pp], pj, 0
    ids_UL[ru, rc], pos_UL[ru, rc], seg_UL[ru, rc] = response_ids_BT[rb, rt], plen_U[ru] + rk, rb + 1
    # the first response token is predicted by the prompt's last token, later ones by their predecessor
    pred = ru * L + torch.where(rk == 0, plen_U[ru] - 1, rc - 1)
    seg_q, seg_k = seg_UL[:, :, None], seg_UL[:, None, :]
    see_ULL = torch.ones((L, L), dtype=torch.bool, device=dev).tril() & ((seg_k == 0) | (seg_k == seg_q))
    resp_UL = seg_UL > 0
    if obs_mask_BT is not None:  # observation tokens are context only: not predicted, not "response"
        own = response_mask_BT.bool()[rb, rt]
        pred = pred[own]
        resp_UL[ru[~own], rc[~own]] = False
    return Layout(ids_UL, pos_UL, pred, resp_UL, additive_mask(see_ULL[:, None], mask_dtype))


def response_logprobs(
    model: PreTrainedModel,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    response_ids_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 512,
    return_entropy: bool = False,
    layout: str | Layout = "rows",
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t | x, y_<t) for every response token -> ``[B, T]`` float32 (0 on padding): the
    trainer's forward (:class:`PolicyLogprobs`) on a bare model. ``layout`` names one of
    :data:`LAYOUTS` or is a :class:`Layout` already made from these tensors. Every row needs at
    least one prompt token."""
    model = unwrap(model, "transformers")
    lay = layout
    if not isinstance(lay, Layout):
        lay = make_layout(prompt_ids_BP, prompt_mask_BP, response_ids_BT, response_mask_BT, lay, model.dtype)
    policy = PolicyLogprobs(model)
    return policy(
        lay, response_ids_BT, response_mask_BT, temperature, chunk_size, return_entropy, top_k, top_p
    )


class PolicyLogprobs(ModelWrapper):
    """The trainer's forward as a module: ``Layout`` + responses -> response log-probs (+ entropy).

    The LM head runs only on the ``N`` real response positions (chunked, see
    :func:`~gspo.model.lm_head.logprobs_from_hidden`; plain autograd up to
    :data:`PLAIN_HEAD_MAX_LOGITS`), never on prompt or padding positions, unless the model
    post-processes its logits (:func:`lm_head_is_plain`). ``top_k`` / ``top_p``: log-probs over the
    sampler's truncated support, renormalized (:func:`~gspo.model.lm_head.truncate_logits`).

    Data-parallel wrappers (DDP, FSDP2's root unit) hook a module's own ``forward``; the training
    loop calls this module, so they wrap the computation it actually runs (base model, then the LM
    head at response positions only) through public forwards, with no hooks moved by hand.
    ``self.model`` is the Hugging Face causal LM (or its PEFT wrapper), so parameter names carry a
    ``model.`` prefix.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        lay: Layout,
        response_ids_BT: torch.Tensor,
        response_mask_BT: torch.Tensor,
        temperature: float = 1.0,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        return_entropy: bool = False,
        top_k: int = 0,
        top_p: float = 1.0,
        plain: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``plain`` (default :func:`lm_head_is_plain`): base model + LM head at the predicting
        positions; else the whole causal-LM forward (its own logit post-processing included)."""
        model = unwrap(self.model, "transformers")
        kw = dict(input_ids=lay.input_ids_RL, attention_mask=lay.attention_mask_R1LL)
        kw.update(position_ids=lay.position_ids_RL, use_cache=False)
        sel_BT = response_mask_BT.bool()
        targets_N = response_ids_BT[sel_BT]
        head = (targets_N, temperature, return_entropy, top_k, top_p)
        if plain is None:
            plain = lm_head_is_plain(model)
        if plain:
            hidden = model.base_model(**kw).last_hidden_state
            hidden_NH = hidden.reshape(-1, hidden.shape[-1])[lay.pred_pos]
            weight_VH = model.get_output_embeddings().weight  # after the forward: FSDP has unsharded it
            if hidden_NH.shape[0] * weight_VH.shape[0] <= PLAIN_HEAD_MAX_LOGITS:
                res = logprobs_from_logits(hidden_NH @ weight_VH.T, *head)
            else:
                res = logprobs_from_hidden(hidden_NH, weight_VH, targets_N, chunk_size, *head[1:])
        else:
            logits = model(**kw).logits
            res = logprobs_from_logits(logits.reshape(-1, logits.shape[-1])[lay.pred_pos], *head)
        logp_N, ent_N = res if return_entropy else (res, None)
        B, T = response_ids_BT.shape
        logp_BT = torch.zeros(B, T, dtype=torch.float32, device=logp_N.device).masked_scatter(sel_BT, logp_N)
        if not return_entropy:
            return logp_BT
        ent_BT = torch.zeros(B, T, dtype=torch.float32, device=logp_N.device).masked_scatter(sel_BT, ent_N)
        return logp_BT, ent_BT


def as_policy(model: nn.Module) -> nn.Module:
    """``model`` as the trainer's forward module: a bare HF model is put in a :class:`PolicyLogprobs`."""
    if isinstance(model, PolicyLogprobs | nn.parallel.DistributedDataParallel):
        return model
    return PolicyLogprobs(model)


def probe(model: PreTrainedModel) -> None:
    """Run (and cache) every probe of this model now: before sharding or routing capture, which the
    probes' own plain forwards must not meet."""
    lm_head_is_plain(model)
    shared_prefix_is_exact(model)


def probe_results(model: PreTrainedModel) -> dict[tuple[str, str], bool]:
    """Every probe answer cached for ``model`` (run :func:`probe` first)."""
    return dict(_PROBES.get(model, {}))


def adopt_probes(model: PreTrainedModel, results: dict[tuple[str, str], bool]) -> None:
    """Take ``results`` (another module's :func:`probe_results`, same architecture and weights) as
    ``model``'s own: a model built on the meta device cannot run a probe before its weights arrive."""
    _PROBES.setdefault(model, {}).update(results)


def lm_head_is_plain(model: PreTrainedModel) -> bool:
    """True when the logits are exactly ``hidden @ W^T`` (:func:`_plain_head_probe`, once per model)."""
    return _probed(model, "plain_head", "", _plain_head_probe)


def _plain_head_probe(model: PreTrainedModel) -> bool:
    """Whether the chunked LM head may replace the model's own logits: a probe on two tiny rows
    against them. Architectures that scale or soft-cap their logits (Granite, Cohere, Gemma 2/3,
    ...) fail it and get the full forward instead (exact; costs ``[N, V]`` logits). Run it outside
    MoE routing capture/replay (the training loop does), or those would record the probe."""

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        dev, V = next(model.parameters()).device, model.config.vocab_size
        p_ids, r_ids = (
            torch.tensor([[5, 6], [7, 8]], device=dev) % V,
            torch.tensor([[9, 10], [11, 12]], device=dev) % V,
        )
        ones = torch.ones(2, 2, dtype=torch.long, device=dev)
        policy = PolicyLogprobs(model)
        lay = make_layout(p_ids, ones, r_ids, ones, "rows")
        return policy(lay, r_ids, ones, plain=False), policy(lay, r_ids, ones, plain=True)

    return _agree(model, run, tol=1e-4, errors=())
