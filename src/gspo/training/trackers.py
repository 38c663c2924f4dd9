"""Experiment trackers: where a run's scalars, resolved config and curves go besides ``metrics.jsonl``.

``report_to`` names them (``tensorboard,wandb``); each is one :class:`Tracker` subclass here, which
imports its package only when chosen. All are local-first: TensorBoard writes the run folder, W&B
honours ``WANDB_MODE=offline`` and ``WANDB_DIR``, trackio keeps its SQLite store in ``TRACKIO_DIR``,
MLflow writes to ``MLFLOW_TRACKING_URI`` (by default its own ``sqlite:///mlflow.db`` in the current
folder). Every tracker gets the scalars TensorBoard gets (finite numbers only), the resolved config,
and the run folder's PNG curves when the run ends.

A tracker that stops taking data mid-run (its store full, read-only or gone, or its writer failing)
is one line on stderr naming it, and is no longer called; the run and ``metrics.jsonl`` go on. Some
fail silently (W&B's offline writer loses what it cannot write; trackio's flush thread only warns),
so after each call gspo also checks the tracker's local store itself (:func:`store_problem`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from gspo.errors import GspoError, one_line


class TrackerStopped(Exception):
    """A tracker no longer takes data; the message says why, in one line."""


class Tracker:
    """One experiment tracker. ``name``: its word in ``report_to``; ``module``: the package it
    imports; ``extra``: the ``gspo[...]`` extra that installs it (None: a core dependency).

    Subclasses write in ``_log`` / ``_log_image`` / ``_close``; :meth:`log`, :meth:`log_image` and
    :meth:`close` raise :class:`TrackerStopped` once the tracker stops taking data: its own error
    (named by its root cause), a failure its background writer reported (``failed``), or its local
    ``store`` full, read-only or gone."""

    name: ClassVar[str]
    module: ClassVar[str]
    extra: ClassVar[str | None] = None
    store: Path | None = None  # the local folder its data goes to (None: none, e.g. a server)
    failed: str | None = None  # set by the tracker's own writer thread when a write failed
    stopped = False  # it raised TrackerStopped: only its closing is left

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None) -> None:
        raise NotImplementedError

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._checked(lambda: self._log(step, scalars))

    def log_image(self, key: str, path: Path, step: int) -> None:
        self._checked(lambda: self._log_image(key, path, step))

    def close(self) -> None:
        self._checked(self._close)

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def _log_image(self, key: str, path: Path, step: int) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def quiet(self) -> contextlib.AbstractContextManager[None]:
        """Around each call: what keeps the package's own report of an error it raises to us quiet."""
        return contextlib.nullcontext()

    def _checked(self, call: Callable[[], None]) -> None:
        try:
            with self.quiet():
                call()
        except Exception as e:
            self.stopped = True
            raise TrackerStopped(root_cause(e)) from None
        why = self.failed or store_problem(self.store)
        if why:
            self.stopped = True
            raise TrackerStopped(why)


def root_cause(e: BaseException) -> str:
    """The innermost error ``e`` was raised from, in one line (a database's "disk is full", not the
    wrapper's "raised as a result of Query-invoked autoflush")."""
    seen = {id(e)}
    while (nxt := e.__cause__ or (None if e.__suppress_context__ else e.__context__)) and id(nxt) not in seen:
        seen.add(id(nxt))
        e = nxt
    return one_line(e, 200, typed=not isinstance(e, OSError))


