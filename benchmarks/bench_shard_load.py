"""Peak host memory of loading a model for training: one process (``from_pretrained``, the whole model)
against each of 2 FSDP2 ranks reading their own shards (gspo.model.shard_load), and against the
older start where rank 0 read the whole model for both.

    python benchmarks/make_random_model.py --shape dense-0.6b --dtype bfloat16 --out /tmp/q06
    python benchmarks/bench_shard_load.py --model /tmp/q06

Peak = the process's VmHWM once the weights are in place ("at load"; on the ranks, before wrap's
first forward), and again after the first forward and the model probes ("after"); "load" = the peak
minus the RSS before the model was touched (imports and the process group are the same in every mode).
Prints the ratios against the one process's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def _vm(key: str) -> float:
    """GiB of /proc/self/status's ``key`` (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    raise KeyError(key)


def _worker(model: str, mode: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from gspo.model.load import load_model_and_tokenizer
    from gspo.model.logprobs import PolicyLogprobs
    from gspo.plans import DistPlan
    from gspo.training import distributed as D

    plan = DistPlan("cpu", "fsdp", "none", False, 1)
    ctx = D.setup(plan) if mode != "one" else None
    before, at_load = _vm("VmRSS"), []
    first_forward = D._first_forward  # the peak once the shards are filled, before wrap's warm-up forward
    D._first_forward = lambda *a: (at_load.append(_vm("VmHWM")), first_forward(*a))
    if mode == "one":
        load_model_and_tokenizer(model, None, "float32", 0)
    else:
        meta, _ = load_model_and_tokenizer(model, None, "float32", 0, meta=True)
        source = None
        if mode == "rank0":
            source = load_model_and_tokenizer(model, None, "float32", 0)[0] if ctx.rank == 0 else None
            D.share_probes(meta, source)
        policy = D.wrap(PolicyLogprobs(meta), plan, ctx, source, Path(model) if mode == "own" else None)
        del source
        if mode == "own":
            D.probe_sharded(policy)
    peak = at_load[0] if at_load else _vm("VmHWM")
    row = {
        "mode": mode,
        "rank": ctx.rank if ctx else 0,
        "before": before,
        "peak": peak,
        "after": _vm("VmHWM"),
    }
    Path(f"{out}.{row['rank']}").write_text(json.dumps(row))
    if ctx is not None:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _run(model: str, mode: str, tmp: Path) -> list[dict]:
    out = tmp / mode
    env = dict(os.environ, OMP_NUM_THREADS="1")
    me = [str(Path(__file__).resolve()), "--worker", mode, "--model", model, "--out", str(out)]
    if mode == "one":
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *me]
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    return [json.loads(p.read_text()) for p in sorted(tmp.glob(f"{mode}.*"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.worker:
        return _worker(a.model, a.worker, a.out)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rows = {m: _run(a.model, m, Path(tmp)) for m in ("one", "own", "rank0")}
    one = rows["one"][0]
    print(f"model {a.model}: one process peak {one['peak']:.2f} GiB (load {one['peak'] - one['before']:.2f})")
    for mode in ("own", "rank0"):
        for r in rows[mode]:
            peak, load = r["peak"], r["peak"] - r["before"]
            print(
                f"  {mode:5s} rank {r['rank']}: at load peak {peak:.2f} GiB ({peak / one['peak']:.2f} of one "
                f"process's), load {load:.2f} GiB ({load / (one['peak'] - one['before']):.2f}); after the "
                f"first forward and probes {r['after']:.2f} GiB ({r['after'] / one['peak']:.2f})"
            )


if __name__ == "__main__":
    main()
