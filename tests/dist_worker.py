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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from gspo.config import Config
    from gspo.data import TrainBatch
    from gspo.model.load import build_char_tokenizer, build_tiny_moe
    from gspo.model.logprobs import PolicyLogprobs
    from gspo.resolve import dist_plan, plan_update
    from gspo.train import distributed as D
    from gspo.train.update import policy_update

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
            rsd = {k: v.detach().clone() for k, v in rollout.named_parameters(remove_duplicate=False)}
            tied = rollout.lm_head.weight is rollout.get_input_embeddings().weight
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
            }
        dist.barrier()
    if ctx is not None and ctx.rank == 0:
        torch.save(results, args.out)
    D.cleanup(ctx)


if __name__ == "__main__":
    main()
