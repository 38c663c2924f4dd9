"""Experiment trackers: where a run's scalars, resolved config and curves go besides ``metrics.jsonl``.

``report_to`` names them (``tensorboard,wandb``); each is one :class:`Tracker` subclass here, which
imports its package only when chosen. All are local-first: TensorBoard writes the run folder, W&B
honours ``WANDB_MODE=offline`` and ``WANDB_DIR``, trackio keeps its SQLite store in ``TRACKIO_DIR``,
MLflow writes to ``MLFLOW_TRACKING_URI`` (by default its own ``sqlite:///mlflow.db`` in the current
folder). Every tracker gets the scalars TensorBoard gets (finite numbers only), the resolved config,
and the run folder's PNG curves when the run ends.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from gspo.errors import GspoError


class Tracker:
    """One experiment tracker. ``name``: its word in ``report_to``; ``module``: the package it
    imports; ``extra``: the ``gspo[...]`` extra that installs it (None: a core dependency)."""

    name: ClassVar[str]
    module: ClassVar[str]
    extra: ClassVar[str | None] = None

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None) -> None:
        raise NotImplementedError

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def log_image(self, key: str, path: Path, step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _project(env: str) -> str:
    """The project (W&B, trackio) or experiment (MLflow) runs are grouped under: the tracker's own
    environment variable, else ``gspo``."""
    return os.environ.get(env) or "gspo"


class TensorBoard(Tracker):
    """``<run>/tensorboard``; on resume, the steps after the checkpoint are purged (the curves never
    show the lost segment twice). The config is a text entry, the curves image entries."""

    name, module = "tensorboard", "tensorboard"

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1
        self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)
        if config:
            import yaml

            text = yaml.safe_dump(config, sort_keys=False)  # indented: a code block in TB's markdown
            self.tb.add_text("config", "".join("    " + ln + "\n" for ln in text.splitlines()), purge or 0)
        # each write waits for TensorBoard's thread: a run folder removed after an error never meets
        # a write still queued there (a traceback from that thread after gspo's one line)
        self.tb.flush()

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def log_image(self, key: str, path: Path, step: int) -> None:
        import matplotlib.image

        self.tb.add_image(key, matplotlib.image.imread(path)[..., :3], step, dataformats="HWC")

    def close(self) -> None:
        self.tb.flush()
        self.tb.close()


class WandB(Tracker):
    """A W&B run named after the run folder, in ``WANDB_PROJECT`` (default ``gspo``); W&B's own
    variables apply (``WANDB_MODE=offline``, ``WANDB_DIR``, ``WANDB_RUN_ID`` + ``WANDB_RESUME``)."""

    name, module, extra = "wandb", "wandb", "wandb"

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=_project("WANDB_PROJECT"), name=run_dir.name, config=config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self.wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio(Tracker):
    """A trackio run named after the run folder, in project ``TRACKIO_PROJECT`` (default ``gspo``),
    stored locally in ``TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``) unless
    ``TRACKIO_SPACE_ID`` names a Space. trackio's notices go to stderr: stdout stays gspo's."""

    name, module, extra = "trackio", "trackio", "trackio"

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None) -> None:
        import trackio

        self.trackio = trackio
        with contextlib.redirect_stdout(sys.stderr):
            self.run = trackio.init(project=_project("TRACKIO_PROJECT"), name=run_dir.name, config=config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self.trackio.Image(str(path))}, step=step)

    def close(self) -> None:
        with contextlib.redirect_stdout(sys.stderr):
            self.trackio.finish()  # the current run (ours), which its exit hook then leaves alone


class MLflow(Tracker):
    """An MLflow run named after the run folder, in experiment ``MLFLOW_EXPERIMENT_NAME`` (default
    ``gspo``) at ``MLFLOW_TRACKING_URI``. Config fields are params (and ``config.yaml`` an artifact),
    the curves artifacts. Through a client, not the fluent API: a caller's active run is left alone."""

    name, module, extra = "mlflow", "mlflow", "mlflow"

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = client = MlflowClient()
        experiment = _project("MLFLOW_EXPERIMENT_NAME")
        found = client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else client.create_experiment(experiment)
        self.run_id = client.create_run(exp_id, run_name=run_dir.name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in config.items()]  # MLflow's longest param value
        client.log_batch(self.run_id, params=params)  # the client splits it into MLflow's batch limits
        client.log_dict(self.run_id, config, "config.yaml")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (TensorBoard, WandB, Trackio, MLflow)}


def tracker_names(report_to: str, wandb: bool = False) -> list[str]:
    """The trackers ``report_to`` names (comma- or space-separated, case ignored, ``none``: only
    metrics.jsonl), with wandb added by the older ``wandb`` switch; unknown names raise ValueError."""
    words = [w for w in re.split(r"[,\s]+", report_to.lower()) if w]
    unknown = [w for w in words if w not in TRACKERS and w != "none"]
    if unknown:
        raise ValueError(f"unknown tracker '{unknown[0]}': names are {', '.join(TRACKERS)} or none")
    if "none" in words and len(words) > 1:
        raise ValueError("'none' cannot be combined with trackers")
    names = [w for w in TRACKERS if w in words or (w == "wandb" and wandb)]  # one order: the table's
    return names


def missing_package(name: str) -> str | None:
    """Why tracker ``name`` cannot run here (its package does not import), with the extra to install;
    None when it can. The import is real: a broken install is caught now, not mid-run."""
    tracker = TRACKERS[name]
    try:
        importlib.import_module(tracker.module)
    except ImportError as e:
        fix = f"pip install 'gspo[{tracker.extra}]'" if tracker.extra else "reinstall gspo"
        if getattr(e, "name", None) == tracker.module:
            return f"{name} is not installed ({fix})"
        return f"{name} cannot be imported ({str(e).splitlines()[0] if str(e) else type(e).__name__}; {fix})"
    return None


def open_trackers(
    names: list[str], run_dir: Path, config: dict[str, Any], resume_step: int | None
) -> list[Tracker]:
    """Start each named tracker; a tracker that fails to start is one line naming it (the ones
    already started are closed)."""
    started: list[Tracker] = []
    for name in names:
        why = missing_package(name)
        try:
            if why:
                raise GspoError(f"config field 'report_to': {why}")
            started.append(TRACKERS[name](run_dir, config, resume_step))
        except Exception as e:
            close_all(started)
            if isinstance(e, GspoError):
                raise
            msg = " ".join(str(e).split())[:300] or type(e).__name__
            raise GspoError(f"report_to {name}: cannot start: {msg}") from None
    return started


def close_all(trackers: list[Tracker]) -> None:
    """Close every tracker, each even if one before it fails (the first error is raised after)."""
    error: BaseException | None = None
    for t in trackers:
        try:
            t.close()
        except Exception as e:
            error = error or e
    if error is not None:
        raise error
