"""What the fourth hostile sweep found in training, checkpoints and export (issues 44 and 49), each
through the CLI: a 2-rank run whose weights were left gathered at its checkpoint, a full disk while a
safetensors file is written (a checkpoint's, or ``final/``'s, which is now written beside and renamed),
values a config or an environment gives that no float32 holds, a device index no int holds,
``--resume`` on a read-only folder or over a ``latest`` that is a folder, and a manifest whose entries
leave the checkpoint folder."""

import json
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import transformers.modeling_utils as modeling_utils
from cli_helpers import gspo_at_once, one_line

from gspo.cli import main as gspo_main
from gspo.training import checkpoint_files as ckpt

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")

SMALL = [
    "--sft-steps", "0", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
    "--eval-size", "2", "--eval-every", "0", "--threads", "1", "--no-progress",
]  # fmt: skip


TWO_RANKS = ["train", "--nproc", "2", "--prompts-per-step", "2", "--group-size", "2", "--num-minibatches", "1",
             "--steps", "2", "--sft-steps", "2", "--eval-size", "2", "--save-every", "1",
             "--max-new-tokens", "6", "--eval-every", "0", "--threads", "1", "--no-progress"]  # fmt: skip


def test_two_ranks_checkpoint_after_a_no_grad_forward(tmp_path):
    """`gspo train --nproc 2` with one minibatch on the MoE model: the routing-volatility forward that
    follows the optimizer step (no backward after it) leaves FSDP2's root group gathered, its weights
    plain tensors beside the others' shards, and the checkpoint's finiteness check crashed on both
    ranks ("Replicate to Partial(product)"). The policy is resharded before a checkpoint and each rank
    checks the values it holds, whatever their placement: every checkpoint is written, final/ too."""
    rc, out = gspo_at_once({"r": [*TWO_RANKS, "--output-dir", str(tmp_path / "runs")]}, tmp_path, 300)["r"]
    assert rc == 0 and "Traceback" not in out, out[-4000:]
    run = next((tmp_path / "runs").iterdir())
    assert (run / "checkpoints" / "latest").read_text() == "step-000002"
    assert (run / "checkpoints" / "step-000001" / "manifest.json").is_file()
    assert (run / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_two_ranks_refuse_non_finite_weights_together(tmp_path):
    """Weights that did turn non-finite on 2 ranks (lr 1 with weight decay 1e39: AdamW scales each
    weight by 1 - 1e39; an lr above 1 is refused at start-up since issue 57) are refused by both ranks
    together (the ranks' local checks are combined): one line, exit 2, the step-0 checkpoint kept."""
    blowup = ["--lr", "1", "--weight-decay", "1e39"]
    runs = {"r": [*TWO_RANKS, *blowup, "--output-dir", str(tmp_path / "runs")]}
    rc, out = gspo_at_once(runs, tmp_path, 300)["r"]
    errors = [ln for ln in out.splitlines() if ln.startswith("gspo: error:")]
    assert rc == 2 and "Traceback" not in out, out[-4000:]
    assert errors and all(e == errors[0] for e in errors), out[-4000:]
    assert (
        "weights are not finite after step 1" in errors[0] and "last good checkpoint is step 0" in errors[0]
    )
    run = next((tmp_path / "runs").iterdir())
    assert (run / "checkpoints" / "latest").read_text() == "step-000000"


def _full_disk(monkeypatch, where: dict[str, str | None]):
    """safetensors' writer, as transformers and gspo call it, fails as on a full disk (half a file
    written, then its error) for files in a folder whose name contains ``where["folder"]``."""
    real = modeling_utils.safe_save_file

    def save(tensors, filename, *args, **kwargs):
        if where["folder"] and where["folder"] in Path(filename).parent.name:
            Path(filename).write_bytes(b"half")
            raise safetensors.SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "safe_save_file", save)
    monkeypatch.setattr(safetensors.torch, "save_file", save)


