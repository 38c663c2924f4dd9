"""The training loop: ``run_loop`` repeats ``rl_step`` -- the GSPO paper's algorithm, one step:

    prompts -> G responses each (old policy) -> rewards -> group advantages -> policy update -> sync

Ctrl-C or SIGTERM (what job schedulers send) finishes the step in flight, checkpoints it and stops
with a line saying how to resume; a step that does not finish within ``GRACE_S`` seconds (endless
dynamic sampling, a slow reward or generation) is abandoned and the last finished step saved. A second
one stops at once, keeping the last checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from gspo.errors import GspoError, warn
from gspo.memory import phase_peak
from gspo.plans import LoopPlan
from gspo.training import distributed as dist_utils
from gspo.training.checkpoints import CheckpointManager
from gspo.training.logger import MetricsLogger, Progress, plot_metrics, read_metrics
from gspo.training.run import HeldOut, Rollout, RunState, Trainer

if TYPE_CHECKING:
    import torch

# consecutive RL steps with a skipped optimizer step (non-finite gradients) or a non-finite loss before
# stopping (fewer stop a run whose every step had one: a diverged run never ends "done")
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


@dataclass
class Loop:
    """One run's parts side by side, as :func:`gspo.launch.open_run` built them (fresh or resumed):
    each keeps its own state, the checkpoint manager saves and restores them, and none reaches
    another through this."""

    trainer: Trainer
    rollout: Rollout
    checkpoints: CheckpointManager  # saves, restores and prunes checkpoints, writes final/; the folder's lock
    state: RunState
    held_out: HeldOut
    logger: MetricsLogger | None  # rank 0 only
    dctx: dist_utils.DistContext

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation of the trainer's current weights (every rank; metrics on rank 0)."""
        return self.rollout.evaluate(self.trainer.policy, self.held_out)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)

    def close(self) -> None:
        """End the sampler process (if any) and release the run folder."""
        try:
            self.rollout.close()
        finally:
            self.checkpoints.release()


def run_loop(loop: Loop, plan: LoopPlan, stop: _StopFlag) -> TrainResult:
    """RL steps from the run's last finished one to ``plan.steps``, each logged and checkpointed."""
    state, checkpoints = loop.state, loop.checkpoints
    stop.busy = lambda: loop.trainer.updating or checkpoints.saving
    bar = Progress(plan.steps, plan.algo, enabled=plan.progress and loop.dctx.rank == 0, initial=state.step)
    start = state.step
    skipped, watch = 0, Watch([STEP_OBSERVERS[name](loop.dctx) for name in plan.observers])
    while state.step < plan.steps:
        if dist_utils.any_rank(stop.requested, loop.dctx):
            stop.busy = lambda: True  # only the checkpoint of the finished step is left: let it be
            if checkpoints.last_saved < state.step:
                checkpoints.save(state.step)
            raise KeyboardInterrupt(f"progress is saved at step {state.step}; continue with --resume")
        metrics = _guarded_step(loop, plan, lambda: stop.requested, watch)
        skipped = skipped + 1 if _diverging(metrics) else 0
        loop.log(state.step, metrics)
        if skipped:
            ran, rank0 = state.step - start, loop.dctx.rank == 0
            _stop_if_diverged(skipped, state.step, ran, plan.steps, checkpoints.last_saved, rank0)
        bar.update(state.step, _status(metrics))
        step, every = state.step, plan.save_every
        if step == plan.steps or (every and step % every == 0):
            checkpoints.save(step)
    bar.close()
    return _finish(loop, plan)


def _stop_if_diverged(skipped: int, step: int, ran: int, last: int, saved: int, say: bool) -> None:
    """A diverged run never ends "done": the ``skipped`` steps up to ``step`` each had a skipped update
    or a NaN loss. ``MAX_SKIPPED_STEPS`` of them in a row, or every step this session ran (``ran``)
    up to the last one (``last``), stop the run in one line: no final/, its checkpoints kept (the
    newest is ``saved``). Fewer at the last step of a run that had healthy ones are a warning (``say``:
    this rank says it)."""
    first = step - skipped + 1
    span = f"steps {first}-{step}" if skipped > 1 else f"step {first}"
    if skipped >= MAX_SKIPPED_STEPS or (step == last and skipped == ran):
        raise GspoError(
            f"diverged: {span} had non-finite gradients or loss (updates skipped); lower 'lr' or "
            "check the loss's settings; no final model was written and the checkpoints are kept "
            f"(the newest is step {saved}; those before step {first} precede this)"
        )
    if step == last and say:
        warn(
            f"{span} had non-finite gradients or loss (updates skipped): the final model has their other updates"
        )


