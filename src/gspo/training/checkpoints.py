"""The checkpoint manager: the one owner of a run's checkpoints.

:class:`CheckpointManager` claims the run folder (its lock; ``--resume`` / ``--overwrite``), chooses
the checkpoint to resume from (the newest complete one; on N ranks each checksums its share of the
shards), restores a run from it, saves a checkpoint of each finished step (atomic, with a manifest;
sharded over the ranks under FSDP2), prunes the older ones and writes the run's ``final/`` folder.
The files themselves (layout, manifest, lock, shards) are :mod:`gspo.training.checkpoint_files`:
a change to how checkpoints are written touches this module and that one.

It writes the trainer's weights and optimizer itself (their files depend on how they are sharded)
and holds the rest of a checkpoint as the pieces of its :class:`Stateful` parts (the run's position
and generators, the learning-rate schedule, the batches a sampler drew ahead): adding a piece of
state touches the part that owns it. It imports none of them.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from gspo.errors import GspoError, one_line
from gspo.model.export import DCP_DIR, save_config_and_tokenizer, save_streamed
from gspo.model.load import AUTO_DTYPE, save_pretrained
from gspo.model.unwrap import is_peft, unwrap
from gspo.plans import CheckpointPlan
from gspo.training import checkpoint_files as files
from gspo.training import distributed as dist_utils


class Stateful(Protocol):
    """A part of the run whose state a checkpoint holds: its entries of ``trainer_state.pt``."""

    def state_dict(self) -> dict[str, Any]:
        """Its entries (collective: every rank calls it; rank 0's are saved)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take its entries back from a checkpoint's whole state (every rank)."""
        ...


class CheckpointManager:
    """Saves, restores, verifies, prunes and chooses the run's checkpoints and writes ``final/``."""

    def __init__(self, plan: CheckpointPlan, dctx: dist_utils.DistContext | None = None) -> None:
        self.plan, self.dctx = plan, dctx
        self.run_dir = plan.run_dir
        self.sharded = False  # each rank saves its own shards (FSDP2 on N ranks): set by :meth:`attach`
        self.saving = False  # writing a checkpoint (a stop lets it finish)
        self.lock: Any = None  # the run folder's lock (rank 0)
        self.last_saved = -1  # the step of the newest complete checkpoint
        # what it saves, set by :meth:`attach`: the trainer's weights, optimizer and tokenizer, and the
        # parts that keep the rest of a checkpoint (saved and restored in this order)
        self.policy: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.tokenizer: Any = None
        self.parts: tuple[Stateful, ...] = ()
        # the dtype the model's own files store (final/'s under save_dtype auto for a hub id, read
        # from its local snapshot at the start and kept in each checkpoint: a resume asks no hub)
        self.source_dtype: str | None = None

    @property
    def _rank(self) -> int:
        return self.dctx.rank if self.dctx is not None else 0

    def attach(
        self, policy: nn.Module, optimizer: torch.optim.Optimizer, tokenizer: Any, parts: tuple[Stateful, ...]
    ) -> None:
        """The run is built: what every checkpoint saves (sharded when the policy is FSDP2 over N
        ranks)."""
        self.policy, self.optimizer, self.tokenizer, self.parts = policy, optimizer, tokenizer, parts
        self.sharded = files.uses_sharded_checkpoints(policy, self.plan.lora)

    @property
    def _dctx(self) -> dist_utils.DistContext:
        assert self.dctx is not None, "a run's checkpoints know its ranks"
        return self.dctx

    @property
    def _model(self) -> nn.Module:
        """The Hugging Face model being trained (its PEFT wrapper with LoRA)."""
        return unwrap(self.policy, "model")

    # --------------------------------------------------------------------------------------------
    # the run folder: claimed, and the checkpoint to resume from chosen
    def choose(self) -> tuple[Path | None, dict[str, Any] | None, str]:
        """The checkpoint to resume from, its state (None, None for a new run) and the line to show
        about it (rank 0). Rank 0 claims the folder (:meth:`claim`, holding the lock); every rank then
        resumes from the checkpoint it chose, or fails with its error (collective)."""
        dctx = self.dctx
        assert dctx is not None
        path, state, note, error = None, None, "", None
        if dctx.rank == 0:
            try:  # one rank: every file checksummed; N ranks: each its share of the shards (below)
                path, state, note = self.claim(shards=dctx.world_size == 1)
            except GspoError as e:
                error = str(e)
        error, path = dist_utils.gather_objects((error, path), dctx)[0]
        if error is not None:
            raise GspoError(error)
        try:
            if path is not None and dctx.world_size > 1:
                path, state, note = self._verify_shares(path, state, note)
            if path is not None and state is None:  # the other ranks read what rank 0 verified
                state = files.load_trainer_state(path)
        except BaseException:
            self.release()
            raise
        return path, state, note

    def claim(self, shards: bool = True) -> tuple[Path | None, dict[str, Any] | None, str]:
        """Rank 0: lock the run folder (one writer), then pick the newest complete checkpoint to resume
        (``--resume``) or make sure the folder holds no earlier run (``--overwrite`` deletes it). Returns
        the checkpoint and its state (None for a new run) and the line to show about it."""
        run_dir, plan = self.run_dir, self.plan
        if plan.resume and plan.overwrite:
            raise GspoError("--resume and --overwrite exclude each other: continue the run, or start it over")
        if plan.resume and not run_dir.is_dir():
            raise GspoError(f"--resume: no checkpoint found under {run_dir}/checkpoints (no such run folder)")
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise GspoError(f"config field 'output_dir': cannot create {run_dir}: {e.strerror}") from None
        self.lock = files.lock_run_dir(run_dir)
        try:
            return self._claimed(shards)
        except BaseException:
            self.release()
            raise

    def _claimed(self, shards: bool) -> tuple[Path | None, dict[str, Any] | None, str]:
        run_dir = self.run_dir
        if self.plan.resume:
            path, state, skipped = files.newest_complete(run_dir, shards)
            why = f" ({'; '.join(skipped)})" if skipped else ""
            if path is None:
                raise GspoError(
                    f"--resume: no complete checkpoint found under {run_dir}/checkpoints{why}; pass "
                    "--overwrite instead of --resume to start the run over"
                )
            note = f"resuming from {path}" + (f"; skipped newer damaged checkpoints{why}" if skipped else "")
            return path, state, note
        traces = files.run_traces(run_dir)
        if traces and not self.plan.overwrite:
            if not files.step_folders(run_dir):  # stopped before step 0 was saved: nothing to resume
                raise GspoError(
                    f"run folder {run_dir} already holds a run ({', '.join(traces)}) that saved no "
                    "checkpoint (it stopped before step 0), so --resume cannot continue it; pass "
                    "--overwrite to delete it and start over, or --name to start a new run"
                )
            raise GspoError(
                f"run folder {run_dir} already holds checkpoints; pass --resume to continue it, --overwrite "
                "to delete it and start over, or --name to start a new run"
            )
        try:
            files.remove_traces(run_dir)  # --overwrite (nothing to remove otherwise)
        except OSError as e:  # a mount point, a read-only file: said, the rest of the folder as it is
            raise GspoError(
                f"--overwrite: cannot delete {e.filename or run_dir}: {e.strerror or e}; remove it by hand "
                "or pick another --name"
            ) from None
        return None, None, ""

    def _verify_shares(
        self, path: Path, state: dict[str, Any] | None, note: str
    ) -> tuple[Path, dict[str, Any] | None, str]:
        """Every rank checksums its share of the chosen checkpoint's shard files (collective); a damaged
        shard sends every rank to the newest complete checkpoint before it, as rank 0 would alone."""
        dctx, run_dir = self.dctx, self.run_dir
        assert dctx is not None
        skipped: list[str] = []
        while True:
            whys = dist_utils.gather_objects(files.check_share(path, dctx.rank, dctx.world_size), dctx)
            why = next((w for w in whys if w), "")
            if not why:
                break
            skipped.append(f"{path.name}: {why}")
            step = int(path.name.removeprefix("step-"))
            if dctx.rank == 0:
                path, state, more = files.newest_complete(run_dir, shards=False, below=step)
                skipped += more
            path = dist_utils.gather_objects(path, dctx)[0]
            if path is None:
                raise GspoError(
                    f"--resume: no complete checkpoint found under {run_dir}/checkpoints ({'; '.join(skipped)}); "
                    "pass --overwrite instead of --resume to start the run over"
                )
        if skipped and dctx.rank == 0:
            note = f"resuming from {path}; skipped newer damaged checkpoints ({'; '.join(skipped)})"
        return path, state if dctx.rank == 0 else None, note

    def abandon(self, fresh: bool) -> None:
        """A start that failed: a new run that never saved step 0 leaves no trace (so the same command
        can simply be run again); the folder is released."""
        if fresh and self._rank == 0:
            files.remove_traces(self.run_dir)
        self.release()

    def release(self) -> None:
        files.unlock_run_dir(self.lock)
        self.lock = None

    # --------------------------------------------------------------------------------------------
    # weights from a checkpoint (the rest of the run is restored by :meth:`restore`)
    @staticmethod
    def is_sharded(path: Path | None) -> bool:
        return path is not None and files.is_sharded(path)

    def weights_dir(self, resume_from: Path) -> Path:
        """The HF folder a resume's weights come from: a whole-model checkpoint's own, or with LoRA
        the frozen base the adapters apply to (checked against its manifest: no other copy to fall
        back on). A sharded checkpoint's holds its config and tokenizer (its weights: shards)."""
        weights_dir = self.run_dir / "checkpoints" / "lora-base" if self.plan.lora else resume_from
        why = files.check_manifest(weights_dir) if self.plan.lora else ""
        if why:
            raise GspoError(f"--resume: {weights_dir}: {why}; start the run over with --overwrite")
        return weights_dir

    def load_weights(self, model: nn.Module, resume_from: Path) -> None:
        """A whole-model checkpoint's weights (with LoRA: the frozen base the adapters apply to)."""
        from transformers import AutoModelForCausalLM

        # from_pretrained undoes the on-disk layout conversions (e.g. per-expert MoE weights)
        weights_dir = self.weights_dir(resume_from)
        saved = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=next(model.parameters()).dtype)
        model.load_state_dict(saved.state_dict())

    def save_lora_base(self, model: nn.Module, tokenizer: Any) -> None:
        """The frozen base, saved once (rank 0, a new run): checkpoints then hold the adapters only."""
        if self._rank == 0:
            save_pretrained(model, tokenizer, self.run_dir / "checkpoints" / "lora-base")
            files.write_manifest(self.run_dir / "checkpoints" / "lora-base")

    @staticmethod
    def load_adapters(model: nn.Module, resume_from: Path) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(
            model, load_file(str(resume_from / "adapter" / "adapter_model.safetensors"))
        )

    @staticmethod
    def load_shards(
        policy: nn.Module, optimizer: torch.optim.Optimizer, resume_from: Path, state: dict[str, Any]
    ) -> None:
        """A sharded checkpoint's model and optimizer shards (collective; before the sampler takes
        the weights)."""
        files.load_shards(policy, optimizer, resume_from, state["optimizer"]["dcp"])

    def restore(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's state: the optimizer's (a sharded checkpoint's came with the weights,
        which are loaded where the run is built), then each part's, in order."""
        if "dcp" not in state["optimizer"]:
            dist_utils.load_optimizer_state_dict(self.policy, self.optimizer, state["optimizer"], self._dctx)
        for part in self.parts:
            part.load_state_dict(state)
        self.last_saved = state["step"]

    # --------------------------------------------------------------------------------------------
    # saving
    def save(self, step: int) -> None:
        """Checkpoint finished step ``step`` (collective: every rank calls it)."""
        self.saving = True
        try:
            self._save(step)
        finally:
            self.saving = False

    def _save(self, step: int) -> None:
        policy, dctx = self.policy, self._dctx
        # a no-grad forward after the last backward (e.g. the routing-volatility probe) leaves FSDP2's
        # root group unsharded: its parameters are then plain full tensors beside the others' DTensors
        dist_utils.reshard(policy)
        _check_finite(policy, step, self.last_saved, dctx)
        tmp, known = None, None
        if self.sharded:  # each rank writes (and checksums) its shards; rank 0 the rest, as below
            tmp, opt_sd, known = self._save_shards(step)
            write = lambda p: save_config_and_tokenizer(self._model, self.tokenizer, p)  # noqa: E731
        else:
            model, full_sd = savable(policy, dctx)
            opt_sd = dist_utils.optimizer_state_dict(policy, self.optimizer, dctx)
            write = lambda p: save_hf(model, self.tokenizer, p, full_sd)  # noqa: E731
        state = {"optimizer": opt_sd, "config": self.plan.config, "source_dtype": self.source_dtype}
        for part in self.parts:  # after the collectives above, which may draw from the generators
            state |= part.state_dict()
        if dctx.rank == 0:
            keep = self.plan.keep
            save = lambda: files.save_checkpoint(self.run_dir, step, write, state, keep, tmp, known)  # noqa: E731
            self._attempt(step, save)
        self.last_saved = step

    def _save_shards(self, step: int) -> tuple[Path, dict[str, Any], dict[str, Any]]:
        """Every rank writes its model and optimizer shards into the new checkpoint's folder, which
        rank 0 makes, and checksums its own files (collective). Returns the folder, the trainer
        state's optimizer entry and the manifest entries of every rank's shard files."""
        dctx = self._dctx
        made: tuple[Path | None, str] = (None, "")
        if dctx.rank == 0:
            try:
                made = (self._attempt(step, lambda: files.begin_checkpoint(self.run_dir, step)), "")
            except GspoError as e:
                made = (None, str(e))
        tmp, error = dist_utils.gather_objects(made, dctx)[0]
        if tmp is None:
            raise GspoError(error)
        try:
            saved = self._attempt(step, lambda: files.save_shards(self.policy, self.optimizer, tmp))
            own = {  # the files DCP's writer gave this rank (__<rank>_<n>.distcp)
                f.relative_to(tmp).as_posix(): files.file_entry(f)
                for f in sorted((tmp / DCP_DIR).glob(f"__{dctx.rank}_*.distcp"))
            }
            known = {k: v for part in dist_utils.gather_objects(own, dctx) for k, v in part.items()}
        except BaseException:
            if dctx.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp, {"dcp": saved}, known

    def _attempt(self, step: int, write: Callable[[], Any]) -> Any:
        """``write()``; a failure to write (e.g. a full disk) is one line naming what is kept."""
        import torch.distributed.checkpoint as dcp

        try:
            return write()
        except Exception as e:
            why = files.write_failure(e)
            if why is None and isinstance(e, dcp.api.CheckpointException):
                why = one_line(e, typed=False)
            if why is None:
                raise
            kept = f"step {self.last_saved}" if self.last_saved >= 0 else "none"
            raise GspoError(
                f"cannot write checkpoint step {step} under {self.run_dir}/checkpoints "
                f"({files.free_space(self.run_dir)}): {why}; the last complete checkpoint is kept ({kept})"
            ) from None

    def write_final(self, save_dtype: str | None) -> Path | None:
        """The run's ``final/`` HF folder, in ``save_dtype`` if given (collective; rank 0 writes it
        beside and renames it: a ``final/`` is complete, or absent). Returns it on rank 0."""
        hf, tokenizer, rank = self._model, self.tokenizer, self._dctx.rank
        if save_dtype == AUTO_DTYPE:  # a hub id's stored dtype, known once its files were local
            save_dtype = self.source_dtype
        dtype = getattr(torch, save_dtype) if save_dtype else None
        if dtype == next(hf.parameters()).dtype:
            dtype = None  # saved as trained
        if self.sharded or (dtype is not None and not is_peft(hf)):
            # gathered, cast and written one decoder layer at a time (collective)
            dist_utils.reshard(self.policy)
            write = lambda p: save_streamed(hf, tokenizer, p, dtype)  # noqa: E731
            if rank != 0:
                save_streamed(hf, tokenizer, None, dtype)  # the gathers only
        else:
            model, final_sd = savable(self.policy, self._dctx)  # collective
            write = lambda p: save_hf(model, tokenizer, p, final_sd, dtype)  # noqa: E731
        if rank != 0:
            return None
        return files.write_final(self.run_dir, write, self.last_saved)

    def say(self, note: str) -> None:
        if note and self._rank == 0:
            print(f"gspo: {note}", file=sys.stderr, flush=True)


def savable(
    policy: nn.Module, dctx: dist_utils.DistContext
) -> tuple[nn.Module, dict[str, torch.Tensor] | None]:
    """What rank 0 writes as the HF folder (collective): the trained module, with the full state
    dict gathered from the shards when distributed (PEFT merges a LoRA model's adapters itself)."""
    hf = unwrap(policy, "model")
    if is_peft(hf) and dctx.world_size > 1 and not dist_utils.is_fsdp(policy):
        return hf, None  # DDP: every rank holds the whole PEFT model, which merges a copy
    return hf, dist_utils.full_state_dict(policy, dctx)


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
    from gspo.model.lora import merged_copy

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
