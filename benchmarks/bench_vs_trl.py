"""gspo vs TRL GRPOTrainer (GSPO mode), side by side in one process, plus the bare compute floor.

Same tiny Qwen3 (dense and MoE, same seed, separate copies), same "reverse" prompts with exact-match
reward, same batch: 8 prompts x 8 generations, up to 8 new tokens, one rollout split into 4 optimizer
steps, fp32, no gradient checkpointing, one CPU thread.

- TRL: ``GRPOTrainer`` with ``importance_sampling_level="sequence"``, ``loss_type="grpo"``,
  ``epsilon=3e-4``, ``epsilon_high=4e-4``, ``beta=0``; time per rollout = wall time of
  ``trainer.train()`` between every 4th optimizer step (a ``TrainerCallback``), first rollout dropped.
- gspo: ``collect_rollout`` + ``policy_update`` with the default config (``old_logp="auto"``: the HF
  sampler in fp32 is the trainer, so its log-probs are pi_old; ``prefix_sharing="auto"``: each group's
  prompt is computed once), ``log_volatility`` off to match TRL; MoE also with it on; both also with
  ``old_logp="recompute"`` (pi_old recomputed, as TRL does) and ``prefix_sharing="off"``.
- floor: the same ``engine.generate`` call + 4 x (``response_logprobs`` on the same minibatches,
  trivial loss, backward, optimizer step), each measured alone.

Each contender runs ``--rounds`` times, alternating, ``--rollouts`` timed rollouts each (after one
warm-up rollout). Times are reported twice: process CPU time (with one torch thread this is the work
done, robust when other jobs share the cores) and wall time. Then a breakdown of gspo's step (CPU-time
timers wrapped around its parts) and the top torch ops by self CPU time.

    pip install -e '.[bench]'          # TRL is an optional bench dependency
    python benchmarks/bench_vs_trl.py  # ~1.5 min CPU time (longer in wall time on a busy machine)
    python benchmarks/bench_vs_trl.py --rollouts 20 --rounds 3 --models moe
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from typing import Any

import torch

from gspo.config import Config
from gspo.model.forward import response_logprobs
from gspo.model.load import build_char_tokenizer, build_tiny_dense, build_tiny_moe
from gspo.rollout.hf import HFRolloutEngine, left_pad
from gspo.tasks import build_task
from gspo.tasks.synthetic import synthetic_examples
from gspo.train import loop as L

PROMPTS, G, NEW_TOKENS, MINIBATCHES = 8, 8, 8, 4
LR, BETAS = 3e-4, (0.9, 0.99)
BUILDERS = {"dense": build_tiny_dense, "moe": build_tiny_moe}


def _now() -> tuple[float, float]:
    """(wall, process CPU) seconds. With one torch thread, CPU time is the work done, unaffected by
    other jobs time-sharing the cores; wall time is what a user waits on an idle machine."""
    return time.perf_counter(), time.process_time()


def _since(t0: tuple[float, float]) -> tuple[float, float]:
    t1 = _now()
    return t1[0] - t0[0], t1[1] - t0[1]


def _cfg(log_volatility: bool = False, old_logp: str = "auto", prefix_sharing: str = "auto") -> Config:
    return Config(
        prompts_per_step=PROMPTS,
        group_size=G,
        max_new_tokens=NEW_TOKENS,
        num_minibatches=MINIBATCHES,
        log_volatility=log_volatility,
        old_logp=old_logp,
        prefix_sharing=prefix_sharing,
        sft_steps=0,
        lr=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
    ).validate()


def _model(kind: str, tok: Any) -> Any:
    return BUILDERS[kind](len(tok), seed=0)


class Setup:
    """Tokenizer, reward, and ``n_rollouts`` batches of 8 prompts shared by every contender."""

    def __init__(self, n_rollouts: int) -> None:
        self.tok = build_char_tokenizer()
        self.task = build_task("reverse", "exact_match", 0, 8)
        self.examples = synthetic_examples("reverse", PROMPTS * n_rollouts, 0)
        self.prompt_ids = L.encode_prompts(self.tok, self.examples, _cfg())

    def batch(self, r: int) -> tuple[list[Any], list[list[int]]]:
        s = slice(r * PROMPTS, (r + 1) * PROMPTS)
        return self.examples[s], self.prompt_ids[s]


# ------------------------------------------------------------------------------------------------
# contenders


def bench_trl(kind: str, su: Setup, n: int) -> list[tuple[float, float]]:
    """Seconds per rollout (generate + 4 optimizer steps) of TRL's GRPOTrainer in GSPO mode."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Marks(TrainerCallback):
        def __init__(self) -> None:
            self.t: list[tuple[float, float]] = []

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            if state.global_step % MINIBATCHES == 0:
                self.t.append(_now())

    def exact_match(prompts, completions, answer, **kwargs):  # noqa: ANN001
        return su.task.reward(prompts, completions, answer)

    ds = datasets.Dataset.from_list(
        [{"prompt": e.prompt, "answer": e.answer} for e in su.examples[: PROMPTS * n]]
    )
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            importance_sampling_level="sequence",
            loss_type="grpo",
            epsilon=3e-4,
            epsilon_high=4e-4,
            beta=0.0,
            num_generations=G,
            per_device_train_batch_size=PROMPTS * G // MINIBATCHES,
            steps_per_generation=MINIBATCHES,
            gradient_accumulation_steps=1,
            num_iterations=1,
            max_completion_length=NEW_TOKENS,
            temperature=1.0,
            gradient_checkpointing=False,
            bf16=False,
            fp16=False,
            use_cpu=True,
            learning_rate=LR,
            adam_beta1=BETAS[0],
            adam_beta2=BETAS[1],
            weight_decay=0.0,
            max_grad_norm=1.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_steps=n * MINIBATCHES,
            shuffle_dataset=False,
            logging_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            log_completions=False,
            dataloader_num_workers=0,
            seed=0,
        )
        marks = Marks()
        trainer = GRPOTrainer(
            model=_model(kind, su.tok),
            reward_funcs=[exact_match],
            args=args,
            train_dataset=ds,
            processing_class=su.tok,
            callbacks=[marks],
        )
        with contextlib.redirect_stdout(io.StringIO()):  # Trainer prints its final metrics dict
            trainer.train()
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks.t, marks.t[1:], strict=False)]


