"""A training run, split by job: what a checkpoint holds (:class:`RunState`), the trainer
(:class:`Trainer`), the sampler (:class:`SamplerSide`) and the run folder (:class:`RunFolder`);
:class:`Run` holds one of each and saves an atomic checkpoint (HF weights + everything exact resume
needs). :func:`gspo.launch.open_run` builds it, fresh or resumed, from the config.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gspo.data import RolloutEngine, Sampler
from gspo.errors import GspoError
from gspo.model.export import DCP_DIR, save_config_and_tokenizer
from gspo.model.load import save_pretrained
from gspo.model.unwrap import unwrap
from gspo.plans import OptimPlan, ScorePlan, UpdatePlan
from gspo.tasks import Task
from gspo.training import checkpoint as ckpt
from gspo.training import distributed as dist_utils
from gspo.training import sharded as sharded_ckpt
from gspo.training.logger import MetricsLogger
from gspo.training.scoring import eval_metrics, eval_scores


@dataclass
class RunState:
    """Where the run is, besides its weights and optimizer: what a checkpoint holds to resume exactly."""

    sample_gen: torch.Generator  # this rank's sampling randomness
    step: int = 0  # last finished RL step
    data_pos: int = 0  # prompts consumed (epoch-wise shuffled order)
    last_saved: int = -1
    initial: dict[str, Any] = field(default_factory=dict)  # held-out metrics before RL


@dataclass
class Trainer:
    """The trainer side: the policy's forward, its optimizer and what every update does."""

    policy: nn.Module  # PolicyLogprobs, DDP/FSDP-wrapped when distributed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    plan: UpdatePlan
    is_moe: bool

    @property
    def hf(self) -> nn.Module:
        """The Hugging Face model being trained (its PEFT wrapper with LoRA)."""
        return unwrap(self.policy, "model")


