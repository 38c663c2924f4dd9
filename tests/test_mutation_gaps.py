"""Gaps a mutation audit found (issue 57), each pinned where no other test file does: a resume that
fails at start-up keeps the run, an abandoned step is rewound so the resume is exact, and every file
of ``final/`` is fsynced before the folder is renamed into place. Each test fails on its mutant in
tests/mutants/mutants.py."""

import os
from pathlib import Path

import pytest
import torch

from gspo import Config, train
from gspo.errors import GspoError

TINY = dict(
    sft_steps=0, eval_size=4, prompts_per_step=2, group_size=4, max_new_tokens=6, eval_every=0,
    threads=1, progress=False,
)  # fmt: skip


def test_final_files_are_fsynced_before_final_is_renamed_into_place(tmp_path, monkeypatch):
    """Every file written into ``.final.tmp`` (nested ones too) is fsynced before the rename that makes
    it ``final/``, and the run folder after it: a power cut never leaves a ``final/`` whose files the
    disk does not hold (os.fsync and os.replace recorded by spies that call the real ones)."""
    from gspo.training import checkpoint_files as ckpt

    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spy_replace(src, dst) -> None:
        events.append(("replace", f"{src} -> {dst}"))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    names = ["config.json", "model.safetensors", "tok/tokenizer.json"]

    def write(folder: Path) -> None:
        for n in names:
            (folder / n).parent.mkdir(exist_ok=True)
            (folder / n).write_bytes(n.encode() * 100)

    run = tmp_path / "run"
    run.mkdir()
    final = ckpt.write_final(run, write, kept=3)
    assert sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file()) == sorted(names)
    tmp = run / ckpt.FINAL_TMP
    (at,) = [i for i, e in enumerate(events) if e == ("replace", f"{tmp} -> {final}")]
    synced = {p for kind, p in events[:at] if kind == "fsync"}
    assert {str(tmp / n) for n in names} <= synced, events
    assert ("fsync", str(run)) in events[at:]  # the rename itself made durable


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_resume_that_fails_at_start_up_keeps_the_run(tmp_path, capsys):
    """A run saved step 1; its model folder is then damaged, so ``--resume`` fails while the run is
    being built (before any step): one line after the resume's notice, exit 2, and the run folder
    keeps every file it had, byte for byte (checkpoints, metrics, and config.yaml still saying the
    settings the run trained with: a new run that fails at start-up leaves no trace, a resumed one
    must keep everything as it was)."""
    from gspo.cli import main
    from gspo.model.load import build_char_tokenizer, build_tiny_moe, save_pretrained

    tok = build_char_tokenizer()
    save_pretrained(build_tiny_moe(len(tok), seed=0), tok, tmp_path / "model")
    args = [
        "train",
        "--model",
        str(tmp_path / "model"),
        "--output-dir",
        str(tmp_path / "runs"),
        "--name",
        "r",
    ]
    args += ["--sft-steps", "0", "--eval-size", "4", "--prompts-per-step", "2", "--group-size", "2"]
    args += ["--max-new-tokens", "4", "--threads", "1", "--no-progress"]
    assert main([*args, "--steps", "1"]) == 0, capsys.readouterr().err
    run = tmp_path / "runs" / "r"
    before = {k: v for k, v in _files(run).items() if k != ".gspo.lock"}
    assert any(k.startswith("checkpoints/step-000001/") for k in before) and "metrics.jsonl" in before
    (tmp_path / "model" / "config.json").write_text("{ damaged")
    capsys.readouterr()
    assert main([*args, "--steps", "2", "--resume"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("gspo: resuming from") and len(lines) == 2, lines
    assert lines[1].startswith("gspo: error: config field 'model'") and "config.json" in lines[1], lines
    after = {k: v for k, v in _files(run).items() if k != ".gspo.lock"}
    assert sorted(after) == sorted(before)
    assert [k for k in before if after[k] != before[k]] == []


REWARD = '''import pathlib

HERE = pathlib.Path(__file__).parent


def parity(prompts, completions, answers):
    """1 for an odd-length completion; a training batch (8 samples: the evaluation scores 4) raises
    when it is the one ``fail_at`` names."""
    if len(completions) == 8:
        calls = HERE / "calls"
        k = int(calls.read_text()) + 1 if calls.exists() else 1
        calls.write_text(str(k))
        fail = HERE / "fail_at"
        if fail.exists() and k == int(fail.read_text()):
            raise ConnectionError("reward server gone")
    return [float(len(c) % 2) for c in completions]
'''


def test_a_step_abandoned_before_its_update_is_rewound_and_the_resume_is_exact(tmp_path):
    """``save_every 2``: the reward fails in step 4, after its responses were sampled and before the
    update. The step is rewound (data position and sampling generator) and step 3 saved; resumed,
    the run ends with the uninterrupted run's weights bit for bit (without the generator's rewind
    step 4 draws other responses)."""
    (tmp_path / "r.py").write_text(REWARD)
    cfg = dict(
        TINY, steps=4, save_every=2, output_dir=str(tmp_path / "runs"), reward=f"{tmp_path / 'r.py'}:parity"
    )
    full = train(Config(name="full", **cfg))
    (tmp_path / "calls").unlink()
    (tmp_path / "fail_at").write_text("4")
    with pytest.raises(
        GspoError, match=r"reward server gone.*progress is saved at step 3; continue with --resume"
    ):
        train(Config(name="cut", **cfg))
    (tmp_path / "fail_at").unlink()
    resumed = train(Config(name="cut", resume=True, **cfg))
    for (k, v), w in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)
