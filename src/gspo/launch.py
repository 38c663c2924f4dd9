"""``gspo.train(cfg)``: the config resolved once into one plan (:func:`gspo.resolve.resolve`), the run
opened fresh or resumed (:func:`open_run`), and the loop run (:func:`gspo.training.loop.run_loop`).

:func:`open_run` loads the model, tokenizer and task, resumes from the newest checkpoint or warm-starts,
applies LoRA, wraps for data parallelism, makes the optimizer, the rollout engine and the logger. This
is the last place the config is read: everything it builds takes plans.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gspo import resolve
from gspo.config import Config, save_yaml
from gspo.errors import GspoError
from gspo.limits import check_plan_fits, check_resources, gpu_total_memory
from gspo.model.load import enable_activation_checkpointing
from gspo.model.logprobs import PolicyLogprobs
from gspo.model.unwrap import unwrap
from gspo.plans import ModelPlan, RunPlan, ScorePlan
from gspo.rollout.factory import make_engine, make_sampler
from gspo.rollout.weight_transfer import check_rollout_devices
from gspo.training import distributed as dist_utils
from gspo.training.checkpoints import CheckpointManager
from gspo.training.logger import MetricsLogger, read_metrics
from gspo.training.loop import TrainResult, closing, deferred_signals, run_loop
from gspo.training.run import Run, RunState, SamplerSide, Trainer, make_optimizer

# fields a resumed run may change: they steer the run, not the math of what it trains (a run folder
# may be moved or renamed and still resumed)
RESUMABLE_CHANGES = {"resume", "overwrite", "steps", "eval_every", "save_every", "progress", "threads"}
RESUMABLE_CHANGES |= {"wandb", "report_to", "nproc", "output_dir", "name", "save_dtype"}
RESUMABLE_CHANGES |= {"rollout_devices"}  # where the sampler runs: the batches are the same bits
RESUMABLE_CHANGES |= {"dist_timeout_min"}  # how long a collective may wait: not what is trained


def train(cfg: Config) -> TrainResult:
    """Run RL post-training as configured (the same as ``gspo train``)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # our own progress line is enough
    transformers.utils.logging.set_verbosity_error()
    cfg = cfg.validate()
    plan = resolve.resolve(cfg)  # the one plan: every stage below takes its section of it
    with deferred_signals() as stop, closing(open_run(cfg, lambda: stop.requested, plan)) as run:
        return run_loop(run, plan.loop, stop)


def open_run(
    cfg: Config, should_stop: Callable[[], bool] = lambda: False, plan: RunPlan | None = None
) -> Run:
    """Set up a fresh run (warm start, step-0 eval and checkpoint) or resume the newest complete
    checkpoint, holding the run folder's lock until :meth:`Run.close`. ``should_stop`` is polled by
    the warm start (Ctrl-C / SIGTERM). ``plan``: the config resolved (:func:`gspo.resolve.resolve`);
    the config itself is read only to check the run being resumed."""
    plan = plan or resolve.resolve(cfg)
    dctx = dist_utils.setup(plan.dist)
    if plan.dist.threads:
        torch.set_num_threads(plan.dist.threads)
    checkpoints = CheckpointManager(plan.checkpoints, dctx)  # holds the run folder's lock
    resume_from, state = check_run_dir(cfg, checkpoints)
    try:
        run = _build(plan, dctx, checkpoints, resume_from, state, should_stop)
    except BaseException as e:
        checkpoints.abandon(fresh=state is None)  # a new run that never finished step 0 leaves no trace
        if state is None and isinstance(e, KeyboardInterrupt) and not str(e):
            raise KeyboardInterrupt(
                "stopped before step 0 was saved, so nothing was kept: run the same command again"
            ) from None
        raise
    run.should_stop = should_stop
    return run


