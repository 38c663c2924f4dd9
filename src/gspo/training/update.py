"""The policy update: ``num_minibatches`` optimizer steps over one rollout batch (GSPO paper, sec. 5).

    record pi_old                    (the trainer's, of minibatches 1..: before any step)
    for each minibatch i:            (contiguous rows of the rollout batch)
        for each micro-batch:        logp = pi_theta(rows); loss(logp, pi_old, A) / N; backward
                                     (pi_old: the sampler's or the trainer's, as the plan says)
        clip the gradient norm, optimizer step

What only reports on the update (the expert volatility of an MoE, once, after the first step; the
train/rollout mismatch where no correction uses it) attaches as observers the plan chose, called at
named points of it (:class:`UpdateObserver`); what changes the loss's weight or mask beside the loss
(a mismatch correction, OPSM, a random drop) is the plan's ``adjustments``: none by default.

``N`` is the global normalizer of the whole minibatch (its sequences, or its tokens for a token-level
aggregation, over all ranks), so micro-batches and ranks add up to the update one process would make
on the whole minibatch. Gradients are averaged across ranks, so each rank's loss is scaled by the
world size.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import nn

from gspo import correction as C
from gspo.data import TrainBatch
from gspo.loss_prologue import loss_inputs
from gspo.losses import LOSSES
from gspo.model import routing as R
from gspo.model.logprobs import Layout, as_policy, make_layout
from gspo.model.unwrap import full_tensor, unwrap
from gspo.plans import UpdatePlan
from gspo.training import distributed as dist_utils

# How each logged metric of a micro-batch combines with the others of the rollout batch:
# a mean weighted by the micro-batch's response tokens or sequences, a minimum or a maximum.
TOKEN, SEQUENCE, MIN, MAX = "token", "sequence", "min", "max"
METRICS: dict[str, str] = {
    "loss/clip_frac_tok": TOKEN,
    "loss/clip_frac_tok_low": TOKEN,
    "loss/clip_frac_tok_high": TOKEN,
    "loss/clip_frac_seq": SEQUENCE,
    "loss/clip_frac_seq_low": SEQUENCE,
    "loss/clip_frac_seq_high": SEQUENCE,
    "loss/approx_kl": TOKEN,
    "loss/ratio_mean": SEQUENCE,  # the loss's own ratio: s_i, or per token (LossSpec.token_ratio)
    "loss/ratio_min": MIN,
    "loss/ratio_max": MAX,
    "loss/seq_ratio_mean": SEQUENCE,  # s_i, where the loss's own ratio is per token
    "loss/seq_ratio_min": MIN,
    "loss/seq_ratio_max": MAX,
    "loss/tok_ratio_min": MIN,  # token ratios, where the loss's own ratio is s_i (not used by it)
    "loss/tok_ratio_max": MAX,
    "loss/gate_tok_mean": TOKEN,  # SAPO's soft gate
    "loss/gate_seq_mean": SEQUENCE,
    "loss/gate_min": MIN,
    "loss/cov_frac_tok": TOKEN,  # Clip-Cov / KL-Cov: the share of tokens selected
    "loss/cov_threshold": SEQUENCE,  # ... and the smallest selected covariance, of each call
    "rollout/entropy": TOKEN,
    # |trainer pi_old - sampler| log-probs: per-sequence token mean, and of the sequence mean
    "mismatch/token_abs_logp_diff": SEQUENCE,
    "mismatch/seq_abs_logp_diff": SEQUENCE,
}
# gspo.correction.mismatch_metrics (with --mismatch-correction)
_MISMATCH = {
    "mismatch_k1_tok": TOKEN,
    "mismatch_k3_tok": TOKEN,
    "mismatch_k1_seq": SEQUENCE,
    "mismatch_k3_seq": SEQUENCE,
    "mismatch_ratio_tok_min": MIN,
    "mismatch_ratio_tok_max": MAX,
    "mismatch_ratio_seq": SEQUENCE,
    "mismatch_ratio_seq_min": MIN,
    "mismatch_ratio_seq_max": MAX,
    "tis_weight_seq": SEQUENCE,
    "tis_trunc_frac_seq": SEQUENCE,
    "tis_trunc_frac_tok": TOKEN,
    "seq_mask_frac_seq": SEQUENCE,
    "seq_mask_frac_tok": TOKEN,
    "tok_mask_frac_tok": TOKEN,
    "tok_mask_frac_seq": SEQUENCE,
    "opsm_frac_seq": SEQUENCE,  # off-policy sequence masking (--opsm-threshold)
    "opsm_frac_tok": TOKEN,
    "random_drop_frac_seq": SEQUENCE,  # --random-seq-drop
}
METRICS.update({f"mismatch/{k}": v for k, v in _MISMATCH.items()})


# ------------------------------------------------------------------------------------------------
# the rollout batch, cut into minibatches of micro-batches


@dataclass(frozen=True)
class MicroBatch:
    """The rows of one forward/backward and everything the loss needs for them, frozen once
    ``update.record_pi_old`` has recorded the trainer's pi_old (before any optimizer step)."""

    data: TrainBatch
    layout: Layout  # model inputs, built once for every forward of these rows
    old_logp_BT: torch.Tensor | None = None  # trainer's pi_old log-probs [B, T] (None: not recorded)
    old_routing: R.Routing | None = None  # pi_old's experts per MoE layer (R2 replay, volatility)
    replay: R.Routing | None = None  # experts forced in the training forward (None: the router chooses)
    on_policy: bool = False  # no update yet (minibatch 0): its own first training forward is pi_old

    @property
    def mask_BT(self) -> torch.Tensor:
        return self.data.response_mask_BT

    @property
    def n_tokens(self) -> torch.Tensor:
        return self.mask_BT.sum()

    @property
    def n_sequences(self) -> torch.Tensor:
        return (self.mask_BT.sum(-1) > 0).sum()