def test_a_full_disk_while_safetensors_writes_is_one_line_and_final_is_whole_or_absent(
    tmp_path, monkeypatch, capsys
):
    """The disk fills while safetensors writes step 2's checkpoint: one line with the free space and
    the checkpoint kept, exit 2 (was the writer's traceback). Resumed, it fills while ``final/`` is
    written: one line, exit 2, no ``final/`` at all (it was written in place: a config without
    weights, which a re-run took as finished) and nothing half-written beside it. With room again,
    ``--resume`` writes ``final/`` from the last checkpoint without training a step more."""
    where: dict[str, str | None] = {"folder": "step-000002"}
    _full_disk(monkeypatch, where)
    args = ["train", *SMALL, "--steps", "3", "--save-every", "1", "--output-dir", str(tmp_path), "--name", "r"]  # fmt: skip
    run = tmp_path / "r"
    root = run / "checkpoints"
    line = one_line(capsys, args, f"cannot write checkpoint step 2 under {root} (")
    assert "GiB free there): No space left on device; the last complete checkpoint is kept (step 1)" in line
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000000", "step-000001"]

    where["folder"] = "final"
    capsys.readouterr()
    assert gspo_main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("gspo: resuming from")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"gspo: error: cannot write the final model {run / 'final'} (")
    assert (
        "GiB free there): No space left on device; the last complete checkpoint is kept (step 3)" in lines[0]
    )
    assert lines[0].endswith("make room and run again (gspo train: add --resume) to write it")
    assert (root / "latest").read_text() == "step-000003"
    assert not (run / "final").exists() and [p.name for p in run.iterdir() if "final" in p.name] == []
    assert not ckpt.final_complete(run)

    where["folder"] = None
    assert gspo_main([*args, "--resume"]) == 0
    final = safetensors.torch.load_file(run / "final" / "model.safetensors")
    last = safetensors.torch.load_file(root / "step-000003" / "model.safetensors")
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in last)
    assert (run / "final" / "config.json").is_file()
    assert [p.name for p in run.iterdir() if "final" in p.name] == ["final"]
    assert ckpt.final_complete(run)
    (run / "final" / "model.safetensors").unlink()  # what an older gspo's in-place write left
    assert not ckpt.final_complete(run)
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]


def test_values_no_float32_or_device_index_holds_are_one_line(tmp_path, capsys):
    """VESPO's kernel shape past float32 (each of its four fields; was torch's "value cannot be
    converted to type float without overflow" at the first update) and a rollout device whose index
    torch cannot hold (was "Could not parse device index"; cuda:256 was silently cuda:0, the trainer's
    GPU): one line naming the field, exit 2, before any weight is read."""
    base = ["train", *SMALL, "--steps", "1", "--output-dir", str(tmp_path)]
    for field in ("k-pos", "lambda-pos", "k-neg", "lambda-neg"):
        line = one_line(
            capsys, [*base, "--algo", "vespo", f"--vespo-{field}", "1e39"], "must be at most 3.403e+38"
        )
        assert f"config field 'vespo_{field.replace('-', '_')}'" in line and "(got 1e+39)" in line
    async_args = [*base, "--async-staleness", "1", "--rollout-devices"]
    for device in ("cuda:99999999999999999999", "cuda:256"):
        line = one_line(
            capsys, [*async_args, device], "config field 'rollout_devices': a device index is at most 127"
        )
        assert device in line
    for device in ("cuda:256", "cuda:99999999999999999999"):  # the trainer's own device alike
        assert device in one_line(
            capsys, [*base, "--device", device], "config field 'device': a device index is at most 127"
        )
    for device in ("cuda:01", "cuda:\u0663"):  # a leading zero; an Arabic-Indic three (str.isdigit())
        one_line(
            capsys, [*async_args, device], "config field 'rollout_devices': each device is 'cpu' or 'cuda:N'"
        )
    assert not any(tmp_path.iterdir())


ENVS = """
from gspo.envs.base import Step


class Huge:
    def reset(self, example):
        return example.prompt

    def step(self, turn):
        return Step(None, 10**400)
"""


def test_an_environment_reward_past_float64_is_one_line(tmp_path, capsys):
    """An environment whose step reward is a Python int past float64 (10**400): one line naming the
    environment and the value, exit 2 (was OverflowError from the reward check)."""
    (tmp_path / "envs.py").write_text(ENVS)
    args = ["train", *SMALL, "--steps", "1", "--env", f"{tmp_path / 'envs.py'}:Huge", "--output-dir", str(tmp_path / "runs")]  # fmt: skip
    line = one_line(capsys, args, "step() reward must be a finite number, got int too large for a float")
    assert "envs.py:Huge" in line


