"""Export, sharded checkpoints and resume against hostile or damaged inputs (issue 37).

One 2-rank FSDP2 run of an UNTIED tiny MoE (its LM head is a weight of its own, as in Qwen3-8B and
30B-A3B) gives real sharded checkpoints; each test damages a copy. Every refusal is one line, exit 2,
no traceback, and leaves nothing half-written behind (``gspo export`` writes a sibling folder and
renames it at the end).
"""

import functools
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gspo.cli import main as gspo_main
from gspo.config import Config
from gspo.errors import GspoError
from gspo.launch import check_run_dir
from gspo.model.export import read_index
from gspo.model.load import build_char_tokenizer, build_tiny_moe, save_pretrained
from gspo.resolve import checkpoint_plan
from gspo.training import checkpoint_files as ckpt
from gspo.training.checkpoints import CheckpointManager
from gspo.training.distributed import DistContext

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")

ROOT = Path(__file__).resolve().parents[1]
REWARD = f"{ROOT / 'tests' / 'fixture_rewards.py'}:noisy"
ARGS = [
    "train", "--model", "model", "--sft-steps", "0", "--eval-size", "4", "--eval-every", "0",
    "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "6", "--threads", "1",
    "--no-progress", "--save-every", "1", "--warmup-steps", "64", "--reward", REWARD,
    "--output-dir", "runs", "--name", "r",
]  # fmt: skip


def _gspo(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "gspo", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def _untied_model(folder: Path) -> None:
    tok = build_char_tokenizer()
    model = build_tiny_moe(len(tok), seed=3, tie_word_embeddings=False)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    save_pretrained(model, tok, folder)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished 2-step run on 2 ranks: sharded checkpoints step-000001 and step-000002, final/."""
    tmp = tmp_path_factory.mktemp("hostile")
    _untied_model(tmp / "model")
    p = _gspo(tmp, *ARGS, "--nproc", "2", "--steps", "2")
    assert p.returncode == 0, p.stderr[-4000:]
    run = tmp / "runs" / "r"
    assert [s.name for s in ckpt.step_folders(run)] == ["step-000001", "step-000002"]
    assert ckpt.is_sharded(run / "checkpoints" / "step-000002")
    return run


def _copy_run(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "r"
    shutil.copytree(base, run, ignore=shutil.ignore_patterns(ckpt.LOCK))
    (tmp_path / "model").symlink_to(base.parent.parent / "model")
    return run


def _copy_step(base: Path, tmp_path: Path, step: int = 2) -> Path:
    dest = tmp_path / f"step-{step:06d}"
    shutil.copytree(base / "checkpoints" / f"step-{step:06d}", dest)
    return dest


def _export(capsys, src: Path, out: Path, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = gspo_main(["export", str(src), "--out", str(out), *extra])
    return rc, capsys.readouterr().err


def _refused(rc: int, err: str, *words: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("gspo: error: "), err
    assert all(w in lines[0] for w in words), (words, err)


def _dcp_model(step: Path) -> dict[str, torch.Tensor]:
    """The trainer's weights as its ranks saved them (DCP), by HF parameter name."""
    import torch.distributed.checkpoint as dcp

    index = read_index(step).state_dict_metadata
    prefix = "model.model."
    sd = {
        k.removeprefix("model."): torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for k, md in index.items()
        if k.startswith(prefix)
    }
    dcp.load({"model": sd}, storage_reader=ckpt.SafeReader(step / "dcp"), no_dist=True)
    return {k.removeprefix("model."): v for k, v in sd.items()}


# ------------------------------------------------------------------------------------------------
# 1. an untied LM head is exported, gathered into final/, and streamed to the sampler


def test_untied_lm_head_is_in_the_export_and_in_final(base, tmp_path, capsys):
    """`gspo export` of the last checkpoint and final/ (gathered from the live shards) both hold the
    LM head, and from_pretrained of either equals the weights the ranks saved, the LM head included."""
    from transformers import AutoModelForCausalLM

    step = base / "checkpoints" / "step-000002"
    rc, err = _export(capsys, step, tmp_path / "exported")
    assert rc == 0, err
    trained = _dcp_model(step)
    assert "lm_head.weight" in trained
    assert not torch.equal(trained["lm_head.weight"], trained["model.embed_tokens.weight"])
    for folder in (tmp_path / "exported", base / "final"):
        assert "lm_head.weight" in load_file(folder / "model.safetensors"), folder
        got = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        assert got.keys() == trained.keys(), folder
        assert all(torch.equal(got[k], trained[k]) for k in trained), folder


def test_the_sampler_weight_stream_and_the_hf_sync_carry_the_lm_head():
    """The per-layer stream (vLLM's sync, final/) names and carries the untied LM head; the HF engine
    over a bfloat16 copy takes it from the trainer at each sync."""
    from gspo.model.export import hf_checkpoint_weights
    from gspo.rollout.hf import HFRolloutEngine

    tok = build_char_tokenizer()
    trainer = build_tiny_moe(len(tok), seed=5, tie_word_embeddings=False)
    streamed = dict(hf_checkpoint_weights(trainer))
    assert torch.equal(streamed["lm_head.weight"], trainer.lm_head.weight)
    assert not torch.equal(streamed["lm_head.weight"], streamed["model.embed_tokens.weight"])
    copy = build_tiny_moe(len(tok), seed=6, tie_word_embeddings=False).to(torch.bfloat16)
    engine = HFRolloutEngine(copy, tok.eos_token_id, tok.pad_token_id, trainer=trainer)
    with torch.no_grad():
        trainer.lm_head.weight.mul_(-2.0)  # the trainer moved; the copy follows at the next sync
    engine.sync_weights()
    want = trainer.lm_head.weight.to(torch.bfloat16)
    assert torch.equal(copy.lm_head.weight, want)


# ------------------------------------------------------------------------------------------------
# 2, 4, 5, 6. gspo export refuses what it cannot export faithfully, in one line, leaving nothing


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_export_refuses_a_checkpoint_that_does_not_match_its_manifest(base, tmp_path, capsys):
    step = _copy_step(base, tmp_path)
    with open(step / "config.json", "a") as f:
        f.write(" ")  # still valid JSON: only the manifest can tell
    rc, err = _export(capsys, step, tmp_path / "out")
    _refused(rc, err, "config.json has", "the manifest says")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["dangling-symlink", "under-a-file", "not-empty"])
