"""A training run: everything ``train()`` needs, opened (fresh or resumed) and saved in one place.

:meth:`Run.open` loads the model, tokenizer and task, resumes from the newest checkpoint or warm-starts,
applies LoRA, wraps for data parallelism, makes the optimizer, the rollout engine and the logger.
:meth:`Run.save` writes an atomic checkpoint (HF weights + everything exact resume needs).
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gspo.config import Config, save_yaml
from gspo.data import RolloutEngine, Sampler
from gspo.errors import GspoError
from gspo.limits import check_plan_fits, check_resources, gpu_total_memory
from gspo.model.export import save_config_and_tokenizer
from gspo.model.load import enable_activation_checkpointing, save_pretrained
from gspo.model.logprobs import PolicyLogprobs
from gspo.model.unwrap import unwrap
from gspo.plans import UpdatePlan
from gspo.resolve import plan_update
from gspo.rollout.factory import make_engine, make_sampler
from gspo.tasks import Task
from gspo.train import checkpoint as ckpt
from gspo.train import distributed as dist_utils
from gspo.train import sharded as sharded_ckpt
from gspo.train.logger import MetricsLogger, read_metrics
from gspo.train.scoring import evaluate

# fields a resumed run may change: they steer the run, not the math of what it trains (a run folder
# may be moved or renamed and still resumed)
RESUMABLE_CHANGES = {"resume", "overwrite", "steps", "eval_every", "save_every", "progress", "threads"}
RESUMABLE_CHANGES |= {"wandb", "nproc", "output_dir", "name"}


@dataclass
class Run:
    cfg: Config
    dctx: dist_utils.DistContext
    policy: nn.Module  # the trainer's forward (PolicyLogprobs, DDP/FSDP-wrapped when distributed)
    tokenizer: Any
    task: Task
    train_ids: list[list[int]]  # token ids of every training prompt
    eval_ids: list[list[int]]  # ... and of every held-out prompt
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: RolloutEngine  # generates: the RL step's responses (through ``sampler``) and the eval's
    rollout_module: nn.Module  # the module the engine samples from (shares weights, or a synced copy)
    sampler: Sampler  # each RL step's responses (synchronous, or a process running ahead)
    sample_gen: torch.Generator  # this rank's sampling randomness (checkpointed)
    is_moe: bool
    plan: UpdatePlan  # what every policy update does, resolved once
    logger: MetricsLogger | None  # rank 0 only
    step: int = 0  # last finished RL step
    data_pos: int = 0  # prompts consumed (epoch-wise shuffled order)
    last_saved: int = -1
    updating: bool = False  # inside the policy update of a step (weights may have changed)
    initial: dict[str, Any] = field(default_factory=dict)  # held-out metrics before RL
    lock: int | None = None  # descriptor holding the run folder's lock (rank 0)
    saving: bool = False  # writing a checkpoint (a stop lets it finish)
    should_stop: Callable[[], bool] = lambda: False  # a Ctrl-C / SIGTERM came (long phases poll it)
    sharded_checkpoints: bool = False  # each rank saves its own shards (FSDP2 on N ranks; gspo.train.sharded)

    @property
    def rank(self) -> int:
        return self.dctx.rank

    @property
    def world(self) -> int:
        return self.dctx.world_size

    @property
    def hf(self) -> nn.Module:
        """The Hugging Face model being trained (its PEFT wrapper with LoRA)."""
        return unwrap(self.policy, "model")

    # --------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, cfg: Config, should_stop: Callable[[], bool] = lambda: False) -> Run:
        """Set up a fresh run (warm start, step-0 eval and checkpoint) or resume the newest complete
        checkpoint, holding the run folder's lock until :meth:`close`. ``should_stop`` is polled by
        the warm start (Ctrl-C / SIGTERM)."""
        dctx = dist_utils.setup(cfg)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        resume_from, state, lock = _check_run_dir(cfg, dctx)
        try:
            run = cls._build(cfg, dctx, resume_from, state, should_stop)
        except BaseException as e:
            if state is None and dctx.rank == 0:  # a new run that never finished step 0: leave no trace,
                ckpt.remove_traces(cfg.run_dir)  # so the same command can simply be run again
            ckpt.unlock_run_dir(lock)
            if state is None and isinstance(e, KeyboardInterrupt) and not str(e):
                raise KeyboardInterrupt(
                    "stopped before step 0 was saved, so nothing was kept: run the same command again"
                ) from None
            raise
        run.lock, run.should_stop = lock, should_stop
        return run

    @classmethod
    def _build(
        cls,
        cfg: Config,
        dctx: dist_utils.DistContext,
        resume_from: Path | None,
        state: dict[str, Any] | None,
        should_stop: Callable[[], bool],
    ) -> Run:
        from gspo.model.routing import is_moe
        from gspo.train.sft import load_source, load_start, warm_start_run

        # FSDP2 from weights on disk: every rank builds the model on the meta device, rank 0 alone
        # reads the weights (CPU) and wrap() hands each rank its shard
        sharded = dist_utils.builds_sharded(cfg, dctx.world_size, resume_from is None and cfg.sft_steps > 0)
        check_plan_fits(cfg, dctx.world_size, gpu_total_memory(dctx.device))  # before any weight is read
        # seeds, model (dropout off), task (reward limits included), context and env checks: the same
        # code gspo compare's shared warm starts begin with
        start = load_start(cfg, dctx.device, meta=sharded)
        source = load_source(cfg) if sharded and dctx.rank == 0 else None
        if sharded:
            dist_utils.share_probes(start.model, source)
        model, tokenizer, task = start.model, start.tokenizer, start.task
        train_ids, eval_ids = start.train_ids, start.eval_ids
        moe = is_moe(model)  # before LoRA wraps it: PEFT leaves the routers as they are
        if cfg.routing_replay and not moe:
            raise GspoError(
                f"config field 'routing_replay': {cfg.model} is not a MoE model (no routers to replay)"
            )
        plan = plan_update(cfg, PolicyLogprobs(model), moe)  # a layout the model cannot take fails now
        check_resources(cfg, model)  # batches that cannot fit in memory fail now, not mid-run
        progress = cfg.progress and dctx.rank == 0
        from_shards = resume_from is not None and sharded_ckpt.is_sharded(resume_from)
        if resume_from is not None and not from_shards and not (sharded and source is None):
            _load_weights(source if sharded else model, cfg, resume_from)
        elif cfg.sft_steps:
            warm_start_run(start, cfg, dctx.device, progress, should_stop)
        model = _apply_lora(model, tokenizer, cfg, dctx, resume_from)
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(model)
        rollout_copy = None
        if cfg.rollout_engine == "hf" and cfg.rollout_dtype not in (None, cfg.dtype):
            # a copy in the sampler's precision (made before sharding; on the meta device its memory
            # is allocated here and filled by the first sync); sync_sampler copies and casts the weights
            rollout_copy = copy.deepcopy(model).requires_grad_(False).to(getattr(torch, cfg.rollout_dtype))
            if sharded:
                rollout_copy.to_empty(device=dctx.device)
        policy = dist_utils.wrap(PolicyLogprobs(model), cfg, dctx, source)
        del source
        optimizer, scheduler = make_optimizer(policy, cfg, dctx.world_size)
        if from_shards:  # before the sampler takes the weights
            sharded_ckpt.load(policy, optimizer, resume_from, state["optimizer"]["dcp"])
        sample_gen = torch.Generator().manual_seed(cfg.seed * 7919 + dctx.rank)
        module = rollout_copy if rollout_copy is not None else dist_utils.rollout_model(policy)
        engine = make_engine(cfg, module, tokenizer, sample_gen, trainer=policy)
        sampler = make_sampler(
            cfg, engine, tokenizer, task, model=unwrap(policy, "model"), train_ids=train_ids,
            version=state["step"] if state else 0, state=state,
        )  # fmt: skip
        run = cls(
            cfg, dctx, policy, tokenizer, task, train_ids, eval_ids, optimizer, scheduler,
            engine, module, sampler, sample_gen, moe, plan, None,
        )  # fmt: skip
        run.sharded_checkpoints = sharded_ckpt.uses_sharded_checkpoints(policy, bool(cfg.lora_rank))
        if state is not None:
            run._restore(state)
        run.logger = (
            MetricsLogger(cfg.run_dir, run.step if state else None, cfg.wandb, cfg.to_dict())
            if dctx.rank == 0
            else None
        )
        if state is None:
            run.initial = run.evaluate()
            run.log(0, run.initial)
            run.save()
        elif dctx.rank == 0:
            run.initial = state.get("initial") or read_metrics(cfg.run_dir / "metrics.jsonl")[0]
        return run

    def _restore(self, state: dict[str, Any]) -> None:
        if "dcp" not in state["optimizer"]:  # a sharded checkpoint's optimizer was loaded with the weights
            dist_utils.load_optimizer_state_dict(self.policy, self.optimizer, state["optimizer"], self.dctx)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = self.last_saved = state["step"]
        self.data_pos = state["data_pos"]
        gens = state["sample_gen"]
        if self.rank < len(gens):  # a rank the saved run did not have keeps its fresh seed
            self.sample_gen.set_state(gens[self.rank])
        rngs = state.get("rng_ranks") or [state["rng"]]
        ckpt.set_rng_state(rngs[self.rank] if self.rank < len(rngs) else state["rng"])

    # --------------------------------------------------------------------------------------------
    def sampling(self) -> contextlib.AbstractContextManager[None]:
        """Hold this around the engine's use (every rank): an HF engine sampling from the trainer's
        own FSDP2 module needs its weights gathered (:func:`dist_utils.gathered`)."""
        if self.cfg.rollout_engine == "hf" and self.rollout_module is self.hf:
            return dist_utils.gathered(self.policy)
        return contextlib.nullcontext()

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy accuracy (rank 0; the other ranks return nothing; every rank calls it)."""
        with self.sampling():
            # vLLM over tp ranks: rank 0's instance spans ranks 0..tp-1, which all run its requests
            tp = self.cfg.vllm_tensor_parallel_size if getattr(self.engine, "tp_group", None) else 1
            if self.rank >= tp:
                return {}
            acc = evaluate(self.engine, self.tokenizer, self.task, self.eval_ids, self.cfg)
            return acc if self.rank == 0 else {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)

    def save(self) -> None:
        """Checkpoint the last finished step (collective: every rank calls it)."""
        self.saving = True
        try:
            self._save()
        finally:
            self.saving = False

    def _save(self) -> None:
        _check_finite(self.policy, self.step, self.last_saved)
        gens = dist_utils.gather_objects(self.sample_gen.get_state(), self.dctx)
        tmp = None
        if self.sharded_checkpoints:  # each rank writes its shards; rank 0 the rest, as below
            tmp, opt_sd = self._save_shards()
            write = lambda p: save_config_and_tokenizer(self.hf, self.tokenizer, p)  # noqa: E731
        else:
            model, full_sd = self.savable()
            opt_sd = dist_utils.optimizer_state_dict(self.policy, self.optimizer, self.dctx)
            write = lambda p: save_hf(model, self.tokenizer, p, full_sd)  # noqa: E731
        # each rank's generators (rewards draw from them), after the collectives above, which may draw
        rngs = dist_utils.gather_objects(ckpt.rng_state(), self.dctx)
        if self.rank == 0:
            state = {
                "optimizer": opt_sd,
                "scheduler": self.scheduler.state_dict(),
                "step": self.step,
                "data_pos": self.data_pos,
                "sample_gen": gens,
                "rng": rngs[0],
                "rng_ranks": rngs,
                "config": self.cfg.to_dict(),
                "initial": self.initial,
            }
            state |= self.sampler.state(self.step)  # e.g. batches sampled ahead, from older versions
            self._attempt(lambda: ckpt.save_checkpoint(self.cfg.run_dir, self.step, write, state, tmp=tmp))
        self.last_saved = self.step

    def _save_shards(self) -> tuple[Path, dict[str, Any]]:
        """Every rank writes its model and optimizer shards into the new checkpoint's folder, which
        rank 0 makes (collective). Returns the folder and the trainer state's optimizer entry."""
        made: tuple[Path | None, str] = (None, "")
        if self.rank == 0:
            try:
                made = (self._attempt(lambda: ckpt.begin_checkpoint(self.cfg.run_dir, self.step)), "")
            except GspoError as e:
                made = (None, str(e))
        tmp, error = dist_utils.gather_objects(made, self.dctx)[0]
        if tmp is None:
            raise GspoError(error)
        try:
            saved = self._attempt(lambda: sharded_ckpt.save(self.policy, self.optimizer, tmp))
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp, {"dcp": saved}

    def _attempt(self, write: Callable[[], Any]) -> Any:
        """``write()``; a failure to write (e.g. a full disk) is one line naming what is kept."""
        import torch.distributed.checkpoint as dcp

        try:
            return write()
        except (OSError, dcp.api.CheckpointException) as e:
            kept = f"step {self.last_saved}" if self.last_saved >= 0 else "none"
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
            raise GspoError(
                f"cannot write checkpoint step {self.step} under {self.cfg.run_dir}/checkpoints: "
                f"{why}; the last complete checkpoint is kept ({kept})"
            ) from None

    def savable(self) -> tuple[nn.Module, dict[str, torch.Tensor] | None]:
        """What rank 0 writes as the HF folder (collective): the trained module, with the full state
        dict gathered from the shards when distributed (PEFT merges a LoRA model's adapters itself)."""
        from gspo.model.lora import is_peft

        if is_peft(self.hf) and self.world > 1:
            return self.hf, None
        return self.hf, dist_utils.full_state_dict(self.policy, self.dctx)

    def maybe_save(self) -> None:
        every, step = self.cfg.save_every, self.step
        if step == self.cfg.steps or (every and step % every == 0):
            self.save()

    def sync_sampler(self, version: int) -> None:
        """After update ``version``: the sampler's weights become the trainer's (each engine takes
        them from the trainer: :meth:`RolloutEngine.sync_weights`)."""
        self.sampler.sync(version)

    def close(self) -> None:
        """End the sampler process (if any) and release the run folder."""
        try:
            self.sampler.close()
        finally:
            try:
                self.engine.close()
            finally:
                ckpt.unlock_run_dir(self.lock)
                self.lock = None