@dataclass
class SamplerSide:
    """The sampler side: the engine (the RL step's responses through ``sampler``, and the eval's),
    the module it samples from (the trainer's own, or a synced copy)."""

    engine: RolloutEngine
    module: nn.Module
    sampler: Sampler  # each RL step's responses (synchronous, or a process running ahead)
    gathers: bool  # an HF engine sampling the trainer's own FSDP2 module: its weights are gathered
    tp: int  # ranks one engine spans (vLLM tensor parallelism; 1 otherwise)

    def sampling(self, policy: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Hold this around the engine's use (every rank)."""
        return dist_utils.gathered(policy) if self.gathers else contextlib.nullcontext()

    def close(self) -> None:
        try:
            self.sampler.close()
        finally:
            self.engine.close()


@dataclass
class RunFolder:
    """The run folder: its lock, metrics log and checkpoints."""

    run_dir: Path
    config: dict[str, Any]  # the run's config, as every checkpoint records it
    sharded: bool  # each rank saves its own shards (FSDP2 on N ranks; gspo.training.sharded)
    logger: MetricsLogger | None = None  # rank 0 only
    lock: Any = None  # the run folder's lock (rank 0)


@dataclass
class Run:
    dctx: dist_utils.DistContext
    state: RunState
    trainer: Trainer
    sampler: SamplerSide
    folder: RunFolder
    tokenizer: Any
    task: Task
    train_ids: list[list[int]]  # token ids of every training prompt
    eval_ids: list[list[int]]  # ... and of every held-out prompt
    score: ScorePlan  # rewards -> advantages, and the held-out evaluation
    updating: bool = False  # inside the policy update of a step (weights may have changed)
    saving: bool = False  # writing a checkpoint (a stop lets it finish)
    should_stop: Callable[[], bool] = lambda: False  # a Ctrl-C / SIGTERM came (long phases poll it)

    @property
    def rank(self) -> int:
        return self.dctx.rank

    @property
    def world(self) -> int:
        return self.dctx.world_size

    def restore(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's trainer state (weights are loaded where the run is built)."""
        t, s = self.trainer, self.state
        if "dcp" not in state["optimizer"]:  # a sharded checkpoint's optimizer was loaded with the weights
            dist_utils.load_optimizer_state_dict(t.policy, t.optimizer, state["optimizer"], self.dctx)
        t.scheduler.load_state_dict(state["scheduler"])
        s.step = s.last_saved = state["step"]
        s.data_pos = state["data_pos"]
        gens = state["sample_gen"]
        if self.rank < len(gens):  # a rank the saved run did not have keeps its fresh seed
            s.sample_gen.set_state(gens[self.rank])
        rngs = state.get("rng_ranks") or [state["rng"]]
        ckpt.set_rng_state(rngs[self.rank] if self.rank < len(rngs) else state["rng"])

    def evaluate(self) -> dict[str, float]:
        """Held-out greedy accuracy, the prompts split over the engines (every rank calls it; rank 0
        returns the metrics of all of them, as one process would score them; the others nothing)."""
        tp = self.sampler.tp  # ranks one engine spans (vLLM's tensor parallelism): they run its requests
        engines, mine = self.world // tp, self.rank // tp
        n = len(self.eval_ids)
        rows = slice(mine * n // engines, (mine + 1) * n // engines)
        scores = None
        if self.sampler.sampler.staleness:  # the sampler runs elsewhere: nothing synced this engine
            self.sampler.engine.sync_weights()
        with self.sampler.sampling(self.trainer.policy):  # (collective: every rank, prompts or not)
            if rows.stop > rows.start:
                ids, examples = self.eval_ids[rows], self.task.eval[rows]
                scores = eval_scores(
                    self.sampler.engine, self.tokenizer, self.task, examples, ids, self.score
                )
        parts = dist_utils.gather_objects(scores if self.rank % tp == 0 else None, self.dctx)
        if self.rank != 0:
            return {}
        parts = [p for p in parts if p is not None]  # one per engine, in the order of the prompts
        return eval_metrics({k: [v for p in parts for v in p[k]] for k in parts[0]})

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.folder.logger is not None:
            self.folder.logger.log(step, metrics)

    def save(self) -> None:
        """Checkpoint the last finished step (collective: every rank calls it)."""
        self.saving = True
        try:
            self._save()
        finally:
            self.saving = False

    def _save(self) -> None:
        t, s, folder = self.trainer, self.state, self.folder
        # a no-grad forward after the last backward (e.g. the routing-volatility probe) leaves FSDP2's
        # root group unsharded: its parameters are then plain full tensors beside the others' DTensors
        dist_utils.reshard(t.policy)
        _check_finite(t.policy, s.step, s.last_saved, self.dctx)
        gens = dist_utils.gather_objects(s.sample_gen.get_state(), self.dctx)
        tmp, known = None, None
        if folder.sharded:  # each rank writes (and checksums) its shards; rank 0 the rest, as below
            tmp, opt_sd, known = self._save_shards()
            write = lambda p: save_config_and_tokenizer(t.hf, self.tokenizer, p)  # noqa: E731
        else:
            model, full_sd = self.savable()
            opt_sd = dist_utils.optimizer_state_dict(t.policy, t.optimizer, self.dctx)
            write = lambda p: save_hf(model, self.tokenizer, p, full_sd)  # noqa: E731
        # each rank's generators (rewards draw from them), after the collectives above, which may draw
        rngs = dist_utils.gather_objects(ckpt.rng_state(), self.dctx)
        if self.rank == 0:
            state = {
                "optimizer": opt_sd,
                "scheduler": t.scheduler.state_dict(),
                "step": s.step,
                "data_pos": s.data_pos,
                "sample_gen": gens,
                "rng": rngs[0],
                "rng_ranks": rngs,
                "config": folder.config,
                "initial": s.initial,
            }
            state |= self.sampler.sampler.state(s.step)  # e.g. batches sampled ahead, from older versions
            save = lambda: ckpt.save_checkpoint(folder.run_dir, s.step, write, state, tmp=tmp, known=known)  # noqa: E731
            self._attempt(save)
        s.last_saved = s.step

    def _save_shards(self) -> tuple[Path, dict[str, Any], dict[str, Any]]:
        """Every rank writes its model and optimizer shards into the new checkpoint's folder, which
        rank 0 makes, and checksums its own files (collective). Returns the folder, the trainer
        state's optimizer entry and the manifest entries of every rank's shard files."""
        made: tuple[Path | None, str] = (None, "")
        if self.rank == 0:
            try:
                step = self.state.step
                made = (self._attempt(lambda: ckpt.begin_checkpoint(self.folder.run_dir, step)), "")
            except GspoError as e:
                made = (None, str(e))
        tmp, error = dist_utils.gather_objects(made, self.dctx)[0]
        if tmp is None:
            raise GspoError(error)
        try:
            saved = self._attempt(lambda: sharded_ckpt.save(self.trainer.policy, self.trainer.optimizer, tmp))
            own = {  # the files DCP's writer gave this rank (__<rank>_<n>.distcp)
                f.relative_to(tmp).as_posix(): ckpt.file_entry(f)
                for f in sorted((tmp / DCP_DIR).glob(f"__{self.rank}_*.distcp"))
            }
            known = {k: v for part in dist_utils.gather_objects(own, self.dctx) for k, v in part.items()}
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp, {"dcp": saved}, known

    def _attempt(self, write: Callable[[], Any]) -> Any:
        """``write()``; a failure to write (e.g. a full disk) is one line naming what is kept."""
        import torch.distributed.checkpoint as dcp

        try:
            return write()
        except Exception as e:
            why = ckpt.write_failure(e)
            if why is None and isinstance(e, dcp.api.CheckpointException):
                why = (str(e).splitlines() or [type(e).__name__])[0]
            if why is None:
                raise
            last = self.state.last_saved
            kept = f"step {last}" if last >= 0 else "none"
            raise GspoError(
                f"cannot write checkpoint step {self.state.step} under {self.folder.run_dir}/checkpoints "
                f"({ckpt.free_space(self.folder.run_dir)}): {why}; the last complete checkpoint is kept ({kept})"
            ) from None

    def savable(self) -> tuple[nn.Module, dict[str, torch.Tensor] | None]:
        """What rank 0 writes as the HF folder (collective): the trained module, with the full state
        dict gathered from the shards when distributed (PEFT merges a LoRA model's adapters itself)."""
        from gspo.model.lora import is_peft

        hf = self.trainer.hf
        if is_peft(hf) and self.world > 1 and not dist_utils._is_fsdp(self.trainer.policy):
            return hf, None  # DDP: every rank holds the whole PEFT model, which merges a copy
        return hf, dist_utils.full_state_dict(self.trainer.policy, self.dctx)

    def close(self) -> None:
        """End the sampler process (if any) and release the run folder."""
        try:
            self.sampler.close()
        finally:
            ckpt.unlock_run_dir(self.folder.lock)
            self.folder.lock = None


def _check_finite(policy: nn.Module, step: int, last_saved: int, dctx: dist_utils.DistContext) -> None:
    """Refuse to checkpoint non-finite weights (a diverged run keeps its last good checkpoint).
    Collective: each rank checks the values it holds (its local shards, whatever their placement:
    sharded, replicated, gathered or empty) and every rank refuses when any rank found one."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in policy.parameters() if p.requires_grad]
    local = [p.detach() for p in local if p.numel()]
    bad = bool(local) and not bool(torch.stack([p.isfinite().all() for p in local]).all())
    if dist_utils.any_rank(bad, dctx):
        where = f"the last good checkpoint is step {last_saved}" if last_saved >= 0 else "nothing was saved"
        raise GspoError(
            f"weights are not finite after step {step} (lr too high?); {where} (lower 'lr' / 'sft_lr')"
        )


def save_hf(
    model: Any,
    tokenizer: Any,
    path: Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """HF folder loadable by ``from_pretrained``; with LoRA the adapters are merged in (the merged
    copy cast to ``dtype``, if given) and also kept on their own under ``adapter/`` (for resuming
    and for PEFT users)."""
    from gspo.model.lora import is_peft, merged_copy

    if is_peft(model) and state_dict is not None:  # FSDP2-sharded: merged from the gathered weights
        merged = _merged_lora_state(model, state_dict)
        if dtype is not None:
            merged = {k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.items()}
        model.get_base_model().save_pretrained(path, safe_serialization=True, state_dict=merged)
        tokenizer.save_pretrained(path)
        model.save_pretrained(Path(path) / "adapter", state_dict=state_dict)
        return
    if is_peft(model):
        merged = merged_copy(model)
        save_pretrained(merged if dtype is None else merged.to(dtype), tokenizer, path)
        model.save_pretrained(Path(path) / "adapter")
        return
    if state_dict is not None:
        model.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(path)
    else:
        save_pretrained(model, tokenizer, path)


def make_optimizer(
    model: nn.Module, plan: OptimPlan
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters and a linear-warmup LR schedule."""
    # fused AdamW at every world size: one kernel for all parameters instead of a Python loop (5% of a
    # tiny-model step); FSDP2's sharded parameters (DTensors) take it as plain tensors do
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=plan.lr,
        betas=(plan.adam_beta1, plan.adam_beta2),
        weight_decay=plan.weight_decay,
        fused=True,
    )
    warm = max(plan.warmup_steps, 1)  # lr x (s + 1) / warm over the first warm steps, then lr
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1 / warm, 1.0, total_iters=warm - 1)
    return optimizer, scheduler


def _merged_lora_state(model: Any, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PEFT model's gathered state dict ``sd`` as the plain model's, each adapted weight merged
    (``W + scaling * B @ A`` over the active adapters, as PEFT's ``merge_and_unload``): an FSDP2-sharded
    PEFT model cannot be copied to merge in place."""
    modules = dict(model.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        if ".lora_" in name:
            continue
        if name.endswith(".base_layer.weight"):
            prefix = name.removesuffix(".base_layer.weight")
            layer = modules[prefix]
            delta = sum(
                (sd[f"{prefix}.lora_B.{a}.weight"].float() @ sd[f"{prefix}.lora_A.{a}.weight"].float())
                * layer.scaling[a]
                for a in layer.active_adapters
            )
            w = w + (delta.T if getattr(layer, "fan_in_fan_out", False) else delta).to(w.dtype)
        out[name.removeprefix("base_model.model.").replace(".base_layer.", ".")] = w
    return out
