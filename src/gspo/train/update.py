"""The policy update: ``num_minibatches`` optimizer steps over one rollout batch (GSPO paper, sec. 5).

    attach pi_old                    (one place decides where it comes from)
    for each minibatch i:            (contiguous rows of the rollout batch)
        for each micro-batch:        logp = pi_theta(rows); loss(logp, pi_old, A) / N; backward
        clip the gradient norm, optimizer step
        after the first step:        expert volatility (MoE), once

``N`` is the global normalizer of the whole minibatch (its sequences, or its tokens for a token-level
aggregation, over all ranks), so micro-batches and ranks add up to the update one process would make
on the whole minibatch. Gradients are averaged across ranks, so each rank's loss is scaled by the
world size.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from gspo import correction as C
from gspo.config import Config
from gspo.errors import GspoError
from gspo.losses import LOSSES
from gspo.model import routing as R
from gspo.model.forward import PolicyLogprobs, attn_implementation, lm_head_is_plain, shared_prefix_is_exact
from gspo.model.lora import hf_module
from gspo.train import distributed as dist_utils
from gspo.train.batch import MicroBatch, RolloutData, split_minibatches

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
    "loss/ratio_mean": SEQUENCE,  # the loss's own ratio: s_i, or per token (TOKEN_RATIO_LOSSES)
    "loss/ratio_min": MIN,
    "loss/ratio_max": MAX,
    "loss/seq_ratio_mean": SEQUENCE,  # s_i, where the loss's own ratio is per token
    "loss/seq_ratio_min": MIN,
    "loss/seq_ratio_max": MAX,
    "loss/gate_tok_mean": TOKEN,  # SAPO's soft gate
    "loss/gate_seq_mean": SEQUENCE,
    "loss/gate_min": MIN,
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
}
METRICS.update({f"mismatch/{k}": v for k, v in _MISMATCH.items()})
# losses whose own ratio is per token: their ``ratio_mean`` is a token mean
TOKEN_RATIO_LOSSES = {"grpo", "sapo_token", "cispo", "gmpo"}
_LOSS_METRIC_PREFIX = "loss/"


@dataclass
class Forward:
    """One forward of a micro-batch under the current policy."""

    logp_BT: torch.Tensor  # [B, T] response log-probs (0 on padding)
    entropy_BT: torch.Tensor | None  # [B, T] token entropy when asked
    routing: R.Routing | None  # experts chosen per MoE layer when captured


def forward(
    policy: nn.Module,
    mb: MicroBatch,
    cfg: Config,
    entropy: bool = False,
    replay: R.Routing | None = None,
    capture: bool = False,
) -> Forward:
    """Response log-probs of ``mb`` under ``policy`` (a :class:`PolicyLogprobs`, possibly wrapped by
    DDP/FSDP), optionally forcing (``replay``) or recording (``capture``) the MoE routing."""
    hf = hf_module(dist_utils.hf_model(policy))
    forcing = R.replay_routing(hf, replay) if replay is not None else nullcontext()
    with forcing, R.capture_routing(hf) if capture else nullcontext() as rec:
        out = policy(
            mb.layout, mb.data.response_ids_BT, mb.mask_BT, cfg.temperature, cfg.logp_chunk_size, entropy
        )
    logp, ent = out if entropy else (out, None)
    return Forward(logp, ent, R.routing_snapshot(rec) if capture else None)


def choose_layout(policy: nn.Module, cfg: Config) -> str:
    """Training forward layout (see :mod:`gspo.model.forward`). Packing removes padding compute, but
    with dense-mask attention (sdpa/eager) its attention cost grows with the packed length squared,
    so ``auto`` packs only with flash attention; prefix sharing needs a model that takes 4D masks.
    The one-time model probes run here, outside any routing capture or replay that would record them."""
    hf = hf_module(dist_utils.hf_model(as_policy(policy)))
    lm_head_is_plain(hf)
    impl = attn_implementation(hf)
    if cfg.routing_replay and cfg.routing_replay_source == "rollout":
        return "rows"  # R3's routing comes per row (gspo.rollout.vllm.routing_rows_layout)
    if cfg.packing == "on" or (cfg.packing == "auto" and impl.startswith("flash")):
        return "packed"
    if cfg.prefix_sharing == "off":
        return "rows"
    if shared_prefix_is_exact(hf):
        return "shared_prefix"
    if cfg.prefix_sharing == "on":
        raise GspoError(
            "config field 'prefix_sharing': 'on' needs a model that takes a 4D attention mask (sdpa or "
            f"eager attention, no sliding window, positions from position_ids); this one ({impl!r}) "
            "does not (use 'auto' or 'off')"
        )
    return "rows"


def as_policy(model: nn.Module) -> nn.Module:
    """``model`` as the trainer's forward module: a bare HF model is put in a :class:`PolicyLogprobs`."""
    if isinstance(model, PolicyLogprobs | nn.parallel.DistributedDataParallel):
        return model
    return PolicyLogprobs(model)


