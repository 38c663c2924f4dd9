"""Peak host memory of one policy update with and without activation checkpointing (issue 20).

Each measurement runs in a fresh process (so its peak RSS, ``ru_maxrss``, is that update's alone):
the embedded small MoE, a synthetic rollout batch of ``--rows`` responses of ``--tokens`` tokens,
one GSPO update (4 minibatches, Routing Replay on, so the replayed backward is what is measured).
Prints the peak of each and the ratio, from the same run:

    python benchmarks/bench_checkpointing.py [--rows 64] [--tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def one(checkpointing: bool, rows: int, tokens: int) -> dict[str, float]:
    """In this process: build, update once, return peak RSS (MiB) and the update's wall time."""
    import resource
    import time

    import torch

    torch.set_num_threads(1)
    from gspo.config import Config
    from gspo.data import TrainBatch
    from gspo.model.load import build_char_tokenizer, build_small_moe, enable_activation_checkpointing
    from gspo.resolve import for_model, layout_plan, update_plan
    from gspo.training.update import policy_update

    vocab = len(build_char_tokenizer())
    model = build_small_moe(vocab, seed=0)
    if checkpointing:
        enable_activation_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    P, T = 16, tokens
    ids = torch.randint(4, vocab, (rows, P + T), generator=g)
    ones_p, ones_t = torch.ones(rows, P, dtype=torch.long), torch.ones(rows, T, dtype=torch.long)
    adv = torch.randn(rows, generator=g)
    data = TrainBatch(ids[:, :P], ones_p, ids[:, P:], ones_t, -torch.rand(rows, T, generator=g), adv)
    cfg = Config(prompts_per_step=rows // 8, group_size=8, routing_replay=True, max_new_tokens=T).validate()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    policy_update(model, opt, sched, data, for_model(update_plan(cfg), layout_plan(cfg), model, True), 1)
    return {
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "before_update_mib": base,
        "update_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=["plain", "checkpointing"])
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.child == "checkpointing", a.rows, a.tokens)))
        return
    res: dict[str, list[dict[str, float]]] = {"plain": [], "checkpointing": []}
    for _ in range(a.repeats):  # alternate, so drift on a shared machine hits both alike
        for kind in res:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                kind,
                "--rows",
                str(a.rows),
                "--tokens",
                str(a.tokens),
            ]
            res[kind].append(
                json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            )
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in res.items()}
    for k, m in med.items():
        growth = m["peak_mib"] - m["before_update_mib"]
        print(
            f"{k:14s} peak {m['peak_mib']:8.0f} MiB  (update adds {growth:6.0f} MiB)  update {m['update_s']:6.1f} s"
        )
    grow = {k: med[k]["peak_mib"] - med[k]["before_update_mib"] for k in med}
    print(
        f"checkpointing / plain: peak {med['checkpointing']['peak_mib'] / med['plain']['peak_mib']:.2f}, "
        f"memory the update adds {grow['checkpointing'] / grow['plain']:.2f}, "
        f"update time {med['checkpointing']['update_s'] / med['plain']['update_s']:.2f}"
    )


if __name__ == "__main__":
    main()
