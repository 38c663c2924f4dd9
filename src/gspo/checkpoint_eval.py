"""``gspo eval``: greedy held-out evaluation of a saved Hugging Face model folder.

A folder inside a run (``runs/NAME/final``, ``runs/NAME/checkpoints/step-N``) is evaluated on the
run's own task settings, read from ``runs/NAME/config.yaml``; flags override them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, load_yaml
from gspo.config.schema import EVAL_FIELDS
from gspo.errors import GspoError
from gspo.limits import check_resources
from gspo.model.export import DCP_DIR
from gspo.training.checkpoint_files import is_sharded


def run_config_of(path: Path) -> Path | None:
    """``config.yaml`` of the run a model folder belongs to, if any."""
    for d in (path.parent, path.parent.parent):
        if (d / "config.yaml").is_file() and (d / "metrics.jsonl").exists():
            return d / "config.yaml"
    return None


def _saved_file(key: str, v: Any) -> tuple[str, str] | None:
    """``(path, suffix)`` of a config value naming a file by a relative path (``suffix``: ``:attr`` of a
    reward / environment spec, the rest of the value); None for other values."""
    if not isinstance(v, str) or v.startswith(("rg:", "format:")):
        return None
    path, suffix = v, ""
    if key in ("reward", "env"):
        target, sep, attr = v.rpartition(":")
        if not sep or not target or target == "tools":
            return None
        path, suffix = target, f":{attr}"
        if not path.endswith(".py"):  # pkg.mod:attr: the file ./pkg/mod.py when the run had one
            path = path.replace(".", os.sep) + ".py"
    elif "/" not in path and "." not in path:  # an embedded task
        return None
    if os.path.isabs(os.path.expanduser(path)):
        return None
    return path, suffix


def _resolve_saved_paths(
    values: dict[str, Any], run_yaml: Path | None, output_dir: Any, given: dict[str, Any]
) -> None:
    """Relative dataset / reward / environment file paths of a run's config.yaml are relative to the
    folder the run was started from: that folder is ``run_yaml``'s run folder less its
    ``<output_dir>/<name>`` when ``output_dir`` was relative. Made absolute in ``values`` (unless given
    as flags); not there, they are refused in one line naming the setting and the fix, never looked up
    in the current folder instead (another ``env.py`` there would be evaluated silently). A file newer
    than the run's config.yaml is a warning: it may have changed since the run."""
    if run_yaml is None:
        return
    out = Path(str(output_dir or "runs"))
    run_dir = run_yaml.parent
    base = (
        run_dir.parents[len(out.parts)]
        if not out.is_absolute() and len(run_dir.parents) > len(out.parts)
        else None
    )
    for key in ("task", "eval_task", "reward", "env"):
        v = values.get(key)
        found = _saved_file(key, v) if key not in given else None
        if found is None:
            continue
        path, suffix = found
        module = key in ("reward", "env") and not v.rpartition(":")[0].endswith(".py")
        if base is not None and (base / path).exists():
            values[key] = f"{base / path}{suffix}"
            _warn_if_newer(base / path, run_yaml, key)
        elif module:  # an importable module, not a file of the run's folder: imported as the run did
            continue
        elif base is None and os.path.exists(path):  # output_dir was absolute: the start folder is unknown
            values[key] = f"{os.path.abspath(path)}{suffix}"
            _warn_if_newer(Path(path), run_yaml, key)
        else:
            where = f" ({base})" if base is not None else ""
            raise GspoError(
                f"{run_yaml}: {key} {v!r} is relative to the folder the run was started from{where} and is "
                f"not found there: run gspo eval from there, or pass --{key.replace('_', '-')}"
            )


def _warn_if_newer(file: Path, run_yaml: Path, key: str) -> None:
    from gspo.errors import warn

    try:
        newer = file.stat().st_mtime > run_yaml.stat().st_mtime
    except OSError:
        return
    if newer:
        warn(
            f"{key} file {file} was modified after the run's {run_yaml.name}: the score may not be the run's"
        )


def evaluate_checkpoint(path: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load ``path`` with ``from_pretrained`` and report held-out reward / accuracy (greedy decoding)."""
    from gspo.model.load import load_model_and_tokenizer
    from gspo.resolve import capacity_plan, engine_plan, prompt_plan, score_plan, task_plan
    from gspo.rollout.factory import make_engine
    from gspo.tasks import task_from_config
    from gspo.tasks.prompts import encode_prompts
    from gspo.training.scoring import evaluate

    folder = Path(path)
    if not folder.is_dir():
        raise GspoError(f"checkpoint folder not found: {path}")
    if is_sharded(folder):
        raise GspoError(
            f"{path} is a sharded checkpoint (FSDP2, {DCP_DIR}/): write its HF folder with "
            f"`gspo export {path} --out DIR`, then evaluate DIR"
        )
    if not (folder / "config.json").is_file():
        raise GspoError(_not_a_model(folder, path))
    run_yaml = run_config_of(folder.resolve())
    saved = load_yaml(str(run_yaml)) if run_yaml else {}
    values = {k: v for k, v in saved.items() if k in EVAL_FIELDS}
    _resolve_saved_paths(values, run_yaml, saved.get("output_dir"), overrides or {})
    values.update(overrides or {})
    cfg = Config(model=path, **values).validate()
    model, tokenizer = load_model_and_tokenizer(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    check_resources(capacity_plan(cfg), model)
    t = task_from_config(task_plan(cfg))
    engine = make_engine(engine_plan(cfg), model, tokenizer)
    out = evaluate(engine, tokenizer, t, encode_prompts(tokenizer, t.eval, prompt_plan(cfg)), score_plan(cfg))
    settings = str(run_yaml) if run_yaml else "defaults"
    return {"checkpoint": path, "task": cfg.task, "n": len(t.eval), "settings": settings, **out}


def _not_a_model(folder: Path, path: str) -> str:
    """Why ``folder`` (which has no config.json) is not a model folder to evaluate, and what is."""
    from gspo.training.checkpoint_files import FINAL, final_complete, step_folders

    if (folder / "config.yaml").is_file() and (
        (folder / "metrics.jsonl").exists() or (folder / FINAL).exists() or (folder / "checkpoints").exists()
    ):
        if final_complete(folder):
            fix = f"evaluate its final model: gspo eval {folder / FINAL}"
        else:
            steps = step_folders(folder)
            fix = (
                f"it has no final model yet; evaluate a checkpoint: gspo eval {steps[-1]}"
                if steps
                else "it has neither a final model nor a checkpoint yet"
            )
        return f"{path} is a run folder, not a model folder: {fix}"
    return f"{path} is not a Hugging Face model folder: it has no config.json"