# ------------------------------------------------------------------------------------------------
# the pieces of Run.open


def _check_run_dir(
    cfg: Config, dctx: dist_utils.DistContext
) -> tuple[Path | None, dict[str, Any] | None, int | None]:
    """The checkpoint to resume from, its state (None, None for a new run) and the run folder's lock
    (rank 0). Rank 0 claims the folder (see :func:`_claim_run_dir`); every rank then resumes from the
    checkpoint it chose, or fails with its error. Refuses a resume that would change what the run
    trains."""
    lock, path, state, note, error = None, None, None, "", None
    if dctx.rank == 0:
        try:
            lock, path, state, note = _claim_run_dir(cfg)
        except GspoError as e:
            error = str(e)
    error, path = dist_utils.gather_objects((error, path), dctx)[0]
    if error is not None:
        raise GspoError(error)
    try:
        if path is not None and state is None:  # the other ranks read what rank 0 verified
            state = ckpt.load_trainer_state(path)
        if state is not None:
            saved = state["config"]
            changed = [
                k
                for k, v in cfg.to_dict().items()
                if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v
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
                    f"({path.name}: step {state['step']}); pass --steps {state['step']} or more"
                )
        if dctx.rank == 0:
            if note:
                print(f"gspo: {note}", file=sys.stderr, flush=True)
            save_yaml(cfg, cfg.run_dir / "config.yaml")  # after a resume only RESUMABLE_CHANGES can differ
    except BaseException:
        ckpt.unlock_run_dir(lock)
        raise
    return path, state, lock