# ------------------------------------------------------------------------------------------------
# pi_old and routing


def volatility_minibatch(cfg: Config, is_moe: bool) -> int | None:
    """Which minibatch expert volatility is measured on: the second (its pi_old routing is recorded
    before any update, and it is looked at again after exactly one optimizer step: the paper's
    per-update figure), or the only one. None: not measured."""
    if not (is_moe and cfg.log_volatility):
        return None
    return 1 if cfg.num_minibatches > 1 else 0


def attach_pi_old(policy: nn.Module, minibatches: list[list[MicroBatch]], cfg: Config, is_moe: bool) -> None:
    """The one place pi_old is decided, before any optimizer step.

    The loss's pi_old is the sampler's log-probs (``old_logp = rollout``) or the trainer's own
    (``recompute``). The trainer's is known for free on minibatch 0, whose first forward is still
    on-policy: the training step takes it from there (:func:`_train_micro_batch`). Minibatches
    1.. get one no-grad forward now when the loss needs the trainer's pi_old, or when pi_old's
    routing is needed (Routing Replay forces it in their training forwards; volatility compares
    with it).
    """
    recompute = cfg.resolved_old_logp() == "recompute"
    replay = is_moe and cfg.routing_replay
    r3 = replay and cfg.routing_replay_source == "rollout"
    trainer_old = recompute or cfg.mismatch_correction != "none"  # the correction compares the two
    vol_i = volatility_minibatch(cfg, is_moe)
    with torch.no_grad():
        for i, mbs in enumerate(minibatches):
            own_routing = i == vol_i or (replay and not r3 and i > 0)  # pi_old's own choice of experts
            for mb in mbs:
                if r3:  # the sampler's experts, forced in every forward of these rows
                    L = mb.layout.input_ids_RL.shape[1]
                    mb.replay = {k: v[:, :L] for k, v in mb.data.sampler_routing.items()}
                if r3 and own_routing:  # (the replayed forwards below cannot show it)
                    mb.old_routing = forward(policy, mb, cfg, capture=True).routing
                if i == 0 or not (trainer_old or (own_routing and not r3)):
                    continue  # minibatch 0: its own first forward is pi_old
                f = forward(policy, mb, cfg, replay=mb.replay if r3 else None, capture=own_routing and not r3)
                mb.old_logp_BT = f.logp_BT
                if own_routing and not r3:
                    mb.old_routing = f.routing
                    mb.replay = f.routing if replay else None


@torch.no_grad()
def measure_volatility(policy: nn.Module, mbs: list[MicroBatch], cfg: Config) -> dict[str, float]:
    """Expert-activation volatility of ``mbs`` under the current policy, one step after pi_old: costs
    one no-grad forward of them. (Where that minibatch's own training forward comes next, with the
    same weights and its own routing, the update takes its routing instead: :func:`volatility`.)"""
    return volatility(mbs, [forward(policy, mb, cfg, capture=True).routing for mb in mbs])