def test_export_refuses_an_out_path_it_cannot_write_cleanly(base, tmp_path, capsys, kind):
    step = base / "checkpoints" / "step-000002"
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out, why = {
        "dangling-symlink": (tmp_path / "link", "is a symlink"),
        "under-a-file": (victim / "x", f"{victim} is not a folder"),
        "not-empty": (tmp_path, "already exists and is not an empty folder"),
    }[kind]
    if kind == "dangling-symlink":
        out.symlink_to(tmp_path / "nowhere")
    rc, err = _export(capsys, step, out)
    _refused(rc, err, f"--out {out}", why)
    assert victim.read_text() == "precious" and not (tmp_path / "nowhere").exists()
    assert _leftovers(tmp_path) == []


def _truncate_shard(step: Path) -> None:
    f = step / "dcp" / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:100])


def _unknown_model_type(step: Path) -> None:
    config = json.loads((step / "config.json").read_text())
    (step / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))


def _torn_tensor(step: Path) -> None:
    """The bytes of rank 1's piece of the LM head zeroed: the index still fits, the tensor is unreadable,
    and the failure comes after the output folder was begun (the LM head is written last)."""
    index = read_index(step)
    (info,) = [
        info
        for key, info in index.storage_data.items()
        if key.fqn == "model.model.lm_head.weight" and info.relative_path == "__1_0.distcp"
    ]
    f = step / "dcp" / "__1_0.distcp"
    data = bytearray(f.read_bytes())
    data[info.offset : info.offset + info.length] = bytes(info.length)
    f.write_bytes(bytes(data))


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