def store_problem(store: Path | None) -> str | None:
    """Why a tracker's local ``store`` folder can take no more data (None when it can): unreachable, on
    a read-only or full filesystem (for root, whose writes use the blocks reserved for it, no free block
    at all), or, for another user, not writable. A store not made yet is judged by the folder above."""
    if store is None:
        return None
    probe = store
    while not probe.exists() and probe.parent != probe:  # a store made at its first write (trackio's)
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError as e:
        return f"its store {store} cannot be reached ({e.strerror})"
    if st.f_flag & os.ST_RDONLY:
        return f"its store {store} is on a read-only filesystem"
    root = os.geteuid() == 0
    if st.f_blocks and not (st.f_bfree if root else st.f_bavail):  # f_blocks 0: a size-less filesystem
        return f"its store {store} is full (no space left on device)"
    if not root and not os.access(probe, os.W_OK | os.X_OK):
        return f"its store {store} is not writable"
    return None


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
        self.store = run_dir / "tensorboard"
        _quiet_tensorboard_threads()
        self.tb = SummaryWriter(str(self.store), purge_step=purge)
        if config:
            import yaml

            text = yaml.safe_dump(config, sort_keys=False)  # indented: a code block in TB's markdown
            self.tb.add_text("config", "".join("    " + ln + "\n" for ln in text.splitlines()), purge or 0)
        # each write waits for TensorBoard's thread: a run folder removed after an error never meets
        # a write still queued there (a traceback from that thread after gspo's one line)
        self.tb.flush()

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, step)
        self.tb.flush()  # raises what the writer thread met (a full disk): the one line names it

    def _log_image(self, key: str, path: Path, step: int) -> None:
        import matplotlib.image

        self.tb.add_image(key, matplotlib.image.imread(path)[..., :3], step, dataformats="HWC")

    def _close(self) -> None:
        try:
            self.tb.flush()
        finally:
            with contextlib.suppress(Exception):  # the same error again (its thread already died of it)
                self.tb.close()


def _quiet_tensorboard_threads() -> None:
    """TensorBoard's event writer thread dies of a failed write (a full disk) with a traceback on
    stderr, and the writer raises the same error at its next flush, which gspo reports in one line:
    the thread's own traceback (threading.excepthook) is left out, other threads' are not."""
    previous = threading.excepthook
    if getattr(previous, "gspo_tensorboard", False):
        return

    def hook(args: Any) -> None:
        module = type(args.thread).__module__ if args.thread is not None else ""
        if not (module.startswith("tensorboard.") and issubclass(args.exc_type, Exception)):
            previous(args)

    hook.gspo_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class WandB(Tracker):
    """A W&B run named after the run folder, in ``WANDB_PROJECT`` (default ``gspo``); W&B's own
    variables apply (``WANDB_MODE=offline``, ``WANDB_DIR``, ``WANDB_RUN_ID`` + ``WANDB_RESUME``)."""

    name, module, extra = "wandb", "wandb", "wandb"

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None) -> None:
        import wandb

        self.wandb = wandb
        # W&B's own settings, unless the user set them (WANDB_QUIET, WANDB_CONSOLE): no end-of-run
        # summary tables, and no capture of the process's console (copying every stderr line into
        # its store, where a full disk turned into a line of noise per line)
        quiet = {"quiet": True} if "WANDB_QUIET" not in os.environ else {}
        console = {"console": "off"} if "WANDB_CONSOLE" not in os.environ else {}
        settings = wandb.Settings(**quiet, **console)
        with contextlib.redirect_stdout(sys.stderr):  # its notices: stdout stays gspo's
            self.run = wandb.init(
                project=_project("WANDB_PROJECT"), name=run_dir.name, config=config, settings=settings
            )
        self.store = Path(self.run.dir)  # the run's files; its .wandb log is beside them

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def _log_image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self.wandb.Image(str(path))}, step=step)

    def _close(self) -> None:
        with contextlib.redirect_stdout(sys.stderr):  # "You can sync this run ...": a notice
            self.run.finish()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Once its store has failed, W&B's own log file (debug.log, in that store) fails each record
        with a "--- Logging error ---" traceback on stderr: its loggers are held to CRITICAL while it
        is closed (gspo's one line has said why)."""
        if not self.stopped:
            yield
            return
        with _held("wandb"):
            yield


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
        self.store = Path(trackio.utils.TRACKIO_DIR)
        _TRACKIO_OPEN[self.run.name] = self
        _catch_trackio_failures()

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def _log_image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self.trackio.Image(str(path))}, step=step)

    def _close(self) -> None:
        try:
            with contextlib.redirect_stdout(sys.stderr):
                self.trackio.finish()  # the current run (ours), which its exit hook then leaves alone
        finally:
            _TRACKIO_OPEN.pop(self.run.name, None)


# the open trackio trackers by run name: its flush thread reports a failed write only as a warning
# naming the run ("trackio failed to flush metric logs for run 'NAME': ..."), data lost
_TRACKIO_OPEN: dict[str, Trackio] = {}
_TRACKIO_FAILURE = re.compile(r"trackio failed to (.*?) for run '(.*)': (.*?)\. User code will continue")