def volatility(mbs: list[MicroBatch], new: list[R.Routing]) -> dict[str, float]:
    """Expert-activation volatility: the fraction of response tokens whose top-k expert set in
    ``new`` (per micro-batch) differs from pi_old's (per layer, and over all layers), token-weighted
    over ``mbs``. Measured once per update, after the first optimizer step."""
    totals: dict[str, torch.Tensor] = {}
    n_tok = 0
    for mb, new_routing in zip(mbs, new, strict=True):
        overall, layers = R.routing_volatility(mb.old_routing, new_routing, mb.layout.response_pos_RL)
        w = int(mb.n_tokens)
        n_tok += w
        for k, v in {"": overall, **{f"/{name}": v for name, v in layers.items()}}.items():
            totals[k] = totals.get(k, torch.zeros(())) + v.float().cpu() * w
    return {f"moe/volatility{k}": float(v) / max(n_tok, 1) for k, v in totals.items()}


# ------------------------------------------------------------------------------------------------
# one optimizer step


@functools.cache
def _parameters(fn: Callable) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(fn).parameters


def _loss_kwargs(cfg: Config) -> dict[str, str]:
    """``aggregation`` for the losses that take one: the configured one, else the loss's default."""
    params = _parameters(LOSSES[cfg.algo][0])
    if "aggregation" not in params:
        return {}
    return {"aggregation": cfg.aggregation or params["aggregation"].default}


def _normalizer(minibatch: list[MicroBatch], cfg: Config, world_size: int) -> float | torch.Tensor:
    """What the loss divides by: the response tokens of the whole minibatch over all ranks for a
    token-level aggregation (DAPO's ``token_mean``), else its sequences over all ranks."""
    if _loss_kwargs(cfg).get("aggregation") == "token_mean":
        n_tok = torch.stack([mb.n_tokens for mb in minibatch]).sum().float()
        return dist_utils.global_sum(n_tok).clamp(min=1)
    return sum(len(mb.data) for mb in minibatch) * world_size


def _train_micro_batch(
    policy: nn.Module,
    mb: MicroBatch,
    cfg: Config,
    normalizer: float | torch.Tensor,
    world_size: int,
    first: bool,
    capture: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], R.Routing | None]:
    """Forward, loss and backward of one micro-batch -> (its loss, its metrics, its routing when
    ``capture`` and not replayed)."""
    f = forward(policy, mb, cfg, entropy=True, replay=mb.replay, capture=capture and mb.replay is None)
    if first:  # minibatch 0: no update has happened yet, so this forward is pi_old
        mb.old_logp_BT = f.logp_BT.detach()
        mb.old_routing = f.routing if f.routing is not None else mb.old_routing
    old_logp = mb.data.sampler_logp_BT if cfg.resolved_old_logp() == "rollout" else mb.old_logp_BT
    weight, loss_mask_BT, corr_metrics = mismatch_correction(
        mb.old_logp_BT, mb.data.sampler_logp_BT, mb.mask_BT, cfg
    )
    eps_low, eps_high = cfg.clip_range()
    loss, loss_metrics = LOSSES[cfg.algo][0](
        f.logp_BT, old_logp, mb.data.adv_B, loss_mask_BT, eps_low, eps_high, normalizer,
        **_loss_kwargs(cfg), weight=weight,
    )  # fmt: skip
    (loss * world_size).backward()
    metrics = {_LOSS_METRIC_PREFIX + k: v for k, v in loss_metrics.items()} | corr_metrics
    m_BT = mb.mask_BT
    metrics["rollout/entropy"] = (f.entropy_BT * m_BT).sum() / m_BT.sum().clamp(min=1)
    if mb.old_logp_BT is not None:  # train/inference mismatch, wherever the trainer's pi_old is known
        n_B = m_BT.sum(-1).clamp(min=1)
        d_BT = torch.where(m_BT.bool(), mb.old_logp_BT - mb.data.sampler_logp_BT, 0.0)
        n_seq = mb.n_sequences.clamp(min=1)
        metrics["mismatch/token_abs_logp_diff"] = (d_BT.abs().sum(-1) / n_B).sum() / n_seq
        metrics["mismatch/seq_abs_logp_diff"] = (d_BT.sum(-1) / n_B).abs().sum() / n_seq
    return loss.detach() * world_size, metrics, f.routing


