"""Expert parallelism measured (issue 32 item 5): per-rank peak memory and bytes sent per RL step of
``gspo train`` on 2 gloo ranks with and without ``--ep 2``, against ``gspo plan``'s communication
model (:mod:`gspo.capacity_comm`) for the same configuration.

    python benchmarks/bench_ep.py                      # builds cpu-moe-480m (478.6M, 64 experts) once

The model is built from its config numbers (random weights, float32) and saved once as safetensors;
both ranks of each run read their own shards from it. Each run is ``gspo train``'s own path under
``torchrun --standalone --nproc_per_node 2`` (what ``gspo train --nproc 2`` launches): the worker
below wraps ``gspo.training.loop.rl_step`` (rollout, update, sampler sync; not the held-out eval or
the checkpoint) with a barrier and counter reads on both sides, then calls ``gspo.cli.main``.

Counted: each run is started in its own network namespace (``unshare -rn``) whose loopback carries
nothing but this run (gloo's TCP pairs, torchrun's store), so

* ``lo``: /proc/net/dev's transmit bytes of the namespace's ``lo`` (every packet once: payload of
  both ranks plus TCP/IP headers and ACKs);
* ``payload``: the sum of ``bytes_sent`` (``ss -ti``) over this rank's own TCP sockets (gloo's
  pairs and its store client): the bytes one rank sends, the plan's unit.

Not collectives: the store and the agent's keep-alive. An idle interval (both ranks asleep between
two barriers, before the first step) gives their rate, subtracted for each step's duration.
A calibration of the four collectives (100 MB each, same namespace) says what gloo sends for each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPE = "cpu-moe-480m"
IDLE_S = 10.0
# the run, as config keys (the same dict makes gspo train's flags and the plan's Config)
SETTINGS: dict[str, Any] = dict(
    device="cpu", sft_steps=0, steps=2, prompts_per_step=4, group_size=4, max_new_tokens=32, max_prompt_tokens=16,
    num_minibatches=2, micro_batch_size=4, eval_size=4, eval_every=0, save_every=0, threads=1, lr=1e-6,
)  # fmt: skip


def _vm(key: str) -> int:
    """Bytes of /proc/self/status's ``key`` (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _lo_tx() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    raise KeyError("lo")


def _payload_sent() -> int:
    """Payload bytes this process's TCP sockets have sent (``ss -tinp``: a socket's line names its
    process, the indented line below it holds its counters)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    mine, total, tag = False, 0, f"pid={os.getpid()},"
    for line in out.splitlines():
        if line and not line[0].isspace():
            mine = tag in line
        if mine:
            total += sum(int(t.split(":")[1]) for t in line.split() if t.startswith("bytes_sent:"))
    return total


def _counters() -> dict[str, float]:
    return {"t": time.time(), "lo": _lo_tx(), "payload": _payload_sent(), "hwm": _vm("VmHWM")}


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {"s": b["t"] - a["t"], "lo": b["lo"] - a["lo"], "payload": b["payload"] - a["payload"]}


def worker(out: str, args: list[str]) -> None:
    """One rank of ``gspo train`` with each RL step's counters recorded."""
    import torch.distributed as dist

    from gspo import cli
    from gspo.training import loop
    from gspo.training import run as run_module

    base, real, res = _vm("VmRSS"), loop.rl_step, {"steps": []}
    real_update, updates = run_module.policy_update, []

    def update(*args: Any) -> dict[str, float]:
        dist.barrier()
        a = _counters()
        out = real_update(*args)
        dist.barrier()
        updates.append(_delta(a, _counters()))
        return out

    def measured(*step_args: Any) -> dict[str, float]:
        dist.barrier()
        if "idle" not in res:
            res["startup_hwm"] = _vm("VmHWM")  # load and the step-0 eval (phase_peak resets it later)
            a = _counters()
            time.sleep(IDLE_S)
            dist.barrier()
            res["idle"] = _delta(a, _counters())
        a = _counters()
        metrics = real(*step_args)
        dist.barrier()
        b = _counters()
        phases = {k: v * 2**30 for k, v in metrics.items() if k.startswith("memory/")}
        res["steps"].append(_delta(a, b) | {"update": updates[-1], "phases": phases, "entry_hwm": a["hwm"]})
        return metrics

    loop.rl_step, run_module.policy_update = measured, update
    rc = cli.main(["train", *args])
    rank = int(os.environ["RANK"])
    # gspo's phase_peak resets VmHWM at each phase of a step and records the phase's peak: the run's
    # peak is the largest of those, the start-up's, and the last reset's (eval, checkpoint, final/)
    res |= {"rank": rank, "rc": rc, "base": base, "end_hwm": _vm("VmHWM")}
    seen = [res["startup_hwm"], res["end_hwm"]] + [v for s in res["steps"] for v in s["phases"].values()]
    res["hwm"] = max(seen + [s["entry_hwm"] for s in res["steps"]])
    Path(f"{out}.{rank}").write_text(json.dumps(res))