def _build(
    plan: RunPlan,
    dctx: dist_utils.DistContext,
    checkpoints: CheckpointManager,
    resume_from: Path | None,
    state: dict[str, Any] | None,
    should_stop: Callable[[], bool],
) -> Run:
    from gspo.model.routing import is_moe
    from gspo.training.sft import load_source, load_start, warm_start_run

    # FSDP2 from weights on disk: every rank builds the model on the meta device and wrap() fills
    # its shards: each rank reading its own from the safetensors files, or rank 0 reading them all
    run_dir = plan.checkpoints.run_dir
    sharded = dist_utils.builds_sharded(
        plan.dist, dctx.world_size, resume_from is None and plan.sft.sft_steps > 0
    )
    check_rollout_devices(plan.sampling.rollout_devices, dctx.device)  # exist, not this rank's
    # what fits, before any weight is read
    check_plan_fits(plan.capacity, dctx.world_size, gpu_total_memory(dctx.device))
    # seeds, model (dropout off), task (reward limits included), context and env checks: the same
    # code gspo compare's shared warm starts begin with
    start = load_start(plan.load, dctx.device, meta=sharded)
    from_shards = checkpoints.is_sharded(resume_from)
    folder = _own_shards(plan.load.model, start.model, resume_from, from_shards, dctx) if sharded else None
    source = load_source(plan.load) if sharded and folder is None and dctx.rank == 0 else None
    if sharded and folder is None:
        dist_utils.share_probes(start.model, source)
    model, tokenizer = start.model, start.tokenizer
    moe = is_moe(model)  # before LoRA wraps it: PEFT leaves the routers as they are
    if plan.model.routing_replay and not moe:
        raise GspoError(
            f"config field 'routing_replay': {plan.load.model} is not a MoE model (no routers to replay)"
        )
    if folder is None:  # a layout the model cannot take fails now (else once its shards are read)
        update = resolve.for_model(plan.update, plan.layout, PolicyLogprobs(model), moe)
    check_resources(plan.capacity, model)  # batches that cannot fit in memory fail now, not mid-run
    if resume_from is None and plan.sft.sft_steps:
        warm_start_run(start, plan.sft, dctx.device, plan.loop.progress and dctx.rank == 0, should_stop)
    elif resume_from is not None and not from_shards and folder is None and not (sharded and source is None):
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
    policy = dist_utils.wrap(PolicyLogprobs(model), plan.dist, dctx, source, folder)
    del source
    if folder is not None:  # the probes run on the sharded model, every rank at once
        dist_utils.probe_sharded(policy)
        update = resolve.for_model(plan.update, plan.layout, PolicyLogprobs(model), moe)
    optimizer, scheduler = make_optimizer(policy, plan.optim)
    if from_shards:  # before the sampler takes the weights
        checkpoints.load_shards(policy, optimizer, resume_from, state)
    run_state = RunState(torch.Generator().manual_seed(plan.load.seed * 7919 + dctx.rank))
    sampler_side = _sampler_side(plan, rollout_copy, policy, start, run_state.sample_gen, state)
    checkpoints.attach(policy)
    run = Run(
        dctx, run_state, Trainer(policy, optimizer, scheduler, update, moe), sampler_side, checkpoints,
        tokenizer, start.task, start.train_ids, start.eval_ids, plan.scoring,
    )  # fmt: skip
    if state is not None:
        checkpoints.restore(run, state)
    if dctx.rank == 0:
        run.logger = MetricsLogger(
            run_dir, run_state.step if state else None, plan.checkpoints.wandb, plan.checkpoints.config
        )
    startup = _startup_peak(dctx.device, state is not None, dctx.rank == 0)  # before the step-0 evaluation
    if state is None:
        run_state.initial = run.evaluate()
        run.log(0, {**run_state.initial, **startup})
        checkpoints.save(run)
    elif dctx.rank == 0:
        run_state.initial = state.get("initial") or read_metrics(run_dir / "metrics.jsonl")[0]
    return run


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


def _own_shards(
    name: str, model: nn.Module, resume_from: Path | None, from_shards: bool, dctx: dist_utils.DistContext
) -> Path | None:
    """The HF folder each rank of a sharded start reads its own shards from (the model's, a hub id's
    snapshot fetched once per node, or the whole-model checkpoint being resumed); None when rank 0
    must read the weights for all (an embedded or GGUF model, a layout the files do not hold), said
    in one line. Collective for a hub id."""
    from gspo.model.load import is_hub_id
    from gspo.model.shard_load import readable

    if name.startswith("embedded:"):
        return None
    if resume_from is not None and not from_shards:
        folder = resume_from  # a whole-model checkpoint: its HF folder
    elif is_hub_id(name):  # the model's weights (also under a sharded checkpoint's resume)
        folder = dist_utils.node_snapshot(name, dctx)
    else:
        folder = Path(name).expanduser()
    why = readable(model, folder) if folder.is_dir() else f"{name} is no local folder"
    if why and dctx.rank == 0:
        print(
            f"gspo: rank 0 reads the whole model for every rank ({why}); the other ranks wait for it in "
            f"a broadcast ({dist_utils.timeout_note()})",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    return None if why else folder


def _sampler_side(
    plan: RunPlan,
    rollout_copy: nn.Module | None,
    policy: nn.Module,
    start: Any,
    sample_gen: torch.Generator,
    state: dict[str, Any] | None,
) -> SamplerSide:
    """The engine over the module it samples (a copy in the sampler's precision, or the trainer's
    own), and the sampler of each RL step."""
    module = rollout_copy if rollout_copy is not None else dist_utils.rollout_model(policy)
    sampling = plan.sampling
    engine = make_engine(sampling.engine, module, start.tokenizer, sample_gen, trainer=policy)
    sampler = make_sampler(
        sampling, engine, start.tokenizer, start.task, model=policy,
        train_ids=start.train_ids, version=state["step"] if state else 0, state=state,
        score=_score(plan.scoring),
    )  # fmt: skip
    # an HF engine sampling the trainer's own FSDP2-sharded module: its weights gathered around each use
    gathers = (
        sampling.engine.spec.in_trainer and module is unwrap(policy, "model") and dist_utils.is_fsdp(policy)
    )
    # vLLM over tp ranks: rank 0's instance spans ranks 0..tp-1, which all run its requests
    tp = sampling.engine.vllm_tensor_parallel_size if getattr(engine, "tp_group", None) else 1
    return SamplerSide(engine, module, sampler, gathers, tp)


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
        if checkpoints.dctx is None or checkpoints.dctx.rank == 0:
            save_yaml(cfg, cfg.run_dir / "config.yaml")  # after a resume only RESUMABLE_CHANGES can differ
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
