"""Run by tests/test_distributed.py under torchrun: one policy update per (wrapper, optimizer) on this
rank's rows, then the checks rank 0 writes to ``--out`` (parameters, metrics, rollout copy, optimizer).

Rank ``r`` of ``W`` gets, from each global minibatch ``i`` of ``mb`` rows, rows
``i*mb + r*mb/W .. i*mb + (r+1)*mb/W``, so local minibatch ``i`` on all ranks together is global minibatch ``i``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

torch.set_num_threads(1)


def local_rows(B: int, n_mb: int, rank: int, world: int) -> torch.Tensor:
    mb = B // n_mb
    per = mb // world
    return torch.cat([torch.arange(i * mb + rank * per, i * mb + (rank + 1) * per) for i in range(n_mb)])


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=name == "adamw-fused")


def _record_gradients(model, opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """The gradients each ``opt.step()`` applies, whole (collective: every rank steps together)."""
    from gspo.model.unwrap import full_tensor

    seen: list[dict[str, torch.Tensor]] = []

    def record(*_):
        seen.append(
            {n: full_tensor(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
        )

    opt.register_step_pre_hook(record)
    return seen


PROBE_IDS = torch.tensor([[5, 9, 13, 7, 21, 6, 11, 4]])


def _replayed_topk_equal(model, data) -> bool:
    """Every router, forced to a fixed routing of this rank's rows, is seen by capture_routing to
    use exactly that routing (R2 and R3 force the routers the same way: ``replay_routing``)."""
    from gspo.model import routing as R
    from gspo.model.logprobs import make_layout
    from gspo.model.unwrap import unwrap

    hf = unwrap(model, "transformers")
    lay = make_layout(
        data.prompt_ids_BP, data.prompt_mask_BP, data.response_ids_BT, data.response_mask_BT, "rows"
    )
    B, L = lay.input_ids_RL.shape
    E, k = hf.config.num_experts, hf.config.num_experts_per_tok
    g = torch.Generator().manual_seed(11)
    forced = {
        name: torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B * L)]).view(B, L, k)
        for name in R.find_routers(hf)
    }
    with torch.no_grad(), R.replay_routing(hf, forced), R.capture_routing(hf) as rec:
        model(lay, data.response_ids_BT, data.response_mask_BT)
    return all(torch.equal(rec[n], forced[n]) for n in forced)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from step_helpers import plan_update

    from gspo.config import Config
    from gspo.data import TrainBatch
    from gspo.model.load import build_char_tokenizer, build_tiny_moe
    from gspo.model.logprobs import PolicyLogprobs
    from gspo.model.unwrap import full_tensor
    from gspo.resolve import dist_plan
    from gspo.training import distributed as D
    from gspo.training.update import policy_update

    blob = torch.load(args.data, weights_only=False)
    data: TrainBatch = blob["data"]
    vocab = len(build_char_tokenizer())
    results = {}
    ctx = None
    for run in blob["runs"]:
        cfg = Config(**run["cfg"]).validate()
        ctx = D.setup(dist_plan(cfg))
        rank, world = ctx.rank, ctx.world_size
        rows = local_rows(data.adv_B.shape[0], cfg.num_minibatches, rank, world)
        local = data.rows(rows)
        hf = build_tiny_moe(vocab, seed=0)
        if cfg.lora_rank:
            from gspo.model.lora import apply_lora

            hf = apply_lora(hf, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
        if cfg.activation_checkpointing:
            from gspo.model.load import enable_activation_checkpointing

            enable_activation_checkpointing(hf)
        model = D.wrap(PolicyLogprobs(hf), dist_plan(cfg), ctx)
        trainable = [p for p in model.parameters() if p.requires_grad]
        rollout = D.rollout_model(model)
        opt = make_optimizer(run["opt"], trainable, run["lr"])
        grads = _record_gradients(model, opt)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        metrics = D.mean_metrics(
            policy_update(model, opt, sched, local, plan_update(cfg, model, True), world), ctx
        )
        sd = D.full_state_dict(model, ctx)
        osd = D.optimizer_state_dict(model, opt, ctx)
        # every rank reads the full optimizer state, as on resume; loading must give it back unchanged
        osd_all = D.gather_objects(osd if rank == 0 else None, ctx)[0]
        D.load_optimizer_state_dict(model, opt, osd_all, ctx)
        osd2 = D.optimizer_state_dict(model, opt, ctx)
        with D.gathered(model):  # what the sampler sees: the trained module's weights, gathered
            # (expert-parallel experts stay split: gathered whole as the sampler copy's sync does)
            rsd = {
                k: full_tensor(v.detach()).clone()
                for k, v in rollout.named_parameters(remove_duplicate=False)
            }
            tied = rollout.lm_head.weight is rollout.get_input_embeddings().weight
            # rank 0 alone runs a forward (as the held-out eval does): no collective inside
            probe_logits = rollout(input_ids=PROBE_IDS).logits.detach().clone() if rank == 0 else None
        if run.get("replay_check"):
            replay_ok = _replayed_topk_equal(model, local)
        if rank == 0:
            # per weight, relative to itself (0 where both are 0): a cast to bf16 is within 2^-8
            tiny = torch.finfo(torch.float32).tiny
            rollout_rel = max(
                float(((rsd[k] - v).abs() / v.abs().clamp(min=tiny)).max()) for k, v in sd.items()
            )
            opt_diff = max(
                (
                    float((osd2["state"][n][k] - s[k]).abs().max())
                    for n, st in osd["state"].items()
                    for k, s in [(k, st) for k in st]
                    if torch.is_tensor(s[k])
                ),
                default=0.0,
            )
            results[run["name"]] = {
                "params": sd,
                "metrics": metrics,
                "rollout_rel": rollout_rel,
                "opt_diff": opt_diff,
                "opt_keys": sorted(osd["state"]),
                "rollout_tied": tied,
                "probe_logits": probe_logits,
                "grads": grads,
                "replay_ok": replay_ok if run.get("replay_check") else None,
            }
        dist.barrier()
    if ctx is not None and ctx.rank == 0:
        torch.save(results, args.out)
    D.cleanup(ctx)


if __name__ == "__main__":
    main()