def split_minibatches(
    data: TrainBatch, n_minibatches: int, micro_size: int, layout: str, mask_dtype: torch.dtype
) -> list[list[MicroBatch]]:
    """``n_minibatches`` contiguous slices of ``data`` (the paper's minibatches), each cut into
    micro-batches of at most ``micro_size`` rows of similar length (length bucketing, so little
    compute goes to padding), each with its model inputs laid out as ``layout``."""
    size = len(data) // n_minibatches
    out = []
    for i in range(n_minibatches):
        mb = data.rows(slice(i * size, (i + 1) * size))
        if micro_size >= size:
            parts = [mb]
        else:
            order = torch.argsort(mb.prompt_mask_BP.sum(-1) + mb.real_mask_BT.sum(-1), stable=True)
            parts = [mb.rows(order[j : j + micro_size]) for j in range(0, size, micro_size)]
        out.append([MicroBatch(p, make_layout(
            p.prompt_ids_BP, p.prompt_mask_BP, p.response_ids_BT, p.response_mask_BT, layout, mask_dtype,
            p.obs_mask_BT,
        )) for p in parts])  # fmt: skip
    return out


@dataclass
class Forward:
    """One forward of a micro-batch under the current policy."""

    logp_BT: torch.Tensor  # [B, T] response log-probs (0 on padding)
    entropy_BT: torch.Tensor | None  # [B, T] token entropy when asked
    routing: R.Routing | None  # experts chosen per MoE layer when captured


def forward(
    policy: nn.Module,
    mb: MicroBatch,
    plan: UpdatePlan,
    entropy: bool = False,
    replay: R.Routing | None = None,
    capture: bool = False,
) -> Forward:
    """Response log-probs of ``mb`` under ``policy`` (a :class:`PolicyLogprobs`, possibly wrapped by
    DDP/FSDP), optionally forcing (``replay``) or recording (``capture``) the MoE routing."""
    hf = unwrap(policy, "transformers")
    forcing = R.replay_routing(hf, replay) if replay is not None else nullcontext()
    with forcing, R.capture_routing(hf) if capture else nullcontext() as rec:
        out = policy(
            mb.layout, mb.data.response_ids_BT, mb.mask_BT, plan.temperature, plan.logp_chunk_size, entropy,
            top_k=plan.top_k, top_p=plan.top_p, plain=plan.plain_head,
        )  # fmt: skip
    logp, ent = out if entropy else (out, None)
    return Forward(logp, ent, R.routing_snapshot(rec) if capture else None)


# ------------------------------------------------------------------------------------------------
# pi_old and routing


@torch.no_grad()
def record_pi_old(
    policy: nn.Module, minibatches: list[list[MicroBatch]], plan: UpdatePlan
) -> list[list[MicroBatch]]:
    """The micro-batches with what the update needs of the trainer's pi_old, recorded before any
    optimizer step (the loss's pi_old is chosen from it in :func:`pi_old`).

    Minibatch 0 is on-policy: its own first training forward is the trainer's pi_old (free).
    Minibatches 1.. get one no-grad forward when the plan needs the trainer's pi_old, or pi_old's
    routing (R2 forces it in their training forwards; volatility compares with it)."""
    return [[_record_pi_old(policy, mb, plan, i) for mb in mbs] for i, mbs in enumerate(minibatches)]


