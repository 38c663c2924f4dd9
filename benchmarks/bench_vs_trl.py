"""gspo vs TRL GRPOTrainer (GSPO mode), side by side in one process, plus the bare compute floor.

Same tiny Qwen3 (dense and MoE, same seed, separate copies), same "reverse" prompts with exact-match
reward, same batch: 8 prompts x 8 generations, up to 8 new tokens, one rollout split into 4 optimizer
steps, fp32, no gradient checkpointing, one CPU thread.

- TRL: ``GRPOTrainer`` with ``importance_sampling_level="sequence"``, ``loss_type="grpo"``,
  ``epsilon=3e-4``, ``epsilon_high=4e-4``, ``beta=0``; time per rollout = time of ``trainer.train()``
  between every 4th optimizer step (a ``TrainerCallback``).
- gspo: ``collect_rollout`` + ``policy_update`` with the default config (``old_logp="auto"``: the HF
  sampler in fp32 is the trainer, so its log-probs are pi_old; ``prefix_sharing="auto"``: each group's
  prompt is computed once), ``log_volatility`` off to match TRL; also with ``old_logp="recompute"``
  (pi_old recomputed, as TRL does), ``prefix_sharing="off"`` and (MoE) ``log_volatility=True``.
- floor: the same ``engine.generate`` call + 4 x (``response_logprobs`` on the same minibatches in
  gspo's layout, trivial loss, backward, AdamW step), each measured alone.

Every contender has its own copy of the model and takes its k-th rollout right after TRL's k-th
(inside TRL's callback, not counted for TRL), so all k-th rollouts run within a second of each other
and a shared machine's drifting load hits them alike; the speedup is the median of the per-rollout
ratios. The first rollout of each is a warm-up. Times are reported twice: process CPU time (with one
torch thread this is the work done, robust when other jobs share the cores) and wall time. Then a
breakdown of gspo's step (CPU-time timers wrapped around its parts) and the top torch ops.

    pip install -e '.[bench]'          # TRL is an optional bench dependency
    python benchmarks/bench_vs_trl.py  # ~4 min CPU time (longer in wall time on a busy machine)
    python benchmarks/bench_vs_trl.py --rollouts 20 --models moe --op-rows 0
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from gspo import data as BA
from gspo.config import Config
from gspo.data import left_pad
from gspo.model.load import build_char_tokenizer, build_tiny_dense, build_tiny_moe
from gspo.model.logprobs import response_logprobs
from gspo.resolve import (
    choose_layout,
    for_model,
    layout_plan,
    optim_plan,
    prompt_plan,
    sample_plan,
    score_plan,
    update_plan,
)
from gspo.rollout.hf import HFRolloutEngine
from gspo.rollout.sampler import SyncSampler
from gspo.tasks import build_task
from gspo.tasks.prompts import encode_prompts
from gspo.tasks.synthetic import synthetic_examples
from gspo.training import run as RN
from gspo.training import scoring as RO
from gspo.training import update as U

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
        self.prompt_ids = encode_prompts(self.tok, self.examples, prompt_plan(_cfg()))

    def batch(self, r: int) -> tuple[list[Any], list[list[int]]]:
        s = slice(r * PROMPTS, (r + 1) * PROMPTS)
        return self.examples[s], self.prompt_ids[s]


# ------------------------------------------------------------------------------------------------
# contenders


Stepper = Callable[[int], dict[str, tuple[float, float]]]


def trl_run(kind: str, su: Setup, n: int, between: Callable[[int], None]) -> list[tuple[float, float]]:
    """Seconds per rollout (generate + 4 optimizer steps) of TRL's GRPOTrainer in GSPO mode.

    ``between(k)`` runs after TRL's k-th rollout (its 4th optimizer step) and is not counted: the other
    contenders take their k-th rollout there, so every contender's k-th rollout runs within a second
    of TRL's and drifting load on a shared machine hits all of them alike."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class Marks(TrainerCallback):
        def __init__(self) -> None:
            self.spans: list[tuple[float, float]] = []
            self.resume = _now()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            if state.global_step % MINIBATCHES == 0:
                end = _now()
                self.spans.append((end[0] - self.resume[0], end[1] - self.resume[1]))
                between(len(self.spans) - 1)
                self.resume = _now()

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
        trainer = GRPOTrainer(
            model=_model(kind, su.tok),
            reward_funcs=[exact_match],
            args=args,
            train_dataset=ds,
            processing_class=su.tok,
        )
        marks = Marks()
        trainer.add_callback(marks)
        marks.resume = _now()
        with contextlib.redirect_stdout(io.StringIO()):  # Trainer prints its final metrics dict
            trainer.train()
    return marks.spans


