"""``gspo`` command line: train, compare, eval. Errors in user input print one line, no traceback."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import typing
from pathlib import Path
from typing import Any

from gspo.config import Config, field_docs, field_type, parse_values
from gspo.errors import GspoError

#: short flags of config fields (besides the long ``--field-name``) that ``gspo train`` takes
ALIASES: dict[str, tuple[str, ...]] = {"expert_parallel_size": ("--ep",)}


def _add_config_flags(
    parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), aliases: bool = False
) -> None:
    docs = field_docs()
    for f in dataclasses.fields(Config):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        flags = (flag, *(ALIASES.get(f.name, ()) if aliases else ()))
        typ = field_type(f.name)
        default = f.default
        help_ = f"{docs.get(f.name, '')} [default: {default}]".replace("%", "%%")
        if typ is bool:
            parser.add_argument(
                *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_
            )
        else:
            parser.add_argument(*flags, dest=f.name, default=None, metavar=typ.__name__.upper(), help=help_)


def _overrides(ns: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The config flags given (not None), converted like YAML values: one parsing path for both."""
    names = {f.name for f in dataclasses.fields(Config)} - set(skip)
    return parse_values({k: v for k, v in vars(ns).items() if k in names and v is not None}, "command line")


def _given_flags(ns: argparse.Namespace, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The config flags given, as ``gspo train`` takes them (``--ep 8`` as --expert-parallel-size 8)."""
    out: list[str] = []
    for f in dataclasses.fields(Config):
        v = getattr(ns, f.name, None)
        if f.name in skip or v is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        out += [flag if v else "--no-" + flag[2:]] if isinstance(v, bool) else [flag, str(v)]
    return tuple(out)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, exit 2, like GspoError
        self.exit(2, f"gspo: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        # argparse reports a subcommand's unknown flags from the top parser: name the subcommand's help
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            sub = self._subcommands.get(getattr(ns, "command", None), self)
            sub.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns

    _subcommands: dict[str | None, argparse.ArgumentParser] = {}


def _version() -> str:
    """The installed distribution's version; the package's own when run from a source tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gspo")
    except PackageNotFoundError:
        from gspo import __version__

        return __version__


def _add_plan_parser(sub: Any) -> None:
    pl = sub.add_parser(
        "plan",
        help="per-GPU memory of a run before it starts, and whether it fits",
        description="Estimate each GPU's memory (weights, gradients, AdamW, activations, sampler, weight "
        "sync) for a model, a world size and the training settings, without loading any weight, and the "
        "bytes each rank sends per micro-batch and per step with their time (over --nodes, with and "
        "without --ep). The "
        "model: an embedded one, a local HF folder, or a hub id whose numbers gspo ships. Exit 2 when "
        "it does not fit.",
    )
    pl.add_argument("--config", help="YAML file of config keys (flags given here override it)")
    pl.add_argument(
        "--gpus",
        type=int,
        help="GPUs (ranks) on one node [default: 8]; past one node: --nodes, --gpus-per-node",
    )
    pl.add_argument("--nodes", type=int, default=1, help="nodes, each started by torchrun [default: 1]")
    pl.add_argument(
        "--gpus-per-node",
        type=int,
        help="ranks on each node (torchrun's --nproc_per_node); needed with --nodes > 1",
    )
    pl.add_argument(
        "--tp", dest="vllm_tensor_parallel_size", metavar="INT",
        help="vllm_tensor_parallel_size: ranks of one vLLM instance, on one node",
    )  # fmt: skip
    from gspo.capacity_comm import INTER_GBPS, INTRA_GBPS

    pl.add_argument(
        "--intra-gbps", type=float, default=INTRA_GBPS, help="within a node, Gb/s (1e9 bits/s) per GPU and "
        f"direction [default: {INTRA_GBPS:g}: NVLink 4 of H100/H200, 900 GB/s both ways = 450 GB/s each way]",
    )  # fmt: skip
    pl.add_argument(
        "--inter-gbps", type=float, default=INTER_GBPS, help="across nodes, Gb/s per GPU and direction "
        f"[default: {INTER_GBPS:g}: one 400 Gb/s NDR InfiniBand NIC per GPU, 50 GB/s]",
    )  # fmt: skip
    pl.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="memory of one GPU in GiB, as torch.cuda and nvidia-smi report it",
    )
    pl.add_argument("--gpu-memory-gb", type=float, help="memory of one GPU in GB (1e9 bytes) [default: 80]")
    _add_config_flags(pl, skip=("nproc",), aliases=True)  # --ep


