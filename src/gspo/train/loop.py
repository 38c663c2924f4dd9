"""The training loop: one readable function, ``train(cfg)``, plus the two steps it repeats.

Each RL step:  sample prompts -> G responses each (rollout engine, sampler log-probs) -> rewards ->
group advantages -> pi_old log-probs (recompute, or the sampler's) -> ``num_minibatches`` optimizer
steps over contiguous slices of the rollout batch -> metrics, eval, checkpoint.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gspo.advantages import group_advantages
from gspo.config import Config, save_yaml
from gspo.errors import GspoError
from gspo.losses import LOSSES
from gspo.model.forward import Layout, make_layout, response_logprobs
from gspo.model.load import load_model_and_tokenizer, save_pretrained
from gspo.rollout.hf import HFRolloutEngine, left_pad
from gspo.tasks import build_task
from gspo.tasks.datasets import Example
from gspo.tasks.rewards import safe_rewards
from gspo.train import checkpoint as ckpt
from gspo.train import distributed as dist_utils
from gspo.train.logger import MetricsLogger, Progress, plot_metrics, read_metrics


@dataclass
class RolloutData:
    """One rollout batch on this rank, ``B = prompts x G`` rows, groups contiguous."""

    prompt_ids_BP: torch.Tensor
    prompt_mask_BP: torch.Tensor
    response_ids_BT: torch.Tensor
    response_mask_BT: torch.Tensor
    sampler_logp_BT: torch.Tensor
    adv_B: torch.Tensor

    def slice(self, idx: slice) -> RolloutData:
        return RolloutData(*(getattr(self, f)[idx] for f in self.__dataclass_fields__)).trim()

    def trim(self) -> RolloutData:
        """Drop prompt columns that are padding in every row (left) and response columns (right)."""
        keep_p = self.prompt_mask_BP.any(0).nonzero()
        keep_t = self.response_mask_BT.any(0).nonzero()
        p0 = int(keep_p[0]) if len(keep_p) else self.prompt_mask_BP.shape[1] - 1
        t1 = int(keep_t[-1]) + 1 if len(keep_t) else 1
        return RolloutData(
            self.prompt_ids_BP[:, p0:],
            self.prompt_mask_BP[:, p0:],
            self.response_ids_BT[:, :t1],
            self.response_mask_BT[:, :t1],
            self.sampler_logp_BT[:, :t1],
            self.adv_B,
        )

    def to(self, device: torch.device) -> RolloutData:
        return RolloutData(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def completion_texts(tokenizer: Any, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> list[str]:
    """Decoded responses without their final EOS (one batched tokenizer call)."""
    from transformers import PreTrainedTokenizerFast

    seqs = []
    for ids, n in zip(ids_BT.tolist(), mask_BT.sum(-1).tolist(), strict=True):
        ids = ids[:n]
        seqs.append(ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids)
    # a fast tokenizer whose decode is the backend's own, without clean-up: decode the batch in one
    # backend call (4x faster than transformers' per-sequence loop, same strings)
    plain = getattr(type(tokenizer), "_decode", None) is PreTrainedTokenizerFast._decode
    if plain and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.backend_tokenizer.decode_batch(seqs, skip_special_tokens=True)
    return tokenizer.batch_decode(seqs, skip_special_tokens=True)


def encode_prompts(tokenizer: Any, examples: list[Example], cfg: Config) -> list[list[int]]:
    """Token ids per prompt (chat template if asked); too-long prompts are an error naming the prompt."""
    from gspo.tasks.datasets import apply_chat_template

    out = []
    for ex in examples:
        text = (
            apply_chat_template(tokenizer, ex.prompt, cfg.system_prompt) if cfg.chat_template else ex.prompt
        )
        ids = tokenizer(text, add_special_tokens=not cfg.chat_template).input_ids
        if not ids:
            raise GspoError(f"prompt is empty after tokenization: {ex.prompt[:60]!r}")
        if len(ids) > cfg.max_prompt_tokens:
            raise GspoError(
                f"prompt has {len(ids)} tokens > max_prompt_tokens={cfg.max_prompt_tokens}: "
                f"{ex.prompt[:60]!r}"
            )
        out.append(ids)
    return out


# ------------------------------------------------------------------------------------------------
# the policy update


def _forward(
    model: Any,
    mb: RolloutData,
    lay: Layout,
    cfg: Config,
    entropy: bool = False,
    replay: Any = None,
    capture: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """Response log-probs ``[B, T]`` (+ entropy) of ``mb`` laid out as ``lay``, optionally replaying or
    capturing MoE routing."""
    from gspo.model import routing as R

    ctx = R.replay_routing(model, replay) if replay is not None else nullcontext()
    cap = R.capture_routing(model) if capture else nullcontext()
    with ctx, cap as rec:
        res = response_logprobs(
            model,
            mb.prompt_ids_BP,
            mb.prompt_mask_BP,
            mb.response_ids_BT,
            mb.response_mask_BT,
            cfg.temperature,
            cfg.logp_chunk_size,
            return_entropy=entropy,
            layout=lay,
        )
    logp, ent = res if entropy else (res, None)
    return logp, ent, (R.routing_snapshot(rec) if capture else None)


def _layout(model: Any, cfg: Config) -> str:
    """Training forward layout (see :mod:`gspo.model.forward`). Packing removes padding compute, but
    with dense-mask attention (sdpa/eager) its attention cost grows with the packed length squared,
    so ``auto`` packs only with flash attention; prefix sharing needs a model that takes 4D masks."""
    from gspo.model.forward import lm_head_is_plain, shared_prefix_is_exact
    from gspo.model.lora import hf_module

    # the one-time model probes run here, before any routing capture or replay could record them;
    # this object is the one the forwards will see (a DDP wrapper, say), so its probe is cached too
    lm_head_is_plain(hf_module(model))
    base = dist_utils.unwrap(model)
    impl = getattr(getattr(base, "config", None), "_attn_implementation", "") or ""
    if cfg.packing == "on" or (cfg.packing == "auto" and impl.startswith("flash")):
        return "packed"
    if cfg.prefix_sharing == "off":
        return "rows"
    if shared_prefix_is_exact(hf_module(base)):
        return "shared_prefix"
    if cfg.prefix_sharing == "on":
        raise GspoError(
            "config field 'prefix_sharing': 'on' needs a model that takes a 4D attention mask (sdpa or "
            f"eager attention, no sliding window, positions from position_ids); this one ({impl!r}) "
            "does not (use 'auto' or 'off')"
        )
    return "rows"


def micro_batches(mb: RolloutData, micro: int) -> list[RolloutData]:
    """Split a minibatch into micro-batches of rows with similar lengths (length bucketing), each
    trimmed to its own longest prompt and response, so little compute goes to padding."""
    if micro >= len(mb.adv_B):
        return [mb.trim()]
    total_B = mb.prompt_mask_BP.sum(-1) + mb.response_mask_BT.sum(-1)
    order = torch.argsort(total_B, stable=True)
    fields = RolloutData.__dataclass_fields__
    return [
        RolloutData(*(getattr(mb, f)[order[j : j + micro]] for f in fields)).trim()
        for j in range(0, len(order), micro)
    ]


def policy_update(
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data: RolloutData,
    cfg: Config,
    world_size: int = 1,
    is_moe: bool = False,
) -> dict[str, float]:
    """``num_minibatches`` optimizer steps over contiguous slices of ``data``; returns mean metrics.

    pi_old: minibatch 0's own first forward is on-policy (no update has happened yet), so its
    detached log-probs *are* pi_old and nothing is recomputed for it. Other minibatches get one
    no-grad forward before the first update (``old_logp="recompute"``), or use the sampler's
    log-probs (``"rollout"``). MoE: Routing Replay needs pi_old's routing of minibatches 2.., and
    volatility that of minibatch 2 (see :func:`_volatility`). Losses use the global minibatch size as
    normalizer; gradients are averaged across ranks, so the loss is scaled by ``world_size`` to give
    the single-process update.
    """

    loss_fn, _, _ = LOSSES[cfg.algo]
    eps_low, eps_high = cfg.clip_range()
    extra = {"aggregation": cfg.grpo_aggregation} if cfg.algo == "grpo" else {}
    mb_size = data.adv_B.shape[0] // cfg.num_minibatches
    max_norm = cfg.max_grad_norm or float("inf")
    micro = cfg.micro_batch_size or mb_size
    # mbs[i][j]: micro-batch j of minibatch i; the same tensors serve pi_old, the update and volatility
    mbs = [
        micro_batches(data.slice(slice(i * mb_size, (i + 1) * mb_size)), micro)
        for i in range(cfg.num_minibatches)
    ]
    # each micro-batch's model inputs, built once for its pi_old, training and volatility forwards
    layout, dtype = _layout(model, cfg), next(iter(model.parameters())).dtype
    lays = {
        (i, j): make_layout(
            m.prompt_ids_BP, m.prompt_mask_BP, m.response_ids_BT, m.response_mask_BT, layout, dtype
        )
        for i, mb in enumerate(mbs)
        for j, m in enumerate(mb)
    }
    replaying = is_moe and cfg.routing_replay
    # volatility is measured on one minibatch: the second (one optimizer step after pi_old, the
    # paper's per-update figure), or the only one, looked at again after its update
    vol_i = (1 if len(mbs) > 1 else 0) if (is_moe and cfg.log_volatility) else None
    old_logp: dict[tuple[int, int], torch.Tensor] = {}
    old_routing: dict[tuple[int, int], Any] = {}
    old_mode = cfg.resolved_old_logp()
    with torch.no_grad():  # pi_old before any update: log-probs and/or routing where needed
        for i in range(1, len(mbs)):
            want = replaying or i == vol_i
            if old_mode == "recompute" or want:
                for j, mmb in enumerate(mbs[i]):
                    old_logp[i, j], _, old_routing[i, j] = _forward(model, mmb, lays[i, j], cfg, capture=want)

    new_routing: dict[tuple[int, int], Any] = {}
    per_mb: dict[str, list[torch.Tensor]] = defaultdict(list)  # one value per minibatch
    token_keys = _TOKEN_METRICS | ({"ratio_mean"} if cfg.algo == "grpo" else set())
    mismatch = torch.zeros(3)  # sum |token diff| (per-seq mean), sum |seq diff|, n sequences
    n_updates = 0
    model.train()
    for i in range(len(mbs)):
        optimizer.zero_grad(set_to_none=True)
        parts: list[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]] = []
        loss_sum = torch.zeros(())
        for j, mmb in enumerate(mbs[i]):
            replay = old_routing[i, j] if (replaying and i > 0) else None
            measure = i == vol_i and i > 0
            if measure and replay is not None:  # replay forces routing: look at the free choice separately
                with torch.no_grad():
                    _, _, new_routing[i, j] = _forward(model, mmb, lays[i, j], cfg, capture=True)
            logp, ent, routing = _forward(
                model,
                mmb,
                lays[i, j],
                cfg,
                entropy=True,
                replay=replay,
                capture=(i == 0 and vol_i == 0) or (measure and replay is None),
            )
            if i == 0:
                old_logp[0, j], old_routing[0, j] = logp.detach(), routing
            elif measure and replay is None:  # this forward runs under the policy after i updates
                new_routing[i, j] = routing
            trainer_old = old_logp.get((i, j))
            m_BT = mmb.response_mask_BT
            n_tok_B = m_BT.sum(-1).clamp(min=1)
            if trainer_old is not None:  # train/inference mismatch, always logged when measurable
                d_BT = (trainer_old - mmb.sampler_logp_BT) * m_BT
                mismatch += (
                    torch.stack(
                        [
                            (d_BT.abs().sum(-1) / n_tok_B).sum(),
                            (d_BT.sum(-1) / n_tok_B).abs().sum(),
                            torch.tensor(float(len(n_tok_B))),
                        ]
                    )
                    .detach()
                    .cpu()
                )
            old = mmb.sampler_logp_BT if old_mode == "rollout" else trainer_old
            loss, metrics = loss_fn(
                logp, old, mmb.adv_B, m_BT, eps_low, eps_high, normalizer=mb_size * world_size, **extra
            )
            (loss * world_size).backward()
            n_tok = m_BT.sum()
            metrics["entropy"] = (ent * m_BT).sum() / n_tok.clamp(min=1)
            parts.append((metrics, (m_BT.sum(-1) > 0).sum(), n_tok))
            loss_sum = loss_sum + loss.detach().float().cpu() * world_size
        # the optimizer's parameters only: frozen ones (LoRA base) must not add stale gradients
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        gnorm = torch.nn.utils.get_total_norm([p.grad for p in params])
        full = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm  # FSDP2: a DTensor
        # one host read for both decisions; clip_grad_norm_ scales by max / (norm + 1e-6) clamped
        # to 1, i.e. changes the gradients exactly when the second test holds (a no-op multiply else)
        finite, clip = torch.stack([full.isfinite(), full + 1e-6 > max_norm]).tolist()
        if finite:
            if clip:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, gnorm)
            optimizer.step()
            n_updates += 1
        scheduler.step()
        mb_metrics = _combine_micro_batches(parts, token_keys)
        mb_metrics["loss"], mb_metrics["grad_norm"] = loss_sum, full.detach().float().cpu()
        for k, v in mb_metrics.items():
            per_mb[k].append(v)

    keys = list(per_mb)
    v_KM = torch.stack([torch.stack(per_mb[k]) for k in keys])  # [metric, minibatch]
    lo, hi, mean = v_KM.amin(-1).tolist(), v_KM.amax(-1).tolist(), v_KM.mean(-1).tolist()
    pick = {"_min": lo, "_max": hi}
    sums = {k: pick.get(k[-4:], mean)[n] for n, k in enumerate(keys)}
    out = {f"loss/{k}": v for k, v in sums.items() if k != "entropy"}
    out["rollout/entropy"] = sums["entropy"]
    out["loss/skipped_updates"] = float(len(mbs) - n_updates)
    if mismatch[2] > 0:
        out["mismatch/token_abs_logp_diff"] = float(mismatch[0] / mismatch[2])
        out["mismatch/seq_abs_logp_diff"] = float(mismatch[1] / mismatch[2])
    if vol_i is not None:
        if vol_i == 0:  # no later minibatch saw an updated policy: look once after the update
            with torch.no_grad():
                for j, mmb in enumerate(mbs[0]):
                    new_routing[0, j] = _forward(model, mmb, lays[0, j], cfg, capture=True)[2]
        out.update(_volatility(mbs, lays, old_routing, new_routing))
    return out


# metrics averaged over tokens (the rest over sequences); ``*_min`` / ``*_max`` are minima / maxima
_TOKEN_METRICS = {"clip_frac_tok", "clip_frac_tok_low", "clip_frac_tok_high", "approx_kl", "entropy"}


def _reduce(key: str, v: torch.Tensor) -> torch.Tensor:
    return v.amin() if key.endswith("_min") else v.amax() if key.endswith("_max") else v.mean()


def _combine_micro_batches(
    parts: list[tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]], token_keys: set[str]
) -> dict[str, torch.Tensor]:
    """One minibatch's metrics from its micro-batches' ``(metrics, sequences, tokens)``: means weighted
    by the sequences or tokens each was averaged over, so they equal the whole-minibatch values."""
    if len(parts) == 1:  # the default: the whole minibatch in one pass
        return {k: v.detach().float().cpu() for k, v in parts[0][0].items()}
    out = {}
    for k in parts[0][0]:
        v = torch.stack([m[k].detach().float().cpu() for m, _, _ in parts])
        if k.endswith(("_min", "_max")):
            out[k] = _reduce(k, v)
            continue
        w = torch.stack([(n_tok if k in token_keys else n_seq).float().cpu() for _, n_seq, n_tok in parts])
        out[k] = (v * w).sum() / w.sum().clamp(min=1)
    return out


def _volatility(
    mbs: list[list[RolloutData]],
    lays: dict[tuple[int, int], Layout],
    old_routing: dict[tuple[int, int], Any],
    new_routing: dict[tuple[int, int], Any],
) -> dict[str, float]:
    """Expert-activation volatility: fraction of response tokens whose top-k expert set under the
    policy after one optimizer step differs from pi_old's (per layer, and their mean).

    Measured on the second minibatch: pi_old's routing comes from one no-grad forward before the
    first update, the new routing from that minibatch's own training forward (one step later), so it
    costs one forward of a quarter of the batch (under Routing Replay, whose forced routing hides the
    free choice, one more). With a single minibatch, the same rows are looked at after the update.
    """
    from gspo.model import routing as R

    per_layer: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
    total, n = torch.zeros(()), 0
    for (i, j), new in new_routing.items():
        mmb = mbs[i][j]
        overall, layers = R.routing_volatility(old_routing[i, j], new, lays[i, j].response_pos_RL)
        w = int(mmb.response_mask_BT.sum())
        total, n = total + overall.float().cpu() * w, n + w
        for k, v in layers.items():
            per_layer[k] = per_layer[k] + v.float().cpu() * w
    out = {"moe/volatility": float(total) / max(n, 1)}
    out.update({f"moe/volatility/{k}": float(v) / max(n, 1) for k, v in per_layer.items()})
    return out


# ------------------------------------------------------------------------------------------------
# rollout, rewards, evaluation


def collect_rollout(
    engine: Any, tokenizer: Any, task: Any, examples: list[Example], prompt_ids: list[list[int]], cfg: Config
) -> tuple[RolloutData, dict[str, float]]:
    """G samples per prompt, rewards, group advantages -> RolloutData (groups contiguous)."""
    G = cfg.group_size
    rep_ids = [p for p in prompt_ids for _ in range(G)]
    t0 = time.time()
    rb = engine.generate(rep_ids, cfg.max_new_tokens, cfg.temperature)
    t_gen = time.time() - t0
    completions = completion_texts(tokenizer, rb.response_ids_BT, rb.response_mask_BT)
    prompts = [e.prompt for e in examples for _ in range(G)]
    answers = [e.answer for e in examples for _ in range(G)]
    rewards, n_bad = safe_rewards(
        task.reward, prompts, completions, answers, on_error=cfg.reward_on_error, name=task.reward_name
    )
    rewards_NG = torch.tensor(rewards, dtype=torch.float32).view(len(examples), G)
    adv_B = group_advantages(rewards_NG, cfg.adv_scale).view(-1)
    p_ids, p_mask = left_pad(rep_ids, tokenizer.pad_token_id)
    lengths = rb.response_mask_BT.sum(-1).float()
    eos = (rb.response_ids_BT == tokenizer.eos_token_id).any(-1).float()
    metrics = {
        "rollout/reward_mean": float(rewards_NG.mean()),
        "rollout/reward_std": float(rewards_NG.std(correction=0)),
        "rollout/solved_groups": float((rewards_NG.std(1, correction=0) == 0).float().mean()),
        "rollout/response_len": float(lengths.mean()),
        "rollout/response_len_max": float(lengths.max()),
        "rollout/truncated_frac": float(1 - eos.mean()),
        "rollout/empty_completions": float(sum(1 for c in completions if not c.strip())),
        "rollout/reward_errors": float(n_bad),
        "time/generate_s": t_gen,
    }
    data = RolloutData(
        p_ids,
        p_mask,
        rb.response_ids_BT.cpu(),
        rb.response_mask_BT.cpu(),
        rb.sampler_logp_BT.float().cpu(),
        adv_B,
    )
    return data, metrics


@torch.no_grad()
def evaluate(
    engine: Any, tokenizer: Any, task: Any, prompt_ids: list[list[int]], cfg: Config
) -> dict[str, float]:
    """Greedy decoding on the held-out set: mean reward and accuracy (reward >= 1)."""
    rb = engine.generate(prompt_ids, cfg.max_new_tokens, 1.0, greedy=True)
    completions = completion_texts(tokenizer, rb.response_ids_BT, rb.response_mask_BT)
    ex = task.eval
    rewards, _ = safe_rewards(
        task.reward,
        [e.prompt for e in ex],
        completions,
        [e.answer for e in ex],
        on_error=cfg.reward_on_error,
        name=task.reward_name,
    )
    r = np.asarray(rewards, dtype=np.float64)
    return {"eval/reward_mean": float(r.mean()), "eval/accuracy": float((r >= 1.0 - 1e-9).mean())}


def warm_start(
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    prompt_ids: list[list[int]],
    cfg: Config,
    device: torch.device,
    progress: bool,
) -> float:
    """Supervised steps on (prompt, answer + EOS) so RL starts from partial accuracy. Returns last loss."""
    rng = random.Random(cfg.seed + 7)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.0)
    bar = Progress(cfg.sft_steps, "warm start", enabled=progress)
    answers = [
        tokenizer(e.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for e in examples
    ]
    loss_v = float("nan")
    model.train()
    for step in range(cfg.sft_steps):
        idx = [rng.randrange(len(examples)) for _ in range(cfg.sft_batch_size)]
        p_ids, p_mask = left_pad([prompt_ids[i] for i in idx], tokenizer.pad_token_id, device)
        resp = [answers[i] for i in idx]
        T = max(map(len, resp))
        r_ids = torch.full((len(idx), T), tokenizer.pad_token_id, dtype=torch.long)
        r_mask = torch.zeros((len(idx), T), dtype=torch.long)
        for k, a in enumerate(resp):
            r_ids[k, : len(a)], r_mask[k, : len(a)] = torch.tensor(a), 1
        r_ids, r_mask = r_ids.to(device), r_mask.to(device)
        logp = response_logprobs(model, p_ids, p_mask, r_ids, r_mask, 1.0, cfg.logp_chunk_size)
        loss = -(logp * r_mask).sum() / r_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == cfg.sft_steps - 1:
            loss_v = float(loss.detach())
        bar.update(step + 1, f"nll {loss_v:.3f}")
    opt.zero_grad(set_to_none=True)  # no warm-start gradient may outlive it (e.g. on a LoRA-frozen base)
    return loss_v


# ------------------------------------------------------------------------------------------------
# the loop


def _prompt_batch(n_train: int, data_pos: int, count: int, seed: int) -> list[int]:
    """Indices ``data_pos .. data_pos+count`` of an epoch-wise shuffled order (deterministic, resumable)."""
    out = []
    for pos in range(data_pos, data_pos + count):
        epoch, k = divmod(pos, n_train)
        perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(int(perm[k]))
    return out


def train(cfg: Config) -> dict[str, Any]:
    """Run RL post-training as configured; returns a summary (final eval, paths)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # our own progress line is enough
    transformers.utils.logging.set_verbosity_error()
    dctx = dist_utils.setup(cfg)
    rank, world, device = dctx.rank, dctx.world_size, dctx.device
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir = cfg.run_dir
    resume_from = ckpt.latest_checkpoint(run_dir) if cfg.resume else None
    if cfg.resume and resume_from is None:
        raise GspoError(f"--resume: no checkpoint found under {run_dir}/checkpoints")
    if not cfg.resume and ckpt.latest_checkpoint(run_dir) is not None:
        raise GspoError(
            f"run folder {run_dir} already holds checkpoints; pass --resume to continue it or "
            "--name to start a new run"
        )
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_yaml(cfg, run_dir / "config.yaml")

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model, tokenizer = load_model_and_tokenizer(cfg.model, cfg.tokenizer, cfg.dtype, cfg.seed)
    model.to(device)
    task = build_task(
        cfg.task, cfg.reward, cfg.seed, cfg.eval_size, cfg.eval_task, cfg.prompt_field, cfg.answer_field
    )
    ctx_len = getattr(model.config, "max_position_embeddings", None)
    if ctx_len is not None and cfg.max_prompt_tokens + cfg.max_new_tokens > ctx_len:
        raise GspoError(
            f"config fields 'max_prompt_tokens' + 'max_new_tokens' = "
            f"{cfg.max_prompt_tokens + cfg.max_new_tokens} exceed the model's context of {ctx_len}"
        )
    train_ids = encode_prompts(tokenizer, task.train, cfg)
    eval_ids = encode_prompts(tokenizer, task.eval, cfg)
    from gspo.model.routing import is_moe as _is_moe

    is_moe = _is_moe(model)  # before LoRA wraps it: PEFT leaves the routers as they are
    _layout(model, cfg)  # a layout the model cannot take is an error now, not after the warm start
    progress = cfg.progress and rank == 0

    start_step, data_pos = 0, 0
    sample_gen = torch.Generator().manual_seed(cfg.seed * 7919 + rank)
    lora_base = run_dir / "checkpoints" / "lora-base"
    if resume_from is not None:
        from transformers import AutoModelForCausalLM

        state = ckpt.load_trainer_state(resume_from)
        # from_pretrained undoes the on-disk layout conversions (e.g. per-expert MoE weights)
        weights_dir = lora_base if cfg.lora_rank else resume_from
        saved = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=next(model.parameters()).dtype)
        model.load_state_dict(saved.state_dict())
        del saved
    elif cfg.sft_steps:
        warm_start(model, tokenizer, task.train, train_ids, cfg, device, progress)
    if cfg.lora_rank:
        from gspo.model.lora import apply_lora

        if world > 1:
            raise GspoError("config field 'lora_rank': LoRA runs in one process for now (use nproc 1)")
        if resume_from is None:  # the frozen base, saved once; checkpoints then hold only adapters
            save_pretrained(model, tokenizer, lora_base)
        model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
        if resume_from is not None:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(
                model, load_file(str(resume_from / "adapter" / "adapter_model.safetensors"))
            )

    model = dist_utils.wrap(model, cfg, dctx)
    optimizer, scheduler = make_optimizer(model, cfg, world)
    if resume_from is not None:
        dist_utils.load_optimizer_state_dict(model, optimizer, state["optimizer"], dctx)
        scheduler.load_state_dict(state["scheduler"])
        start_step, data_pos = state["step"], state["data_pos"]
        sample_gen.set_state(state["sample_gen"][rank] if world > 1 else state["sample_gen"][0])
        ckpt.set_rng_state(state["rng"])
    rollout_model = dist_utils.rollout_model(model, dctx)
    engine = make_engine(cfg, rollout_model, tokenizer, sample_gen)
    logger = (
        MetricsLogger(run_dir, start_step if resume_from else None, cfg.wandb, cfg.to_dict())
        if rank == 0
        else None
    )

    last_saved = start_step

    def save(step: int) -> None:
        gens = dist_utils.gather_objects(sample_gen.get_state(), dctx)
        full_sd = dist_utils.full_state_dict(model, dctx)
        opt_sd = dist_utils.optimizer_state_dict(model, optimizer, dctx)
        if rank != 0:
            return
        state = {
            "optimizer": opt_sd,
            "scheduler": scheduler.state_dict(),
            "step": step,
            "data_pos": data_pos,
            "sample_gen": gens,
            "rng": ckpt.rng_state(),
            "config": cfg.to_dict(),
        }
        base = dist_utils.unwrap(model)
        ckpt.save_checkpoint(run_dir, step, lambda p: _save_hf(base, tokenizer, p, full_sd), state)
        nonlocal last_saved
        last_saved = step

    if resume_from is None:
        ev = evaluate(engine, tokenizer, task, eval_ids, cfg) if rank == 0 else {}
        if logger:
            logger.log(0, ev)
        save(0)
    initial = read_metrics(run_dir / "metrics.jsonl")[0] if rank == 0 else {}

    bar = Progress(cfg.steps, f"{cfg.algo}", enabled=progress)
    bar.update(start_step)
    last: dict[str, float] = {}
    prompts_local = cfg.prompts_per_step // world if cfg.prompts_per_step % world == 0 else None
    if prompts_local is None:
        raise GspoError(
            f"config field 'prompts_per_step': {cfg.prompts_per_step} must divide by nproc={world}"
        )
    for step in range(start_step + 1, cfg.steps + 1):
        t0 = time.time()
        idx = _prompt_batch(len(task.train), data_pos, cfg.prompts_per_step, cfg.seed)
        idx = idx[rank * prompts_local : (rank + 1) * prompts_local]
        gen_state = sample_gen.get_state()
        data_pos += cfg.prompts_per_step
        try:
            data, metrics = collect_rollout(
                engine, tokenizer, task, [task.train[i] for i in idx], [train_ids[i] for i in idx], cfg
            )
        except (GspoError, KeyboardInterrupt) as e:
            # nothing was updated this step: rewind it and checkpoint, so no finished step is lost
            sample_gen.set_state(gen_state)
            data_pos -= cfg.prompts_per_step
            if last_saved < step - 1 and world == 1:
                save(step - 1)
            where = f"progress is saved at step {step - 1}; continue with --resume"
            if isinstance(e, KeyboardInterrupt):
                raise KeyboardInterrupt(where) from None
            raise GspoError(f"{e} ({where})") from None
        t1 = time.time()
        metrics.update(policy_update(model, optimizer, scheduler, data.to(device), cfg, world, is_moe))
        dist_utils.sync_rollout_model(model, rollout_model, dctx)
        engine.sync_weights()
        metrics["time/update_s"] = time.time() - t1
        metrics["time/step_s"] = time.time() - t0
        metrics["lr"] = scheduler.get_last_lr()[0]
        metrics = dist_utils.mean_metrics(metrics, dctx)
        if rank == 0 and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            metrics.update(evaluate(engine, tokenizer, task, eval_ids, cfg))
        if logger:
            logger.log(step, metrics)
        last.update(metrics)
        bar.update(
            step,
            f"reward {metrics['rollout/reward_mean']:.3f} acc {last.get('eval/accuracy', float('nan')):.3f}"
            f" clip {metrics.get('loss/clip_frac_tok', 0):.3f}",
        )
        if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
            save(step)

    summary: dict[str, Any] = {"run_dir": str(run_dir)}
    final_sd = dist_utils.full_state_dict(model, dctx)  # collective on every rank; None in one process
    if rank == 0:
        final_dir = run_dir / "final"
        _save_hf(dist_utils.unwrap(model), tokenizer, final_dir, final_sd)
        rows = read_metrics(run_dir / "metrics.jsonl")
        plot_metrics(rows, run_dir / "curves.png", title=f"{cfg.algo} on {cfg.task} ({cfg.model})")
        evals = [r for r in rows if r.get("eval/accuracy") is not None]
        summary.update(
            {
                "initial_accuracy": initial.get("eval/accuracy"),
                "final_accuracy": evals[-1]["eval/accuracy"] if evals else None,
                "final_dir": str(final_dir),
                "plot": str(run_dir / "curves.png"),
            }
        )
        logger.close()
    dist_utils.cleanup(dctx)
    return summary


def _save_hf(
    model: Any, tokenizer: Any, path: Path, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """HF folder loadable by ``from_pretrained``; with LoRA the adapters are merged in and also kept
    on their own under ``adapter/`` (for resuming and for PEFT users)."""
    from gspo.model.lora import is_peft, merged_copy

    if is_peft(model):
        save_pretrained(merged_copy(model), tokenizer, path)
        model.save_pretrained(Path(path) / "adapter")
        return
    if state_dict is not None:
        model.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(path)
    else:
        save_pretrained(model, tokenizer, path)


def make_optimizer(model: Any, cfg: Config, world_size: int = 1) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the trainable parameters and a linear-warmup LR schedule."""
    # fused AdamW: one kernel for all parameters instead of a Python loop (5% of a tiny-model step)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.weight_decay,
        fused=world_size == 1,
    )
    warm = max(cfg.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    return optimizer, scheduler


def make_engine(cfg: Config, model: Any, tokenizer: Any, generator: torch.Generator) -> Any:
    """Rollout engine by name; vLLM is imported only when selected."""
    if cfg.rollout_engine == "vllm":
        from gspo.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine.from_trainer(cfg, model, tokenizer)
    return HFRolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, generator)