DAMAGE = {
    "truncated-shard": (_truncate_shard, "dcp/__1_0.distcp has 100 bytes"),
    "garbage-index": (lambda s: (s / "dcp" / ".metadata").write_bytes(b"garbage"), "dcp/.metadata"),
    "missing-rank-shard": (lambda s: (s / "dcp" / "__1_0.distcp").unlink(), "dcp/__1_0.distcp is missing"),
    "unknown-model-type": (_unknown_model_type, "config.json"),
    "torn-tensor": (_torn_tensor, "cannot be read"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_export_of_a_damaged_checkpoint_says_why_and_leaves_nothing(base, tmp_path, capsys, kind):
    """Damage the manifest was rewritten to match: one line naming it, no --out and no temporary
    folder left, and the same --out then takes a good export."""
    step = _copy_step(base, tmp_path)
    damage, words = DAMAGE[kind]
    damage(step)
    ckpt.write_manifest(step)
    out = tmp_path / "exports" / "out"
    rc, err = _export(capsys, step, out)
    _refused(rc, err, words)
    assert not (tmp_path / "exports").exists() and _leftovers(tmp_path) == []
    rc, err = _export(capsys, base / "checkpoints" / "step-000002", out)
    assert rc == 0 and (out / "model.safetensors").is_file(), err


def test_a_planted_index_payload_never_runs(base, tmp_path, capsys):
    step = _copy_step(base, tmp_path)
    marker = tmp_path / "pwned"
    (step / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    ckpt.write_manifest(step)
    rc, err = _export(capsys, step, tmp_path / "out")
    _refused(rc, err, "dcp/.metadata cannot be read safely", "not allowed")
    assert not marker.exists()


def test_a_planted_payload_in_a_shard_entry_never_runs(tmp_path):
    """A non-tensor entry of the shards (the optimizer's param groups are such entries) carrying a
    pickled callable: the resume's load refuses it in one line and it never runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from gspo.model.logprobs import PolicyLogprobs
    from gspo.resolve import optim_plan
    from gspo.training.run import make_optimizer

    tok = build_char_tokenizer()
    policy = PolicyLogprobs(build_tiny_moe(len(tok), seed=1))
    optimizer, _ = make_optimizer(policy, optim_plan(Config()))
    for p in policy.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    states = {"model": get_model_state_dict(policy), "optimizer": get_optimizer_state_dict(policy, optimizer)}
    marker = tmp_path / "pwned"
    states["optimizer"]["param_groups"][0]["lr"] = _Payload(str(marker))
    dcp.save(states, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(GspoError, match="cannot be loaded") as e:
        ckpt.load_shards(policy, optimizer, tmp_path, with_optimizer=True)
    assert "\n" not in str(e.value) and not marker.exists()


def test_export_without_tokenizer_files_is_refused_unless_asked(base, tmp_path, capsys):
    step = _copy_step(base, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (step / name).unlink()
    ckpt.write_manifest(step)
    rc, err = _export(capsys, step, tmp_path / "out")
    _refused(rc, err, "no tokenizer files", "--no-tokenizer")
    assert not (tmp_path / "out").exists()
    rc, err = _export(capsys, step, tmp_path / "out", "--no-tokenizer")
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------------
# 7-10. resume and pruning


def _claim(run: Path, **kw):
    cfg = Config(output_dir=str(run.parent), name=run.name, **kw)
    checkpoints = CheckpointManager(checkpoint_plan(cfg))
    try:
        return checkpoints.claim()
    finally:
        checkpoints.release()


@pytest.mark.parametrize("kind", ["truncated-shard", "missing-rank-shard", "garbage-index"])
def test_a_damaged_sharded_checkpoint_falls_back_to_the_previous_one(base, tmp_path, kind):
    """Shards damaged under a manifest rewritten to match are found before anything is loaded."""
    run = _copy_run(base, tmp_path)
    step = run / "checkpoints" / "step-000002"
    damage, words = DAMAGE[kind]
    damage(step)
    ckpt.write_manifest(step)
    path, state, note = _claim(run, resume=True)
    assert path.name == "step-000001" and state["step"] == 1
    assert "skipped newer damaged checkpoints (step-000002: " in note and words in note and "\n" not in note


def test_a_damaged_sharded_checkpoint_resumes_from_the_command_line(base, tmp_path, capsys, monkeypatch):
    """Through `gspo train --resume` (one process, resharded; the command in-process: its code path
    without an interpreter start): one line says which checkpoint and why the newer one was skipped,
    and the run trains on to its last step."""
    run = _copy_run(base, tmp_path)
    _truncate_shard(run / "checkpoints" / "step-000002")
    ckpt.write_manifest(run / "checkpoints" / "step-000002")
    monkeypatch.chdir(tmp_path)  # ARGS' model and runs folders
    capsys.readouterr()
    rc = gspo_main([*ARGS, "--nproc", "1", "--steps", "2", "--resume"])
    err = capsys.readouterr().err
    assert rc == 0 and "Traceback" not in err, err[-4000:]
    notes = [ln for ln in err.splitlines() if ln.startswith("gspo: resuming")]
    assert len(notes) == 1 and "step-000001; skipped newer damaged checkpoints (step-000002: " in notes[0]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


def _fake_checkpoint(run: Path, step: int, keep: int) -> Path:
    write = lambda p: (p / "model.safetensors").write_bytes(b"w")  # noqa: E731
    return ckpt.save_checkpoint(run, step, write, {"step": step}, keep=keep)


def test_a_stray_step_folder_is_neither_counted_nor_deleted(tmp_path, capsys):
    """keep=2 keeps the two newest complete checkpoints; a step folder gspo did not complete (no
    manifest) is not one of them, is never deleted, and is reported once."""
    run = tmp_path / "r"
    for step in (1, 2):
        _fake_checkpoint(run, step, keep=2)
    stray = run / "checkpoints" / "step-0000009"
    stray.mkdir()
    (stray / "notes.txt").write_text("not gspo's")
    capsys.readouterr()
    _fake_checkpoint(run, 3, keep=2)
    _fake_checkpoint(run, 4, keep=2)
    names = [p.name for p in ckpt.step_folders(run)]
    assert names == ["step-000003", "step-000004", "step-0000009"]
    assert (stray / "notes.txt").read_text() == "not gspo's"
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "step-0000009" in ln]
    assert len(warnings) == 1 and "never deleted" in warnings[0], warnings


def test_resume_with_steps_below_the_checkpoint_is_refused_before_anything_is_written(base, tmp_path):
    run = _copy_run(base, tmp_path)
    before = {p: p.read_bytes() for p in [run / "config.yaml", *sorted((run / "final").iterdir())]}
    saved = torch.load(run / "checkpoints" / "step-000002" / ckpt.TRAINER_STATE, weights_only=True)["config"]
    cfg = Config(**{**saved, "steps": 1, "resume": True, "nproc": 1, "output_dir": str(run.parent)})
    with pytest.raises(GspoError, match=r"--steps 1 is below the step of the checkpoint .*step 2\)") as e:
        check_run_dir(cfg, CheckpointManager(checkpoint_plan(cfg), DistContext(0, 1, 0, torch.device("cpu"))))
    assert "\n" not in str(e.value) and "pass --steps 2 or more" in str(e.value)
    assert {p: p.read_bytes() for p in before} == before
    assert sorted((run / "final").iterdir()) == sorted(p for p in before if p.parent.name == "final")
    cfg = Config(**{**saved, "steps": 2, "resume": True, "nproc": 1, "output_dir": str(run.parent)})
    checkpoints = CheckpointManager(checkpoint_plan(cfg), DistContext(0, 1, 0, torch.device("cpu")))
    path, state = check_run_dir(cfg, checkpoints)
    checkpoints.release()
    assert path.name == "step-000002" and state["step"] == 2  # as many steps as done: allowed


def test_a_run_killed_before_step_0_is_not_sent_to_resume(tmp_path):
    """kill -9 before the step-0 checkpoint leaves config.yaml (and the logs) but no checkpoint: the
    next run is told to start over with --overwrite, not to --resume (which would find nothing)."""
    run = tmp_path / "r"
    (run / "tensorboard").mkdir(parents=True)
    (run / "config.yaml").write_text("steps: 2\n")
    with pytest.raises(GspoError) as e:
        _claim(run)
    msg = str(e.value)
    assert "saved no checkpoint" in msg and "--overwrite" in msg and "pass --resume" not in msg, msg
    with pytest.raises(GspoError, match="no complete checkpoint found.*--overwrite"):
        _claim(run, resume=True)
    path, state, _ = _claim(run, overwrite=True)
    assert path is None and state is None and ckpt.run_traces(run) == []


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_each_rank_checksums_its_own_shards(base, tmp_path):
    """A 2-rank checkpoint's manifest holds each rank's own checksum of its shard (they match the
    files), and on resume each rank verifies its share: rank 0 never reads rank 1's shard."""
    step = _copy_step(base, tmp_path)
    names = ckpt.shard_files(step)
    assert names == ["dcp/__0_0.distcp", "dcp/__1_0.distcp"]
    manifest = json.loads((step / ckpt.MANIFEST).read_text())["files"]
    assert all(manifest[n] == ckpt.file_entry(step / n) for n in names)
    _flip_a_byte(step / "dcp" / "__1_0.distcp")  # same size: only a checksum finds it
    assert ckpt.check_share(step, 0, 2) == ""
    assert "dcp/__1_0.distcp does not match its checksum" in ckpt.check_share(step, 1, 2)
    assert ckpt.verify(step, shards=False)[1] == ""  # rank 0 alone, sizes only for the shards
    assert "does not match its checksum" in ckpt.verify(step)[1]  # one process: every file


def test_a_shard_damaged_under_its_manifest_sends_both_ranks_back_a_checkpoint(base, tmp_path):
    """`gspo train --nproc 2 --resume` with one byte of rank 1's newest shard flipped: rank 1 finds it,
    both ranks resume from the checkpoint before, one line says why, and the run trains on."""
    run = _copy_run(base, tmp_path)
    _flip_a_byte(run / "checkpoints" / "step-000002" / "dcp" / "__1_0.distcp")
    p = _gspo(tmp_path, *ARGS, "--nproc", "2", "--steps", "2", "--resume")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-4000:]
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("gspo: resuming")]
    assert len(notes) == 1 and "step-000001; skipped newer damaged checkpoints (step-000002: " in notes[0]
    assert "dcp/__1_0.distcp does not match its checksum" in notes[0]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]


