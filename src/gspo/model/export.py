"""Hugging Face folders written one decoder layer at a time: no process holds the whole model.

* :func:`hf_checkpoint_weights`: the trainer's weights named and laid out as ``save_pretrained``
  writes them, produced a layer at a time (FSDP2 shards gathered per layer). The vLLM weight sync and
  the final export both stream from it.
* :func:`write_safetensors`: ``(name, tensor)`` pairs into ``model.safetensors`` (or numbered shards
  with ``model.safetensors.index.json``, as ``save_pretrained`` names them), a shard's worth held at a
  time.
* :func:`save_streamed`: a ``from_pretrained``-loadable folder from a (sharded) training model.
* :func:`export_dcp`: the same folder from a sharded (``torch.distributed.checkpoint``) checkpoint, in
  one process without a process group, reading one layer's tensors at a time.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from gspo.compat import transformers_model
from gspo.errors import GspoError, one_line
from gspo.model.unwrap import POLICY_PREFIX, full_tensor, is_peft

#: the largest safetensors file written (``save_pretrained``'s default, 5 GB)
MAX_SHARD_BYTES = 5 * 10**9
#: where a sharded checkpoint keeps its DCP files, and the key its model state is saved under
DCP_DIR = "dcp"
DCP_MODEL_KEY = "model"

_LAYER_KEY = re.compile(r"^(.*?\blayers\.\d+)\.")


def layer_groups(names: Iterable[str]) -> list[list[str]]:
    """``names`` (state-dict order) grouped: the weights before the first decoder layer, each layer's,
    then the weights after the last one."""
    groups: dict[str, list[str]] = {}
    seen_layer = False
    for k in names:
        m = _LAYER_KEY.match(k)
        seen_layer = seen_layer or m is not None
        groups.setdefault(m.group(1) if m else (" tail" if seen_layer else " head"), []).append(k)
    tail = groups.pop(" tail", None)
    return [*groups.values(), *([tail] if tail else [])]


def hf_checkpoint_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs as ``save_pretrained`` would write them (the names and layouts vLLM's
    loaders expect), produced one decoder layer at a time: the conversion of a layer's weights is
    computed when the consumer asks for them, so the extra memory is about one layer's converted
    tensors (unconverted tensors are the live parameters themselves, detached, no copy).

    Weights outside the decoder layers (embeddings, final norm, LM head) come first and last, in the
    state dict's order. On FSDP2 shards this is a collective: every rank iterates it to the end.
    """
    if is_peft(model):
        raise GspoError(
            "config field 'rollout_engine': vLLM rollouts with LoRA (lora_rank > 0) are not supported"
        )
    sd = transformers_model.save_state_dict(model)
    for names in layer_groups(sd):
        group = {k: full_tensor(sd[k].detach()) for k in names}  # a DTensor shard gathered, per layer
        yield from transformers_model.revert_weight_conversion(model, group).items()