def _claim_run_dir(cfg: Config) -> tuple[int, Path | None, dict[str, Any] | None, str]:
    """Rank 0: lock the run folder (one writer), then pick the newest complete checkpoint to resume
    (``--resume``) or make sure the folder holds no earlier run (``--overwrite`` deletes it). Returns
    the lock, the checkpoint and its state (None for a new run) and the line to show about it."""
    run_dir = cfg.run_dir
    if cfg.resume and cfg.overwrite:
        raise GspoError("--resume and --overwrite exclude each other: continue the run, or start it over")
    if cfg.resume and not run_dir.is_dir():
        raise GspoError(f"--resume: no checkpoint found under {run_dir}/checkpoints (no such run folder)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GspoError(f"config field 'output_dir': cannot create {run_dir}: {e.strerror}") from None
    lock = ckpt.lock_run_dir(run_dir)
    try:
        if cfg.resume:
            path, state, skipped = ckpt.newest_complete(run_dir)
            why = f" ({'; '.join(skipped)})" if skipped else ""
            if path is None:
                raise GspoError(
                    f"--resume: no complete checkpoint found under {run_dir}/checkpoints{why}; pass "
                    "--overwrite instead of --resume to start the run over"
                )
            note = f"resuming from {path}" + (f"; skipped newer damaged checkpoints{why}" if skipped else "")
            return lock, path, state, note
        traces = ckpt.run_traces(run_dir)
        if traces and not cfg.overwrite:
            if not ckpt.step_folders(run_dir):  # stopped before step 0 was saved: nothing to resume
                raise GspoError(
                    f"run folder {run_dir} already holds a run ({', '.join(traces)}) that saved no "
                    "checkpoint (it stopped before step 0), so --resume cannot continue it; pass "
                    "--overwrite to delete it and start over, or --name to start a new run"
                )
            raise GspoError(
                f"run folder {run_dir} already holds checkpoints; pass --resume to continue it, --overwrite "
                "to delete it and start over, or --name to start a new run"
            )
        ckpt.remove_traces(run_dir)  # --overwrite (nothing to remove otherwise)
        return lock, None, None, ""
    except BaseException:
        ckpt.unlock_run_dir(lock)
        raise


def _load_weights(model: nn.Module, cfg: Config, resume_from: Path) -> None:
    from transformers import AutoModelForCausalLM

    # from_pretrained undoes the on-disk layout conversions (e.g. per-expert MoE weights)
    weights_dir = cfg.run_dir / "checkpoints" / "lora-base" if cfg.lora_rank else resume_from
    why = ckpt.check_manifest(weights_dir) if cfg.lora_rank else ""
    if why:  # the frozen base every checkpoint's adapters apply to: no other copy to fall back on
        raise GspoError(f"--resume: {weights_dir}: {why}; start the run over with --overwrite")
    saved = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=next(model.parameters()).dtype)
    model.load_state_dict(saved.state_dict())