def _record_pi_old(policy: nn.Module, mb: MicroBatch, plan: UpdatePlan, i: int) -> MicroBatch:
    own = plan.own_routing[i]
    replay = old_routing = old_logp = None
    if plan.replays_sampler:  # R3: the sampler's experts, forced in every forward of these rows
        L = mb.layout.input_ids_RL.shape[1]
        replay = {k: v[:, :L] for k, v in mb.data.sampler_routing.items()}
        if own:  # pi_old's own experts need a forward without replay
            old_routing = forward(policy, mb, plan, capture=True).routing
    if i == 0:
        return replace(mb, replay=replay, old_routing=old_routing, on_policy=True)
    own_here = own and not plan.replays_sampler  # pi_old's routing comes from the forward below
    if plan.trainer_pi_old or own_here:
        f = forward(policy, mb, plan, replay=replay, capture=own_here)
        old_logp = f.logp_BT
        if own_here:
            old_routing = f.routing
            replay = f.routing if plan.replays_pi_old else None
    return replace(mb, old_logp_BT=old_logp, old_routing=old_routing, replay=replay)


def pi_old(mb: MicroBatch, f: Forward, plan: UpdatePlan) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one place pi_old is chosen -> (the loss's pi_old, the trainer's pi_old or None where it
    was not computed). The trainer's is minibatch 0's own training forward ``f`` (no step yet), else
    what :func:`record_pi_old` recorded; the loss takes the sampler's log-probs where the plan says."""
    trainer_BT = f.logp_BT.detach() if mb.on_policy else mb.old_logp_BT
    return (mb.data.sampler_logp_BT if plan.sampler_pi_old else trainer_BT), trainer_BT


# ------------------------------------------------------------------------------------------------
# observers: what only reports on the update, chosen by the plan (UpdatePlan.observers)


