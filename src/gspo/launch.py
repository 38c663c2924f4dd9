"""``gspo.train(cfg)``: the config resolved once into one plan (:func:`gspo.resolve.resolve`), the run
opened fresh or resumed (:func:`open_run`), and the loop run (:func:`gspo.training.loop.run_loop`).

:func:`open_run` loads the model, tokenizer and task, resumes from the newest checkpoint or warm-starts,
applies LoRA, wraps for data parallelism, makes the optimizer, the rollout engine and the logger. This
is the last place the config is read: everything it builds takes plans.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gspo import resolve
from gspo.config import Config, save_yaml
from gspo.errors import REIMPORTED_MAIN_EXIT, SAMPLER_PROCESS, GspoError, reimported_main
from gspo.limits import check_plan_fits, check_resources, gpu_total_memory
from gspo.model.load import enable_activation_checkpointing
from gspo.model.logprobs import PolicyLogprobs
from gspo.model.unwrap import unwrap
from gspo.plans import LoadPlan, ModelPlan, RunPlan, ScorePlan
from gspo.rollout.factory import make_engine, make_sampler
from gspo.rollout.weight_transfer import check_rollout_devices
from gspo.training import distributed as dist_utils
from gspo.training.checkpoints import CheckpointManager
from gspo.training.logger import MetricsLogger, read_metrics
from gspo.training.loop import Loop, TrainResult, closing, deferred_signals, run_loop
from gspo.training.run import HeldOut, Rollout, RunState, Trainer, make_optimizer

# fields a resumed run may change: they steer the run, not the math of what it trains (a run folder
# may be moved or renamed and still resumed)
RESUMABLE_CHANGES = {"resume", "overwrite", "steps", "eval_every", "save_every", "progress", "threads"}
RESUMABLE_CHANGES |= {"wandb", "report_to", "nproc", "output_dir", "name", "save_dtype"}
RESUMABLE_CHANGES |= {"rollout_devices"}  # where the sampler runs: the batches are the same bits
RESUMABLE_CHANGES |= {"dist_timeout_min"}  # how long a collective may wait: not what is trained


# one training per process: a run sets process-wide state (torch's threads and default generator,
# the signal handlers, the sampler's shared memory), so two at once in two threads make neither's run
_TRAINING = threading.Lock()


def train(cfg: Config) -> TrainResult:
    """Run RL post-training as configured (the same as ``gspo train``). One at a time per process:
    a second call while one runs (another thread) is refused; one after another is fine."""
    if not isinstance(cfg, Config):
        raise TypeError(f"gspo.train takes a gspo.Config, got {type(cfg).__name__} (gspo.Config(steps=...))")
    _refuse_spawned_reimport()
    if not _TRAINING.acquire(blocking=False):
        raise GspoError(
            "gspo.train is already running in this process (another thread): one run per process "
            "at a time; run them one after another, or in separate processes (gspo compare does)"
        )
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # our own progress line is enough
        transformers.utils.logging.set_verbosity_error()
        cfg = cfg.validate()
        plan = resolve.resolve(cfg)  # the one plan: every stage below takes its section of it
        if plan.dist.reproducible:  # before the first kernel runs (gspo.repro); the plan runs one thread
            from gspo.repro import pin

            pin()
        with deferred_signals() as stop, closing(open_run(cfg, lambda: stop.requested, plan)) as run:
            return run_loop(run, plan.loop, stop)
    finally:
        _TRAINING.release()


def _refuse_spawned_reimport() -> None:
    """A process started by multiprocessing's "spawn" (the async sampler's) first re-runs the parent's
    main script as ``__mp_main__``; a script without an ``if __name__ == "__main__":`` guard would start
    a second training there. Stop that process at once, in one line naming the guard (the async
    sampler's own process says nothing: its parent names the cause from the exit status)."""
    import inspect
    import multiprocessing

    frame = inspect.currentframe()
    # the script's own top level, being run as __mp_main__ (a function of it that a process pool's
    # worker calls later, with the same globals, is no re-run)
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__"
    ):
        frame = frame.f_back
    if frame is None:
        return
    if multiprocessing.current_process().name != SAMPLER_PROCESS:
        print(f"gspo: error: {reimported_main(frame.f_code.co_filename)}", file=sys.stderr, flush=True)
    raise SystemExit(REIMPORTED_MAIN_EXIT)