def _add_export_parser(sub: Any) -> None:
    x = sub.add_parser(
        "export",
        help="turn a sharded checkpoint into a Hugging Face folder",
        description="Write the HF folder (safetensors, config, tokenizer; loadable by from_pretrained) of a "
        "sharded checkpoint (runs/NAME/checkpoints/step-N written by FSDP2 on several ranks), reading one "
        "decoder layer at a time, in one process.",
    )
    x.add_argument("checkpoint", help="a sharded checkpoint folder (runs/NAME/checkpoints/step-N)")
    x.add_argument("--out", required=True, help="the HF folder to write (must not exist, or be empty)")
    x.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="export the weights and config of a checkpoint that has no tokenizer files (refused otherwise)",
    )


def _add_compare_parser(sub: Any) -> None:
    c = sub.add_parser(
        "compare",
        help="GSPO vs GSPO-token vs GRPO vs GRPO+Routing Replay over seeds, with CIs and a report",
        description="Run each algorithm on the same seeds from one warm start per seed, then write "
        "report.md (means and 95% CIs over seeds, paired differences, the paper's claims with "
        "verdicts from the CIs), plots with confidence bands, summary.json and per_seed.csv. "
        "Values: preset <- --config YAML <- flags.",
    )
    from gspo.study.presets import list_presets

    c.add_argument(
        "--preset",
        default="default",
        help=f"named regime ({', '.join(list_presets())}) or a preset YAML file [default: default]",
    )
    c.add_argument("--config", help="YAML file of base config keys (over the preset's)")
    c.add_argument("--seeds", default=None, help="comma-separated seeds [default: the preset's, 0-4]")
    c.add_argument(
        "--variants",
        default=None,
        help="comma-separated: gspo, gspo_token, grpo, grpo_replay [default: the preset's]",
    )
    c.add_argument("--out", default=None, help="output folder [default: runs/compare-<preset>]")
    c.add_argument(
        "--workers", type=int, default=2, help="runs side by side, one torch thread each [default: 2]"
    )
    c.add_argument("--ci", default="t", choices=["t", "bootstrap"], help="95%% CI method [default: t]")
    c.add_argument(
        "--warm-target",
        type=float,
        default=None,
        help="warm start each seed until this greedy accuracy on 200 held-out-like prompts (checked "
        "every 10 steps), at most --sft-steps [default: the preset's]",
    )
    c.add_argument(
        "--warm-dir",
        default=None,
        help="folder of warm starts, shared by compares with the same warm-start settings "
        "[default: <out>/../warm-starts]",
    )
    c.add_argument(
        "--study",
        default=None,
        metavar="DIRS",
        help="instead of training: combine these comma-separated compare folders into one "
        "cross-regime report in --out",
    )
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="start over the runs in --out made with other settings (their checkpoints and metrics are "
        "deleted); without it they are refused. A folder that is not a run of this comparison is never touched",
    )
    _add_config_flags(c, skip=("name", "output_dir", "seed", "algo", "routing_replay", "resume", "overwrite"))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gspo", description="GSPO reinforcement-learning post-training for causal LMs.")
    parser.add_argument("--version", action="version", version=f"gspo {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser._subcommands = sub.choices  # type: ignore[assignment]

    p = sub.add_parser(
        "train",
        help="train a policy (default: embedded tiny MoE on a synthetic task)",
        description="Train with GSPO / GSPO-token / GRPO. Flags override the YAML config.",
    )
    p.add_argument("--config", help="YAML file of config keys (flags given here override it)")
    _add_config_flags(p, aliases=True)

    _add_compare_parser(sub)
    _add_plan_parser(sub)
    _add_export_parser(sub)

    e = sub.add_parser(
        "eval",
        help="greedy held-out evaluation of a checkpoint",
        description="Evaluate a saved model (HF folder) on a task's held-out set.",
    )
    e.add_argument("checkpoint", help="HF model folder (e.g. runs/NAME/final)")
    from gspo.config.schema import EVAL_FIELDS

    _add_config_flags(e, skip=tuple(f.name for f in dataclasses.fields(Config) if f.name not in EVAL_FIELDS))
    return parser


def _launch_torchrun(nproc: int) -> int:
    """Re-run this command under torchrun with ``nproc`` processes (``--nproc`` dropped)."""
    args, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        args.append(a)
    # the workers learn the process count from WORLD_SIZE: torchrun rejects a trailing --nproc as ambiguous
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "gspo",
        *args,
    ]
    from gspo.procs import die_with_parent

    env = dict(os.environ, GSPO_LAUNCHED="1")
    # torchrun sets this itself when unset, and says so in a banner around a rank's one-line error
    env.setdefault("OMP_NUM_THREADS", "1")
    # own session: a terminal Ctrl-C reaches this launcher only, which passes one SIGTERM on (torchrun
    # hands it to every rank: they checkpoint the finished step and stop); torchrun gets SIGTERM too
    # if this process dies, even by kill -9 (and the ranks when torchrun dies)
    proc = subprocess.Popen(
        cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=die_with_parent
    )
    first = _relay_stderr(proc)
    if first is not None and first.startswith("gspo: error:"):
        return 2
    return 130 if first is not None else proc.returncode