class UpdateObserver:
    """Watches one policy update from outside its loss, at named points: whether a minibatch's
    training forwards record their routing (``captures``), each micro-batch after its backward,
    each minibatch's routings, each optimizer step; then its metrics. Each point does nothing here."""

    def captures(self, i: int) -> bool:
        return False

    def micro_batch(self, mb: MicroBatch, trainer_BT: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return {}

    def minibatch(self, i: int, minibatch: list[MicroBatch], routings: list[R.Routing | None]) -> None:
        pass

    def stepped(self, i: int, policy: nn.Module) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


class Volatility(UpdateObserver):
    """Expert-activation volatility (MoE): the fraction of response tokens whose top-k experts one
    optimizer step changed, on minibatch ``plan.volatility_minibatch``, against pi_old's routing.
    Read off that minibatch's own training forwards when it is next trained one step after pi_old
    (``free``); else one no-grad forward of it after the first step (``forward``)."""

    def __init__(self, plan: UpdatePlan, minibatches: list[list[MicroBatch]]) -> None:
        self.plan, self.i = plan, plan.volatility_minibatch
        assert self.i is not None, "volatility is measured on a minibatch"
        self.minibatch_i = minibatches[self.i]
        self.old: list[R.Routing | None] = [mb.old_routing for mb in self.minibatch_i]
        self.out: dict[str, float] = {}

    def captures(self, i: int) -> bool:
        # minibatch 0's forwards show pi_old's routing; a "free" minibatch's the routing one step on
        return i == self.i and (i == 0 or self.plan.volatility_free)

    def minibatch(self, i: int, minibatch: list[MicroBatch], routings: list[R.Routing | None]) -> None:
        if not self.captures(i):
            return
        if self.plan.volatility_free:
            self.out = volatility(minibatch, self.old, routings)
        else:  # minibatch 0 is pi_old: its routing (unless R3 replayed it and it came before)
            self.old = [r if r is not None else o for r, o in zip(routings, self.old, strict=True)]

    def stepped(self, i: int, policy: nn.Module) -> None:
        if i == 0 and self.plan.volatility_forward:  # now exactly one optimizer step from pi_old
            self.out = measure_volatility(policy, self.minibatch_i, self.old, self.plan)

    def metrics(self) -> dict[str, float]:
        return self.out


@torch.no_grad()
def measure_volatility(
    policy: nn.Module, mbs: list[MicroBatch], old: list[R.Routing | None], plan: UpdatePlan
) -> dict[str, float]:
    """Expert-activation volatility of ``mbs`` under the current policy against pi_old's routing
    ``old``: costs one no-grad forward of them (the plan's ``forward`` volatility)."""
    return volatility(mbs, old, [forward(policy, mb, plan, capture=True).routing for mb in mbs])


def volatility(
    mbs: list[MicroBatch], old: list[R.Routing | None], new: list[R.Routing | None]
) -> dict[str, float]:
    """Expert-activation volatility: the fraction of response tokens whose top-k expert set in
    ``new`` differs from pi_old's ``old`` (per micro-batch; per layer, and over all layers), and in
    the paper's unit the share of activated experts that changed (``moe/volatility_experts``),
    token-weighted over ``mbs``. Measured once per update, after the first optimizer step."""
    totals: dict[str, torch.Tensor] = {}
    n_tok = 0
    for mb, old_routing, new_routing in zip(mbs, old, new, strict=True):
        assert old_routing is not None and new_routing is not None, "both routings were recorded"
        overall, layers = R.routing_volatility(old_routing, new_routing, mb.layout.response_pos_RL)
        share = R.routing_share_changed(old_routing, new_routing, mb.layout.response_pos_RL)
        w = int(mb.n_tokens)
        n_tok += w
        per_key = {"": overall, "_experts": share, **{f"/{name}": v for name, v in layers.items()}}
        for k, v in per_key.items():
            totals[k] = totals.get(k, torch.zeros(())) + v.float().cpu() * w
    return {f"moe/volatility{k}": float(v) / max(n_tok, 1) for k, v in totals.items()}


class MismatchObserver(UpdateObserver):
    """|trainer pi_old - sampler| log-probs of each micro-batch whose trainer pi_old is known, where
    no correction reports them (:func:`gspo.correction.abs_logp_diff`)."""

    def micro_batch(self, mb: MicroBatch, trainer_BT: torch.Tensor | None) -> dict[str, torch.Tensor]:
        if trainer_BT is None:  # the loss took the sampler's: the trainer's own was not computed
            return {}
        diff = C.abs_logp_diff(trainer_BT, mb.data.sampler_logp_BT, mb.mask_BT)
        return {f"mismatch/{k}": v for k, v in diff.items()}


#: observer name (UpdatePlan.observers) -> its class, built for each update
OBSERVERS: dict[str, Callable[[UpdatePlan, list[list[MicroBatch]]], UpdateObserver]] = {
    "volatility": Volatility,
    "mismatch": lambda plan, minibatches: MismatchObserver(),
}


# ------------------------------------------------------------------------------------------------
# adjustments: what changes the loss's weight or mask beside the loss (UpdatePlan.adjustments)


@dataclass
class Adjusted:
    """The loss's per-sequence (or per-token) weight and its mask, as the adjustments left them,
    and their metrics (logged under ``mismatch/``)."""

    weight: torch.Tensor | None
    mask_BT: torch.Tensor
    metrics: dict[str, torch.Tensor]


def _correct(
    a: Adjusted, mb: MicroBatch, logp_BT: torch.Tensor, trainer_BT: torch.Tensor | None, plan: UpdatePlan
) -> Adjusted:
    """The plan's train/inference mismatch correction (:data:`gspo.correction.CORRECTIONS`), from
    the trainer's pi_old (always computed when a correction is on)."""
    assert trainer_BT is not None, "a correction needs the trainer's pi_old"
    weight, mask_BT, metrics = C.CORRECTIONS[plan.correction](
        trainer_BT, mb.data.sampler_logp_BT, mb.mask_BT,
        cap=plan.mismatch_cap, lo=plan.mismatch_low, hi=plan.mismatch_high,
    )  # fmt: skip
    return Adjusted(weight, mask_BT, a.metrics | metrics)


def _opsm(
    a: Adjusted, mb: MicroBatch, logp_BT: torch.Tensor, trainer_BT: torch.Tensor | None, plan: UpdatePlan
) -> Adjusted:
    """Off-policy sequence masking, with this forward's pi_theta (:func:`gspo.correction.with_opsm`)."""
    assert plan.opsm_threshold is not None
    data = mb.data
    weight, opsm = C.with_opsm(
        a.weight, logp_BT, data.sampler_logp_BT, data.adv_B, mb.mask_BT, plan.opsm_threshold
    )
    return Adjusted(weight, a.mask_BT, a.metrics | opsm)


def _random_drop(
    a: Adjusted, mb: MicroBatch, logp_BT: torch.Tensor, trainer_BT: torch.Tensor | None, plan: UpdatePlan
) -> Adjusted:
    """An ablation (docs/stability): sequences dropped at random, the global generator's draws."""
    u_B = torch.rand(mb.mask_BT.shape[0], device=mb.mask_BT.device)
    weight, drop = C.with_random_drop(a.weight, u_B, mb.mask_BT, plan.random_seq_drop)
    return Adjusted(weight, a.mask_BT, a.metrics | drop)


#: adjustment name (UpdatePlan.adjustments) -> (the adjusted so far, the micro-batch, this forward's
#: log-probs, the trainer's pi_old or None, the plan) -> the adjusted
ADJUSTMENTS: dict[str, Callable[..., Adjusted]] = {
    "correction": _correct,
    "opsm": _opsm,
    "random_drop": _random_drop,
}


# ------------------------------------------------------------------------------------------------
# one optimizer step


def _normalizer(minibatch: list[MicroBatch], plan: UpdatePlan, world_size: int) -> float | torch.Tensor:
    """What the loss divides by: the response tokens of the whole minibatch over all ranks for a
    token-level aggregation (DAPO's ``token_mean``), else its sequences over all ranks."""
    if plan.token_normalizer:
        n_tok = torch.stack([mb.n_tokens for mb in minibatch]).sum().float()
        return dist_utils.global_sum(n_tok).clamp(min=1)
    return sum(len(mb.data) for mb in minibatch) * world_size


def _train_micro_batch(
    policy: nn.Module,
    mb: MicroBatch,
    plan: UpdatePlan,
    normalizer: float | torch.Tensor,
    world_size: int,
    capture: bool,
    observers: list[UpdateObserver],
) -> tuple[torch.Tensor, dict[str, torch.Tensor], R.Routing | None]:
    """Forward, loss and backward of one micro-batch -> (its loss, its metrics, its routing when
    ``capture`` and not replayed). A replayed routing stays forced through the backward, where
    activation checkpointing recomputes each layer's forward: the same experts, exactly."""
    forcing = nullcontext()
    if mb.replay is not None:
        forcing = R.replay_routing(unwrap(policy, "transformers"), mb.replay, backward_inside=True)
    with forcing:
        f = forward(policy, mb, plan, entropy=True, capture=capture and mb.replay is None)
        old_logp_BT, trainer_BT = pi_old(mb, f, plan)
        a = Adjusted(None, mb.mask_BT, {})
        for name in plan.adjustments:  # the plan's, in order: none by default
            a = ADJUSTMENTS[name](a, mb, f.logp_BT, trainer_BT, plan)
        inp = loss_inputs(
            f.logp_BT, old_logp_BT, a.mask_BT, mb.data.adv_B, normalizer=normalizer, weight=a.weight
        )
        out = LOSSES[plan.algo].fn(inp, **dict(plan.loss_kwargs))
        (out.loss * world_size).backward()
    metrics = {f"loss/{k}": v for k, v in out.metrics.items()} | {
        f"mismatch/{k}": v for k, v in a.metrics.items()
    }
    m_BT = mb.mask_BT
    metrics["rollout/entropy"] = (f.entropy_BT * m_BT).sum() / m_BT.sum().clamp(min=1)
    for o in observers:
        metrics |= o.micro_batch(mb, trainer_BT)
    return out.loss.detach() * world_size, metrics, f.routing


def _optimizer_step(optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[torch.Tensor, bool]:
    """Clip the global gradient norm and step; skip the step when the norm is not finite.
    Returns (the norm before clipping, whether the step was taken)."""
    # the optimizer's parameters only: frozen ones (LoRA base) must not add stale gradients
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    gnorm = torch.nn.utils.get_total_norm([p.grad for p in params])
    full = full_tensor(gnorm)  # FSDP2: a DTensor
    # one host read for both decisions; clip_grad_norm_ scales by max / (norm + 1e-6) clamped to 1,
    # i.e. changes the gradients exactly when the second test holds (a no-op multiply else)
    finite, clip = torch.stack([full.isfinite(), full + 1e-6 > max_norm]).tolist()
    if finite:
        if clip:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, gnorm)
        optimizer.step()
    return full.detach(), bool(finite)


# ------------------------------------------------------------------------------------------------
# the update


def policy_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: TrainBatch,
    plan: UpdatePlan,
    world_size: int = 1,
) -> dict[str, float]:
    """``plan.num_minibatches`` optimizer steps over contiguous slices of ``data``; returns the metrics.

    ``model``: the trainer's forward module (:class:`PolicyLogprobs`, possibly DDP/FSDP-wrapped) or
    a bare HF model. ``data`` holds this rank's rows; local minibatch ``i`` of every rank together
    is global minibatch ``i``.
    """
    policy = as_policy(model)
    dtype = next(iter(policy.parameters())).dtype
    n_mb = plan.num_minibatches
    micro = plan.micro_batch_size or len(data) // n_mb
    minibatches = record_pi_old(policy, split_minibatches(data, n_mb, micro, plan.layout, dtype), plan)
    observers = [OBSERVERS[name](plan, minibatches) for name in plan.observers]
    parts: list[tuple[dict[str, torch.Tensor], MicroBatch]] = []
    step_losses, grad_norms, n_steps = [], [], 0
    policy.train()
    for i, minibatch in enumerate(minibatches):
        optimizer.zero_grad(set_to_none=True)
        normalizer = _normalizer(minibatch, plan, world_size)
        capture = any(o.captures(i) for o in observers)
        loss, routings = torch.zeros(()), []
        for mb in minibatch:
            mb_loss, metrics, routing = _train_micro_batch(
                policy, mb, plan, normalizer, world_size, capture, observers
            )
            loss = loss + mb_loss.float().cpu()
            parts.append((metrics, mb))
            routings.append(routing)
        for o in observers:
            o.minibatch(i, minibatch, routings)
        norm, stepped = _optimizer_step(optimizer, plan.max_grad_norm)
        scheduler.step()
        step_losses.append(loss)
        grad_norms.append(norm.float().cpu())
        n_steps += stepped
        for o in observers:
            o.stepped(i, policy)

    optimizer.zero_grad(set_to_none=True)  # the rollout and the sync that follow need no gradients
    token_ratio = LOSSES[plan.algo].token_ratio  # a loss's own per-token ratio has a token mean
    out = reduce_metrics(parts, METRICS | ({"loss/ratio_mean": TOKEN} if token_ratio else {}))
    for o in observers:
        out |= o.metrics()
    out["loss/loss"], out["loss/grad_norm"] = torch.stack(
        [torch.stack(step_losses).mean(), torch.stack(grad_norms).mean()]
    ).tolist()
    out["loss/skipped_updates"] = float(n_mb - n_steps)
    return out


