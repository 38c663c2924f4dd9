"""Hostile input to `gspo compare`, `gspo plan` and the YAML files gspo reads (issue 37): a user's
folder is never deleted, every bad value is one line naming the file, line and field (exit 2, no
traceback), the plan's micro-batch search answers at once, and a multi-turn run is planned by its
trajectory length."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch

from gspo.capacity import KNOWN_MODELS, Shape, estimate, largest_micro_batch, shape_of
from gspo.cli import main
from gspo.config import Config, load_yaml, make_config, save_yaml
from gspo.config.parse import read_yaml
from gspo.errors import GspoError
from gspo.resolve import capacity_plan
from gspo.study.presets import load_preset
from gspo.study.runner import plan_run, run_compare

# a compare that stops before any training when a run folder is refused
FAST = ["--seeds", "0", "--variants", "gspo", "--workers", "1", "--sft-steps", "0", "--steps", "1"]


def _one_line_error(capsys, rc: int, *parts: str) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("gspo: error:") and "\n" not in err and "Traceback" not in err, err
    for p in parts:
        assert p in err, (p, err)
    return err


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------
# compare: a run folder is deleted by nobody but the user


def _run_cfg(out: Path, **kw) -> Config:
    """The config compare gives variant gspo, seed 0 (no warm start) in ``out``."""
    values = dict(name="gspo-s0", output_dir=str(out), seed=0, algo="gspo", routing_replay=False, sft_steps=0)
    return make_config(None, {**values, **kw})


def test_compare_refuses_a_folder_of_user_files_and_leaves_it(tmp_path, capsys):
    """OUT/gspo-s1 holding a user's files (no gspo config.yaml, or one of another run): refused in one
    line naming the folder, before any training (seed 0 is not run first), with or without
    --overwrite; every file kept."""
    out = tmp_path / "out"
    decoy = out / "gspo-s1"
    (decoy / "thesis").mkdir(parents=True)
    (decoy / "thesis" / "chapter1.tex").write_text("years of work")
    (decoy / "notes.txt").write_text("keep me")
    before = _snapshot(decoy)
    two_seeds = ["--seeds", "0,1", *FAST[2:]]
    for extra in ([], ["--overwrite"]):
        rc = main(["compare", "--out", str(out), *two_seeds, *extra])
        _one_line_error(capsys, rc, str(decoy), "not a run of this comparison")
        assert _snapshot(decoy) == before
    (decoy / "config.yaml").write_text("name: my-experiment\nalgo: mine\n")  # someone else's config.yaml
    before = _snapshot(decoy)
    rc = main(["compare", "--out", str(out), *two_seeds, "--overwrite"])
    _one_line_error(capsys, rc, str(decoy), "not a run of this comparison")
    assert _snapshot(decoy) == before
    assert not (out / "gspo-s0").exists()
    decoy_file = out / "gspo_token-s0"  # a file where a run folder goes
    decoy_file.write_text("a file")
    rc = main(["compare", "--out", str(out), *FAST[:2], "--variants", "gspo_token", *FAST[4:]])
    _one_line_error(capsys, rc, str(decoy_file), "is not a folder")
    assert decoy_file.read_text() == "a file"
    assert not (out / "report.md").exists() and not (tmp_path / "warm-starts").exists()


def test_plan_run_decides_without_deleting(tmp_path):
    """Each state of a run folder: empty -> new run; same settings, no checkpoint yet -> start over
    (train removes only what a run writes); other settings -> refused naming the setting and
    --overwrite, or with it started over; finished with other settings -> refused. plan_run itself
    never removes a file."""
    out = tmp_path / "out"
    cfg = _run_cfg(out, lr=1e-4)
    run = cfg.run_dir
    run.mkdir(parents=True)
    assert plan_run(cfg) == cfg  # empty folder
    save_yaml(cfg, run / "config.yaml")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "checkpoints" / "step-000001").mkdir(parents=True)  # incomplete: no trainer state
    (run / "my-notes.txt").write_text("mine")
    before = _snapshot(run)
    assert plan_run(cfg).overwrite and plan_run(cfg).resume is False
    changed = dataclasses.replace(cfg, lr=2e-4)
    with pytest.raises(GspoError) as e:
        plan_run(changed)
    msg = str(e.value)
    assert str(run) in msg and "unfinished run made with other settings" in msg and "lr: 0.0001" in msg
    assert "--overwrite" in msg and "\n" not in msg
    assert plan_run(changed, overwrite=True).overwrite
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text("{}")
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, run / "final" / "model.safetensors")  # finished: final/ holds its weights
    weights = (run / "final" / "model.safetensors").read_bytes()
    assert plan_run(cfg) is None  # finished with the same settings: reused
    with pytest.raises(GspoError, match="is a finished run made with other settings"):
        plan_run(changed)
    assert _snapshot(run) == {**before, "final/config.json": b"{}", "final/model.safetensors": weights}


def test_interrupted_compare_run_is_resumed_or_refused_never_wiped(tmp_path, capsys):
    """A compare's run interrupted after its checkpoints: re-running the compare with one flag
    changed is refused in one line (checkpoints and metrics intact); the same command resumes it
    from its last checkpoint and finishes it."""
    from gspo.launch import train

    out = tmp_path / "out"
    tiny = dict(steps=2, save_every=1, eval_size=4, prompts_per_step=2, group_size=2, max_new_tokens=4)
    tiny |= dict(eval_every=0, threads=1, progress=False, reproducible=False)  # in this process: not pinned
    cfg = _run_cfg(out, **tiny)
    train(cfg)
    run = cfg.run_dir
    import shutil

    shutil.rmtree(run / "final")  # as if killed after the last checkpoint
    before = _snapshot(run)
    assert any(k.startswith("checkpoints/step-") for k in before)
    flags = {k: v for k, v in tiny.items() if k not in ("save_every",)}
    with pytest.raises(GspoError, match=r"unfinished run made with other settings \(lr: "):
        run_compare(None, {**flags, "sft_steps": 0, "lr": 5e-5}, [0], ["gspo"], str(out), workers=1)
    assert _snapshot(run) == before
    run_compare(None, {**flags, "sft_steps": 0, "save_every": 1}, [0], ["gspo"], str(out), workers=1)
    assert (run / "final" / "config.json").exists()
    assert "resuming from" in capsys.readouterr().err
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 2


@pytest.mark.parametrize(
    "args, want",
    [
        (["--study", ","], "--study: expected comma-separated names"),
        (["--study", ""], "--study: expected comma-separated names"),
        (["--variants", ""], "--variants: expected comma-separated names"),
        (["--variants", " , "], "--variants: expected comma-separated names"),
        (["--seeds", ""], "--seeds: expected comma-separated"),
    ],
)
def test_compare_empty_names_are_one_line(tmp_path, capsys, args, want):
    """Given but naming nothing: refused (`--variants ""` used to start the default compare; the
    unknown preset makes a regression fail at once instead of training)."""
    rc = main(["compare", "--out", str(tmp_path / "o"), *args, "--preset", "no-such-preset"])
    _one_line_error(capsys, rc, want)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("study", [False, True])
def test_compare_out_that_is_a_file_or_under_one(tmp_path, capsys, study):
    f = tmp_path / "afile"
    f.write_text("data")
    extra = ["--study", str(tmp_path)] if study else FAST
    rc = main(["compare", "--out", str(f), *extra])
    _one_line_error(capsys, rc, f"--out {f}: is not a folder")
    rc = main(["compare", "--out", str(f / "sub"), *extra])
    _one_line_error(capsys, rc, f"--out {f / 'sub'}: lies under {f}")
    assert f.read_text() == "data"


# ------------------------------------------------------------------------------------------------
# plan: model shapes, GPU memory, the micro-batch search, multi-turn sequence length

BASE = dict(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)


@pytest.mark.parametrize(
    "change, want",
    [
        (dict(num_attention_heads=0), "'num_attention_heads' must be a whole number"),
        (dict(hidden_size=float("nan")), "'hidden_size' must be a whole number"),
        (dict(vocab_size=float("inf")), "'vocab_size' must be a whole number"),
        (dict(hidden_size=[64]), "'hidden_size' must be a whole number"),
        (dict(num_hidden_layers={"n": 2}), "'num_hidden_layers' must be a whole number"),
        (dict(num_hidden_layers=-2), "'num_hidden_layers' must be a whole number"),
        (dict(intermediate_size=True), "'intermediate_size' must be a whole number"),
        (dict(hidden_size=64.5), "'hidden_size' must be a whole number"),
        (dict(hidden_size=10**30), "'hidden_size' must be a whole number"),
        (dict(hidden_size=65), "'num_attention_heads' 4 does not divide 'hidden_size' 65"),
        (dict(num_key_value_heads=3), "'num_key_value_heads' 3 does not divide 'num_attention_heads' 4"),
        (dict(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8), "'num_experts_per_tok'"),
        (dict(vocab_size=None), "missing 'vocab_size'"),
        (dict(tie_word_embeddings="yes"), "'tie_word_embeddings' must be true or false"),
    ],
)
def test_plan_refuses_an_impossible_model_config(tmp_path, capsys, change, want):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**BASE, **change}))  # NaN/Infinity: Python's JSON
    rc = main(["plan", "--model", str(model), "--gpus", "1"])
    _one_line_error(capsys, rc, f"{model / 'config.json'}: {want}")


def test_plan_accepts_head_dim_that_does_not_divide_the_hidden_size():
    """Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024 (head_dim given): a real shape."""
    assert shape_of("Qwen/Qwen3-0.6B").q_dim == 2048
    assert Shape.from_config({**BASE, "hidden_size": 65, "head_dim": 16}).q_dim == 64


def test_plan_refuses_an_unreadable_model_config(tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    for content in (b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b"[1, 2]"):
        (model / "config.json").write_bytes(content)
        rc = main(["plan", "--model", str(model), "--gpus", "1"])
        _one_line_error(capsys, rc, str(model / "config.json"))


@pytest.mark.parametrize("gb", ["nan", "inf", "-inf", "1e300", "0", "-1"])
def test_plan_refuses_a_gpu_memory_that_is_not_a_positive_finite_number(capsys, gb):
    rc = main(["plan", "--model", "Qwen/Qwen3-0.6B", "--gpus", "1", f"--gpu-memory-gb={gb}"])
    _one_line_error(capsys, rc, "--gpu-memory-gb")


def _linear_search(cfg: Config, shape: Shape, world: int, gpu: float) -> int:
    best = 0
    per = max(1, cfg.prompts_per_step * cfg.group_size // world // cfg.num_minibatches)
    for m in range(1, per + 1):
        if (
            estimate(capacity_plan(dataclasses.replace(cfg, micro_batch_size=m)), shape, world, gpu).peak
            <= gpu
        ):
            best = m
    return best


@pytest.mark.parametrize("model", ["Qwen/Qwen3-0.6B", "tiny"])
@pytest.mark.parametrize("minibatches", [1, 4])
def test_largest_micro_batch_equals_the_exhaustive_search(model, minibatches):
    """Bisection below the whole minibatch, the whole minibatch tried first (it holds no gradients
    across micro-batches): the same answer as trying every size, on a GPU of each size's peak (and
    just below it). The tiny model's activations outgrow its gradients, so there the whole
    minibatch need not fit where one sequence less does."""
    shape = Shape.from_config(BASE) if model == "tiny" else shape_of(model)
    cfg = Config(prompts_per_step=8, group_size=8, num_minibatches=minibatches, max_new_tokens=512).validate()
    peaks = {
        estimate(capacity_plan(dataclasses.replace(cfg, micro_batch_size=m)), shape, 1).peak
        for m in range(1, 65)
    }
    for gpu in sorted(peaks | {p * (1 - 1e-9) for p in peaks}):
        assert largest_micro_batch(capacity_plan(cfg), shape, 1, gpu) == _linear_search(cfg, shape, 1, gpu), (
            gpu
        )


def test_plan_answers_at_once_for_a_million_sequences(capsys):
    """prompts x group = 10**6 (the config's cap): the micro-batch search used to try every size
    (20-55 s); now a handful of estimates. More than the cap is refused in one line."""
    cfg = Config(model="Qwen/Qwen3-8B", prompts_per_step=1000, group_size=1000).validate()
    shape = shape_of("Qwen/Qwen3-8B")
    t0 = time.process_time()
    best = largest_micro_batch(capacity_plan(cfg), shape, 1, 141e9)
    assert time.process_time() - t0 < 2.0
    assert 0 < best <= 10**6
    t0 = time.process_time()
    rc = main(_plan_8b("--prompts-per-step", "1000", "--group-size", "1000", "--gpu-memory-gb", "1000"))
    assert time.process_time() - t0 < 2.0
    assert rc == 2 and "largest micro_batch_size that fits: " in capsys.readouterr().out
    rc = main(_plan_8b("--prompts-per-step", "10000", "--group-size", "1000"))
    _one_line_error(capsys, rc, "prompts_per_step x group_size must be <= 1,000,000")


def _plan_8b(*args: str) -> list[str]:
    return ["plan", "--model", "Qwen/Qwen3-8B", "--gpus", "1", *args]


def test_multi_turn_runs_are_planned_by_their_trajectory_length(capsys):
    """With an environment, a sequence after its prompt is up to max_trajectory_tokens long (all
    turns and observations), not max_new_tokens (one turn): the plan's activations and KV cache grow
    with it, and gspo train's memory check refuses what only the trajectory makes too large."""
    from gspo.limits import check_plan_fits

    shape = shape_of("Qwen/Qwen3-1.7B")
    base = dict(model="Qwen/Qwen3-1.7B", prompts_per_step=8, group_size=8, max_new_tokens=256)
    single = estimate(capacity_plan(Config(**base, max_trajectory_tokens=8192).validate()), shape, 1)
    short = estimate(
        capacity_plan(Config(**base, env="tools", max_trajectory_tokens=256).validate()), shape, 1
    )
    long = estimate(
        capacity_plan(Config(**base, env="tools", max_trajectory_tokens=8192).validate()), shape, 1
    )
    assert short.activations == pytest.approx(single.activations)  # one turn's budget = the trajectory's
    assert long.activations > 8 * short.activations and long.sampler > 8 * short.sampler
    fits = Config(**base, max_trajectory_tokens=8192).validate()
    check_plan_fits(capacity_plan(fits), 1, 141e9)  # single-turn: the trajectory budget does not apply
    with pytest.raises(GspoError, match="config field 'micro_batch_size': this run needs about"):
        check_plan_fits(capacity_plan(dataclasses.replace(fits, env="tools")), 1, 141e9)
    main(_plan_8b("--env", "tools", "--max-trajectory-tokens", "4096"))
    assert "up to 256+4096 tokens" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# YAML: config files and presets


def test_duplicate_key_in_a_config_file_names_file_line_and_key(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("steps: 2\nlr: 1e-4\nsteps: 3\n")
    with pytest.raises(GspoError) as e:
        load_yaml(str(f))
    assert str(e.value) == f"{f}:3: invalid YAML: duplicate key 'steps' (first on line 1)"
    rc = main(["train", "--config", str(f)])
    _one_line_error(capsys, rc, f"{f}:3:", "duplicate key 'steps'")
    rc = main(["compare", "--config", str(f), "--out", str(tmp_path / "o"), *FAST])
    _one_line_error(capsys, rc, f"{f}:3:", "duplicate key 'steps'")
    rc = main(["plan", "--config", str(f)])
    _one_line_error(capsys, rc, f"{f}:3:", "duplicate key 'steps'")


def test_duplicate_keys_in_presets_at_any_depth(tmp_path, capsys):
    p = tmp_path / "p.yaml"
    p.write_text("config: {steps: 2}\nseeds: [0]\nconfig: {steps: 3}\n")
    with pytest.raises(
        GspoError, match=r"p\.yaml:3: invalid YAML: duplicate key 'config' \(first on line 1\)"
    ):
        load_preset(str(p))
    p.write_text("seeds: [0]\nconfig:\n  lr: 1.0e-4\n  steps: 2\n  steps: 3\n")
    rc = main(["compare", "--preset", str(p), "--out", str(tmp_path / "o"), *FAST[4:]])
    _one_line_error(capsys, rc, f"{p}:5:", "duplicate key 'steps'")


def test_merge_keys_may_still_be_overridden(tmp_path):
    """`<<: *base` then a key of base: YAML's override, not a duplicate."""
    f = tmp_path / "m.yaml"
    f.write_text("base: &b {steps: 2, lr: 1}\nrun:\n  <<: *b\n  steps: 3\n")
    assert read_yaml(f)[0]["run"] == {"steps": 3, "lr": 1}


@pytest.mark.parametrize(
    "content, want",
    [
        (b"description: \xff\xfe\n", "preset file is not UTF-8 text"),
        (b"config: " + b"[" * 10_000 + b"]" * 10_000 + b"\n", ":1: invalid YAML: nested too deeply"),
        (b"seeds: 3\n", ":1: 'seeds' must be a non-empty list of integers"),
        (b"seeds: [a]\n", ":1: 'seeds' must be a non-empty list of integers"),
        (b"seeds: [1.5]\n", ":1: 'seeds' must be a non-empty list of integers"),
        (b"seeds: []\n", ":1: 'seeds' must be a non-empty list of integers"),
        (b"variants: gspo\n", ":1: 'variants' must be a non-empty list of names"),
        (b"variants: [[gspo]]\n", ":1: 'variants' must be a non-empty list of names"),
        (b"description: x\nwarm_target: abc\n", ":2: 'warm_target' must be a finite number"),
        (b"warm_target: .nan\n", ":1: 'warm_target' must be a finite number"),
        (b"description: [a]\n", ":1: 'description' must be text"),
        (b"config: [1]\n", ":1: 'config' must be a mapping of config keys"),
        (b"config: {1: 2}\n", ":1: 'config' must be a mapping of config keys"),
        (b"config: {steps: [1]}\n", ":1: config key 'steps' expects int, got a list"),
        (b"primary: 3\n", ":1: 'primary' must be a list of endpoints"),
        (b"primary: [{metric: [1], contrast: gspo - grpo}]\n", "unknown metric"),
        (b"primary: [{metric: acc_final, contrast: [gspo]}]\n", "contrast must be 'a - b'"),
        (b"primary: [{metric: acc_final, contrast: gspo - grpo, margin: x}]\n", "'margin' must be a finite"),
        (b"primary: [{metric: acc_final, contrast: gspo - grpo, direction: [up]}]\n", "direction must be"),
        (b"primary: [{metric: acc_final, contrast: gspo - grpo}]\nfamily: {size: x}\n", ":2: family size"),
        (b"primary: [{metric: acc_final, contrast: gspo - grpo}]\nfamily: {alpha: .nan}\n", "'family alpha'"),
        (b"- seeds\n", "expected a mapping of preset keys, got list"),
        (b"seedz: [0]\n", "unknown preset key(s) seedz"),
        (b"pairs: [gspo - nope]\n", ":1: 'pairs' must be a list of 'a - b' of this preset's variants"),
        (b"pairs: gspo - grpo\n", ":1: 'pairs' must be a list of 'a - b'"),
    ],
)
def test_bad_preset_is_one_line_naming_file_line_and_key(tmp_path, capsys, content, want):
    p = tmp_path / "p.yaml"
    p.write_bytes(content)
    with pytest.raises(GspoError) as e:
        load_preset(str(p))
    assert str(e.value).startswith(str(p)) and want in str(e.value) and "\n" not in str(e.value), str(e.value)
    rc = main(["compare", "--preset", str(p), "--out", str(tmp_path / "o")])
    _one_line_error(capsys, rc, str(p), want)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "content, want",
    [
        (b"lr: 1e-4\nsteps: [1]\n", ":2: config key 'steps' expects int, got a list"),
        (b"lr: 1e-4\n\nsteps: {a: 1}\n", ":3: config key 'steps' expects int, got a dict"),
        (b"steps: 2\nseed: .inf\n", ":2: config key 'seed' expects int, got inf"),
        (b"steps: 2\nlr: .nan\n", "config field 'lr': must be a finite number"),
        (b"steps: " + b"[" * 10_000 + b"]" * 10_000 + b"\n", ":1: invalid YAML: nested too deeply"),
        (b"a: &a [1]\nb: [*a, *a]\n", ":1: unknown config key 'a'"),
        (b"false\n", "expected a mapping of config keys, got bool"),
    ],
)
def test_bad_config_file_values_name_the_line(tmp_path, capsys, content, want):
    f = tmp_path / "c.yaml"
    f.write_bytes(content)
    rc = main(["train", "--config", str(f)])
    _one_line_error(capsys, rc, str(f), want)


def test_known_models_and_embedded_ones_still_read():
    """The checks refuse nothing real: every shipped shape and the embedded models."""
    for name in KNOWN_MODELS:
        assert shape_of(name).params() > 0
    for spec in ("embedded:tiny-moe", "embedded:tiny-dense"):
        s = shape_of(spec)
        assert s.heads % s.kv_heads == 0 and math.isfinite(s.params())