def _relay_stderr(proc: subprocess.Popen) -> str | None:
    """Copy the ranks' and torchrun's stderr to ours until a rank's one-line ``gspo:`` error or
    interrupt message, which is shown once; torchrun's report of the failed ranks that follows it is
    dropped. Returns that line (None if there was none)."""
    import signal

    first: str | None = None
    while True:
        try:
            for line in proc.stderr:
                if first is None and line.startswith(("gspo: error:", "gspo: interrupted")):
                    first = line
                    sys.stderr.write(line)
                elif first is None:
                    sys.stderr.write(line)
            proc.wait()
            return first
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGTERM)


def cmd_train(ns: argparse.Namespace) -> int:
    from gspo.config import make_config

    overrides = _overrides(ns)
    if "WORLD_SIZE" in os.environ:  # under torchrun: the real process count wins
        overrides["nproc"] = int(os.environ["WORLD_SIZE"])
    cfg = make_config(ns.config, overrides)
    if cfg.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from gspo.limits import check_local_ranks

        check_local_ranks(cfg.nproc)
        return _launch_torchrun(cfg.nproc)
    from gspo.launch import train

    res = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        init, final = res.initial_accuracy, res.final_accuracy
        if init is not None and final is not None:
            print(f"held-out accuracy: {init:.3f} -> {final:.3f} ({100 * (final - init):+.1f} points)")
        print(f"run folder: {res.run_dir}  (final model: {res.final_dir}, curves: {res.plot})")
    return 0


def cmd_compare(ns: argparse.Namespace) -> int:
    import shlex

    from gspo.compare import run_compare, write_study
    from gspo.study.runner import out_folder

    def names(flag: str, text: str | None) -> list[str] | None:  # given but naming nothing: refused
        items = None if text is None else [x.strip() for x in text.split(",") if x.strip()]
        if items == []:
            raise GspoError(f"{flag}: expected comma-separated names, got {text!r}")
        return items

    if ns.study is not None:
        dirs = names("--study", ns.study)
        report = write_study(dirs, out_folder(ns.out or "runs/study"), ns.ci)
        print(f"report: {report}")
        return 0
    skip = ("name", "output_dir", "seed", "algo", "routing_replay", "resume", "overwrite")
    try:
        seeds = [int(s) for s in names("--seeds", ns.seeds)] if ns.seeds is not None else None
    except ValueError:
        raise GspoError(f"--seeds: expected comma-separated integers, got {ns.seeds!r}") from None
    variants = names("--variants", ns.variants)
    command = shlex.join(["gspo", *sys.argv[1:]]) if sys.argv[1:2] == ["compare"] else None
    report = run_compare(
        ns.config,
        _overrides(ns, skip),
        seeds,
        variants,
        ns.out,
        ns.preset,
        ns.workers,
        ns.ci,
        command=command,
        warm_target=ns.warm_target,
        warm_dir=ns.warm_dir,
        overwrite=ns.overwrite,
    )
    print(f"report: {report}")
    return 0