def write_safetensors(
    weights: Iterable[tuple[str, torch.Tensor]], folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[Path]:
    """Write ``weights`` as ``save_pretrained`` lays them out, holding at most one shard (plus the
    tensor being added) in memory. Returns the files written."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[Path, list[str]]] = []
    pending: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            path = folder / f"model-part-{len(parts):05d}.tmp"
            save_file(pending, str(path), metadata={"format": "pt"})
            parts.append((path, list(pending)))
        pending, size = {}, 0

    for name, t in weights:
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > max_shard_bytes:
            flush()
        pending[name] = t.detach().to("cpu").contiguous()
        size, total = size + nbytes, total + nbytes
    flush()
    if len(parts) == 1:
        names = [folder / "model.safetensors"]
    else:
        names = [folder / f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors" for i in range(len(parts))]
    for (tmp, _), final in zip(parts, names, strict=True):
        os.replace(tmp, final)
    if len(parts) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {
                k: final.name for (_, keys), final in zip(parts, names, strict=True) for k in keys
            },
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return names


def save_config_and_tokenizer(
    model: Any, tokenizer: Any, folder: Path, dtype: torch.dtype | None = None
) -> None:
    """Everything of an HF folder but the weights (config, generation config, tokenizer files unless
    ``tokenizer`` is None); ``dtype``: the weights' dtype the config records (default: the model's)."""
    folder.mkdir(parents=True, exist_ok=True)
    trained = model.config.dtype
    model.config.dtype = dtype or trained
    try:
        model.config.save_pretrained(folder)
    finally:
        model.config.dtype = trained
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def save_streamed(model: Any, tokenizer: Any, folder: Path | None, dtype: torch.dtype | None = None) -> None:
    """A ``from_pretrained``-loadable folder of ``model`` (FSDP2 shards or a whole module), gathered
    and written one decoder layer at a time (collective: every rank calls it; the rank passing a
    ``folder`` writes, the others only take part in the gathers); floating weights cast to ``dtype``
    one tensor at a time (default: as they are)."""
    weights = hf_checkpoint_weights(model)
    if folder is None:
        for _ in weights:
            pass
        return
    if dtype is not None:
        weights = ((k, v.to(dtype) if v.is_floating_point() else v) for k, v in weights)
    save_config_and_tokenizer(model, tokenizer, folder, dtype)
    write_safetensors(weights, folder)


#: the files of which at least one makes a folder hold a tokenizer ``AutoTokenizer`` can load
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _read_config(step_dir: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(step_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:  # unknown model_type, bad JSON
        why = one_line(e, typed=False)
        raise GspoError(f"{step_dir}/config.json cannot be read as a transformers config: {why}") from None


def _read_tokenizer(step_dir: Path, required: bool) -> Any:
    from transformers import AutoTokenizer

    if not any((step_dir / f).is_file() for f in TOKENIZER_FILES):
        if required:
            raise GspoError(
                f"{step_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); pass --no-tokenizer "
                "to export the weights and config alone"
            )
        return None
    try:
        return AutoTokenizer.from_pretrained(step_dir)
    except Exception as e:  # noqa: BLE001 (any damaged tokenizer file)
        raise GspoError(f"{step_dir}: its tokenizer cannot be loaded ({one_line(e)})") from None


# ------------------------------------------------------------------------------------------------
# reading a sharded checkpoint (gspo.training.checkpoint_files writes them)


# a failed write as torch.save's zip writer and safetensors report it (not OSErrors): "[enforce fail
# at inline_container.cc:672] . unexpected pos ...", "PytorchStreamWriter failed writing file ...";
# safetensors names the OS error: "Error while serializing: I/O error: No space left on device (os
# error 28)" (0.5+), "Error while serializing: IoError(Os { code: 28, kind: StorageFull, ... })"
_WRITER_ERRORS = ("inline_container", "PytorchStreamWriter")
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)|IoError\(Os \{ code: (\d+)")


def write_failure(e: BaseException) -> str | None:
    """Why writing weights or a checkpoint failed, in one line, when ``e`` is the disk's doing (a full
    disk, a quota, an I/O error: an OSError, or a writer's error wrapping one, here or in what raised
    it); None for anything else."""
    for err in (e, e.__cause__, e.__context__):
        if not isinstance(err, Exception):
            continue
        text = str(err).strip()
        code = _OS_ERROR_CODE.search(text)
        number = (
            err.errno if isinstance(err, OSError) else int(code.group(1) or code.group(2)) if code else None
        )
        writer = not isinstance(err, OSError) and any(w in text for w in _WRITER_ERRORS)
        # torch's zip writer says only "unexpected pos" when a write stops at the file-size limit
        limit = _file_size_limit() if number == errno.EFBIG or writer else None
        if limit:
            return f"a file reached the file-size limit of {limit:,} bytes (ulimit -f; raise it: ulimit -f unlimited)"
        if isinstance(err, OSError):
            return err.strerror or one_line(err, typed=False)
        if code:
            return os.strerror(int(code.group(1) or code.group(2)))
        if writer:
            return one_line(err, typed=False)
    return None


def _file_size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``: a write past it fails with EFBIG, as
    Python ignores SIGXFSZ), None when there is none."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def failure(e: BaseException) -> str:
    """One line for a failed DCP load: the first rank's own error (not torch's traceback dump)."""
    import torch.distributed.checkpoint as dcp

    if isinstance(e, dcp.api.CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    return one_line(e)


def read_index(step_dir: Path) -> Any:
    """The DCP index (``Metadata``) of the sharded checkpoint ``step_dir``; :class:`GspoError` naming
    the file when it cannot be read safely."""
    from gspo.compat.torch_dcp import SafeReader

    try:
        return SafeReader(step_dir / DCP_DIR).read_metadata()
    except Exception as e:  # noqa: BLE001 (garbage, a truncated file or a planted callable: damaged)
        raise GspoError(f"{step_dir}/{DCP_DIR}/.metadata cannot be read safely ({failure(e)})") from None


def check_dcp(step_dir: Path) -> str:
    """Why the shards of ``step_dir`` cannot be loaded ("" when every piece its index names is on disk):
    the index unreadable, a rank's shard missing or shorter than the index says."""
    try:
        index = read_index(step_dir)
    except GspoError as e:
        return str(e).removeprefix(f"{step_dir}/")
    need: dict[str, int] = {}
    try:
        for info in index.storage_data.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    except (AttributeError, TypeError) as e:
        return f"{DCP_DIR}/.metadata is no DCP index of shards ({type(e).__name__})"
    for name, size in sorted(need.items()):
        f = step_dir / DCP_DIR / name
        if not f.is_file():
            return f"{DCP_DIR}/{name} is missing (a rank's shard)"
        if f.stat().st_size < size:
            return f"{DCP_DIR}/{name} has {f.stat().st_size} bytes, its index needs {size} (truncated?)"
    return ""