def test_resume_says_what_is_wrong_with_the_run_folder_before_training(tmp_path, monkeypatch, capsys):
    """`--resume` where the run folder cannot be written (a read-only filesystem, as the kernel answers
    there: EROFS) says so (it said "must be a plain file: remove it" of the lock file); and over a
    ``latest`` replaced by a folder (which no checkpoint can replace) it refuses at the start, not after
    training a step that it then cannot save. One line each, exit 2, nothing trained or changed."""
    import errno
    import os

    args = ["train", *SMALL, "--steps", "1", "--output-dir", str(tmp_path), "--name", "r"]
    assert gspo_main(args) == 0
    run = tmp_path / "r"
    metrics = (run / "metrics.jsonl").read_text()
    resume = [*args, "--steps", "2", "--resume"]
    real_open = os.open

    def read_only(path, *a, **kw):
        if str(path).endswith(".gspo.lock"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(os, "open", read_only)
        line = one_line(capsys, resume, f"run folder {run} cannot be written")
    assert "(Read-only file system)" in line and "plain file" not in line and "make it writable" in line

    latest = run / "checkpoints" / "latest"
    latest.unlink()
    latest.mkdir()
    (latest / "mine.txt").write_text("mine")
    line = one_line(capsys, resume, f"{latest} is a folder")
    assert "move it away" in line
    assert (run / "metrics.jsonl").read_text() == metrics and (latest / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-000000", "step-000001"]


def test_export_refuses_manifest_entries_that_leave_the_checkpoint_folder(tmp_path, capsys):
    """`gspo export` of a checkpoint whose manifest lists ``../../..``-style names, an absolute path,
    or a file that is a symlink out of the folder, each matching a decoy file elsewhere in size and
    checksum (so the old check stat'ed, read and hashed it, and passed): one line naming the entry,
    exit 2, no --out folder made."""
    import hashlib
    import os

    decoy = tmp_path / "scratch" / "decoy.txt"
    decoy.parent.mkdir()
    decoy.write_text("someone else's")
    entry = {"size": decoy.stat().st_size, "sha256": hashlib.sha256(decoy.read_bytes()).hexdigest()}
    step = tmp_path / "run" / "checkpoints" / "step-000001"
    (step / "dcp").mkdir(parents=True)
    (step / "dcp" / ".metadata").write_bytes(b"")
    (step / "linked.bin").symlink_to(decoy)
    names = [os.path.relpath(decoy, step), "../" * 8 + str(decoy).lstrip("/"), str(decoy), "linked.bin"]
    for name in names:
        empty = {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()}
        (step / "manifest.json").write_text(json.dumps({"files": {name: entry, "dcp/.metadata": empty}}))
        out = tmp_path / "out"
        line = one_line(
            capsys, ["export", str(step), "--out", str(out)], "a path out of the checkpoint folder"
        )
        assert "manifest.json lists" in line and name[:20] in line
        assert not out.exists()
    assert decoy.read_text() == "someone else's"


def test_a_full_disk_while_final_is_written_under_compare_is_one_line_and_a_rerun_finishes(
    tmp_path, monkeypatch, capsys
):
    """`gspo compare` whose disk fills while a run's ``final/`` is written: one line, exit 2, no
    ``final/`` (a half-written one was taken as "done already, reusing"); run again with room, the
    run continues from its last checkpoint and writes ``final/``, weights included."""
    where: dict[str, str | None] = {"folder": "final"}
    _full_disk(monkeypatch, where)
    out = tmp_path / "cmp"
    # --no-reproducible: compare trains in this process, where the full disk is patched (the mode spawns)
    args = ["compare", "--seeds", "0", "--variants", "gspo,grpo", "--steps", "1", "--sft-steps", "2",
            "--prompts-per-step", "2", "--group-size", "2", "--eval-size", "2", "--max-new-tokens", "4",
            "--no-progress", "--workers", "1", "--model", "embedded:tiny-moe", "--out", str(out),
            "--no-reproducible"]  # fmt: skip
    capsys.readouterr()
    assert gspo_main(args) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("gspo: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(f"gspo: error: cannot write the final model {out / 'gspo-s0' / 'final'} (")
    assert not (out / "gspo-s0" / "final").exists()
    where["folder"] = None
    assert gspo_main(args) == 0
    for run in ("gspo-s0", "grpo-s0"):
        assert (out / run / "final" / "model.safetensors").is_file()