def _diverging(metrics: dict[str, float]) -> bool:
    """Whether a step shows divergence: an update skipped for a non-finite gradient norm, or a
    non-finite loss (a diverged run skips only some of a step's updates: those with finite
    gradients still move the weights, so counting only all-skipped steps never stopped it)."""
    loss = metrics.get("loss/loss", 0.0)
    return metrics["loss/skipped_updates"] > 0 or not math.isfinite(loss)


def rl_step(
    trainer: Trainer, rollout: Rollout, state: RunState, should_stop: Callable[[], bool], watch: Watch
) -> dict[str, float]:
    """One RL step on this rank: the GSPO paper's algorithm. Returns its metrics (and what ``watch``
    saw of its phases: rollout, update, sync)."""
    dctx = state.dctx
    # a sampler process samples elsewhere: nothing of the trainer's to gather (FSDP2)
    rolling = contextlib.nullcontext() if rollout.sampler.staleness else rollout.sampling(trainer.policy)
    with rolling, watch.phase("rollout"):
        # prompts -> G responses each -> rewards -> group advantages (dynamic sampling: its rounds)
        b = rollout.sampler.next_batch(
            state.step + 1, state.data_pos, lambda short: _another_round(short, should_stop, dctx)
        )
    state.data_pos, metrics = b.data_end, b.metrics
    trainer.updating = True  # from here on a failure cannot rewind the step
    rollout.engine.sleep()  # vLLM on a GPU gives its memory to the update
    with watch.phase("update"):
        metrics |= trainer.update(b.data.to(dctx.device))
    with watch.phase("sync"):
        rollout.sync(state.step + 1)  # the sampler's weights become the trainer's
    trainer.updating = False
    metrics["lr"] = trainer.scheduler.get_last_lr()[0]
    return metrics | watch.metrics(metrics)


# ------------------------------------------------------------------------------------------------
# what only watches the step, chosen by the loop's plan (LoopPlan.observers)


