"""Metrics sinks: JSONL (the source of truth), TensorBoard, optional Weights & Biases, a progress line."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from gspo.errors import GspoError


class MetricsLogger:
    """Writes one JSON object per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    On resume, lines after ``resume_step`` are dropped (they belong to work the checkpoint lost) and
    TensorBoard purges the same steps, so curves never show the lost segment twice.
    """

    def __init__(
        self,
        run_dir: Path,
        resume_step: int | None = None,
        use_wandb: bool = False,
        config: dict[str, Any] | None = None,
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            keep = [json.dumps(r) for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_name(self.path.name + ".tmp")  # replaced whole: a kill keeps the old log
            tmp.write_text("".join(k + "\n" for k in keep))
            os.replace(tmp, self.path)
        elif self.path.exists():
            self.path.unlink()
        self.file = self.path.open("a")
        purge = None if resume_step is None else resume_step + 1
        self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)
        self.tb.flush()  # each write waits for TensorBoard's thread: a run folder removed after an
        # error never meets a write still queued there (a traceback from that thread)
        self.wandb = None
        if use_wandb:
            try:
                import wandb
            except ImportError:
                raise GspoError(
                    "config field 'wandb': wandb is not installed (pip install gspo[wandb])"
                ) from None
            self.wandb = wandb.init(project="gspo", name=run_dir.name, config=config, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {
            "step": step,
            **{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()},
        }
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        for k, v in metrics.items():
            if isinstance(v, int | float) and math.isfinite(v):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        self.file.close()
        self.tb.flush()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


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