def cmd_plan(ns: argparse.Namespace) -> int:
    from gspo.capacity import report, shape_of
    from gspo.capacity_comm import check_layout, comm_report, gpu_bytes_of, launch_lines, link_of
    from gspo.config import make_config
    from gspo.resolve import capacity_plan

    link = link_of(ns.nodes, ns.gpus_per_node, ns.gpus, ns.intra_gbps, ns.inter_gbps)
    gpu, given = gpu_bytes_of(ns.gpu_memory_gb, ns.gpu_memory_gib)  # bytes, whichever unit was given
    cfg = make_config(ns.config, {**_overrides(ns, ("nproc",)), "nproc": link.world})
    plan = capacity_plan(cfg)
    shape = shape_of(plan.model)
    check_layout(plan, shape, link)
    text, fits = report(plan, plan.model, link.world, gpu, given, link.nodes, shape)
    # a launch line only for a run that fits: one printed above "does not fit" reads as the way to start it
    launch = launch_lines(link, ns.config, _given_flags(ns, ("nproc",))) if fits else []
    print("\n".join([text, *comm_report(plan, shape, link, gpu), *launch]))
    if not fits:
        raise GspoError(f"does not fit in {gpu / 2**30:.1f} GiB per GPU ({given}; see the table above)")
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    _quiet_upstream()
    try:
        return _export(Path(ns.checkpoint), Path(ns.out), ns.no_tokenizer)
    except OSError as e:  # a path the system cannot even look at (a name over 255 bytes, say)
        raise GspoError(f"{e.filename or ns.out}: {e.strerror or e}") from None


def _export(src: Path, out: Path, no_tokenizer: bool) -> int:
    from gspo.model.export import export_dcp
    from gspo.training.checkpoint_files import check_manifest, is_sharded

    if not src.is_dir():
        raise GspoError(f"checkpoint folder not found: {src}")
    if not is_sharded(src):
        raise GspoError(f"{src} is not a sharded checkpoint (no dcp/.metadata); an HF folder needs no export")
    why = check_manifest(src)
    if why:
        raise GspoError(f"{src}: {why}")
    if out.is_symlink():  # dangling or not: the export would replace the link, not write where it points
        raise GspoError(f"--out {out} is a symlink; give the path of a new (or empty) folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GspoError(f"--out {out} already exists and is not an empty folder")
    above = next((a for a in out.parents if a.exists() or a.is_symlink()), None)
    if above is not None and not above.is_dir():
        raise GspoError(f"--out {out}: {above} is not a folder")
    files = export_dcp(src, out, tokenizer=not no_tokenizer)
    print(f"wrote {out} ({len(files)} safetensors file{'s' if len(files) > 1 else ''})")
    return 0


def _quiet_upstream() -> None:
    """Silence what transformers and torch print on their own in gspo's one-process commands: the
    weight-loading progress bar, and DCP's note that it reads a sharded checkpoint in one process
    (which is what gspo asked for)."""
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def cmd_eval(ns: argparse.Namespace) -> int:
    from gspo.checkpoint_eval import EVAL_FIELDS, evaluate_checkpoint

    _quiet_upstream()
    skip = tuple(f.name for f in dataclasses.fields(Config) if f.name not in EVAL_FIELDS)
    out = evaluate_checkpoint(ns.checkpoint, _overrides(ns, skip))
    print(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        commands = {
            "train": cmd_train, "compare": cmd_compare, "plan": cmd_plan, "eval": cmd_eval, "export": cmd_export,
        }  # fmt: skip
        return commands[ns.command](ns)
    except (GspoError, KeyboardInterrupt, SystemError) as e:
        return _say_error(e)


def _say_error(e: BaseException) -> int:
    """Say ``e`` in one line: gspo's own error (exit 2) or an interrupt (130). A ``SystemError`` is what
    CPython raises when a C call (safetensors' writer, a torch op in export) returns while an exception
    is pending, typically a Ctrl-C landing inside it; its chain holds that exception, which is what the
    user needs to read (issue 49 item 6: an extra ``SystemError`` after the one line). Anything else in
    a ``SystemError``'s chain is a real bug: re-raised, traceback and all."""
    real, seen = e, set()
    while isinstance(real, SystemError) and id(real) not in seen:
        seen.add(id(real))
        real = real.__cause__ or real.__context__ or real
    if isinstance(real, GspoError):
        print(f"gspo: error: {real}", file=sys.stderr)
        return 2
    if isinstance(real, KeyboardInterrupt):
        print(
            f"\ngspo: interrupted; {str(real) or 'the last checkpoint is kept (continue with --resume)'}",
            file=sys.stderr,
        )
        return 130
    raise e


def entry() -> None:
    """The ``gspo`` command: :func:`main`, then exit even when user code (a reward, an environment) left
    a non-daemon thread running, which would keep the finished process alive forever."""
    rc = main()
    stray = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if any(t.is_alive() for t in stray):
        print(
            f"gspo: warning: user code left {len(stray)} thread(s) running; exiting anyway", file=sys.stderr
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)


if __name__ == "__main__":
    entry()