def open_run(
    cfg: Config, should_stop: Callable[[], bool] = lambda: False, plan: RunPlan | None = None
) -> Loop:
    """Set up a fresh run (warm start, step-0 eval and checkpoint) or resume the newest complete
    checkpoint, holding the run folder's lock until :meth:`Loop.close`. ``should_stop`` is polled by
    the warm start (Ctrl-C / SIGTERM). ``plan``: the config resolved (:func:`gspo.resolve.resolve`);
    the config itself is read only to check the run being resumed."""
    plan = plan or resolve.resolve(cfg)
    dctx = dist_utils.setup(plan.dist)
    if plan.dist.threads:
        torch.set_num_threads(plan.dist.threads)
    checkpoints = CheckpointManager(plan.checkpoints, dctx)  # holds the run folder's lock
    resume_from, state = check_run_dir(cfg, checkpoints)
    try:
        loop = _build(plan, dctx, checkpoints, resume_from, state, should_stop)
    except BaseException as e:
        checkpoints.abandon(fresh=state is None)  # a new run that never finished step 0 leaves no trace
        if state is None and isinstance(e, KeyboardInterrupt) and not str(e):
            raise KeyboardInterrupt(
                "stopped before step 0 was saved, so nothing was kept: run the same command again"
            ) from None
        raise
    if state is not None and dctx.rank == 0:  # a resume that failed to start left it as it was
        save_yaml(cfg, plan.checkpoints.run_dir / "config.yaml")  # only RESUMABLE_CHANGES can differ
    return loop


def _build(
    plan: RunPlan,
    dctx: dist_utils.DistContext,
    checkpoints: CheckpointManager,
    resume_from: Path | None,
    state: dict[str, Any] | None,
    should_stop: Callable[[], bool],
) -> Loop:
    from gspo.model.routing import is_moe
    from gspo.training.sft import load_start, warm_start_run

    # FSDP2 from weights on disk: every rank builds the model on the meta device and wrap() fills
    # its shards: each rank reading its own from the safetensors files, or rank 0 reading them all
    sharded = dist_utils.builds_sharded(
        plan.dist, dctx.world_size, resume_from is None and plan.sft.sft_steps > 0
    )
    check_rollout_devices(plan.sampling.rollout_devices, dctx.device)  # exist, not this rank's
    # what fits, before any weight is read
    check_plan_fits(plan.capacity, dctx.world_size, gpu_total_memory(dctx.device))
    # seeds, model (dropout off), task (reward limits included), context and env checks: the same
    # code gspo compare's shared warm starts begin with
    load, from_checkpoint = _load_plan(plan, dctx, checkpoints, resume_from, state, sharded)
    start = load_start(load, dctx.device, meta=sharded)
    from_shards = checkpoints.is_sharded(resume_from)
    # a sharded checkpoint's resume reads no weights but its shards: the model's own files never
    empty = sharded and from_shards
    folder, source = _shard_source(load, start.model, sharded and not empty, resume_from, dctx)
    model, tokenizer = start.model, start.tokenizer
    moe = is_moe(model)  # before LoRA wraps it: PEFT leaves the routers as they are
    if plan.model.routing_replay and not moe:
        raise GspoError(
            f"config field 'routing_replay': {plan.load.model} is not a MoE model (no routers to replay)"
        )
    if folder is None and not empty:  # a layout the model cannot take fails now (else once it is read)
        update = resolve.for_model(plan.update, plan.layout, PolicyLogprobs(model), moe)
    check_resources(plan.capacity, model)  # batches that cannot fit in memory fail now, not mid-run
    # a resume's weights come from elsewhere than load_weights: its shards, the start (read from the
    # checkpoint), each rank's own shards of it, or rank 0's broadcast (on the other ranks)
    elsewhere = from_shards or from_checkpoint or folder is not None or (sharded and source is None)
    if resume_from is None and plan.sft.sft_steps:
        warm_start_run(start, plan.sft, dctx.device, plan.loop.progress and dctx.rank == 0, should_stop)
    elif resume_from is not None and not elsewhere:
        checkpoints.load_weights(source if sharded else model, resume_from)
    model = _apply_lora(model, tokenizer, plan.model, checkpoints, resume_from)
    if plan.model.activation_checkpointing:
        enable_activation_checkpointing(model)
    rollout_copy, copy_dtype = None, plan.model.rollout_copy_dtype
    if copy_dtype is not None:
        # a copy in the sampler's precision (made before sharding; on the meta device its memory
        # is allocated here and filled by the first sync); sync_sampler copies and casts the weights
        rollout_copy = copy.deepcopy(model).requires_grad_(False).to(getattr(torch, copy_dtype))
        if sharded:
            rollout_copy.to_empty(device=dctx.device)
    policy = dist_utils.wrap(PolicyLogprobs(model), plan.dist, dctx, source, folder, empty=empty)
    del source
    if folder is not None:  # the probes run on the sharded model, every rank at once
        dist_utils.probe_sharded(policy)
        update = resolve.for_model(plan.update, plan.layout, PolicyLogprobs(model), moe)
    optimizer, scheduler = make_optimizer(policy, plan.optim)
    if from_shards:  # before the sampler takes the weights
        checkpoints.load_shards(policy, optimizer, resume_from, state)
    if empty:  # its weights are the checkpoint's now
        dist_utils.probe_sharded(policy)
        update = resolve.for_model(plan.update, plan.layout, PolicyLogprobs(model), moe)
    run_state = RunState(dctx, torch.Generator().manual_seed(plan.load.seed * 7919 + dctx.rank))
    trainer = Trainer(policy, optimizer, scheduler, update, moe, dctx.world_size)
    rollout = _rollout(plan, rollout_copy, policy, start, run_state.sample_gen, state, dctx)
    return _side_by_side(plan, dctx, checkpoints, trainer, rollout, run_state, start, state)