def _catch_trackio_failures() -> None:
    """Turn trackio's warning of a failed flush into its tracker's ``failed`` (gspo's one line at its
    next call) instead of a warning among the run's output; every other warning is shown as before."""
    previous = warnings.showwarning
    if getattr(previous, "gspo_trackio", False):
        return

    def show(message: Any, category: Any, filename: str, lineno: int, *args: Any, **kwargs: Any) -> None:
        found = _TRACKIO_FAILURE.match(str(message))
        tracker = _TRACKIO_OPEN.get(found.group(2)) if found else None
        if tracker is None or found is None:
            previous(message, category, filename, lineno, *args, **kwargs)
        elif tracker.failed is None:
            tracker.failed = f"{found.group(1)} failed: {found.group(3)}"

    show.gspo_trackio = True  # type: ignore[attr-defined]
    warnings.showwarning = show


class MLflow(Tracker):
    """An MLflow run named after the run folder, in experiment ``MLFLOW_EXPERIMENT_NAME`` (default
    ``gspo``) at ``MLFLOW_TRACKING_URI``. Config fields are params (and ``config.yaml`` an artifact),
    the curves artifacts. Through a client, not the fluent API: a caller's active run is left alone."""

    name, module, extra = "mlflow", "mlflow", "mlflow"

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = client = MlflowClient()
        self.store = _mlflow_store(client.tracking_uri)
        experiment = _project("MLFLOW_EXPERIMENT_NAME")
        found = client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else client.create_experiment(experiment)
        self.run_id = client.create_run(exp_id, run_name=run_dir.name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in config.items()]  # MLflow's longest param value
        client.log_batch(self.run_id, params=params)  # the client splits it into MLflow's batch limits
        client.log_dict(self.run_id, config, "config.yaml")

    def _log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def _log_image(self, key: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def _close(self) -> None:
        self.client.set_terminated(self.run_id)

    def quiet(self) -> contextlib.AbstractContextManager[None]:
        """MLflow logs a database error with its whole traceback (~300 lines) before raising it to
        us: its loggers are held to CRITICAL for the call (the error still reaches gspo's one line)."""
        return _held("mlflow")


@contextlib.contextmanager
def _held(name: str) -> Iterator[None]:
    """Logger ``name`` (and its children that set no level of their own) at CRITICAL for a while."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _mlflow_store(uri: str) -> Path | None:
    """The local folder of an MLflow tracking URI (its sqlite database's, or its file store), None for
    a server."""
    from urllib.parse import urlparse

    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :]).resolve().parent
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path).resolve()
    return None


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (TensorBoard, WandB, Trackio, MLflow)}


def tracker_names(report_to: str, wandb: bool = False) -> list[str]:
    """The trackers ``report_to`` names (comma- or space-separated, case ignored, ``none``: only
    metrics.jsonl), with wandb added by the older ``wandb`` switch; unknown names raise ValueError."""
    words = [w for w in re.split(r"[,\s]+", report_to.lower()) if w]
    if not words:  # an empty value is a mistake (an unset shell variable), not a quiet "none"
        raise ValueError(f"is empty: name trackers ({', '.join(TRACKERS)}) or none (metrics.jsonl alone)")
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
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 (a package whose import calls sys.exit is broken too)
        fix = f"pip install 'gspo[{tracker.extra}]'" if tracker.extra else "reinstall gspo"
        if isinstance(e, ImportError) and getattr(e, "name", None) == tracker.module:
            return f"{name} is not installed ({fix})"
        if isinstance(e, SystemExit):
            return f"{name} cannot be imported (its import called sys.exit({e.code!r:.40}); {fix})"
        return f"{name} cannot be imported ({one_line(e)}; {fix})"
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
            raise GspoError(f"report_to {name}: cannot start: {one_line(e, 300, typed=False)}") from None
    return started


def close_all(trackers: list[Tracker]) -> None:
    """Close every tracker, each even if one before it fails; one that fails (or whose store turns
    out to be full) is one line on stderr naming it: the run is done, and metrics.jsonl has it all."""
    for t in trackers:
        try:
            t.close()
        except Exception as e:
            why = str(e) if isinstance(e, TrackerStopped) else root_cause(e)
            print(
                f"gspo: report_to {t.name}: {why}; its last data may be missing", file=sys.stderr, flush=True
            )
