"""The update plan: every decision a policy update makes, resolved once from the config.

    pi_old       the sampler's log-probs (``rollout``) or the trainer's own (``recompute``)
    replay       none, R2 (pi_old's own experts, recorded by the trainer) or R3 (the sampler's)
    volatility   none, read from a training forward (free) or from one extra no-grad forward
    correction   none or a registered train/inference mismatch correction
    layout       how the training forward lays out its rows (padded, packed, shared prefix)

:func:`gspo.train.update.policy_update` runs a plan: it tests no config field and holds no mode flag.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from gspo.config import Config
from gspo.config.algorithm import loss_options
from gspo.errors import GspoError
from gspo.losses import LOSSES
from gspo.model.logprobs import attn_implementation, lm_head_is_plain, shared_prefix_is_exact
from gspo.model.unwrap import unwrap


@dataclass(frozen=True)
class UpdatePlan:
    """What one policy update does (:func:`plan_update` builds it; the fields are its decisions)."""

    algo: str  # key of gspo.losses.LOSSES
    eps_low: float
    eps_high: float
    aggregation: str | None  # for the losses that take one (None: the loss takes no aggregation)
    num_minibatches: int  # optimizer steps per rollout batch
    micro_batch_size: int  # rows per forward/backward (0: the whole minibatch)
    max_grad_norm: float  # inf: no clipping
    temperature: float
    top_k: int  # the sampler's truncation, applied to the trainer's log-probs too (0 / 1.0: off)
    top_p: float
    logp_chunk_size: int
    layout: str  # rows / packed / shared_prefix (gspo.model.logprobs)
    pi_old: str  # "rollout": the sampler's log-probs; "recompute": the trainer's
    trainer_pi_old: bool  # the trainer's pi_old of minibatches 1.. is computed (loss or correction)
    replay: str | None  # None, "R2" or "R3"
    volatility: str | None  # None, "free" (a training forward shows it) or "forward" (an extra one)
    volatility_minibatch: int | None  # which minibatch volatility is measured on
    correction: str  # "none" or a key of gspo.correction's registry
    mismatch_low: float
    mismatch_high: float
    mismatch_cap: float
    opsm_threshold: float | None = None  # off-policy sequence masking (gspo.correction.with_opsm)
    loss_options: tuple[tuple[str, float], ...] = ()  # the loss's own keywords (VESPO's kernel)

    @property
    def token_normalizer(self) -> bool:
        """The loss divides by the minibatch's response tokens (DAPO's token_mean), else its sequences."""
        return self.aggregation == "token_mean"

    def own_routing(self, i: int) -> bool:
        """Whether minibatch ``i`` needs pi_old's own choice of experts (R2 forces it in minibatches
        1..; volatility compares with it)."""
        return i == self.volatility_minibatch or (self.replay == "R2" and i > 0)


def plan_update(cfg: Config, policy: nn.Module, is_moe: bool) -> UpdatePlan:
    """The plan of every update of this run (probing ``policy`` once for its layout)."""
    eps_low, eps_high = cfg.clip_range()
    params = inspect.signature(LOSSES[cfg.algo][0]).parameters
    aggregation = (cfg.aggregation or params["aggregation"].default) if "aggregation" in params else None
    replay = None
    if is_moe and cfg.routing_replay:
        replay = "R3" if cfg.routing_replay_source == "rollout" else "R2"
    vol_i = (1 if cfg.num_minibatches > 1 else 0) if is_moe and cfg.log_volatility else None
    # minibatch vol_i > 0 is next trained one step after pi_old, so its training forward shows the
    # new routing, unless replay forces the experts there
    volatility = None if vol_i is None else ("free" if vol_i > 0 and replay is None else "forward")
    pi_old = pi_old_source(cfg)
    return UpdatePlan(
        algo=cfg.algo,
        eps_low=eps_low,
        eps_high=eps_high,
        aggregation=aggregation,
        num_minibatches=cfg.num_minibatches,
        micro_batch_size=cfg.micro_batch_size,
        max_grad_norm=cfg.max_grad_norm or float("inf"),
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        logp_chunk_size=cfg.logp_chunk_size,
        layout=choose_layout(policy, cfg),
        pi_old=pi_old,
        trainer_pi_old=pi_old == "recompute" or cfg.mismatch_correction != "none",
        replay=replay,
        volatility=volatility,
        volatility_minibatch=vol_i,
        correction=cfg.mismatch_correction,
        mismatch_low=cfg.mismatch_low,
        mismatch_high=cfg.mismatch_high_resolved(),
        mismatch_cap=cfg.mismatch_cap,
        opsm_threshold=cfg.opsm_threshold,
        loss_options=tuple(loss_options(cfg).items()),
    )


def pi_old_source(cfg: Config) -> str:
    """Where the loss's pi_old comes from: ``rollout`` (the sampler's log-probs) or ``recompute`` (the
    trainer's own forward); ``old_logp = auto`` takes the sampler's wherever they are the trainer's
    numerics (the HF engine in float32 is the trainer itself) or the batch's own policy (async)."""
    if cfg.old_logp != "auto":
        return cfg.old_logp
    if cfg.async_staleness:  # sampled from an older version: its log-probs are that policy's
        return "rollout"
    same_numerics = (
        cfg.rollout_engine == "hf" and cfg.dtype == "float32" and cfg.rollout_dtype in (None, "float32")
    )
    return "rollout" if same_numerics else "recompute"


def choose_layout(policy: nn.Module, cfg: Config) -> str:
    """Training forward layout (see :mod:`gspo.model.logprobs`). Packing removes padding compute, but
    with dense-mask attention (sdpa/eager) its attention cost grows with the packed length squared,
    so ``auto`` packs only with flash attention; prefix sharing needs a model that takes 4D masks.
    The one-time model probes run here, outside any routing capture or replay that would record them."""
    hf = unwrap(policy, "hf")
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
