"""Experiment tracking (``--report-to``): every tracker, offline, gets the scalars TensorBoard gets, the
resolved config and the run's curves; a tracker whose package is missing is one line naming the
extra to install, before any weight is read (docs/guides/tracking.md)."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_helpers import env, one_line

from gspo.training.logger import MetricsLogger

RUN = [
    "--steps", "2", "--sft-steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "2",
    "--max-new-tokens", "8", "--eval-every", "1", "--threads", "1", "--no-progress",
]  # fmt: skip


def offline_env(stores: Path) -> dict[str, str]:
    """Every tracker local, its store under ``stores``."""
    return dict(
        env(),
        WANDB_MODE="offline",
        WANDB_DIR=str(stores),
        WANDB_SILENT="true",
        TRACKIO_DIR=str(stores / "trackio"),
        # MLflow's default store, sqlite (its file store, kept in maintenance only, cannot hold both
        # moe/volatility and moe/volatility/layer0: a file cannot be a folder too)
        MLFLOW_TRACKING_URI=f"sqlite:///{stores}/mlflow.db",
    )


def tensorboard_store(run: Path) -> tuple[dict, str, list[str]]:
    """{(tag, step): value} of the run's event file, its config text and image tags."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {(t, e.step): e.value for t in tags["scalars"] for e in acc.Scalars(t)}
    (text,) = acc.Tensors("config/text_summary")
    return scalars, text.tensor_proto.string_val[0].decode(), tags["images"]


def wandb_records(path: Path):
    """The protobuf records of an offline run's ``.wandb`` file (LevelDB's log format: 32 KiB blocks of
    chunks, each a 7-byte header of CRC, length, type; after the file's 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, buf = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def wandb_store(stores: Path) -> tuple[dict, dict, dict]:
    (path,) = stores.glob("wandb/offline-run-*/run-*.wandb")
    scalars, config, images = {}, {}, {}
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            config = {i.key: json.loads(i.value_json) for i in rec.run.config.update}
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            for k, v in row.items():  # an image is a group of keys: curves/_type, curves/path, ...
                if k.endswith("/_type") and v == "image-file":
                    images[k[:-6]] = path.parent / "files" / row[k[:-6] + "/path"]
            for k, v in row.items():
                if not k.startswith("_") and k.split("/")[0] not in images:
                    scalars[(k, row["_step"])] = v
    return scalars, config, images


def trackio_store(stores: Path, name: str, monkeypatch) -> tuple[dict, dict, list]:
    from trackio import sqlite_storage
    from trackio.sqlite_storage import SQLiteStorage

    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", stores / "trackio")  # read at import from the env

    scalars, images = {}, []
    for row in SQLiteStorage.get_logs("gspo", name):
        for k, v in row.items():
            if isinstance(v, dict) and v.get("_type") == "trackio.image":
                images.append(k)
            elif k not in ("step", "timestamp"):
                scalars[(k, row["step"])] = v
    return scalars, SQLiteStorage.get_run_config("gspo", name), images


def mlflow_store(stores: Path, name: str) -> tuple[dict, dict, list[str]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{stores}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("gspo").experiment_id])
    assert run.info.run_name == name and run.info.status == "FINISHED"
    scalars = {
        (k, m.step): m.value for k in run.data.metrics for m in client.get_metric_history(run.info.run_id, k)
    }
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    return scalars, run.data.params, artifacts


def same_scalars(got: dict, want: dict) -> None:
    """The same (key, step) pairs as TensorBoard, values equal to float32 (TB's precision)."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:10]
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-30), k