class StepObserver:
    """Watches one RL step from outside: around each of its named phases (rollout, update, sync),
    then what it saw, added to the step's metrics. Each does nothing here."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def metrics(self, step: dict[str, float]) -> dict[str, float]:
        return {}


class Timings(StepObserver):
    """``time/step_s``, and ``time/update_s`` from the update on (the update and the sync)."""

    def __init__(self, dctx: dist_utils.DistContext) -> None:
        self.starts: dict[str, float] = {}

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        self.starts[name] = time.time()
        return contextlib.nullcontext()

    def metrics(self, step: dict[str, float]) -> dict[str, float]:
        now = time.time()
        return {"time/update_s": now - self.starts["update"], "time/step_s": now - self.starts["rollout"]}


class AsyncIdle(Timings):
    """A sampler running ahead: the share of the step the trainer waited for its batch."""

    def metrics(self, step: dict[str, float]) -> dict[str, float]:
        took = max(time.time() - self.starts["rollout"], 1e-9)
        return {"async/trainer_idle_frac": step["async/queue_wait_s"] / took}


class MemoryPeaks(StepObserver):
    """Each phase's peak memory (:func:`gspo.memory.phase_peak`: ``memory/<phase>_peak_gib`` and
    ``_reserved_gib`` on a GPU, ``_peak_rss_gib`` on the CPU), the numbers ``gspo plan`` estimates."""

    def __init__(self, dctx: dist_utils.DistContext) -> None:
        self.device, self.peaks = dctx.device, {}

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return phase_peak(name, self.peaks, self.device)

    def metrics(self, step: dict[str, float]) -> dict[str, float]:
        return self.peaks


#: observer name (LoopPlan.observers) -> its class, built once per run
STEP_OBSERVERS: dict[str, Callable[[dist_utils.DistContext], StepObserver]] = {
    "memory": MemoryPeaks,
    "async_idle": AsyncIdle,
    "timings": Timings,
}


class Watch:
    """The step's observers as one: every phase entered in each, their metrics merged."""

    def __init__(self, observers: list[StepObserver]) -> None:
        self.observers = observers

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for o in self.observers:
                stack.enter_context(o.phase(name))
            yield

    def metrics(self, step: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for o in self.observers:
            out |= o.metrics(step)
        return out


# ------------------------------------------------------------------------------------------------


def _another_round(short: bool, should_stop: Callable[[], bool], dctx: dist_utils.DistContext) -> bool:
    """Dynamic sampling, between rounds (collective): another round while any rank is short of
    informative groups, so every rank draws the same prompts; a Ctrl-C need not wait for the last."""
    if not dist_utils.any_rank(short, dctx):
        return False
    if dist_utils.any_rank(should_stop(), dctx):
        raise _StepAbandoned
    return True


def _guarded_step(
    loop: Loop, plan: LoopPlan, should_stop: Callable[[], bool], watch: Watch
) -> dict[str, float]:
    """``rl_step`` + held-out eval. A failure before the update (a reward error, a second Ctrl-C)
    leaves the weights untouched: the step is rewound and the last finished one checkpointed."""
    state = loop.state
    gen_state, data_pos = state.sample_gen.get_state(), state.data_pos
    try:
        metrics = rl_step(loop.trainer, loop.rollout, state, should_stop, watch)
    except (GspoError, KeyboardInterrupt, _StepAbandoned) as e:
        _stopped_in_step(loop, e, gen_state, data_pos)
    state.step += 1
    metrics = dist_utils.mean_metrics(metrics, loop.dctx)
    if state.step == plan.steps or (plan.eval_every and state.step % plan.eval_every == 0):
        metrics |= _held_out(loop, metrics)
    return metrics


def _stopped_in_step(loop: Loop, e: BaseException, gen_state: torch.Tensor, data_pos: int) -> NoReturn:
    """A step stopped by ``e``: before its update it is rewound (its sampling generator and data
    position) and the last finished step checkpointed; the stop is said in one line."""
    state, checkpoints, world = loop.state, loop.checkpoints, loop.dctx.world_size
    untouched = not loop.trainer.updating
    if untouched:
        state.sample_gen.set_state(gen_state)
        state.data_pos = data_pos
        # a collective save needs every rank here: one process, or all agreed to stop
        if checkpoints.last_saved < state.step and (world == 1 or isinstance(e, _StepAbandoned)):
            checkpoints.save(state.step)
    where = f"the last checkpoint is step {checkpoints.last_saved}; continue with --resume"
    if untouched:
        where = f"progress is saved at step {state.step}; continue with --resume"
    if isinstance(e, KeyboardInterrupt | _StepAbandoned):
        raise KeyboardInterrupt(where) from None
    raise GspoError(f"{e} ({where})") from None


def _held_out(loop: Loop, metrics: dict[str, float]) -> dict[str, float]:
    """The held-out evaluation after a finished step; a Ctrl-C during it keeps the step, without
    its held-out score."""
    state = loop.state
    try:
        return loop.evaluate()
    except KeyboardInterrupt:
        if loop.dctx.world_size > 1:
            raise
        loop.log(state.step, metrics)
        loop.checkpoints.save(state.step)
        raise KeyboardInterrupt(
            f"progress is saved at step {state.step} (its held-out evaluation was cut short); "
            "continue with --resume"
        ) from None


def _status(metrics: dict[str, float]) -> str:
    acc = metrics.get("eval/accuracy")
    return (
        f"reward {metrics['rollout/reward_mean']:.3f}"
        + (f" acc {acc:.3f}" if acc is not None else "")
        + f" clip {metrics.get('loss/clip_frac_tok', 0):.3f}"
    )


def _finish(loop: Loop, plan: LoopPlan) -> TrainResult:
    """Final HF folder, curves and summary."""
    result = TrainResult(plan.run_dir, loop.trainer.model)
    result.final_dir = loop.checkpoints.write_final(plan.save_dtype)  # collective; rank 0 writes
    if loop.logger is not None:  # rank 0
        rows = read_metrics(plan.run_dir / "metrics.jsonl")
        result.plot = plan.run_dir / "curves.png"
        plot_metrics(rows, result.plot, title=plan.title)
        evals = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
        result.initial_accuracy = loop.state.initial.get("eval/accuracy")
        result.final_accuracy = evals[-1] if evals else None
        loop.logger.close()
    loop.rollout.engine.close()  # vLLM's groups live on the trainer's process group: end them first
    dist_utils.cleanup(loop.dctx)
    return result


@contextmanager
def closing(loop: Loop):  # noqa: ANN202
    try:
        yield loop
    finally:
        loop.close()


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
