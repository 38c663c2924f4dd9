"""Config groups: the policy loss, train/inference mismatch, asynchronous rollouts, DAPO's sample
filters and the policy's training forward (dropout, MoE routing)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from annotated_types import Ge, Gt, Interval
from pydantic import with_config

from gspo.config.checks import DOCUMENTED, Group, OneOf, bad
from gspo.plans import ENGINES


def loss_names() -> tuple[str, ...]:
    from gspo.losses import LOSSES  # torch: imported when first checked, not with the config

    return tuple(LOSSES)


def advantage_scales() -> tuple[str, ...]:
    from gspo.advantages import SCALES

    return tuple(SCALES)


@with_config(DOCUMENTED)
@dataclass
class Algorithm(Group):
    algo: Annotated[str, OneOf(loss_names)] = "gspo"
    """``gspo`` (sequence ratio), ``gspo_token`` (GSPO-token), ``grpo`` (token ratio baseline),
    ``grpo_seq_mask`` (GRPO's token ratios under GSPO's sequence mask, an ablation), ``sapo``,
    ``sapo_token``, ``cispo``, ``gmpo``, ``luspo`` (GSPO with each sequence's term scaled by its
    length, arXiv 2602.05261), ``vespo`` (REINFORCE scaled by a smooth kernel of the unnormalized
    sequence ratio, arXiv 2602.10693), ``dppo_tv`` / ``dppo_kl`` (a token's gradient kept while its
    probability stays in a Binary-TV / Binary-KL trust region around pi_old, arXiv 2602.04879),
    ``clip_cov`` / ``kl_cov`` (GRPO with the few tokens of highest covariance between log-prob and
    advantage detached / KL-penalised, against entropy collapse, arXiv 2505.22617)."""
    eps_low: Annotated[float | None, Ge(0)] = None
    """Lower clip range (default per algo: gspo 3e-4, grpo 0.2, luspo 2e-3, clip_cov 0.2; vespo and
    kl_cov have none); for ``dppo_tv`` / ``dppo_kl`` the trust region's threshold below pi_old (> 0;
    default 0.15 / 0.05)."""
    eps_high: Annotated[float | None, Ge(0)] = None
    """Upper clip range (default per algo: gspo 4e-4, grpo 0.27, luspo 2.5e-3, clip_cov 0.2; vespo and
    kl_cov have none); for ``dppo_tv`` / ``dppo_kl`` the trust region's threshold above pi_old (> 0;
    default 0.15 / 0.05)."""
    aggregation: Annotated[str | None, OneOf((None, "seq_mean_token_mean", "token_mean"))] = None
    """Token aggregation of the token-level losses (grpo, sapo_token, cispo): ``seq_mean_token_mean``
    (per-sequence token mean, then mean over sequences: GRPO paper) or ``token_mean`` (sum over all
    tokens of the optimizer step / their count: DAPO, CISPO). Default: the loss's own (grpo and
    sapo_token: seq_mean_token_mean; cispo: token_mean)."""
    random_seq_drop: Annotated[float, Interval(ge=0, lt=1)] = 0.0
    """An ablation: drop each sequence from the loss at random with this probability, in every
    micro-batch, whatever its ratio or advantage (GSPO's clip drops ~7% of sequences at lr 1e-3:
    this asks whether the share dropped matters or which ones; docs/stability). Logged:
    ``mismatch/random_drop_frac_seq``. 0: off."""
    adv_scale: Annotated[str, OneOf(advantage_scales)] = "group"
    """Advantage scaling: ``group`` std, ``batch`` std, ``none`` (center only), or ``maxrl``: divided by
    the group's mean reward (MaxRL, arXiv 2602.02710; the maximum-likelihood gradient for 0/1
    rewards). ``maxrl`` needs rewards >= 0: refused with ``overlong_buffer`` (its penalty is
    negative), and a negative reward stops the run in one line; a group whose rewards are all 0 gets
    A = 0 (no success to learn from)."""
    old_logp: Annotated[str, OneOf(("auto", "recompute", "rollout"))] = "auto"
    """pi_old log-probs: ``recompute`` with the trainer before the update, ``rollout`` (use the
    sampler's log-probs, the paper's infrastructure simplification), or ``auto``: ``rollout`` when
    the sampler is the trainer's own module in float32 (its log-probs are the trainer's), else
    ``recompute``."""

    sapo_tau_neg: Annotated[float | None, Gt(0)] = None
    """``sapo`` / ``sapo_token``: the soft gate's temperature for A < 0 (default 1.05, the paper's;
    above ``sapo_tau_pos`` it damps negative updates more). SAPO has no clip range."""
    sapo_tau_pos: Annotated[float | None, Gt(0)] = None
    """``sapo`` / ``sapo_token``: the soft gate's temperature for A > 0 (default 1.0)."""
    vespo_k_pos: Annotated[float | None, Ge(0)] = None
    """``vespo``: the kernel's power k for A >= 0 (default 2.0; the paper's c1)."""
    vespo_lambda_pos: Annotated[float | None, Ge(0)] = None
    """``vespo``: the kernel's decay lambda for A >= 0 (default 3.0; the paper's c2)."""
    vespo_k_neg: Annotated[float | None, Ge(0)] = None
    """``vespo``: the kernel's power k for A < 0 (default 3.0)."""
    vespo_lambda_neg: Annotated[float | None, Ge(0)] = None
    """``vespo``: the kernel's decay lambda for A < 0 (default 2.0)."""
    clip_cov_ratio: Annotated[float | None, Gt(0)] = None
    """``clip_cov``: the fraction of response tokens whose gradient is detached, in (0, 1), at least
    one token per loss call (default 2e-4, verl's). Taken of each call's tokens, as verl: a
    micro-batch on one rank (``micro_batch_size`` then changes the update)."""
    clip_cov_lb: float | None = None
    """``clip_cov``: tokens are selected among those whose covariance is above this (default 1.0)."""
    clip_cov_ub: float | None = None
    """``clip_cov``: ... and below this (default 5.0, verl's)."""
    kl_cov_ratio: Annotated[float | None, Gt(0)] = None
    """``kl_cov``: the fraction of response tokens (of each loss call, as ``clip_cov_ratio``) with
    the largest covariance that pay the KL penalty, in (0, 1) (default 2e-4, verl's)."""
    kl_cov_coef: Annotated[float | None, Ge(0)] = None
    """``kl_cov``: the penalty's coefficient on |log pi_theta - log pi_old| (default 0.1, verl's
    ``ppo_kl_coef``; the paper's recipes use 1)."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        clipped = ("gspo", "gspo_token", "grpo", "grpo_seq_mask", "luspo", "clip_cov")
        if cfg.eps_low is not None and cfg.algo in clipped and cfg.eps_low > 1:
            raise bad(cfg, "eps_low", f"must be <= 1 for {cfg.algo} (the ratio's lower clip is 1 - eps_low)")
        _check_loss_fields(cfg)
        if cfg.algo == "vespo":
            for f in ("vespo_lambda_pos", "vespo_lambda_neg"):
                if getattr(cfg, f) == 0:
                    raise bad(cfg, f, "must be > 0 (the kernel W^k e^(lambda (1 - W)) must decay)")
            for f in VESPO_FIELDS:
                if (getattr(cfg, f) or 0) > FLOAT32_MAX:
                    raise bad(
                        cfg, f, f"must be at most {FLOAT32_MAX:.4g} (the kernel is computed in float32)"
                    )
        if cfg.adv_scale == "maxrl" and cfg.overlong_buffer > 0:
            raise bad(cfg, "adv_scale", "'maxrl' divides by the group's mean reward and needs rewards >= 0, "
                      "but overlong_buffer > 0 adds a negative penalty")  # fmt: skip
        if cfg.aggregation is not None and _loss(cfg.algo).aggregation is None:
            raise bad(cfg, "aggregation", f"{cfg.algo} takes no aggregation (its normalizer is fixed)")


SAPO_FIELDS = ("sapo_tau_neg", "sapo_tau_pos")
VESPO_FIELDS = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
COV_FIELDS = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef")
#: each loss's own config fields -> the losses they apply to
LOSS_FIELDS = (
    {f: ("sapo", "sapo_token") for f in SAPO_FIELDS}
    | {f: ("vespo",) for f in VESPO_FIELDS}
    | {f: ("clip_cov",) for f in COV_FIELDS[:3]}
    | {f: ("kl_cov",) for f in COV_FIELDS[3:]}
)
#: the losses without a clip range: what sets their shape instead
NO_RANGE = {
    "sapo": "its soft gate's temperatures: sapo_tau_neg, sapo_tau_pos",
    "sapo_token": "its soft gate's temperatures: sapo_tau_neg, sapo_tau_pos",
    "vespo": "its kernel's shape: vespo_k_*, vespo_lambda_*",
    "kl_cov": "its penalty: kl_cov_*",
}


def _check_loss_fields(cfg: Any) -> None:
    """A loss's own fields only with that loss; no clip range where there is none; DPPO's thresholds,
    Clip-Cov's and KL-Cov's fractions and Clip-Cov's band where they select something."""
    for f, owners in LOSS_FIELDS.items():
        if getattr(cfg, f) is not None and cfg.algo not in owners:
            raise bad(cfg, f, f"applies to algo {' / '.join(owners)} only, not {cfg.algo}")
    for f in ("eps_low", "eps_high"):
        if cfg.algo in NO_RANGE and getattr(cfg, f) is not None:
            raise bad(cfg, f, f"{cfg.algo} has no clip range ({NO_RANGE[cfg.algo]})")
        if cfg.algo in ("dppo_tv", "dppo_kl") and getattr(cfg, f) == 0:
            raise bad(
                cfg, f, f"must be > 0 for {cfg.algo} (a trust region of 0 drops every token that moves)"
            )
    for f in ("clip_cov_ratio", "kl_cov_ratio"):
        if (getattr(cfg, f) or 0) >= 1:
            raise bad(cfg, f, "must be a fraction in (0, 1) of the tokens")
    if cfg.algo == "clip_cov":
        lb, ub = (loss_params(cfg)[k] for k in ("clip_cov_lb", "clip_cov_ub"))
        if not lb < ub:
            f = "clip_cov_lb" if cfg.clip_cov_lb is not None else "clip_cov_ub"
            raise bad(
                cfg, f, f"the covariance band (clip_cov_lb, clip_cov_ub) = ({lb}, {ub}) selects no token"
            )


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max (torch is not imported here)