@pytest.mark.slow
def test_report_to_every_tracker_gets_tensorboards_scalars_config_and_curves(tmp_path, monkeypatch):
    stores, out = tmp_path / "stores", tmp_path / "runs"
    stores.mkdir()
    res = subprocess.run(
        [sys.executable, "-m", "gspo", "train", *RUN, "--output-dir", str(out), "--name", "t"]
        + ["--report-to", "tensorboard,wandb,mlflow,trackio"],
        capture_output=True, text=True, env=offline_env(stores), cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    # stdout stays gspo's own two lines (trackio's and W&B's notices go to stderr)
    assert len(res.stdout.strip().splitlines()) == 2, res.stdout
    run = out / "t"
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["report_to"] == "tensorboard,wandb,mlflow,trackio"

    tb, tb_config, tb_images = tensorboard_store(run)
    steps = {s for _, s in tb}
    assert steps == {0, 1, 2} and ("rollout/reward_mean", 2) in tb and ("eval/accuracy", 0) in tb
    # every finite scalar of metrics.jsonl, and only those, is in TensorBoard
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    jsonl = {(k, r["step"]) for r in rows for k, v in r.items() if k != "step" and v is not None}
    assert set(tb) == jsonl
    assert yaml.safe_load("\n".join(ln[4:] for ln in tb_config.splitlines())) == config
    assert tb_images == ["curves"]

    scalars, wb_config, images = wandb_store(stores)
    same_scalars(scalars, tb)
    assert {k: wb_config[k] for k in config} == config
    assert images["curves"].read_bytes() == (run / "curves.png").read_bytes()

    scalars, tr_config, images = trackio_store(stores, "t", monkeypatch)
    same_scalars(scalars, tb)
    assert {k: tr_config[k] for k in config} == config and images == ["curves"]

    scalars, params, artifacts = mlflow_store(stores, "t")
    same_scalars(scalars, tb)
    assert params == {k: str(v) for k, v in config.items()}
    assert set(artifacts) == {"config.yaml", "curves.png"}
    assert not (tmp_path / "wandb").exists()  # W&B wrote where WANDB_DIR says, not the current folder


@pytest.mark.parametrize(
    "args, package, field",
    [
        (["--report-to", "tensorboard,wandb"], "wandb", "report_to"),
        (["--wandb"], "wandb", "wandb"),  # the older switch: named as given
        (["--report-to", "trackio"], "trackio", "report_to"),
        (["--report-to", "mlflow,tensorboard"], "mlflow", "report_to"),
    ],
)
def test_missing_tracker_package_is_one_line_naming_the_extra(
    tmp_path, capsys, monkeypatch, args, package, field
):
    """The package absent (None in sys.modules: Python's own "not installed" for an import): one line
    naming the field and the extra, exit 2, before the model is read (a model folder that does not
    exist would be the error otherwise) and before the run folder is made."""
    monkeypatch.setitem(sys.modules, package, None)
    out = tmp_path / "runs"
    cmd = ["train", "--model", str(tmp_path / "no-model"), "--output-dir", str(out), *args]
    line = one_line(capsys, cmd, f"config field '{field}': {package} is not installed")
    assert f"pip install 'gspo[{package}]'" in line
    assert not out.exists()


def test_report_to_names(tmp_path, capsys, monkeypatch):
    """Unknown or contradictory names are one line; ``none`` keeps metrics.jsonl alone; the older
    ``wandb`` switch adds wandb to whatever ``report_to`` names."""
    one_line(capsys, ["train", "--report-to", "tensorbaord"], "unknown tracker 'tensorbaord'")
    one_line(capsys, ["train", "--report-to", "none,mlflow"], "'none' cannot be combined")
    for d in ("none", "alias"):
        (tmp_path / d).mkdir()
    logger = MetricsLogger(tmp_path / "none", config={"report_to": "none"})
    logger.log(0, {"a": 1.0})
    logger.close()
    assert not (tmp_path / "none" / "tensorboard").exists()
    assert (tmp_path / "none" / "metrics.jsonl").read_text() == '{"step": 0, "a": 1.0}\n'

    monkeypatch.setenv("WANDB_MODE", "disabled")  # W&B's no-op run: what is asserted is which trackers start
    logger = MetricsLogger(tmp_path / "alias", use_wandb=True, config={"report_to": "tensorboard"})
    assert [t.name for t in logger.trackers] == ["tensorboard", "wandb"]
    logger.close()


def test_a_failing_tracker_is_dropped_with_one_line(tmp_path, capsys, monkeypatch):
    """A tracker that fails mid-run (a lost connection) is dropped with a line on stderr; training and
    metrics.jsonl go on, and the other trackers still get every step."""
    from gspo.training import trackers

    class Broken(trackers.TensorBoard):
        name = "wandb"

        def log(self, step, scalars):
            raise ConnectionError("tracker server gone\n(details)")

    monkeypatch.setitem(trackers.TRACKERS, "wandb", Broken)
    (tmp_path / "r").mkdir()
    logger = MetricsLogger(tmp_path / "r", config={"report_to": "wandb,tensorboard"})
    logger.log(0, {"a": 1.0})
    logger.log(1, {"a": float("nan")})
    assert [t.name for t in logger.trackers] == ["tensorboard"]
    logger.close()
    err = capsys.readouterr().err
    assert err == "gspo: report_to wandb: tracker server gone; no longer logging to it\n"
    assert len((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) == 2


def test_tensorboard_on_resume_purges_only_the_steps_after_the_checkpoint(tmp_path):
    """Issue 57 gap 10: a run logged steps 0-3 and resumes from the checkpoint of step 2: TensorBoard
    drops the lost step 3 (logged again by the resumed run) and keeps step 2's points, which the
    resumed run does not log again."""
    from gspo.training.trackers import TensorBoard

    (tmp_path / "r").mkdir()
    tb = TensorBoard(tmp_path / "r", {"lr": 1e-3}, None)
    for step in range(4):
        tb.log(step, {"a": float(step)})
    tb.close()
    tb = TensorBoard(tmp_path / "r", {"lr": 1e-3}, 2)
    tb.log(3, {"a": 30.0})
    tb.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "r" / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("a")] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]


def test_trackers_started_before_one_that_fails_to_start_are_closed(tmp_path, monkeypatch):
    """Issue 57 gap 10: ``report_to: tensorboard,wandb`` where W&B cannot start (here: raises in its
    constructor): one line naming it, and TensorBoard, already started, is closed (its writer
    flushed and its thread stopped), not left open."""
    from gspo.errors import GspoError
    from gspo.training import trackers

    closed = []

    class Closing(trackers.TensorBoard):
        def close(self):
            closed.append(self.name)
            super().close()

    class FailsToStart(trackers.TensorBoard):
        name = "wandb"

        def __init__(self, run_dir, config, resume_step):
            raise ConnectionError("no server")

    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", Closing)
    monkeypatch.setitem(trackers.TRACKERS, "wandb", FailsToStart)
    (tmp_path / "r").mkdir()
    with pytest.raises(GspoError, match="^report_to wandb: cannot start: no server$"):
        trackers.open_trackers(["tensorboard", "wandb"], tmp_path / "r", {"lr": 1e-3}, None)
    assert closed == ["tensorboard"]
