"""The training loop: ``run_loop`` repeats ``rl_step`` -- the GSPO paper's algorithm, one step:

    prompts -> G responses each (old policy) -> rewards -> group advantages -> policy update -> sync

Ctrl-C or SIGTERM (what job schedulers send) finishes the step in flight, checkpoints it and stops
with a line saying how to resume; a step that does not finish within ``GRACE_S`` seconds (endless
dynamic sampling, a slow reward or generation) is abandoned and the last finished step saved. A second
one stops at once, keeping the last checkpoint.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo.errors import GspoError
from gspo.memory import phase_peak
from gspo.plans import LoopPlan
from gspo.training import distributed as dist_utils
from gspo.training.logger import Progress, plot_metrics, read_metrics
from gspo.training.run import Run

# consecutive RL steps whose every optimizer step was skipped (non-finite gradients) before stopping
MAX_SKIPPED_STEPS = 3
# seconds a first Ctrl-C / SIGTERM lets the step in progress run before abandoning it (an update or
# a checkpoint write in progress is always let finish: both are bounded and cutting them loses work)
GRACE_S = 10.0


class StopNow(KeyboardInterrupt):
    """Raised by the signal handler: a second Ctrl-C / SIGTERM, or the grace period of the first one
    ran out. Code that catches KeyboardInterrupt for its own reasons (a reward wrapper) re-raises it."""


class _StepAbandoned(Exception):
    """Every rank agreed to stop inside a step (dynamic sampling polls the stop flag between rounds)."""


@dataclass
class TrainResult:
    """What ``train`` returns (on rank 0; other ranks get ``run_dir`` and ``model`` only)."""

    run_dir: Path
    model: Any  # the trained Hugging Face model, in memory (LoRA: the PEFT model)
    initial_accuracy: float | None = None
    final_accuracy: float | None = None
    final_dir: Path | None = None  # AutoModelForCausalLM.from_pretrained-able
    plot: Path | None = None


def run_loop(run: Run, plan: LoopPlan, stop: _StopFlag) -> TrainResult:
    """RL steps from the run's last finished one to ``plan.steps``, each logged and checkpointed."""
    stop.busy = lambda: run.updating or run.checkpoints.saving
    bar = Progress(plan.steps, plan.algo, enabled=plan.progress and run.rank == 0, initial=run.state.step)
    skipped = 0
    while run.state.step < plan.steps:
        if dist_utils.any_rank(stop.requested, run.dctx):
            stop.busy = lambda: True  # only the checkpoint of the finished step is left: let it be
            if run.state.last_saved < run.state.step:
                run.checkpoints.save(run)
            raise KeyboardInterrupt(f"progress is saved at step {run.state.step}; continue with --resume")
        metrics = _guarded_step(run, plan)
        skipped = skipped + 1 if metrics["loss/skipped_updates"] == plan.num_minibatches else 0
        if skipped >= MAX_SKIPPED_STEPS:
            raise GspoError(
                f"every update of the last {skipped} steps had a non-finite gradient norm (diverged; "
                f"lower 'lr'); the last good checkpoint is step {run.state.last_saved}"
            )
        run.log(run.state.step, metrics)
        bar.update(run.state.step, _status(metrics))
        step, every = run.state.step, plan.save_every
        if step == plan.steps or (every and step % every == 0):
            run.checkpoints.save(run)
    bar.close()
    return _finish(run, plan)


def rl_step(run: Run, plan: LoopPlan) -> dict[str, float]:
    """One RL step on this rank: the GSPO paper's algorithm. Returns its metrics."""
    t0, peaks, device, t, s = time.time(), {}, run.dctx.device, run.trainer, run.sampler
    # a sampler process samples elsewhere: nothing of the trainer's to gather (FSDP2)
    rolling = contextlib.nullcontext() if s.sampler.staleness else s.sampling(t.policy)
    with rolling, phase_peak("rollout", peaks, device):
        # prompts -> G responses each -> rewards -> group advantages (dynamic sampling: its rounds)
        b = s.sampler.next_batch(
            run.state.step + 1, run.state.data_pos, lambda short: _another_round(run, short)
        )
    run.state.data_pos, metrics = b.data_end, b.metrics
    t1 = time.time()
    run.updating = True  # from here on a failure cannot rewind the step
    s.engine.sleep()  # vLLM on a GPU gives its memory to the update
    with phase_peak("update", peaks, device):
        metrics |= t.update(b.data.to(device), run.world)
    with phase_peak("sync", peaks, device):
        s.sampler.sync(run.state.step + 1)  # the sampler's weights become the trainer's
    metrics |= peaks
    if "async/queue_wait_s" in metrics:  # a sampler running ahead: how long the trainer waited for it
        metrics["async/trainer_idle_frac"] = metrics["async/queue_wait_s"] / max(time.time() - t0, 1e-9)
    run.updating = False
    metrics["time/update_s"], metrics["time/step_s"] = time.time() - t1, time.time() - t0
    metrics["lr"] = t.scheduler.get_last_lr()[0]
    return metrics