def _side_by_side(
    plan: RunPlan,
    dctx: dist_utils.DistContext,
    checkpoints: CheckpointManager,
    trainer: Trainer,
    rollout: Rollout,
    run_state: RunState,
    start: Any,
    state: dict[str, Any] | None,
) -> Loop:
    """The run's parts side by side, resumed from ``state`` (None: a fresh run, evaluated and
    checkpointed at step 0)."""
    run_dir = plan.checkpoints.run_dir
    # what a checkpoint holds besides the weights and optimizer, each part's own (restored in order:
    # the run state's global generators last)
    checkpoints.attach(trainer.policy, trainer.optimizer, start.tokenizer, (trainer, rollout, run_state))
    if state is not None:
        checkpoints.restore(state)
    logger = None
    if dctx.rank == 0:
        logger = MetricsLogger(
            run_dir, run_state.step if state else None, plan.checkpoints.wandb, plan.checkpoints.config
        )
    held_out = HeldOut(start.task, start.tokenizer, start.eval_ids, plan.scoring)
    loop = Loop(trainer, rollout, checkpoints, run_state, held_out, logger, dctx)
    startup = _startup_peak(dctx.device, state is not None, dctx.rank == 0)  # before the step-0 evaluation
    if state is None:
        run_state.initial = loop.evaluate()
        loop.log(0, {**run_state.initial, **startup})
        checkpoints.save(0)
    elif dctx.rank == 0 and not run_state.initial:
        run_state.initial = read_metrics(run_dir / "metrics.jsonl")[0]
    return loop