def _loss(algo: str) -> Any:
    from gspo.losses import LOSSES  # torch: imported when first needed, not with the config

    return LOSSES[algo]


def loss_params(cfg: Any) -> dict[str, float]:
    """The loss's own parameters (:class:`gspo.losses.LossSpec`): its defaults, overridden by the
    config's ``eps_low`` / ``eps_high`` (a clip range; DPPO's thresholds), ``sapo_*`` (SAPO's
    temperatures, parameter ``tau_neg`` from ``sapo_tau_neg``), ``vespo_*`` (VESPO's kernel, parameter
    ``k_pos`` from ``vespo_k_pos``) and the Clip-Cov / KL-Cov fields (parameters named as the fields)."""
    spec = _loss(cfg.algo)
    given = dict(zip(spec.eps, (cfg.eps_low, cfg.eps_high), strict=False))
    given |= {k: getattr(cfg, f"sapo_{k}") for k in spec.params if f"sapo_{k}" in SAPO_FIELDS}
    given |= {k: getattr(cfg, f"vespo_{k}") for k in spec.params if f"vespo_{k}" in VESPO_FIELDS}
    given |= {k: getattr(cfg, k) for k in spec.params if k in COV_FIELDS}
    return {k: v if (v := given.get(k)) is not None else d for k, d in spec.params.items()}