def _gspo_state(kind: str, su: Setup, cfg: Config) -> tuple[Any, Any, Any, Any]:
    model = _model(kind, su.tok)
    opt, sched = L.make_optimizer(model, cfg)  # what ``gspo train`` uses (fused AdamW, warmup 0)
    engine = HFRolloutEngine(
        model, su.tok.eos_token_id, su.tok.pad_token_id, torch.Generator().manual_seed(0)
    )
    return model, opt, sched, engine


def bench_gspo(
    kind: str,
    su: Setup,
    n: int,
    log_volatility: bool = False,
    old_logp: str = "auto",
    prefix_sharing: str = "auto",
) -> list[tuple[float, float]]:
    """Seconds per rollout of gspo's ``collect_rollout`` + ``policy_update``."""
    cfg = _cfg(log_volatility, old_logp, prefix_sharing)
    model, opt, sched, engine = _gspo_state(kind, su, cfg)
    times = []
    for r in range(n):
        ex, ids = su.batch(r)
        t0 = _now()
        data, _ = L.collect_rollout(engine, su.tok, su.task, ex, ids, cfg)
        L.policy_update(model, opt, sched, data, cfg, 1, kind == "moe")
        times.append(_since(t0))
    return times[1:]


def bench_floor(kind: str, su: Setup, n: int) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """(generate, 4 x fwd/bwd/step) (wall, cpu) seconds per rollout, each measured alone on the same batches."""
    cfg = _cfg()
    model, opt, _, engine = _gspo_state(kind, su, cfg)
    layout = L._layout(model, cfg)
    out = []
    for r in range(n):
        _, ids = su.batch(r)
        rep = [p for p in ids for _ in range(G)]
        t0 = _now()
        rb = engine.generate(rep, NEW_TOKENS, 1.0)
        t_gen = _since(t0)
        p_ids, p_mask = left_pad(rep, su.tok.pad_token_id)
        data = L.RolloutData(
            p_ids, p_mask, rb.response_ids_BT, rb.response_mask_BT, rb.sampler_logp_BT, torch.zeros(len(rep))
        )
        mb = len(rep) // MINIBATCHES
        mbs = [data.slice(slice(i * mb, (i + 1) * mb)) for i in range(MINIBATCHES)]
        model.train()
        t0 = _now()
        for m in mbs:
            opt.zero_grad(set_to_none=True)
            logp = response_logprobs(
                model,
                m.prompt_ids_BP,
                m.prompt_mask_BP,
                m.response_ids_BT,
                m.response_mask_BT,
                1.0,
                cfg.logp_chunk_size,
                layout=layout,
            )
            (logp * m.response_mask_BT).sum().div(mb).backward()
            opt.step()
        out.append((t_gen, _since(t0)))
    return out[1:]