def _gspo_state(kind: str, su: Setup, cfg: Config) -> tuple[Any, Any, Any, Any]:
    model = _model(kind, su.tok)
    opt, sched = RN.make_optimizer(model, optim_plan(cfg))  # what ``gspo train`` uses (fused AdamW, warmup 0)
    engine = HFRolloutEngine(
        model, su.tok.eos_token_id, su.tok.pad_token_id, torch.Generator().manual_seed(0)
    )
    return model, opt, sched, engine


def _collect_rollout(sampler, tok, task, ex, ids, plan):  # noqa: ANN001, ANN202
    """G samples per prompt, their rewards and advantages: the loop's sampling and scoring."""
    s = sampler.sample(1, ex, ids)
    return RO.score_rollout(s.batch, tok, task, ex, plan, s.gen_s)


def gspo_stepper(kind: str, su: Setup, cfg: Config) -> Stepper:
    """One rollout of gspo's ``collect_rollout`` + ``policy_update`` per call -> {"": (wall, cpu)}."""
    model, opt, sched, engine = _gspo_state(kind, su, cfg)

    def step(r: int) -> dict[str, tuple[float, float]]:
        ex, ids = su.batch(r)
        t0 = _now()
        data, _ = _collect_rollout(
            SyncSampler(engine, su.tok, su.task, sample_plan(cfg)), su.tok, su.task, ex, ids, score_plan(cfg)
        )
        U.policy_update(
            model, opt, sched, data, for_model(update_plan(cfg), layout_plan(cfg), model, kind == "moe"), 1
        )
        return {"": _since(t0)}

    return step


def floor_stepper(kind: str, su: Setup) -> Stepper:
    """The bare compute of a rollout, each part timed alone: the same ``engine.generate`` call, then
    4 x (``response_logprobs`` in gspo's layout, trivial loss, backward, AdamW step)."""
    cfg = _cfg()
    model, opt, _, engine = _gspo_state(kind, su, cfg)
    layout = choose_layout(model, layout_plan(cfg))

    def step(r: int) -> dict[str, tuple[float, float]]:
        _, ids = su.batch(r)
        rep = [p for p in ids for _ in range(G)]
        t0 = _now()
        rb = engine.generate(rep, NEW_TOKENS, 1.0)
        t_gen = _since(t0)
        p_ids, p_mask = left_pad(rep, su.tok.pad_token_id)
        data = BA.TrainBatch(
            p_ids, p_mask, rb.response_ids_BT, rb.response_mask_BT, rb.sampler_logp_BT, torch.zeros(len(rep))
        )
        mb = len(rep) // MINIBATCHES
        mbs = [data.rows(slice(i * mb, (i + 1) * mb)) for i in range(MINIBATCHES)]
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
        t_upd = _since(t0)
        return {"": (t_gen[0] + t_upd[0], t_gen[1] + t_upd[1]), "generate": t_gen, "fwd/bwd/step": t_upd}

    return step


