"""Per-rank peak memory of the policy update at 1 and 2 ranks (FSDP2 on gloo, CPU), and the memory
model's estimate for each (issue 20). Each rank builds the model the way ``gspo train`` does from
weights on disk: on the meta device, sharded, then filled from rank 0's copy (rank 0 alone builds it,
on the CPU); then one warm-up update and one measured update on a synthetic batch.

Per rank: peak resident set (VmHWM) minus the resident set before the model was built.

    python benchmarks/bench_scale.py --shape cpu-dense-160m            # 1 process, then 2 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import QWEN3_VOCAB, SHAPES, build  # noqa: E402


def _vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(shape: str, rows: int, prompt: int, response: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from gspo.config import Config
    from gspo.data import TrainBatch
    from gspo.model.logprobs import PolicyLogprobs
    from gspo.resolve import dist_plan, for_model, layout_plan, update_plan
    from gspo.training import distributed as D
    from gspo.training.update import policy_update

    world = int(os.environ.get("WORLD_SIZE", "1"))
    G = 2
    cfg = Config(
        prompts_per_step=rows // G, group_size=G, num_minibatches=4, micro_batch_size=1, nproc=world,
        max_new_tokens=response, max_prompt_tokens=prompt, routing_replay=False, log_volatility=False,
        old_logp="recompute", parallel="fsdp", threads=1,
    ).validate()  # fmt: skip
    ctx = D.setup(dist_plan(cfg))
    base = _vm("VmRSS")
    model = build(shape, "meta" if world > 1 else "cpu")
    source = None
    if world > 1 and ctx.rank == 0:
        with torch.random.fork_rng(devices=[]):
            source = build(shape, "cpu")
    if world > 1:
        D.share_probes(model, source)
    plan = for_model(
        update_plan(cfg), layout_plan(cfg), PolicyLogprobs(model), bool(SHAPES[shape]["kind"] == "moe")
    )
    policy = D.wrap(PolicyLogprobs(model), dist_plan(cfg), ctx, source)
    del source
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(ctx.rank)
    n = rows // world
    ids = torch.randint(4, V, (n, prompt + response), generator=g)
    data = TrainBatch(
        ids[:, :prompt], torch.ones(n, prompt, dtype=torch.long), ids[:, prompt:],
        torch.ones(n, response, dtype=torch.long), -torch.rand(n, response, generator=g), torch.randn(n, generator=g),
    )  # fmt: skip
    for _ in range(2):
        policy_update(policy, opt, sched, data, plan, world)
    res = {"rank": ctx.rank, "world": world, "peak": _vm("VmHWM") - base, "shape": shape}
    peaks = D.gather_objects(res, ctx)
    if ctx.rank == 0:
        Path(out).write_text(json.dumps(peaks))
    D.cleanup(ctx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="cpu-dense-160m", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default="/tmp/bench_scale.json")
    a = ap.parse_args()
    if a.worker:
        worker(a.shape, a.rows, a.prompt, a.response, a.out)
        return
    from gspo.capacity import Shape, estimate
    from gspo.config import Config
    from gspo.resolve import capacity_plan

    spec = dict(SHAPES[a.shape])
    spec.pop("kind")
    spec.setdefault("vocab_size", QWEN3_VOCAB)
    shape = Shape.from_config(spec)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    common = ["--worker", "--shape", a.shape, "--rows", str(a.rows), "--prompt", str(a.prompt)]
    common += ["--response", str(a.response), "--out", a.out]
    results = {}
    for world in (1, 2):
        launch = (
            [sys.executable]
            if world == 1
            else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        )
        subprocess.run([*launch, __file__, *common], check=True, env=env, capture_output=True, text=True)
        peaks = json.loads(Path(a.out).read_text())
        cfg = Config(
            prompts_per_step=a.rows // 2, group_size=2, num_minibatches=4, micro_batch_size=1, nproc=world,
            max_new_tokens=a.response, max_prompt_tokens=a.prompt, parallel="fsdp",
        ).validate()  # fmt: skip
        est = estimate(capacity_plan(cfg), shape, world).update_peak
        results[world] = max(p["peak"] for p in peaks)
        for p in peaks:
            print(
                f"{a.shape} ({shape.params() / 1e6:.0f}M parameters) world {world} rank {p['rank']}: "
                f"peak {p['peak'] / 2**30:.2f} GiB, estimate {est / 2**30:.2f} GiB ({100 * (est / p['peak'] - 1):+.1f}%)"
            )
    print(f"per-rank peak at 2 ranks / 1 process: {results[2] / results[1]:.2f}")


if __name__ == "__main__":
    main()
