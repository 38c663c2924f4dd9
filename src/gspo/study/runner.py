"""Running a study: every (variant, seed) of a preset from one supervised warm start per seed.

Per seed the warm start runs once (:func:`warm_start_job`, through the same :func:`gspo.training.sft.load_start`
and :func:`gspo.training.sft.warm_start_run` as ``gspo train``) and every variant starts RL from that
model, so the variants differ only in the RL algorithm. Runs go to a pool of worker processes
(spawned, one torch thread each); finished runs are reused, unfinished ones resume.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo.compat.process_pool import kill_workers
from gspo.config import Config, make_config
from gspo.errors import GspoError
from gspo.procs import die_with_parent
from gspo.study.binding import STEERING, resolved_settings, run_record, study_values
from gspo.study.folders import claim_folder
from gspo.study.metrics import Criteria
from gspo.study.presets import RUN_RECORD, VARIANTS, Preset, load_preset
from gspo.study.report import write_report
from gspo.study.warm import WARM_FIELDS, warm_start_folder, warm_start_job

__all__ = ["plan_run", "run_compare", "warm_start_folder", "warm_start_job"]

# config fields that steer a run but do not change what it computes: a finished run with other
# values of these is still reused
_STEERING = STEERING


def _train_job(cfg: Config) -> tuple[str, float, float | None, float | None]:
    """Train one (variant, seed) run; returns ``(name, seconds, initial acc, final acc)``."""
    from gspo.launch import train

    t0 = time.time()
    res = train(cfg)
    shutil.rmtree(cfg.run_dir / "checkpoints", ignore_errors=True)  # finished: final/ and metrics stay
    return cfg.run_name, time.time() - t0, res.initial_accuracy, res.final_accuracy


def _saved_config(cfg: Config) -> dict[str, Any] | None:
    """The run folder's config.yaml when it is a gspo run of this comparison (a mapping naming this
    run and an algorithm); None for anything else (a user's folder, an unreadable file)."""
    from gspo.config.parse import read_yaml

    try:
        saved, _ = read_yaml(cfg.run_dir / "config.yaml")
    except GspoError:
        return None
    if not isinstance(saved, dict) or saved.get("name") != cfg.run_name or "algo" not in saved:
        return None
    return saved


def _differs(cfg: Config, saved: dict[str, Any]) -> str | None:
    """The first setting the run folder's saved config has otherwise than ``cfg`` ("key: old, now new";
    settings that only steer the run are ignored; a field the saved config lacks, added by a newer
    gspo, counts as its default); None when they agree."""
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    for k, v in cfg.to_dict().items():
        if k not in _STEERING and saved.get(k, defaults.get(k)) != v:
            return f"{k}: {saved.get(k)!r}, now {v!r}"
    return None


def plan_run(cfg: Config, overwrite: bool = False) -> Config | None:
    """What to run for ``cfg`` in its folder; deletes nothing itself. None when a finished run with
    the same settings is there (reused); an unfinished one continues from its newest complete
    checkpoint (``resume``) or, interrupted before its first, starts over. A run made with other
    settings is refused, or with ``overwrite`` started over (``gspo train --overwrite`` removes only
    what a run writes). Anything else there (a file, a folder that is not this comparison's run) is
    refused and left as it is."""
    from gspo.training.checkpoint_files import LOCK, final_complete, newest_complete

    run = cfg.run_dir
    if not run.exists() and not run.is_symlink():
        return cfg
    if not run.is_dir():
        raise GspoError(f"{run} exists and is not a folder; move it away or pass another --out")
    if all(p.name in (RUN_RECORD, LOCK) for p in run.iterdir()):  # empty, or stopped before train wrote
        return cfg
    saved = _saved_config(cfg)
    if saved is None:
        raise GspoError(
            f"{run} is not a run of this comparison (no gspo config.yaml naming {cfg.run_name}); gspo "
            "compare neither writes into nor deletes it: move it away or pass another --out"
        )
    finished = final_complete(run)
    damaged = _damaged_weights(run / "final") if finished else ""
    if damaged and not overwrite:  # never reused as "done already": its weights are not the run's
        raise GspoError(
            f"{run} is a finished run whose final model is damaged ({damaged}); pass --overwrite to train "
            "it again (its checkpoints and metrics are deleted), or another --out"
        )
    diff = _differs(cfg, saved) or damaged
    if diff and not overwrite:
        raise GspoError(
            f"{run} is {'a finished' if finished else 'an unfinished'} run made with other settings "
            f"({diff}); pass --overwrite to start it over (its checkpoints and metrics are deleted), or "
            "another --out"
        )
    if diff or (not finished and newest_complete(run)[0] is None):
        return dataclasses.replace(cfg, overwrite=True)
    return None if finished else dataclasses.replace(cfg, resume=True)


def _damaged_weights(final: Path) -> str:
    """Why a safetensors file of ``final`` is not whole ("" when each is): its header must parse
    and the file must end exactly where the header's last tensor does (a file cut short, or grown,
    is damaged). Reads the headers only."""
    import struct

    for f in sorted(final.glob("*.safetensors")):
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > size - 8:
                    return f"{f.name}: {size:,} bytes, shorter than its header says"
                header = json.loads(fh.read(n))
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        except (OSError, struct.error, ValueError, TypeError, KeyError, IndexError) as e:
            return f"{f.name}: its header cannot be read ({type(e).__name__})"
        want = 8 + n + max(ends, default=0)
        if size != want:
            return f"{f.name}: {size:,} bytes, its header says {want:,} (truncated?)"
    return ""


def out_folder(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as a folder to write into, created if need be; a one-line GspoError when it is a
    file, lies under a file or cannot be created."""
    out = Path(path)
    above = next((a for a in (out, *out.parents) if a.exists() or a.is_symlink()), None)
    if above is not None and not above.is_dir():
        where = "is" if above == out else f"lies under {above}, which is"
        raise GspoError(f"{flag} {out}: {where} not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GspoError(f"{flag} {out}: cannot create the folder ({e.strerror or e})") from None
    return out


def run_compare(
    config_path: str | None,
    overrides: dict[str, Any],
    seeds: list[int] | None = None,
    variants: list[str] | None = None,
    out_dir: str | None = None,
    preset: str | None = None,
    workers: int = 1,
    ci: str = "t",
    criteria: Criteria | None = None,
    command: str | None = None,
    warm_target: float | None = None,
    warm_dir: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Train every (variant, seed) from one warm start per seed, then write the report; returns its path.

    Config values: defaults <- ``reproducible: true`` <- ``preset``'s config <- ``config_path`` YAML <-
    ``overrides``. Seeds and variants default to the preset's (without a preset: seeds 0-4, all four
    variants). ``workers`` processes run side by side (each with one torch thread unless ``threads``
    is set); reproducible runs always train in spawned workers (:func:`gspo.repro.pin` needs a
    process whose kernels have not run yet), never in this one.
    ``warm_target`` (default: the preset's): warm start each seed until this greedy accuracy on
    held-out-like prompts, at most ``sft_steps`` steps (see :func:`warm_start_job`). Warm starts are
    kept under ``warm_dir`` (default ``<out>/../warm-starts``) and shared by compares that need the
    same one. A run folder in ``out`` made with other settings is refused, or with ``overwrite``
    started over; one that is not this comparison's run is always refused (:func:`plan_run`)."""
    p = load_preset(preset) if preset else Preset(name="custom")
    seeds = list(p.seeds if seeds is None else seeds)
    variants = list(p.variants if variants is None else variants)
    target = p.warm_target if warm_target is None else warm_target
    _check_args(seeds, variants, workers, target, p.settings())
    base = _base_config(p, config_path, overrides, workers)
    out = out_folder(out_dir or f"runs/compare-{p.name}")
    warm_path = out_folder(warm_dir, "--warm-dir") if warm_dir else out.parent / "warm-starts"
    if command is None:
        command = _command_line(p, config_path, overrides, seeds, variants, out, workers, warm_target)
    changed = _changed(p, _base_config(p, None, {}, workers), base, variants, target)
    record = run_record(p, seeds, changed, resolved_settings(p, base, variants, target))
    jobs = Jobs(base, seeds, variants, out, target, warm_path, overwrite, record=record, arms=p.arms)
    jobs.check_folders()  # every run folder before any training: a refusal costs no work
    claim_folder(out, "compare")  # nor a report file the comparison did not write
    t_start = time.time()
    load = _LoadSampler()
    with _continue_hint(command):
        if workers == 1 and not base.reproducible:
            _run_serial(jobs)
        else:
            _run_pool(jobs, workers)
    load.stop()
    (out / "warm_starts.json").write_text(json.dumps(jobs.warm_folders, indent=1))
    _write_timing(out, jobs.timing, time.time() - t_start, workers, load.mean(), command)
    return write_report(out, variants, seeds, base, preset=p, ci=ci, criteria=criteria or Criteria())


def _changed(
    p: Preset, declared: Config, base: Config, variants: list[str], target: float | None
) -> dict[str, dict[str, Any]]:
    """Every setting this compare runs otherwise than the preset declares (name -> {declared, used}):
    config values (those that only steer a run aside), the variants and the warm-start target."""
    was, now = declared.to_dict(), base.to_dict()
    out = {
        k: {"declared": was.get(k), "used": v}
        for k, v in now.items()
        if k not in _STEERING and was.get(k) != v
    }
    if variants != p.variants:
        out["variants"] = {"declared": p.variants, "used": variants}
    if target != p.warm_target:
        out["warm_target"] = {"declared": p.warm_target, "used": target}
    return out


def _check_args(
    seeds: list[int], variants: list[str], workers: int, target: float | None, known: dict[str, Any]
) -> None:
    unknown = [v for v in variants if v not in known]
    if unknown:
        raise GspoError(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    if not seeds or not variants:
        raise GspoError("--seeds and --variants must name at least one each")
    if len(set(seeds)) != len(seeds):
        raise GspoError(f"--seeds: repeated seed in {seeds}")
    if workers < 1:
        raise GspoError(f"--workers: must be >= 1 (got {workers})")
    if target is not None and not 0 < target <= 1:
        raise GspoError(f"--warm-target: must be in (0, 1] (got {target})")


def _base_config(p: Preset, config_path: str | None, overrides: dict[str, Any], workers: int) -> Config:
    from gspo.config import load_yaml

    values = study_values(p)  # studies pin their kernels unless told otherwise
    if config_path:
        values |= load_yaml(config_path)
    values |= overrides
    base = make_config(None, values)
    if workers > 1:  # side-by-side processes: one thread each, no interleaved progress bars
        base = dataclasses.replace(base, threads=base.threads or 1, progress=False)
    return base


@dataclass
class Jobs:
    """What a compare runs, and what it has run (seconds per job, warm-start folder per seed)."""

    base: Config
    seeds: list[int]
    variants: list[str]
    out: Path
    target: float | None
    warm_dir: Path
    overwrite: bool = False
    record: dict[str, Any] = field(default_factory=dict)  # what the runs are run for (run_record)
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)  # the preset's own variants
    timing: dict[str, float] = field(default_factory=dict)
    warm_folders: dict[str, str | None] = field(default_factory=dict)

    def run_cfg(self, v: str, seed: int, warm: str | None) -> Config:
        kw = dict(name=f"{v}-s{seed}", output_dir=str(self.out), seed=seed, **(VARIANTS | self.arms)[v])
        if warm is not None:
            kw.update(model=warm, sft_steps=0)
            if self.base.tokenizer is None:
                kw.update(tokenizer=warm)
        return dataclasses.replace(self.base, **kw).validate()

    def check_folders(self) -> None:
        """:func:`plan_run` on every (variant, seed) with the warm-start folder it will have."""
        for seed in self.seeds:
            for key, base in self.groups().items():
                warm = None if base.sft_steps == 0 else str(self.warm_folder(seed, key))
                for v in self.group_variants(key):
                    plan_run(self.run_cfg(v, seed, warm), self.overwrite)

    def _key(self, v: str) -> str:
        """The warm-start settings variant ``v``'s arm changes (its own model...); "" for none."""
        arm = (VARIANTS | self.arms)[v]
        return ",".join(f"{k}={arm[k]}" for k in sorted(arm) if k in WARM_FIELDS)

    def groups(self) -> dict[str, Config]:
        """Warm-start settings -> the base config of the variants that share one warm start per seed
        (an arm on another model gets its own, from that model)."""
        out: dict[str, Config] = {}
        for v in self.variants:
            key = self._key(v)
            arm = (VARIANTS | self.arms)[v]
            out.setdefault(
                key, dataclasses.replace(self.base, **{k: arm[k] for k in arm if k in WARM_FIELDS})
            )
        return out

    def group_variants(self, key: str) -> list[str]:
        return [v for v in self.variants if self._key(v) == key]

    def warm_folder(self, seed: int, key: str = "") -> Path:
        return warm_start_folder(self.groups().get(key, self.base), seed, self.target, self.warm_dir)

    def warm_done(self, seed: int, warm: str | None, dt: float, key: str = "") -> list[Config]:
        """Record a seed's warm start (of the variants of warm-start settings ``key``); the runs of
        that seed and group still to train."""
        name = f"{seed}" + (f":{key}" if key else "")
        self.timing[f"warm-start-s{name}"] = dt
        self.warm_folders[name] = warm
        todo = []
        for v in self.group_variants(key):
            cfg = plan_run(self.run_cfg(v, seed, warm), self.overwrite)
            if cfg is None:
                print(f"[compare] {v} seed {seed}: done already, reusing {self.out / f'{v}-s{seed}'}")
            else:
                prepare_run(cfg, self.record)
                todo.append(cfg)
        return todo


def prepare_run(cfg: Config, record: dict[str, Any]) -> None:
    """Before ``cfg`` trains: its folder's :data:`RUN_RECORD` (the preset's hash, endpoints, family,
    declaring commit, gspo's commit) with the start time. A resumed run keeps the record of its first
    start (its earliest data came from then); one that never had a record gets none."""
    path = cfg.run_dir / RUN_RECORD
    if cfg.resume:
        return
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    now = time.time()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
    tmp = path.with_name(f"{RUN_RECORD}.tmp{os.getpid()}")
    try:
        tmp.write_text(
            json.dumps({**record, "run": cfg.run_name, "started_at": now, "started": started}, indent=1)
        )
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise GspoError(f"{path}: cannot record the run's declaration ({e.strerror or e})") from None


def _write_timing(
    out: Path, timing: dict[str, float], wall: float, workers: int, load: float | None, command: str
) -> None:
    """timing.json: wall time summed over the sessions that trained something, per-job seconds."""
    timing_file = out / "timing.json"
    old = json.loads(timing_file.read_text()) if timing_file.exists() else {}
    sessions = old.get("sessions", [])
    if sum(timing.values()) > 0:  # this call trained something: it counts toward the wall time
        sessions.append({"wall_s": wall, "workers": workers, "mean_load_1min": load})
    loads = [x["mean_load_1min"] for x in sessions if x["mean_load_1min"]]
    record = {
        "wall_s": sum(x["wall_s"] for x in sessions),
        "workers": workers,
        "mean_load_1min": statistics.fmean(loads) if loads else None,
        "cpus": os.cpu_count(),
        "sessions": sessions,
        "jobs_s": {**old.get("jobs_s", {}), **{k: v for k, v in timing.items() if v > 0}},
        "command": command,
    }
    timing_file.write_text(json.dumps(record, indent=1))


class _LoadSampler:
    """The 1-minute load average every 20 s while the compare runs (others' jobs on a shared machine
    slow it: the report states the load next to the wall time)."""

    def __init__(self) -> None:
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(20.0):
            try:
                self.samples.append(os.getloadavg()[0])
            except OSError:
                return

    def stop(self) -> None:
        self._stop.set()

    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None


def _run_serial(jobs: Jobs) -> None:
    """One seed after the other in this process: its warm start, then its runs."""
    for seed in jobs.seeds:
        for key, base in jobs.groups().items():
            _, warm, dt = warm_start_job(base, seed, jobs.out, jobs.target, jobs.warm_dir)
            _train_all(jobs, jobs.warm_done(seed, warm, dt, key))


def _train_all(jobs: Jobs, todo: list[Config]) -> None:
    for cfg in todo:
        print(f"[compare] {cfg.run_name} -> {cfg.run_dir}", flush=True)
        name, dt, _, _ = _train_job(cfg)
        jobs.timing[name] = dt


def _run_pool(jobs: Jobs, workers: int) -> None:
    """Warm starts first, then each seed's runs as soon as its warm start is there; ``workers``
    processes (spawned: a clean torch in each)."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ex = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=mp.get_context("spawn"),
        initializer=die_with_parent,  # a worker is killed when the compare dies, even by kill -9
        initargs=(signal.SIGKILL, os.getpid()),
    )
    warm_args = (jobs.out, jobs.target, jobs.warm_dir)
    try:
        pending = {
            ex.submit(warm_start_job, base, s, *warm_args): f"warm:{key}"
            for s in jobs.seeds
            for key, base in jobs.groups().items()
        }
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                kind = pending.pop(fut)
                res = fut.result()  # re-raises a worker's GspoError here
                if kind.startswith("warm:"):
                    seed, warm, dt = res
                    if dt:
                        print(f"[compare] warm start seed {seed}: {dt:.0f} s", flush=True)
                    for cfg in jobs.warm_done(seed, warm, dt, kind.removeprefix("warm:")):
                        pending[ex.submit(_train_job, cfg)] = "train"
                else:
                    name, dt, a0, a1 = res
                    jobs.timing[name] = dt
                    acc = f"held-out acc {a0:.3f} -> {a1:.3f}" if a0 is not None and a1 is not None else ""
                    print(f"[compare] {name}: {dt:.0f} s {acc}", flush=True)
    except BaseException:
        # a Ctrl-C, SIGTERM or a failed run: end the workers now (an unfinished run continues from its
        # last checkpoint next time); the resource tracker exits once they are gone
        kill_workers(ex)
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    ex.shutdown(wait=True)


@contextmanager
def _continue_hint(command: str) -> Iterator[None]:
    """SIGTERM stops the compare like Ctrl-C; either way the message names the command that continues it."""
    import threading

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, on_term) if main else None
    again = (
        "run the same command again (finished runs are reused, unfinished ones go on from their last "
        "checkpoint)"
    )
    try:
        yield
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"finished runs are kept; to continue, {again}: {command}") from None
    except GspoError as e:  # a run's own hint names `gspo train`'s flags, which compare sets itself
        msg = str(e).replace("continue with --resume", f"to continue, {again}")
        raise GspoError(msg.replace("pick another --name", "pass another --out")) from None
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _command_line(p: Preset, config_path, overrides, seeds, variants, out, workers, warm_target) -> str:  # noqa: ANN001
    parts = ["gspo", "compare"]
    if p.path is not None:
        parts += ["--preset", p.name]
    if config_path:
        parts += ["--config", config_path]
    if seeds != p.seeds:
        parts += ["--seeds", ",".join(map(str, seeds))]
    if variants != p.variants:
        parts += ["--variants", ",".join(variants)]
    if warm_target is not None:
        parts += ["--warm-target", str(warm_target)]
    parts += ["--out", str(out), "--workers", str(workers)]
    for k, v in overrides.items():
        parts += [f"--{k.replace('_', '-')}", str(v)]
    return shlex.join(parts)