def run_contenders(kind: str, su: Setup, n: int, trl: bool) -> dict[str, list[tuple[float, float]]]:
    """``n`` rollouts of every contender, interleaved rollout by rollout (inside TRL's loop when TRL
    runs); the first rollout of each is a warm-up and dropped. -> {contender: [(wall, cpu), ...]}."""
    steppers = {
        "gspo": gspo_stepper(kind, su, _cfg()),
        "floor": floor_stepper(kind, su),
        "gspo(recompute)": gspo_stepper(kind, su, _cfg(old_logp="recompute")),
        "gspo(no-share)": gspo_stepper(kind, su, _cfg(prefix_sharing="off")),
    }
    if kind == "moe":
        steppers["gspo+vol"] = gspo_stepper(kind, su, _cfg(log_volatility=True))
    res: dict[str, list[tuple[float, float]]] = defaultdict(list)

    def between(k: int) -> None:
        for name, step in steppers.items():
            for part, t in step(k).items():
                res[f"{name}:{part}" if part else name].append(t)

    if trl:
        res["trl"] = trl_run(kind, su, n, between)
    else:
        for k in range(n):
            between(k)
    return {k: v[1:] for k, v in res.items()}


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

    orig_vol = U.measure_volatility
    spec = U.LOSSES[cfg.algo]
    patches = [
        (engine, "generate", timed("generate", engine.generate)),
        (RO, "safe_rewards", timed("rewards", RO.safe_rewards)),
        (RO, "group_advantages", timed("advantages", RO.group_advantages)),
        (U, "split_minibatches", timed("slicing/trim/layout", U.split_minibatches)),
        (U, "forward", timed(fwd_key, U.forward)),
        (U, "measure_volatility", timed("volatility", vol)),
        (torch.Tensor, "backward", timed("train bwd", torch.Tensor.backward)),
        (torch.nn.utils, "get_total_norm", timed("grad clip", torch.nn.utils.get_total_norm)),
        (opt, "step", timed("optimizer step", opt.step)),
    ]
    totals = defaultdict(float)
    with contextlib.ExitStack() as st:
        for obj, name, val in patches:
            st.enter_context(_patched(obj, name, val))
        U.LOSSES[cfg.algo] = dataclasses.replace(spec, fn=timed("loss fn", spec.fn))
        try:
            for r in range(n):
                if r == 1:  # drop warm-up
                    acc.clear()
                    totals.clear()
                ex, ids = su.batch(r)
                t0 = time.process_time()
                sampler = SyncSampler(engine, su.tok, su.task, sample_plan(cfg))
                data, _ = _collect_rollout(sampler, su.tok, su.task, ex, ids, score_plan(cfg))
                t1 = time.process_time()
                U.policy_update(
                    model,
                    opt,
                    sched,
                    data,
                    for_model(update_plan(cfg), layout_plan(cfg), model, kind == "moe"),
                    1,
                )
                t2 = time.process_time()
                totals["collect_rollout"] += t1 - t0
                totals["policy_update"] += t2 - t1
        finally:
            U.LOSSES[cfg.algo] = spec
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
        data, _ = _collect_rollout(
            SyncSampler(engine, su.tok, su.task, sample_plan(cfg)), su.tok, su.task, ex, ids, score_plan(cfg)
        )
        U.policy_update(
            model, opt, sched, data, for_model(update_plan(cfg), layout_plan(cfg), model, kind == "moe"), 1
        )

    step(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for r in range(1, n + 1):
            step(r)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40)


# ------------------------------------------------------------------------------------------------


def _report(kind: str, res: dict[str, list], clock: int) -> str:
    """Print per-contender stats for one clock (0 wall, 1 cpu); return the headline line.

    Contenders ran rollout by rollout in turn, so the k-th rollouts of all of them are neighbours in
    time: the speedup is the median of the per-rollout ratios (robust to a shared machine's drifting
    load), with the ratio of medians and of best times beside it."""
    med = statistics.median
    name = ("wall", "cpu")[clock]
    series = {k: [t[clock] for t in v] for k, v in res.items() if v}
    floor, y = med(series["floor"]), med(series["gspo"])
    gen, upd = med(series["floor:generate"]), med(series["floor:fwd/bwd/step"])
    print(f"  [{name} time] floor {floor:.4f} s (generate {gen:.4f} + 4x fwd/bwd/step {upd:.4f})")
    for k, ts in series.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        print(f"    {k:22s} median {med(ts):.4f}  IQR [{q[0]:.4f}, {q[2]:.4f}]  min {min(ts):.4f}")

    def paired(a: str, b: str) -> float:
        return med(x / z for x, z in zip(series[a], series[b], strict=True))

    line = f"{kind} ({name}): "
    if "trl" in series:
        x = med(series["trl"])
        line += (
            f"TRL {x:.4f} s/rollout, gspo {y:.4f} s/rollout, speedup (median of per-rollout ratios) = "
            f"{paired('trl', 'gspo'):.2f} (target >= 2) [ratio of medians {x / y:.2f}, of best times "
            f"{min(series['trl']) / min(series['gspo']):.2f}]; "
        )
    else:
        line += f"gspo {y:.4f} s/rollout; "
    line += f"gspo/floor = {paired('gspo', 'floor'):.2f} (target <= 1.2)"
    variants = [
        ("gspo(recompute)", "old_logp=recompute"),
        ("gspo(no-share)", "prefix_sharing=off"),
        ("gspo+vol", "log_volatility"),
    ]
    for key, what in variants:
        if key in series:
            line += f"; {what}: {med(series[key]):.4f} s, /floor = {paired(key, 'floor'):.2f}"
            line += f", speedup = {paired('trl', key):.2f}" if "trl" in series else ""
    print("    " + line)
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=40, help="timed rollouts per contender")
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
        res = run_contenders(kind, su, n, trl=not args.no_trl)
        print(f"\n== {kind}: {len(res['gspo'])} timed rollouts per contender (s/rollout)")
        summary += [_report(kind, res, 1), _report(kind, res, 0)]

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