def mismatch_correction(
    old_logp_BT: torch.Tensor | None, sampler_logp_BT: torch.Tensor, mask_BT: torch.Tensor, cfg: Config
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """The configured train/inference mismatch correction (:mod:`gspo.correction`) ->
    (per-sequence loss weight or None, the loss's token mask, metrics)."""
    if cfg.mismatch_correction == "none" or old_logp_BT is None:
        return None, mask_BT, {}
    lo, hi = cfg.mismatch_low, cfg.mismatch_high_resolved()
    kind = cfg.mismatch_correction
    weight, loss_mask_BT = None, mask_BT
    if kind == "seq_tis":
        weight = C.sequence_tis_weights(old_logp_BT, sampler_logp_BT, mask_BT, cfg.mismatch_cap)
        stats = C.mismatch_metrics(old_logp_BT, sampler_logp_BT, mask_BT, tis_cap=cfg.mismatch_cap)
    elif kind == "seq_mask":
        weight = C.sequence_mask(old_logp_BT, sampler_logp_BT, mask_BT, lo, hi)
        stats = C.mismatch_metrics(old_logp_BT, sampler_logp_BT, mask_BT, seq_bounds=(lo, hi))
    else:  # token_mask (IcePop): masked tokens leave the loss, as padding does
        loss_mask_BT = mask_BT * C.token_mask(old_logp_BT, sampler_logp_BT, mask_BT, lo, hi).to(mask_BT.dtype)
        stats = C.mismatch_metrics(old_logp_BT, sampler_logp_BT, mask_BT, token_bounds=(lo, hi))
    return weight, loss_mask_BT, {f"mismatch/{k}": v for k, v in stats.items()}


def _optimizer_step(optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[torch.Tensor, bool]:
    """Clip the global gradient norm and step; skip the step when the norm is not finite.
    Returns (the norm before clipping, whether the step was taken)."""
    # the optimizer's parameters only: frozen ones (LoRA base) must not add stale gradients
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    gnorm = torch.nn.utils.get_total_norm([p.grad for p in params])
    full = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm  # FSDP2: a DTensor
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
    data: RolloutData,
    cfg: Config,
    world_size: int = 1,
    is_moe: bool = False,
) -> dict[str, float]:
    """``num_minibatches`` optimizer steps over contiguous slices of ``data``; returns the metrics.

    ``model``: the trainer's forward module (:class:`PolicyLogprobs`, possibly DDP/FSDP-wrapped) or
    a bare HF model. ``data`` holds this rank's rows; local minibatch ``i`` of every rank together
    is global minibatch ``i``.
    """
    policy = as_policy(model)
    dtype = next(iter(policy.parameters())).dtype
    n_mb = cfg.num_minibatches
    micro = cfg.micro_batch_size or len(data) // n_mb
    minibatches = split_minibatches(data, n_mb, micro, choose_layout(policy, cfg), dtype)
    attach_pi_old(policy, minibatches, cfg, is_moe)
    vol_i = volatility_minibatch(cfg, is_moe)
    # volatility for free: minibatch vol_i > 0 is next trained one step after pi_old, so its training
    # forward shows the new routing (unless Routing Replay forces it)
    free_vol = vol_i is not None and vol_i > 0 and all(mb.replay is None for mb in minibatches[vol_i])
    max_norm = cfg.max_grad_norm or float("inf")

    parts: list[tuple[dict[str, torch.Tensor], MicroBatch]] = []
    step_losses, grad_norms, n_steps, out = [], [], 0, {}
    policy.train()
    for i, minibatch in enumerate(minibatches):
        optimizer.zero_grad(set_to_none=True)
        normalizer = _normalizer(minibatch, cfg, world_size)
        loss = torch.zeros(())
        look = free_vol and i == vol_i  # this minibatch's forwards show the routing after one step
        routings = []
        for mb in minibatch:
            mb_loss, metrics, routing = _train_micro_batch(
                policy, mb, cfg, normalizer, world_size, first=i == 0, capture=i == 0 == vol_i or look
            )
            loss = loss + mb_loss.float().cpu()
            parts.append((metrics, mb))
            routings.append(routing)
        if look:
            out.update(volatility(minibatch, routings))
        norm, stepped = _optimizer_step(optimizer, max_norm)
        scheduler.step()
        step_losses.append(loss)
        grad_norms.append(norm.float().cpu())
        n_steps += stepped
        if i == 0 and vol_i is not None and not free_vol:  # now exactly one optimizer step from pi_old
            out.update(measure_volatility(policy, minibatches[vol_i], cfg))

    out.update(reduce_metrics(parts, metric_reductions(cfg.algo)))
    out["loss/loss"], out["loss/grad_norm"] = torch.stack(
        [torch.stack(step_losses).mean(), torch.stack(grad_norms).mean()]
    ).tolist()
    out["loss/skipped_updates"] = float(n_mb - n_steps)
    return out


def metric_reductions(algo: str) -> dict[str, str]:
    """:data:`METRICS` for one algorithm."""
    return METRICS | ({"loss/ratio_mean": TOKEN} if algo in TOKEN_RATIO_LOSSES else {})


def reduce_metrics(
    parts: list[tuple[dict[str, torch.Tensor], MicroBatch]], reductions: dict[str, str] = METRICS
) -> dict[str, float]:
    """Combine the micro-batches' metrics by ``reductions`` (one host transfer): the result equals
    the metric computed on all rows at once. A metric only some micro-batches have is reduced over
    those."""
    keys = sorted({k for m, _ in parts for k in m})
    unknown = [k for k in keys if k not in reductions]
    if unknown:
        raise KeyError(f"metrics without a declared reduction in update.METRICS: {unknown}")
    nan = torch.tensor(float("nan"))
    rows = [  # [metric (+ tokens, sequences)] per micro-batch, then one transfer each
        torch.stack(
            [m.get(k, nan).detach().float() for k in keys] + [mb.n_tokens.float(), mb.n_sequences.float()]
        ).cpu()
        for m, mb in parts
    ]
    V_KM = torch.stack(rows, 1)  # [metric (+ tokens, sequences), micro-batch]
    V_KM, n_tok_M, n_seq_M = V_KM[:-2], V_KM[-2], V_KM[-1]
    present = ~V_KM.isnan()
    kinds = [reductions[k] for k in keys]
    is_tok, is_min, is_max = (
        torch.tensor([kd == want for kd in kinds])[:, None] for want in (TOKEN, MIN, MAX)
    )
    W_KM = torch.where(is_tok, n_tok_M, n_seq_M) * present
    mean = torch.where(present, V_KM, 0).mul(W_KM).sum(1, keepdim=True) / W_KM.sum(1, keepdim=True).clamp(
        min=1
    )
    lo = torch.where(present, V_KM, float("inf")).amin(1, keepdim=True)
    hi = torch.where(present, V_KM, float("-inf")).amax(1, keepdim=True)
    vals = torch.where(is_min, lo, torch.where(is_max, hi, mean)).squeeze(1).tolist() if keys else []
    return dict(zip(keys, vals, strict=True))