def calibrate() -> None:
    """What gloo sends, per rank, for each collective FSDP2 and EP use (100 MB each)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    w, n = dist.get_world_size(), 25_000_000
    x = torch.ones(n)
    ops = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(n * w), x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(n // w), x),
        "all_reduce": lambda: dist.all_reduce(x),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(n), x),
    }
    for name, op in ops.items():
        dist.barrier()
        a = _payload_sent()
        op()
        dist.barrier()
        sent = _payload_sent() - a
        if dist.get_rank() == 0:
            print(json.dumps({"op": name, "input_bytes": 4 * n, "sent": sent}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _isolated(cmd: list[str]) -> list[str]:
    """``cmd`` in a fresh network namespace with its loopback up (its counters: this run alone)."""
    return ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *cmd]


def _torchrun(*args: str) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    return _isolated([*run, str(Path(__file__).resolve()), *args])


def _flags(settings: dict[str, Any]) -> list[str]:
    return [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def _train(model: str, ep: int, tmp: Path) -> list[dict[str, Any]]:
    run_dir = tmp / f"runs-ep{ep}"
    args = [*_flags(SETTINGS), "--model", model, "--output-dir", str(run_dir), "--name", f"ep{ep}"]
    args += ["--expert-parallel-size", str(ep), "--no-progress"]
    out = tmp / f"ep{ep}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(_torchrun("--worker", str(out), "--", *args), env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"ep {ep}: torchrun failed ({p.returncode}):\n{p.stderr[-4000:]}")
    shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints: GBs
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]


def _estimate(model: str, ep: int) -> dict[str, float]:
    """capacity_comm's bytes per rank and step for SETTINGS at ``ep``, by term."""
    from gspo.capacity import estimate, shape_of
    from gspo.capacity_comm import INTER_GBPS, INTRA_GBPS, link_of, traffic
    from gspo.config import make_config
    from gspo.resolve import capacity_plan

    cfg = capacity_plan(
        make_config(None, {**SETTINGS, "model": model, "nproc": 2, "expert_parallel_size": ep})
    )
    shape = shape_of(model)
    t = traffic(cfg, shape, link_of(1, 2, None, INTRA_GBPS, INTER_GBPS), ep)
    terms = {f"{m.what} (x{t.update_batches})": m.nbytes * t.update_batches for m in t.update}
    terms |= {f"{m.what} (x{t.forward_batches})": m.nbytes * t.forward_batches for m in t.forward}
    terms |= {m.what: m.nbytes for m in t.sync}
    return terms | {"total": t.step()[0], "memory peak": estimate(cfg, shape, 2).peak}


def _build(out: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from make_random_model import build

    from gspo.model.load import build_char_tokenizer, save_pretrained

    model = build(SHAPE, torch.float32)
    save_pretrained(model, build_char_tokenizer(), out)
    print(f"{SHAPE}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters -> {out}")
    return str(out)


def _report(ep: int, ranks: list[dict[str, Any]], est: dict[str, float]) -> dict[str, Any]:
    G = 1e9
    print(f"\n== ep {ep}: estimate (capacity_comm, per rank and step) ==")
    for k, v in est.items():
        print(
            f"  {k:<32} {v / (2**30 if k == 'memory peak' else G):9.3f} {'GiB' if k == 'memory peak' else 'GB'}"
        )
    row: dict[str, Any] = {"ep": ep, "estimate": est, "ranks": []}
    for r in ranks:
        idle = r["idle"]
        rate_lo, rate_pl = idle["lo"] / idle["s"], idle["payload"] / idle["s"]
        print(
            f"rank {r['rank']}: peak RSS {r['hwm'] / 2**30:.2f} GiB (over the start {(r['hwm'] - r['base']) / 2**30:.2f}; "
            f"start-up {r['startup_hwm'] / 2**30:.2f}, after the last step {r['end_hwm'] / 2**30:.2f}); "
            f"idle {rate_pl:.0f} B/s payload, {rate_lo:.0f} B/s lo"
        )
        steps = []
        for i, s in enumerate(r["steps"], 1):
            payload = s["payload"] - rate_pl * s["s"]
            lo = s["lo"] - rate_lo * s["s"]
            upd = s["update"]["payload"] - rate_pl * s["update"]["s"]
            steps.append({"payload": payload, "lo": lo, "s": s["s"], "update": upd, "phases": s["phases"]})
            peaks = ", ".join(f"{k[7:]} {v / 2**30:.2f}" for k, v in s["phases"].items())
            print(
                f"  step {i}: {s['s']:.1f} s, payload sent {payload / G:.3f} GB "
                f"(measured / estimate {payload / est['total']:.3f}; in policy_update {upd / G:.3f}), "
                f"lo (both ranks, headers) {lo / G:.3f} GB; peak RSS by phase (GiB) {peaks}"
            )
        keep = ("rank", "base", "hwm", "startup_hwm", "end_hwm", "idle")
        row["ranks"].append({k: r[k] for k in keep} | {"steps": steps})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="an HF folder (default: build SHAPE in a temp folder)")
    ap.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="write the results here")
    if sys.argv[1:2] == ["--worker"]:  # a rank: --worker OUT -- gspo train's flags
        return worker(sys.argv[2], sys.argv[4:])
    a = ap.parse_args()
    if a.calibrate:
        return calibrate()
    print(f"load: {Path('/proc/loadavg').read_text().split()[:3]} on {os.cpu_count()} CPUs")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cal = subprocess.run(_torchrun("--calibrate"), env=env, capture_output=True, text=True, check=True)
    calib = [json.loads(line) for line in cal.stdout.splitlines() if line.startswith("{")]
    for c in calib:
        print(
            f"gloo {c['op']:<24} 2 ranks, {c['input_bytes'] / 1e6:.0f} MB in: sends {c['sent'] / 1e6:.1f} MB per rank"
        )
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or _build(Path(tmp) / "model")
        rows = [_report(ep, _train(model, ep, Path(tmp)), _estimate(model, ep)) for ep in (1, 2)]
    print(f"load after: {Path('/proc/loadavg').read_text().split()[:3]}")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"settings": SETTINGS, "calibration": calib, "runs": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