# ------------------------------------------------------------------------------------------------
# profile of gspo's step


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def gspo_breakdown(kind: str, su: Setup, n: int, log_volatility: bool) -> dict[str, float]:
    """Mean CPU seconds per rollout of each part of gspo's step (timers wrapped around its functions)."""
    cfg = _cfg(log_volatility)
    model, opt, sched, engine = _gspo_state(kind, su, cfg)
    acc: dict[str, float] = defaultdict(float)
    depth = {"vol": 0}

    def timed(key: Any, fn: Any) -> Any:
        @functools.wraps(fn)
        def w(*a, **k):
            name = key() if callable(key) else key
            t0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                if name:
                    acc[name] += time.process_time() - t0

        return w

    def fwd_key() -> str | None:
        if depth["vol"]:
            return None
        return (
            "train fwd (logp+entropy)"
            if torch.is_grad_enabled()
            else "pi_old fwd (no grad: routing, recompute)"
        )

    def vol(*a, **k):
        depth["vol"] += 1
        try:
            return orig_vol(*a, **k)
        finally:
            depth["vol"] -= 1

    orig_vol = L._volatility
    loss_fn, lo, hi = L.LOSSES[cfg.algo]
    patches = [
        (engine, "generate", timed("generate", engine.generate)),
        (L, "safe_rewards", timed("rewards", L.safe_rewards)),
        (L, "group_advantages", timed("advantages", L.group_advantages)),
        (L, "micro_batches", timed("slicing/trim", L.micro_batches)),
        (L, "_forward", timed(fwd_key, L._forward)),
        (L, "_volatility", timed("volatility", vol)),
        (torch.Tensor, "backward", timed("train bwd", torch.Tensor.backward)),
        (torch.nn.utils, "clip_grad_norm_", timed("grad clip", torch.nn.utils.clip_grad_norm_)),
        (opt, "step", timed("optimizer step", opt.step)),
    ]
    totals = defaultdict(float)
    with contextlib.ExitStack() as st:
        for obj, name, val in patches:
            st.enter_context(_patched(obj, name, val))
        L.LOSSES[cfg.algo] = (timed("loss fn", loss_fn), lo, hi)
        try:
            for r in range(n):
                if r == 1:  # drop warm-up
                    acc.clear()
                    totals.clear()
                ex, ids = su.batch(r)
                t0 = time.process_time()
                data, _ = L.collect_rollout(engine, su.tok, su.task, ex, ids, cfg)
                t1 = time.process_time()
                L.policy_update(model, opt, sched, data, cfg, 1, kind == "moe")
                t2 = time.process_time()
                totals["collect_rollout"] += t1 - t0
                totals["policy_update"] += t2 - t1
        finally:
            L.LOSSES[cfg.algo] = (loss_fn, lo, hi)
    k = n - 1
    out = {name: v / k for name, v in acc.items()}
    gen_side = out.get("generate", 0) + out.get("rewards", 0) + out.get("advantages", 0)
    upd_side = sum(v for name, v in out.items() if name not in ("generate", "rewards", "advantages"))
    out["other (collect_rollout)"] = totals["collect_rollout"] / k - gen_side
    out["other (policy_update)"] = totals["policy_update"] / k - upd_side
    out["TOTAL"] = (totals["collect_rollout"] + totals["policy_update"]) / k
    return out