def reduce_metrics(
    parts: list[tuple[dict[str, torch.Tensor], MicroBatch]], reductions: dict[str, str] = METRICS
) -> dict[str, float]:
    """Combine the micro-batches' metrics by ``reductions`` (one host transfer): the result equals
    the metric computed on all rows at once. A metric only some micro-batches have is reduced over
    those."""
    keys = sorted({k for m, _ in parts for k in m})
    if unknown := [k for k in keys if k not in reductions]:
        raise KeyError(f"metrics without a declared reduction in update.METRICS: {unknown}")
    rows = []  # [metric (+ tokens, sequences)] per micro-batch, then one transfer each
    for m, mb in parts:
        nan = torch.tensor(float("nan"), device=mb.n_tokens.device)
        vals = [m.get(k, nan).detach().float().to(nan.device) for k in keys]
        rows.append(torch.stack(vals + [mb.n_tokens.float(), mb.n_sequences.float()]).cpu())
    V_KM = torch.stack(rows, 1)  # [metric (+ tokens, sequences), micro-batch]
    V_KM, n_tok_M, n_seq_M = V_KM[:-2], V_KM[-2], V_KM[-1]
    present = ~V_KM.isnan()
    kinds = [reductions[k] for k in keys]
    is_tok, is_min, is_max = (
        torch.tensor([kd == want for kd in kinds])[:, None] for want in (TOKEN, MIN, MAX)
    )
    W_KM = torch.where(is_tok, n_tok_M, n_seq_M) * present
    weighted = torch.where(present, V_KM, 0).mul(W_KM).sum(1, keepdim=True)
    mean = weighted / W_KM.sum(1, keepdim=True).clamp(min=1)
    lo = torch.where(present, V_KM, float("inf")).amin(1, keepdim=True)
    hi = torch.where(present, V_KM, float("-inf")).amax(1, keepdim=True)
    vals = torch.where(is_min, lo, torch.where(is_max, hi, mean)).squeeze(1).tolist() if keys else []
    return dict(zip(keys, vals, strict=True))
