"""Metrics sinks: JSONL (the source of truth), the experiment trackers (TensorBoard by default, W&B,
trackio, MLflow: :mod:`gspo.training.trackers`), a progress line, the curves' PNG."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gspo.errors import GspoError, one_line
from gspo.repro import write_environment
from gspo.training.trackers import Tracker, close_all, open_trackers, tracker_names


class MetricsLogger:
    """Writes one JSON object per step to ``metrics.jsonl`` and mirrors its finite scalars to the
    trackers ``report_to`` names (:mod:`gspo.training.trackers`; TensorBoard by default).

    On resume, lines after ``resume_step`` are dropped (they belong to work the checkpoint lost) and
    TensorBoard purges the same steps, so curves never show the lost segment twice. ``report_to``
    (None: the config's) and ``use_wandb`` (the older switch, which adds wandb) pick the trackers;
    each gets ``config`` at the start and the run folder's PNG curves written before :meth:`close`.
    """

    def __init__(
        self,
        run_dir: Path,
        resume_step: int | None = None,
        use_wandb: bool = False,
        config: dict[str, Any] | None = None,
        report_to: str | None = None,
    ) -> None:
        config = config or {}
        if report_to is None:
            report_to = config.get("report_to", "tensorboard")
        try:
            names = tracker_names(report_to, use_wandb or bool(config.get("wandb")))
        except ValueError as e:
            raise GspoError(f"config field 'report_to': {e} (got {report_to!r:.80})") from None
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            keep = [json.dumps(r) for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_name(self.path.name + ".tmp")  # replaced whole: a kill keeps the old log
            tmp.write_text("".join(k + "\n" for k in keep))
            os.replace(tmp, self.path)
        elif self.path.exists():
            self.path.unlink()
        self.file = self.path.open("a")
        self.opened, self.last_step = time.time(), resume_step or 0
        # beside the metrics: what decided their bits (versions, threads, kernels, CPU), per session
        write_environment(run_dir, resume_step or 0, config.get("reproducible"))
        try:
            self.trackers = open_trackers(names, run_dir, config, resume_step)
        except BaseException:
            self.file.close()
            raise

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {
            "step": step,
            **{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()},
        }
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        self.last_step = step
        scalars = {k: v for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        self._each(lambda t: t.log(step, scalars))

    def _each(self, call: Callable[[Tracker], None]) -> None:
        """``call`` on every tracker; one that fails is dropped with a line on stderr (metrics.jsonl,
        the source of truth, has the step already: a tracker's outage does not stop training)."""
        for t in list(self.trackers):
            try:
                call(t)
            except Exception as e:
                self.trackers.remove(t)
                with contextlib.suppress(Exception):
                    t.close()
                print(
                    f"gspo: report_to {t.name}: {one_line(e, typed=False)}; no longer logging to it",
                    file=sys.stderr,
                    flush=True,
                )

    def close(self) -> None:
        self.file.close()
        # the curves the run wrote since this logger opened (an earlier process's are not this run's)
        curves = sorted(p for p in self.run_dir.glob("*.png") if p.stat().st_mtime >= self.opened - 1)
        for p in curves:
            self._each(lambda t, p=p: t.log_image(p.stem, p, self.last_step))
        trackers, self.trackers = self.trackers, []
        close_all(trackers)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``. A last line cut short (the process was killed mid-write) is
    dropped; a damaged line elsewhere is an error naming it."""
    lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    rows = []
    for i, ln in enumerate(lines):
        try:
            row = json.loads(ln)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise GspoError(f"{path}: line {i + 1} is not valid JSON (damaged metrics log)") from None
        if not isinstance(row, dict):
            raise GspoError(f"{path}: line {i + 1} is not a JSON object (damaged metrics log)")
        rows.append(row)
    return rows


class Progress:
    """A tqdm bar on a terminal; without one (job logs, CI) tqdm's same status text as one plain line
    every ``every`` steps, so logs stay readable."""

    def __init__(
        self, total: int, label: str, enabled: bool = True, initial: int = 0, every: int = 10
    ) -> None:
        from tqdm.auto import tqdm

        self.enabled, self.every, self.tty = enabled, every, sys.stderr.isatty()
        self.bar = tqdm(
            total=total,
            desc=label,
            initial=initial,
            disable=not (enabled and self.tty),
            file=sys.stderr,
            dynamic_ncols=True,
            leave=True,
        )
        self.label, self.total, self.t0 = label, total, time.time()

    def update(self, done: int, info: str = "") -> None:
        if not self.enabled:
            return
        if self.tty:
            self.bar.set_postfix_str(info, refresh=False)
            self.bar.update(done - self.bar.n)
        elif done % self.every == 0 or done >= self.total:
            line = self.bar.format_meter(
                done, self.total, time.time() - self.t0, prefix=self.label, postfix=info
            )
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()


PLOT_PANELS = [
    ("reward", ["rollout/reward_mean"], "train reward"),
    ("eval", ["eval/accuracy"], "held-out accuracy"),
    ("clip", ["loss/clip_frac_tok", "loss/clip_frac_seq"], "clip fraction"),
    ("entropy", ["rollout/entropy"], "token entropy"),
    ("length", ["rollout/response_len"], "response length"),
    ("volatility", ["moe/volatility"], "expert-activation volatility"),
]


def plot_metrics(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """PNG with one panel per metric group (panels without data are left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (n, [k for k in keys if any(r.get(k) is not None for r in rows)], t) for n, keys, t in PLOT_PANELS
    ]
    panels = [p for p in panels if p[1]]
    if not panels:
        return
    cols = 3
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False)
    for ax, (_, keys, t) in zip(axes.flat, panels, strict=False):
        for k in keys:
            pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 40 else None, label=k)
        ax.set_title(t)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