def export_dcp(step_dir: Path, out: Path, tokenizer: bool = True) -> list[Path]:
    """Turn a sharded checkpoint (``step_dir/dcp``, any world size) into an HF folder at ``out``, in
    this process, reading one decoder layer's tensors at a time. Written into a sibling folder renamed
    to ``out`` at the end (removed on failure: nothing half-written). Returns the weight files."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from gspo.compat.torch_dcp import SafePlanner, SafeReader

    why = check_dcp(step_dir)
    if why:
        raise GspoError(f"{step_dir}: {why}")
    stored = read_index(step_dir).state_dict_metadata
    config = _read_config(step_dir)
    tok = _read_tokenizer(step_dir, tokenizer)
    with torch.device("meta"):  # names, tied weights and the save-time conversion; no memory
        model = AutoModelForCausalLM.from_config(config)
    names = list(transformers_model.save_state_dict(model))
    prefix = f"{DCP_MODEL_KEY}.{POLICY_PREFIX}"
    missing = [k for k in names if prefix + k not in stored]
    if missing:
        raise GspoError(
            f"{step_dir}/{DCP_DIR}: the checkpoint has no weight {missing[0]!r} of {config.model_type}"
        )
    reader = SafeReader(step_dir / DCP_DIR)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for group in layer_groups(names):
            sd = {}
            for k in group:
                md = stored[prefix + k]
                sd[POLICY_PREFIX + k] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            try:
                dcp.load({DCP_MODEL_KEY: sd}, storage_reader=reader, planner=SafePlanner(), no_dist=True)
            except (Exception, dcp.api.CheckpointException) as e:  # bytes damaged under a matching manifest
                raise GspoError(
                    f"{step_dir}/{DCP_DIR}: the weights of {group[0]!r} cannot be read ({failure(e)})"
                ) from None
            yield from transformers_model.revert_weight_conversion(
                model, {k.removeprefix(POLICY_PREFIX): v for k, v in sd.items()}
            ).items()

    def write(tmp: Path) -> list[Path]:
        save_config_and_tokenizer(model, tok, tmp)
        return write_safetensors(weights(), tmp)

    return _write_atomically(out, write)


def _write_atomically(out: Path, write: Any) -> list[Path]:
    """``write(tmp)`` into a new sibling of ``out``, renamed to ``out`` when it returns (``out``: absent
    or an empty folder); on any failure the sibling is removed. Returns the files, named under ``out``."""
    import shutil
    import tempfile

    made = next((p for p in reversed(out.parents) if not p.exists() and not p.is_symlink()), None)
    try:  # the folders above it, as ``save_pretrained`` would make them (removed again on failure)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise GspoError(f"--out {out}: cannot create a folder in {out.parent}: {e.strerror or e}") from None
    try:
        files = write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a folder save_pretrained makes is not
        os.replace(tmp, out)  # replaces an empty folder
    except BaseException as e:
        shutil.rmtree(made or tmp, ignore_errors=True)
        why = write_failure(e)  # a full disk: an OSError, or the safetensors writer's error
        if why is not None:
            raise GspoError(f"--out {out}: cannot write it: {why}") from None
        raise
    return [out / f.name for f in files]