def torch_op_profile(kind: str, su: Setup, n: int, rows: int) -> str:
    """Top torch ops by self CPU time over ``n`` gspo steps (after one warm-up step)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = _cfg()
    model, opt, sched, engine = _gspo_state(kind, su, cfg)

    def step(r: int) -> None:
        ex, ids = su.batch(r)
        data, _ = L.collect_rollout(engine, su.tok, su.task, ex, ids, cfg)
        L.policy_update(model, opt, sched, data, cfg, 1, kind == "moe")

    step(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for r in range(1, n + 1):
            step(r)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40)


# ------------------------------------------------------------------------------------------------


def _report(kind: str, res: dict[str, list], clock: int, rounds: list[dict[str, list]]) -> str:
    """Print per-contender stats for one clock (0 wall, 1 cpu); return the headline line.

    Besides the ratio of medians over all rounds, the speedup is also taken per round (TRL and gspo
    run back to back there, so slow drifts of a shared machine hit both alike) and from best times."""
    med = statistics.median
    name = ("wall", "cpu")[clock]
    series = {
        k: [t[clock] if k != "floor" else t[0][clock] + t[1][clock] for t in v] for k, v in res.items() if v
    }
    floor, y = med(series["floor"]), med(series["gspo"])
    gen, upd = med(t[0][clock] for t in res["floor"]), med(t[1][clock] for t in res["floor"])
    print(f"  [{name} time] floor {floor:.4f} s (generate {gen:.4f} + 4x fwd/bwd/step {upd:.4f})")
    for k, ts in series.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        print(f"    {k:18s} median {med(ts):.4f}  IQR [{q[0]:.4f}, {q[2]:.4f}]  min {min(ts):.4f}")
    line = f"{kind} ({name}): "
    if "trl" in series:
        x = med(series["trl"])
        line += f"TRL {x:.4f} s/rollout, gspo {y:.4f} s/rollout, speedup X/Y = {x / y:.2f} (target >= 2); "
        per = [med(t[clock] for t in r["trl"]) / med(t[clock] for t in r["gspo"]) for r in rounds]
        best = min(series["trl"]) / min(series["gspo"])
        line += f"per-round speedups {' '.join(f'{v:.2f}' for v in per)} (median {med(per):.2f}); "
        line += f"best-time speedup {best:.2f}; "
    else:
        line += f"gspo {y:.4f} s/rollout; "
    line += f"gspo/floor = {y / floor:.2f} (target <= 1.2)"
    for key, what in [("gspo(recompute)", "old_logp=recompute"), ("gspo(no-share)", "prefix_sharing=off")]:
        if key in series:
            v = med(series[key])
            line += f"; with {what}: gspo {v:.4f} s, /floor = {v / floor:.2f}"
            line += f", speedup = {med(series['trl']) / v:.2f}" if "trl" in series else ""
    if "gspo+vol" in series:
        v = med(series["gspo+vol"])
        line += f"; with log_volatility: gspo {v:.4f} s, /floor = {v / floor:.2f}"
        line += f", speedup = {med(series['trl']) / v:.2f}" if "trl" in series else ""
    print("    " + line)
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=10, help="timed rollouts per contender and round (K)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds TRL/gspo/floor (noise control)")
    ap.add_argument("--models", nargs="+", default=["dense", "moe"], choices=list(BUILDERS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-trl", action="store_true", help="skip TRL (e.g. when it is not installed)")
    ap.add_argument("--op-rows", type=int, default=15, help="rows of the torch op profile (0: skip)")
    args = ap.parse_args()

    import transformers

    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    n = args.rollouts + 1  # + one warm-up rollout
    su = Setup(max(n, 6))
    summary = []
    for kind in args.models:
        res: dict[str, list] = defaultdict(list)
        rounds: list[dict[str, list]] = []
        for _ in range(args.rounds):
            r: dict[str, list] = {}
            if not args.no_trl:
                r["trl"] = bench_trl(kind, su, n)
            r["gspo"] = bench_gspo(kind, su, n)
            r["floor"] = bench_floor(kind, su, n)
            r["gspo(recompute)"] = bench_gspo(kind, su, n, old_logp="recompute")
            r["gspo(no-share)"] = bench_gspo(kind, su, n, prefix_sharing="off")
            if kind == "moe":
                r["gspo+vol"] = bench_gspo(kind, su, n, log_volatility=True)
            for k, v in r.items():
                res[k] += v
            rounds.append(r)
        print(f"\n== {kind}: {len(res['gspo'])} timed rollouts per contender (s/rollout)")
        summary += [_report(kind, res, 1, rounds), _report(kind, res, 0, rounds)]

        for lv in [False, True] if kind == "moe" else [False]:
            bd = gspo_breakdown(kind, su, 6, lv)
            tot = bd.pop("TOTAL")
            print(
                f"  gspo step breakdown ({kind}, log_volatility={lv}), mean CPU s/rollout over 5, total {tot:.4f}:"
            )
            for name, v in sorted(bd.items(), key=lambda kv: -kv[1]):
                print(f"    {name:30s} {v:.4f}  {100 * v / tot:5.1f}%")
        if args.op_rows:
            print(f"  top torch ops by self CPU ({kind}, gspo, 3 steps):")
            print(torch_op_profile(kind, su, 3, args.op_rows))
    print("\nSUMMARY (cpu = process CPU time, robust on a shared machine; wall = elapsed)")
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
