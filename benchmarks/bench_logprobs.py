"""Forward+backward time and peak memory of LM-head log-probs: naive ``[N, V]`` logits vs chunked.

Each variant runs in a fresh subprocess, ``--rounds`` times, alternating naive and chunked so that
drifting load on a shared machine hits both alike; the best time over all runs of a variant counts. Peak memory there is ``ru_maxrss`` at the end minus
``ru_maxrss`` right after allocating (and touching) the inputs, so it counts only what the
log-prob computation adds: logits buffers, autograd saved tensors and the gradients (both variants
produce the same ``[N, H]`` and ``[V, H]`` gradients). Time is the best of ``--repeats`` runs of
forward + ``backward`` w.r.t. both hidden and LM-head weight (wall clock; process CPU time is printed
too, as it is less sensitive to other load on a shared machine).

    python benchmarks/bench_logprobs.py                      # Qwen3 vocab 151,936, H=256, N=2048
    python benchmarks/bench_logprobs.py --chunk-sizes 256 512 1024
    python benchmarks/bench_logprobs.py --freeze-weight       # frozen LM head (e.g. LoRA)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _maxrss_bytes() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * (1 if sys.platform == "darwin" else 1024)


def _rss_bytes() -> int:
    """Current resident set size (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


def worker(args: argparse.Namespace) -> None:
    import torch

    from gspo.model.lm_head import logprobs_from_hidden, naive_logprobs_from_hidden

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    # in-place init: no transient copies that would inflate the baseline
    hidden = torch.empty(args.n, args.hidden, dtype=dtype).normal_(0, 0.5, generator=g).requires_grad_(True)
    weight = (
        torch.empty(args.vocab, args.hidden, dtype=dtype)
        .normal_(0, 0.05, generator=g)
        .requires_grad_(not args.freeze_weight)
    )
    targets = torch.randint(0, args.vocab, (args.n,), generator=g)
    coef = torch.randn(args.n, generator=g)
    # warm up both code paths on separate tiny tensors so lazily loaded kernels count in the baseline
    hs, ws, ts = (
        torch.randn(4, 8, requires_grad=True),
        torch.randn(16, 8, requires_grad=True),
        targets[:4] % 16,
    )
    logprobs_from_hidden(hs, ws, ts, chunk_size=2).sum().backward()
    naive_logprobs_from_hidden(hs, ws, ts).sum().backward()
    del hs, ws, ts
    base = max(_maxrss_bytes(), _rss_bytes())
    base_cur = _rss_bytes()

    if args.variant == "naive":

        def fn():
            return naive_logprobs_from_hidden(hidden, weight, targets, temperature=args.temperature)
    else:

        def fn():
            return logprobs_from_hidden(
                hidden, weight, targets, chunk_size=args.chunk_size, temperature=args.temperature
            )

    times, cpu_times = [], []
    for _ in range(args.repeats):
        hidden.grad = weight.grad = None
        t0, c0 = time.perf_counter(), time.process_time()
        logp = fn()
        (logp * coef).sum().backward()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    peak = _maxrss_bytes() - base  # before the checksum below, which allocates its own temporaries
    grad = hidden.grad if args.freeze_weight else weight.grad
    checksum = float(logp.detach().double().sum()), float(grad.double().abs().sum())
    out = {
        "time_s": min(times),
        "times_s": times,
        "cpu_s": min(cpu_times),
        "peak_bytes": peak,
        "baseline_bytes": base,
        "baseline_minus_current_rss": base - base_cur,
        "checksum": checksum,
    }
    print(json.dumps(out))


def run_variant(args: argparse.Namespace, variant: str, chunk_size: int | None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--n",
        str(args.n),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--repeats",
        str(args.repeats),
        "--temperature",
        str(args.temperature),
    ]
    if args.freeze_weight:
        cmd.append("--freeze-weight")
    if chunk_size is not None:
        cmd += ["--chunk-size", str(chunk_size)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2048, help="flattened positions N")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size H")
    ap.add_argument("--vocab", type=int, default=151_936, help="vocab size V (Qwen3: 151,936)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per variant (best is reported)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2, help="alternating subprocess runs per variant")
    ap.add_argument("--freeze-weight", action="store_true", help="LM-head weight without grad")
    ap.add_argument(
        "--chunk-sizes",
        type=int,
        nargs="+",
        default=None,
        help="chunked variants to run (default: the library default chunk size)",
    )
    ap.add_argument("--worker", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    ap.add_argument("--chunk-size", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.variant = args.worker
        worker(args)
        return

    from gspo.model.lm_head import DEFAULT_CHUNK_SIZE

    chunk_sizes = args.chunk_sizes or [DEFAULT_CHUNK_SIZE]
    gib = 2**30
    print(
        f"N={args.n} H={args.hidden} V={args.vocab} dtype={args.dtype} threads={args.threads} "
        f"repeats={args.repeats} rounds={args.rounds} freeze_weight={args.freeze_weight} "
        f"(full [N,V] float32 logits = {args.n * args.vocab * 4 / gib:.2f} GiB)"
    )
    variants = [("naive", None)] + [("chunked", cs) for cs in chunk_sizes]
    runs: dict[tuple, list[dict]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            runs[v].append(run_variant(args, *v))

    def summary(v: tuple) -> dict:
        rs = runs[v]
        return {
            "time_s": min(r["time_s"] for r in rs),
            "times_s": [round(t, 2) for r in rs for t in r["times_s"]],
            "cpu_s": min(r["cpu_s"] for r in rs),
            "peak_bytes": max(r["peak_bytes"] for r in rs),
            "checksum": rs[0]["checksum"],
        }

    naive = summary(variants[0])
    print(
        f"naive           : fwd+bwd {naive['time_s']:.2f} s (runs {naive['times_s']}), "
        f"cpu {naive['cpu_s']:.2f} s, peak +{naive['peak_bytes'] / gib:.3f} GiB"
    )
    for v in variants[1:]:
        cs, res = v[1], summary(v)
        print(
            f"chunked cs={cs:<5}: fwd+bwd {res['time_s']:.2f} s (runs {res['times_s']}), "
            f"cpu {res['cpu_s']:.2f} s, peak +{res['peak_bytes'] / gib:.3f} GiB"
        )
        dl = abs(res["checksum"][0] - naive["checksum"][0]) / max(1.0, abs(naive["checksum"][0]))
        dg = abs(res["checksum"][1] - naive["checksum"][1]) / max(1.0, abs(naive["checksum"][1]))
        mem_ratio = res["peak_bytes"] / naive["peak_bytes"]
        time_ratio = res["time_s"] / naive["time_s"]
        print(
            f"  chunk_size={cs}: peak memory ratio chunked/naive = {mem_ratio:.3f} (target <= 0.25), "
            f"time ratio = {time_ratio:.3f} (target <= 1.1); cpu-time ratio = {res['cpu_s'] / naive['cpu_s']:.3f}; "
            f"checksum rel diff logp {dl:.1e} grad {dg:.1e}"
        )


if __name__ == "__main__":
    main()