@with_config(DOCUMENTED)
@dataclass
class Mismatch(Group):
    routing_replay_source: Annotated[str, OneOf(("pi_old", "rollout"))] = "pi_old"
    """Which experts Routing Replay forces: ``pi_old`` (R2: the trainer's own pi_old forward) or
    ``rollout`` (R3: the experts the rollout engine routed each token to; vLLM engine)."""
    mismatch_correction: Annotated[str, OneOf(("none", "seq_tis", "seq_mask", "token_mask"))] = "none"
    """Train/inference mismatch correction, from the trainer's pi_old vs the sampler's log-probs:
    ``seq_tis`` (weight each sequence by min(rho_i, mismatch_cap), rho_i the length-normalized ratio
    pi_old/pi_sampler), ``seq_mask`` (drop sequences with rho_i outside [mismatch_low,
    mismatch_high]), ``token_mask`` (IcePop: drop tokens whose ratio is outside the band; for GRPO),
    or ``none``."""
    mismatch_cap: Annotated[float, Ge(1)] = 2.0
    """``seq_tis``: the largest sequence weight C."""
    mismatch_low: float = 0.5
    """``seq_mask`` / ``token_mask``: lowest ratio pi_old/pi_sampler kept."""
    mismatch_high: float | None = None
    """``seq_mask`` / ``token_mask``: highest ratio kept (default 2 for sequences, 5 for tokens: IcePop)."""
    opsm_threshold: Annotated[float | None, Ge(0)] = None
    """Off-policy sequence masking (OPSM, DeepSeek-V3.2): drop from the loss each sequence with a
    negative advantage whose mean per-token log-ratio log(pi_sampler / pi_theta) exceeds this
    threshold delta (nats per token; TRL suggests 0.5), for every loss, async and multi-turn included.
    Logged: ``mismatch/opsm_frac_seq`` (and ``_tok``). None: off."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        if cfg.routing_replay_source == "rollout":  # R3: the rollout engine's routing
            if not ENGINES[cfg.rollout_engine].records_routing:
                msg = "'rollout' (R3) needs rollout_engine vllm (the HF engine is the trainer)"
                raise bad(cfg, "routing_replay_source", msg)
            if not cfg.routing_replay:
                raise bad(cfg, "routing_replay_source", "'rollout' (R3) applies with routing_replay on")
        high = cfg.mismatch_high_resolved()
        if not 0 <= cfg.mismatch_low < 1 < high:
            raise bad(
                cfg,
                "mismatch_low",
                f"the band [mismatch_low, mismatch_high] = [{cfg.mismatch_low}, {high}] must hold 1",
            )


@with_config(DOCUMENTED)
@dataclass
class Async(Group):
    async_staleness: Annotated[int, Ge(0)] = 0
    """Asynchronous rollouts: a sampler process (its own model copy and engine, HF or vLLM, one
    thread) generates up to K policy versions ahead of the trainer, so generation and training
    overlap; step t's responses come from the weights after step t-1-K and the sampler's log-probs
    are pi_old. With N ranks one sampler process serves them all (rank 0 publishes the weights and
    splits each batch); with LoRA it receives merged weights; with dynamic sampling it draws and
    scores the extra rounds itself; with R3 its engine's routing comes with each batch. 0: synchronous."""
    rollout_devices: str | None = None
    """Async: the device the sampler process runs on (``cuda:N`` or ``cpu``), none of the trainer's
    (rank r trains on ``cuda:r`` under ``device auto``). Weights then cross from trainer rank 0 over a
    process group the two join (NCCL on a GPU, gloo on the CPU; only gloo is tested), one tensor at a
    time, instead of shared memory. One device: several (tensor-parallel sampling) are not supported
    yet. None: the sampler shares the trainer's host memory."""
    partial_rollout_tokens: Annotated[int, Ge(0)] = 0
    """Async partial rollouts: step t's responses are sampled under version t-1-K up to this many
    tokens; the rows still going then continue under version t-K (the next update) with
    their tokens kept, as slime's and AReaL's partial rollouts continue long generations under new
    weights, but at a fixed token count rather than a moment, so runs stay deterministic. Each token
    keeps its version's log-prob as pi_old. 0: off (one version per batch)."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        # the trainer's own device too: torch keeps an index in 8 bits (cuda:256 silently is cuda:0)
        if re.fullmatch(r"cuda:[0-9]+", cfg.device) and int(cfg.device[5:]) > MAX_DEVICE_INDEX:
            raise bad(cfg, "device", f"a device index is at most {MAX_DEVICE_INDEX} (torch's largest)")
        _check_rollout_devices(cfg)
        if cfg.partial_rollout_tokens and not cfg.async_staleness:
            raise bad(cfg, "partial_rollout_tokens", "needs async_staleness > 0 (the next version is what "
                      "the rest of a long generation is sampled under)")  # fmt: skip
        if not cfg.async_staleness:
            return
        partial = cfg.partial_rollout_tokens
        r3 = cfg.routing_replay and cfg.routing_replay_source == "rollout"
        for f, ok, why in [
            ("routing_replay_source", not (r3 and partial), "a response continued under a newer version has "
             "two versions' routing, which R3 cannot replay as one forward"),
            ("routing_replay_source", not (r3 and cfg.dynamic_sampling), "the sampler's extra rounds do not "
             "carry their routing yet"),
            ("old_logp", cfg.old_logp != "recompute", "a stale batch's pi_old is the policy that sampled it: "
             "the sampler's log-probs"),
            ("dynamic_sampling", not (cfg.dynamic_sampling and cfg.env), "the sampler process joins rounds of "
             "single-turn responses only"),
            ("partial_rollout_tokens", not partial or partial < cfg.max_new_tokens, "it must leave tokens to "
             "continue: below max_new_tokens"),
            ("partial_rollout_tokens", not (partial and cfg.env), "a trajectory's turns are not split between "
             "versions yet"),
            ("partial_rollout_tokens", not (partial and cfg.dynamic_sampling), "the sampler's extra rounds are "
             "not split between versions yet"),
        ]:  # fmt: skip
            if not ok:
                raise bad(cfg, f, f"is not supported with async_staleness > 0 ({why})")


MAX_DEVICE_INDEX = 127


def rollout_device_list(value: str | None) -> tuple[str, ...]:
    """``rollout_devices`` as a tuple of device names (empty: not set)."""
    return tuple(d.strip() for d in value.split(",")) if value else ()


def _check_rollout_devices(cfg: Any) -> None:
    """Rollout devices need async, name one device, and on a GPU leave the trainer's (``cuda:LOCAL_RANK``
    under ``device auto``/``cuda``, or its ``cuda:N``) alone; whether they exist is checked at launch."""
    devices = rollout_device_list(cfg.rollout_devices)
    if not devices:
        return
    if not cfg.async_staleness:
        raise bad(cfg, "rollout_devices", "needs async_staleness > 0 (it places the async sampler process)")
    if any(d != "cpu" and not re.fullmatch(r"cuda:(0|[1-9][0-9]*)", d) for d in devices):
        raise bad(cfg, "rollout_devices", "each device is 'cpu' or 'cuda:N' (N a number, no leading zero)")
    # torch keeps a device index in 8 bits: a larger one is refused, or silently wraps (cuda:256 is cuda:0)
    if any(d != "cpu" and int(d[5:]) > MAX_DEVICE_INDEX for d in devices):
        raise bad(cfg, "rollout_devices", f"a device index is at most {MAX_DEVICE_INDEX} (torch's largest)")
    if len(devices) > 1:
        raise bad(cfg, "rollout_devices", "takes one device (one sampler process; tensor-parallel sampling "
                  "over several is not supported yet)")  # fmt: skip
    if devices[0] == "cpu":
        return
    if cfg.device == "cpu":
        raise bad(cfg, "rollout_devices", "a GPU takes the weights over NCCL, which needs the trainer on a GPU "
                  "too (device is 'cpu')")  # fmt: skip
    trainer = [cfg.device] if cfg.device.startswith("cuda:") else [f"cuda:{r}" for r in range(cfg.nproc)]
    both = sorted(set(devices) & set(trainer))
    if both:
        raise bad(cfg, "rollout_devices", f"{both[0]} is also a trainer device (trainer devices: "
                  f"{','.join(trainer)}): the sampler needs a GPU the trainer does not use")  # fmt: skip


@with_config(DOCUMENTED)
@dataclass
class SampleFilters(Group):
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no gradient under group-normalized advantages) and
    draw more prompts until the batch is full (DAPO); see ``dynamic_sampling_max_rounds``."""
    dynamic_sampling_max_rounds: Annotated[int, Ge(0)] = 4
    """Extra sampling rounds dynamic sampling may draw per step; a batch still short after them is
    filled with dropped groups (zero advantage: no gradient, counted in ``rollout/filtered_groups``)."""
    overlong_filter: bool = False
    """Give responses cut off at ``max_new_tokens`` (no EOS) zero advantage: out of the loss (DAPO)."""
    overlong_buffer: Annotated[int, Ge(0)] = 0
    """DAPO's soft overlong penalty: responses within the last N tokens before ``max_new_tokens`` get a
    reward penalty growing linearly to ``overlong_penalty`` (0 disables)."""
    overlong_penalty: Annotated[float, Ge(0)] = 1.0
    """Largest soft overlong penalty (reward units), reached at ``max_new_tokens``."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        limit = "max_trajectory_tokens" if cfg.env else "max_new_tokens"  # the budget the penalty counts in
        if cfg.overlong_buffer > getattr(cfg, limit):
            raise bad(cfg, "overlong_buffer", f"must be <= {limit}={getattr(cfg, limit)}")


@with_config(DOCUMENTED)
@dataclass
class PolicyForward(Group):
    keep_dropout: bool = False
    """Keep the model's dropout on in training forwards. Off by default (as TRL): sampling runs in
    eval mode, so dropout alone would move ratios out of GSPO's 3e-4 clip range."""
    routing_replay: bool = False
    """MoE only: force pi_old's experts in pi_theta's forward (Routing Replay; needed by GRPO)."""
    log_volatility: bool = True
    """MoE only: log the fraction of response tokens whose top-k experts changed over one optimizer
    step (measured on the second minibatch; costs one no-grad forward of it)."""