@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 591226752 vs 591226640"),
        OSError(28, "No space left on device"),
    ],
    ids=["torch-zip-writer", "enospc"],
)
def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(
    tmp_path, monkeypatch, capsys, failure
):
    """`gspo train` whose disk fills while step 2's checkpoint is written (torch.save's zip writer, as
    seen on a full disk, or a plain ENOSPC): exit 2, one line naming the step, the folder, the free
    space and the checkpoint kept; nothing half-written is left and ``latest`` names step 1. Any
    other error from the writer is not rewritten."""
    real_save = torch.save

    def save(obj, f, *a, **kw):
        if "000002" in str(f):
            Path(f).write_bytes(b"half")
            raise failure
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(ckpt.torch, "save", save)
    args = ["train", "--sft-steps", "0", "--steps", "3", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--eval-size", "2", "--eval-every", "0", "--save-every", "1",
            "--threads", "1", "--no-progress", "--output-dir", str(tmp_path), "--name", "r"]  # fmt: skip
    capsys.readouterr()
    assert gspo_main(args) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    root = tmp_path / "r" / "checkpoints"
    assert len(err) == 1 and err[0].startswith(
        f"gspo: error: cannot write checkpoint step 2 under {root} ("
    ), err
    assert "GiB free there): " in err[0] and err[0].endswith("the last complete checkpoint is kept (step 1)")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000000", "step-000001"]
    assert (root / "latest").read_text() == "step-000001"
    monkeypatch.setattr(ckpt.torch, "save", functools.partial(_raise, ValueError("a bug in the writer")))
    with pytest.raises(ValueError, match="a bug in the writer"):
        gspo_main([*args[:-1], "r2"])


def _raise(error: BaseException, *args: object, **kwargs: object) -> None:
    raise error