def _another_round(run: Run, short: bool) -> bool:
    """Dynamic sampling, between rounds (collective): another round while any rank is short of
    informative groups, so every rank draws the same prompts; a Ctrl-C need not wait for the last."""
    if not dist_utils.any_rank(short, run.dctx):
        return False
    if dist_utils.any_rank(run.should_stop(), run.dctx):
        raise _StepAbandoned
    return True


def _guarded_step(run: Run, plan: LoopPlan) -> dict[str, float]:
    """``rl_step`` + held-out eval. A failure before the update (a reward error, a second Ctrl-C)
    leaves the weights untouched: the step is rewound and the last finished one checkpointed."""
    state = run.state
    gen_state, data_pos = state.sample_gen.get_state(), state.data_pos
    try:
        metrics = rl_step(run, plan)
    except (GspoError, KeyboardInterrupt, _StepAbandoned) as e:
        untouched = not run.updating
        if untouched:
            state.sample_gen.set_state(gen_state)
            state.data_pos = data_pos
            # a collective save needs every rank here: one process, or all agreed to stop
            if state.last_saved < state.step and (run.world == 1 or isinstance(e, _StepAbandoned)):
                run.checkpoints.save(run)
        where = f"the last checkpoint is step {state.last_saved}; continue with --resume"
        if untouched:
            where = f"progress is saved at step {state.step}; continue with --resume"
        if isinstance(e, KeyboardInterrupt | _StepAbandoned):
            raise KeyboardInterrupt(where) from None
        raise GspoError(f"{e} ({where})") from None
    state.step += 1
    metrics = dist_utils.mean_metrics(metrics, run.dctx)
    if state.step == plan.steps or (plan.eval_every and state.step % plan.eval_every == 0):
        try:
            metrics.update(run.evaluate())
        except KeyboardInterrupt:  # the step itself is done: keep it, without its held-out score
            if run.world > 1:
                raise
            run.log(state.step, metrics)
            run.checkpoints.save(run)
            raise KeyboardInterrupt(
                f"progress is saved at step {state.step} (its held-out evaluation was cut short); "
                "continue with --resume"
            ) from None
    return metrics


def _status(metrics: dict[str, float]) -> str:
    acc = metrics.get("eval/accuracy")
    return (
        f"reward {metrics['rollout/reward_mean']:.3f}"
        + (f" acc {acc:.3f}" if acc is not None else "")
        + f" clip {metrics.get('loss/clip_frac_tok', 0):.3f}"
    )


def _finish(run: Run, plan: LoopPlan) -> TrainResult:
    """Final HF folder, curves and summary."""
    result = TrainResult(plan.run_dir, run.trainer.hf)
    result.final_dir = run.checkpoints.write_final(run, plan.save_dtype)  # collective; rank 0 writes
    if run.rank == 0:
        rows = read_metrics(plan.run_dir / "metrics.jsonl")
        result.plot = plan.run_dir / "curves.png"
        plot_metrics(rows, result.plot, title=plan.title)
        evals = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
        result.initial_accuracy = run.state.initial.get("eval/accuracy")
        result.final_accuracy = evals[-1] if evals else None
        run.logger.close()
    run.sampler.engine.close()  # vLLM's groups live on the trainer's process group: end them first
    dist_utils.cleanup(run.dctx)
    return result


@contextmanager
def closing(run: Run):  # noqa: ANN202
    try:
        yield run
    finally:
        run.close()


# ------------------------------------------------------------------------------------------------
# signals


class _StopFlag:
    requested = False  # a first Ctrl-C / SIGTERM came
    done = False  # training is over (the handlers are being restored)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.busy: Callable[[], bool] = lambda: False  # in a phase that is let finish


@contextmanager
def deferred_signals():  # noqa: ANN202
    """SIGINT/SIGTERM set a flag the loop checks between steps and start the grace period, after which
    the main thread is interrupted; a second one raises at once."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag  # signals reach the main thread only: nothing to defer
        return
    main = threading.get_ident()

    def handler(signum: int, _frame: Any) -> None:
        if flag.done:
            return
        if flag.requested:
            raise StopNow
        flag.requested = True
        name = signal.Signals(signum).name
        print(
            f"\ngspo: {name}: stopping: the step in progress is finished and saved, or abandoned after "
            f"{GRACE_S:g} s keeping the last finished step (again to stop now)",
            file=sys.stderr,  # a notice, not output: stdout may be a pipe the user parses
            flush=True,
        )
        threading.Thread(target=_grace, args=(flag, main), name="gspo-stop-grace", daemon=True).start()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        with flag.lock:
            flag.done = True
        for s, h in old.items():
            signal.signal(s, h)


def _grace(flag: _StopFlag, main: int) -> None:
    """After GRACE_S (and once no update or checkpoint write is in progress), interrupt the main thread
    as a second signal would: a real signal also wakes blocking waits."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline or flag.busy():
        time.sleep(0.1)
        if flag.done:
            return
    with flag.lock:
        if not flag.done:
            print(
                f"gspo: the step in progress did not finish within {GRACE_S:g} s: abandoning it",
                file=sys.stderr,
                flush=True,
            )
            signal.pthread_kill(main, signal.SIGINT)