def _apply_lora(
    model: nn.Module, tokenizer: Any, cfg: Config, dctx: dist_utils.DistContext, resume_from: Path | None
) -> nn.Module:
    if not cfg.lora_rank:
        return model
    from gspo.model.lora import apply_lora

    if resume_from is None and dctx.rank == 0:  # the frozen base, saved once; checkpoints then hold adapters
        save_pretrained(model, tokenizer, cfg.run_dir / "checkpoints" / "lora-base")
        ckpt.write_manifest(cfg.run_dir / "checkpoints" / "lora-base")
    model = apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_target_modules)
    if resume_from is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(
            model, load_file(str(resume_from / "adapter" / "adapter_model.safetensors"))
        )
    return model


def _check_finite(policy: nn.Module, step: int, last_saved: int) -> None:
    """Refuse to checkpoint non-finite weights (a diverged run keeps its last good checkpoint)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    if params and not bool(torch.stack([p.detach().isfinite().all() for p in params]).all()):
        where = f"the last good checkpoint is step {last_saved}" if last_saved >= 0 else "nothing was saved"
        raise GspoError(
            f"weights are not finite after step {step} (lr too high?); {where} (lower 'lr' / 'sft_lr')"
        )


def save_hf(
    model: Any, tokenizer: Any, path: Path, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """HF folder loadable by ``from_pretrained``; with LoRA the adapters are merged in and also kept
    on their own under ``adapter/`` (for resuming and for PEFT users)."""
    from gspo.model.lora import is_peft, merged_copy

    if is_peft(model):
        save_pretrained(merged_copy(model), tokenizer, path)
        model.save_pretrained(Path(path) / "adapter")
        return
    if state_dict is not None:
        model.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(path)
    else:
        save_pretrained(model, tokenizer, path)


def make_optimizer(
    model: nn.Module, cfg: Config, world_size: int = 1
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters and a linear-warmup LR schedule."""
    # fused AdamW at every world size: one kernel for all parameters instead of a Python loop (5% of a
    # tiny-model step); FSDP2's sharded parameters (DTensors) take it as plain tensors do
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.weight_decay,
        fused=True,
    )
    warm = max(cfg.warmup_steps, 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm))
    return optimizer, scheduler