def _startup_peak(device: torch.device, resumed: bool, say: bool) -> dict[str, float]:
    """On a GPU, the peak memory of the start-up so far (weights, sampler started, its start check):
    the number ``gspo plan``'s start-up line estimates, said on stderr when ``say``; {} elsewhere."""
    if device.type != "cuda":
        return {}
    peak = {
        "memory/startup_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "memory/startup_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }
    if say:
        print(
            f"gspo: start-up peak {peak['memory/startup_peak_gib']:.2f} GiB allocated on {device} "
            f"({'resume' if resumed else 'fresh run'}; gspo plan's 'start-up peak' line)",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    return peak


def _load_plan(
    plan: RunPlan,
    dctx: dist_utils.DistContext,
    checkpoints: CheckpointManager,
    resume_from: Path | None,
    state: dict[str, Any] | None,
    sharded: bool,
) -> tuple[LoadPlan, bool]:
    """Where the run's config, tokenizer and (unless sharded) weights are read from, and whether that
    is the checkpoint being resumed. No rank asks the hub anything but each node's local rank 0
    (on several ranks a hub id is fetched once per node, :func:`gspo.training.distributed.node_snapshot`,
    then read as a local folder), and a resume of a hub model does not ask it at all: the checkpoint
    holds the config, the tokenizer and the weights (with LoRA, checkpoints/lora-base the frozen base;
    a sharded checkpoint its shards, which a ``sharded`` start fills its own from), so it needs neither
    the hub nor its cache (but a sharded checkpoint resumed in one process or under DDP, whose model
    is built from the hub's weights first). Collective on several ranks for a hub id. Also sets the
    checkpoint manager's ``source_dtype`` (``save_dtype auto`` of a hub id) from the local files."""
    from gspo.model.load import AUTO_DTYPE, HUB_TOKENIZER_FILES, is_hub_id, stored_dtype

    load, hub = plan.load, is_hub_id(plan.load.model)
    if hub and resume_from is not None and (sharded or not checkpoints.is_sharded(resume_from)):
        weights = checkpoints.weights_dir(resume_from)
        load, from_checkpoint = dataclasses.replace(load, model=str(weights), tokenizer=None), True
    else:
        from_checkpoint = False
        if hub and dctx.world_size > 1:
            load = dataclasses.replace(load, model=str(dist_utils.node_snapshot(load.model, dctx)))
        if load.tokenizer is not None and is_hub_id(load.tokenizer) and dctx.world_size > 1:
            folder = dist_utils.node_snapshot(load.tokenizer, dctx, HUB_TOKENIZER_FILES)
            load = dataclasses.replace(load, tokenizer=str(folder))
    if plan.loop.save_dtype == AUTO_DTYPE:  # a hub id: its snapshot's config (the checkpoint keeps it)
        kept = state is not None and "source_dtype" in state
        checkpoints.source_dtype = (
            state["source_dtype"]
            if kept
            else stored_dtype(plan.load.model if from_checkpoint else load.model)
        )  # (a checkpoint written before it kept the dtype: the hub's config, as before)
    return load, from_checkpoint


def _shard_source(
    load: LoadPlan, model: nn.Module, reads: bool, resume_from: Path | None, dctx: dist_utils.DistContext
) -> tuple[Path | None, nn.Module | None]:
    """Where the ranks of a sharded start that ``reads`` weights take them from: (the folder each
    rank reads its own shards from, None) or (None, the whole model on rank 0's CPU, None on the
    others; the probes shared from it). (None, None) when no weights are read here."""
    from gspo.training.sft import load_source

    if not reads:
        return None, None
    folder = _own_shards(load.model, model, resume_from, dctx)
    source = load_source(load) if folder is None and dctx.rank == 0 else None
    if folder is None:
        dist_utils.share_probes(model, source)
    return folder, source


def _own_shards(
    name: str, model: nn.Module, resume_from: Path | None, dctx: dist_utils.DistContext
) -> Path | None:
    """The HF folder each rank of a sharded start reads its own shards from (the model's, a hub id's
    snapshot fetched once per node, or the whole-model checkpoint being resumed); None when rank 0
    must read the weights for all (an embedded or GGUF model, a layout the files do not hold), said
    in one line."""
    from gspo.model.shard_load import readable

    if name.startswith("embedded:"):
        return None
    folder = resume_from if resume_from is not None else Path(name).expanduser()
    why = readable(model, folder) if folder.is_dir() else f"{name} is no local folder"
    if why and dctx.rank == 0:
        print(
            f"gspo: rank 0 reads the whole model for every rank ({why}); the other ranks wait for it in "
            f"a broadcast ({dist_utils.timeout_note()})",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    return None if why else folder


def _rollout(
    plan: RunPlan,
    rollout_copy: nn.Module | None,
    policy: nn.Module,
    start: Any,
    sample_gen: torch.Generator,
    state: dict[str, Any] | None,
    dctx: dist_utils.DistContext,
) -> Rollout:
    """The engine over the module it samples (a copy in the sampler's precision, or the trainer's
    own), and the sampler of each RL step."""
    module = rollout_copy if rollout_copy is not None else dist_utils.rollout_model(policy)
    sampling, version = plan.sampling, state["step"] if state else 0
    engine = make_engine(sampling.engine, module, start.tokenizer, sample_gen, trainer=policy)
    sampler = make_sampler(
        sampling, engine, start.tokenizer, start.task, model=policy,
        train_ids=start.train_ids, version=version, state=state, score=_score(plan.scoring),
    )  # fmt: skip
    # an HF engine sampling the trainer's own FSDP2-sharded module: its weights gathered around each use
    gathers = (
        sampling.engine.spec.in_trainer and module is unwrap(policy, "model") and dist_utils.is_fsdp(policy)
    )
    # vLLM over tp ranks: rank 0's instance spans ranks 0..tp-1, which all run its requests
    tp = sampling.engine.vllm_tensor_parallel_size if getattr(engine, "tp_group", None) else 1
    return Rollout(engine, module, sampler, gathers, tp, dctx, version)


def _score(scoring: ScorePlan) -> Callable[..., Any]:
    """The trainer's scoring, for the sampler to score each step's batch with (and an async process,
    dynamic sampling's rounds: picklable, a module function and a frozen plan)."""
    import functools

    from gspo.training.scoring import score_rollout

    return functools.partial(score_rollout, plan=scoring)


# ------------------------------------------------------------------------------------------------
# the run folder: claimed by the checkpoint manager, checked against the run being resumed
def check_run_dir(cfg: Config, checkpoints: CheckpointManager) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume from and its state (None, None for a new run), chosen by the manager
    (which holds the run folder's lock on rank 0, released on an error here). Refuses a resume that
    would change what the run trains."""
    path, state, note = checkpoints.choose()
    try:
        if state is not None:
            _check_resumable(cfg, path, state)
        checkpoints.say(note)
        if state is None and (checkpoints.dctx is None or checkpoints.dctx.rank == 0):
            save_yaml(cfg, cfg.run_dir / "config.yaml")  # a resume's, once it has started (open_run)
    except BaseException:
        checkpoints.release()
        raise
    return path, state


def _check_resumable(cfg: Config, path: Path | None, state: dict[str, Any]) -> None:
    saved = state["config"]
    changed = [
        k for k, v in cfg.to_dict().items() if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v
    ]
    if changed:
        k = changed[0]
        raise GspoError(
            f"--resume: config field '{k}' differs from the run being resumed ({saved[k]!r} -> "
            f"{getattr(cfg, k)!r}); a resumed run continues as recorded: drop the change, or start "
            "a new run with --name"
        )
    if cfg.steps < state["step"]:  # before config.yaml or final/ is touched
        raise GspoError(
            f"--resume: --steps {cfg.steps} is below the step of the checkpoint being resumed "
            f"({path.name if path else ''}: step {state['step']}); pass --steps {state['step']} or more"
        )


def _apply_lora(
    model: nn.Module,
    tokenizer: Any,
    plan: ModelPlan,
    checkpoints: CheckpointManager,
    resume_from: Path | None,
) -> nn.Module:
    if not plan.lora_rank:
        return model
    from gspo.model.lora import apply_lora

    if resume_from is None:  # the frozen base, saved once; checkpoints then hold adapters
        checkpoints.save_lora_base(model, tokenizer)
    model = apply_lora(model, plan.lora_rank, plan.lora_alpha, plan.lora_target_modules)
    if resume_from is not None:
        checkpoints.load_adapters(model, resume_from)
    return model
