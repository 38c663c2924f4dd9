"""Hostile inputs: every one fails in one line naming the file or field and the problem, exit 2, never a
traceback or a hang, before any training (issue 23, "every input range-checked").

Most cases call ``gspo.cli.main`` in this process (what ``gspo`` runs) or the validating function;
the few that need a reward to be called run the real command once.
"""

import json
import os
import resource
import signal
import time

import pytest
from cli_helpers import one_line

from gspo.cli import main
from gspo.errors import GspoError
from gspo.resolve import capacity_plan

FAST = [
    "--sft-steps", "0", "--steps", "1", "--eval-size", "2", "--prompts-per-step", "2", "--group-size", "2",
    "--num-minibatches", "1", "--max-new-tokens", "4", "--eval-every", "0", "--threads", "1", "--no-progress",
]  # fmt: skip


def _train(capsys, tmp_path, *args, want):
    return one_line(capsys, ["train", *FAST, "--output-dir", str(tmp_path / "o"), *args], want)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------------------------------------
# datasets


def test_deeply_nested_json_is_one_line(tmp_path, capsys):
    f = tmp_path / "deep.jsonl"
    f.write_text('{"prompt": "a", "answer": ' + "[" * 20_000 + "]" * 20_000 + "}\n")
    _train(capsys, tmp_path, "--task", str(f), want=f"{f}:1: invalid JSON: nested too deeply")
    g = tmp_path / "deep.json"
    g.write_text('[{"prompt": "a", "answer": ' + "[" * 20_000 + "]" * 20_000 + "}]")
    _train(capsys, tmp_path, "--task", str(g), want=f"{g}:1: invalid JSON: nested too deeply")


def test_5000_digit_integer_answer_is_one_line(tmp_path, capsys):
    f = tmp_path / "big.jsonl"
    f.write_text('{"prompt": "p", "answer": "1"}\n{"prompt": "x", "answer": ' + "9" * 5000 + "}\n")
    line = _train(capsys, tmp_path, "--task", str(f), want=f"{f}:2: unreadable JSON value")
    assert "4300 digits" in line and len(line) < 300


def test_held_out_prompts_also_in_training_are_warned_about(tmp_path, capsys):
    from gspo.tasks import build_task

    rows = [{"prompt": f"q{i % 5}", "answer": "1"} for i in range(20)]  # every prompt 4 times
    task = build_task(_write_jsonl(tmp_path / "dup.jsonl", rows), "exact_match", 0, 2)
    err = capsys.readouterr().err
    assert len(task.eval) == 2
    assert "gspo: warning: 2 of 2 held-out prompts of" in err and "also occur in the training set" in err
    build_task(_write_jsonl(tmp_path / "ok.jsonl", [{"prompt": f"u{i}", "answer": "1"} for i in range(20)]),
               "exact_match", 0, 2)  # fmt: skip
    assert "held-out prompts" not in capsys.readouterr().err


def test_relative_dataset_path_of_a_run_is_found_by_eval_from_another_folder(tmp_path, monkeypatch, capsys):
    """A run started in ``work/`` with ``--task data.jsonl --output-dir runs``: ``gspo eval`` of its model
    works from anywhere; moved elsewhere, it says which setting and how to fix it."""
    from gspo.checkpoint_eval import evaluate_checkpoint
    from gspo.config import Config, save_yaml
    from gspo.model.load import load_model_and_tokenizer, save_pretrained

    work = tmp_path / "work"
    run = work / "runs" / "r"
    run.mkdir(parents=True)
    _write_jsonl(work / "data.jsonl", [{"prompt": f"{i}", "answer": "1"} for i in range(20)])
    save_yaml(
        Config(task="data.jsonl", output_dir="runs", name="r", eval_size=2, max_new_tokens=2),
        run / "config.yaml",
    )
    (run / "metrics.jsonl").write_text("")
    save_pretrained(*load_model_and_tokenizer("embedded:tiny-dense"), run / "final")
    monkeypatch.chdir(tmp_path)
    out = evaluate_checkpoint(str(run / "final"))
    assert out["task"] == str(work / "data.jsonl") and out["n"] == 2
    (work / "data.jsonl").rename(tmp_path / "moved.jsonl")
    capsys.readouterr()  # the progress bars of the save and load above, when this test runs alone
    one_line(capsys, ["eval", str(run / "final")], "config.yaml: task 'data.jsonl' is relative to the folder")


# ------------------------------------------------------------------------------------------------
# numbers the machine cannot hold, or that make no sense


@pytest.mark.parametrize(
    "flag,value,want",
    [
        ("--async-staleness", "1000000", "config field 'async_staleness': must be <= 64"),
        ("--eval-size", "1000000000", "config field 'eval_size': must be <= 1,000,000"),
        ("--sft-batch-size", "1000000000", "config field 'sft_batch_size': must be <= 1,000,000"),
        ("--steps", "9" * 30, "config field 'steps': must be <="),
        ("--seed", "-1", "config field 'seed': must be >= 0"),
        ("--seed", str(2**64), "config field 'seed': must be <="),
        ("--max-new-tokens", str(10**12), "config field 'max_new_tokens': must be <="),
        ("--temperature", "1e-30", "config field 'temperature': must be >= 0.001"),
        ("--nproc", "100000", "config field 'nproc': must be <="),
        ("--dynamic-sampling-max-rounds", "10000000", "config field 'dynamic_sampling_max_rounds'"),
        ("--overlong-penalty", "1e300", "config field 'overlong_penalty': must be <= 1e+30"),
        ("--reward-timeout-s", "1e30", "config field 'reward_timeout_s': must be <= 604800"),
        ("--lr", "1" + "0" * 400, "config field 'lr': must be a finite number"),
        ("--group-size", "9" * 5000, "config key 'group_size' expects int"),  # int-to-str digit limit
    ],
)
def test_absurd_numbers_are_refused_before_work(tmp_path, capsys, flag, value, want):
    line = _train(capsys, tmp_path, flag, value, want=want)
    assert len(line) < 400  # the value is shortened, not printed whole
    assert not (tmp_path / "o").exists()  # refused before the run folder is made


def test_batches_are_checked_against_available_memory(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("gspo.memory.available_memory", lambda: 64 << 20)  # a 64 MiB machine
    _train(capsys, tmp_path, "--eval-size", "100000", want="config field 'eval_size': needs at least")
    _train(capsys, tmp_path, "--prompts-per-step", "20000", "--group-size", "4",
           want="config field 'prompts_per_step': needs at least")  # fmt: skip


def test_lora_rank_past_the_hidden_size(tmp_path, capsys):
    from gspo.config import Config
    from gspo.limits import check_resources
    from gspo.model.load import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("embedded:tiny-moe")
    check_resources(capacity_plan(Config(lora_rank=64)), model)
    with pytest.raises(GspoError, match="config field 'lora_rank': must be <= the model's hidden size 64"):
        check_resources(capacity_plan(Config(lora_rank=65)), model)


def test_model_aware_check_counts_the_async_weight_copies_and_their_files(monkeypatch):
    from gspo.config import Config
    from gspo.limits import check_resources
    from gspo.model.load import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("embedded:tiny-moe")
    check_resources(capacity_plan(Config(async_staleness=4)), model)  # fits
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1024))
    with pytest.raises(
        GspoError, match=r"config field 'async_staleness': needs about \d+ open files.*ulimit -n"
    ):
        check_resources(capacity_plan(Config(async_staleness=64)), model)
    # over a process group (--rollout-devices) no shared-memory descriptor is opened
    check_resources(capacity_plan(Config(async_staleness=64, rollout_devices="cpu")), model)
    monkeypatch.setattr("gspo.memory.available_memory", lambda: 4 << 20)  # 9 copies of 0.9 MB do not fit
    small = dict(
        prompts_per_step=2, group_size=2, num_minibatches=1, eval_size=2, max_prompt_tokens=16, sft_steps=0
    )
    check_resources(capacity_plan(Config(**small, async_staleness=1)), model)
    with pytest.raises(GspoError, match="config field 'async_staleness': needs about 7.8 MiB of memory"):
        check_resources(capacity_plan(Config(**small, async_staleness=8)), model)
    with pytest.raises(GspoError, match="needs about 7.8 MiB"):  # a CPU sampler holds them here too
        check_resources(capacity_plan(Config(**small, async_staleness=8, rollout_devices="cpu")), model)


@pytest.mark.parametrize("value", ["1" + "0" * 50, "1.0e+50"])
def test_yaml_prompts_per_step_1e50(tmp_path, capsys, value):
    (tmp_path / "c.yaml").write_text(f"prompts_per_step: {value}\n")
    i = FAST.index("--prompts-per-step")
    args = FAST[:i] + FAST[i + 2 :]  # the YAML's value, not the flag's
    one_line(capsys, ["train", *args, "--config", str(tmp_path / "c.yaml")],
              "config field 'prompts_per_step': must be <= 1,000,000")  # fmt: skip


def test_yaml_alias_bomb_is_refused_at_once(tmp_path, capsys):
    lines, prev = ["name:"], None
    for c in "abcdefghi":  # 9**9 strings when expanded
        item = "*" + prev if prev else "x"
        lines.append(f"  - &{c} [{', '.join([item] * 9)}]")
        prev = c
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\n")
    t0 = time.time()
    _train(
        capsys,
        tmp_path,
        "--config",
        str(tmp_path / "bomb.yaml"),
        want="config key 'name' expects str, got a list",
    )
    assert time.time() - t0 < 10


# ------------------------------------------------------------------------------------------------
# files: YAML config, model and tokenizer folders


@pytest.mark.parametrize(
    "content,want",
    [
        (b"steps: \xff\xfe\n", "config file is not UTF-8 text"),
        (b"steps: " + b"[" * 5_000 + b"]" * 5_000 + b"\n", "invalid YAML: nested too deeply"),
        (b"1: 2\n", "config keys must be names, got int 1"),
        (b"- steps\n", "expected a mapping of config keys, got list"),
        (b"steps: [1, 2\n", "invalid YAML"),
        (b"name: {a: 1}\n", "config key 'name' expects str, got a dict"),
        (b"lr: 1" + b"0" * 400 + b"\n", "config key 'lr' expects float"),  # float(int) overflows
    ],
)
def test_bad_yaml_config_is_one_line_naming_the_file(tmp_path, capsys, content, want):
    f = tmp_path / "c.yaml"
    f.write_bytes(content)
    line = _train(capsys, tmp_path, "--config", str(f), want=want)
    assert str(f) in line


def test_yaml_config_that_is_a_folder(tmp_path, capsys):
    _train(capsys, tmp_path, "--config", str(tmp_path), want=f"config file {tmp_path} is a directory")


def test_fifo_as_config_or_dataset_does_not_block(tmp_path, capsys):
    os.mkfifo(tmp_path / "c.yaml")
    os.mkfifo(tmp_path / "d.jsonl")
    _train(capsys, tmp_path, "--config", str(tmp_path / "c.yaml"), want="is not a regular file")
    _train(capsys, tmp_path, "--task", str(tmp_path / "d.jsonl"), want="d.jsonl: not a regular file")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gspo.model.load import load_model_and_tokenizer, save_pretrained

    d = tmp_path_factory.mktemp("m") / "model"
    save_pretrained(*load_model_and_tokenizer("embedded:tiny-dense"), d)
    return d


def _broken_copy(model_dir, tmp_path, name, text):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(model_dir, d)
    (d / name).write_text(text)
    return d


@pytest.mark.parametrize(
    "name,text,want",
    [
        ("config.json", "{bad", "config.json:1: invalid JSON"),
        ("config.json", "[1]", "config.json: expected a JSON object, got list"),
        (
            "config.json",
            None,
            "config.json: StrictDataclassFieldValidationError",
        ),  # a field of the wrong type
        ("tokenizer.json", "[1, 2", "tokenizer.json:1: invalid JSON"),
    ],
)
def test_bad_model_or_tokenizer_file_is_one_line_naming_it(model_dir, tmp_path, capsys, name, text, want):
    if text is None:
        cfg = json.loads((model_dir / "config.json").read_text())
        text = json.dumps({**cfg, "num_hidden_layers": "two"})
    d = _broken_copy(model_dir, tmp_path, name, text)
    line = _train(capsys, tmp_path, "--model", str(d), want="config field 'model'")
    assert want.split(":")[0] in line and want.split(":")[-1].strip() in line


def test_tokenizer_with_ids_past_the_model_vocabulary_is_refused_at_load(model_dir, tmp_path, capsys):
    from gspo.model.load import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.add_tokens([f"<extra{i}>" for i in range(20)])
    tok.save_pretrained(tmp_path / "tok")
    line = _train(capsys, tmp_path, "--model", str(model_dir), "--tokenizer", str(tmp_path / "tok"),
                  want="config field 'tokenizer'")  # fmt: skip
    assert "token ids up to 72 (73 tokens)" in line and "only 53 embedding rows" in line


# ------------------------------------------------------------------------------------------------
# names


@pytest.mark.parametrize("name", [".", "..", "a/b", "/abs", "..\\x", " "])
def test_run_name_must_stay_inside_the_output_folder(tmp_path, capsys, name):
    _train(capsys, tmp_path, "--name", name, want="config field 'name': must be a plain folder name")


@pytest.mark.parametrize("name", ["a\nb", "tab\there", "x" * 300])
def test_run_name_without_control_characters_and_not_too_long(tmp_path, capsys, name):
    _train(capsys, tmp_path, "--name", name, want="config field 'name': must be at most 200 bytes")


def test_answer_longer_than_the_context_is_refused_before_the_warm_start(tmp_path, capsys):
    """A 200,000-character answer (the sweep's run was killed for memory after 83 s): one line naming
    the example, before the first supervised step."""
    rows = [{"prompt": f"rev:{i}=", "answer": str(i)[::-1]} for i in range(30)]
    rows.append({"prompt": "x", "answer": "9" * 200_000})
    f = _write_jsonl(tmp_path / "big.jsonl", rows)
    args = [*FAST, "--sft-steps", "5", "--eval-size", "4"]
    line = one_line(capsys, ["train", *args, "--task", f, "--output-dir", str(tmp_path / "o")], "warm start:")
    assert "answer tokens, more than the model's context" in line


def test_threads_left_by_user_code_do_not_keep_the_command_alive(tmp_path):
    """A reward that starts a non-daemon thread and returns: the finished command still exits (with a
    warning line), instead of hanging until killed."""
    import subprocess
    import sys

    leak = tmp_path / "leak.py"
    leak.write_text(
        "import threading, time\n"
        "def reward(prompts, completions, answers):\n"
        "    threading.Thread(target=time.sleep, args=(3600,)).start()\n"
        "    return [float(c == a) for c, a in zip(completions, answers)]\n"
    )
    cmd = [sys.executable, "-m", "gspo", "train", *FAST, "--output-dir", str(tmp_path), "--name", "r",
           "--reward", f"{leak}:reward"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "gspo: warning: user code left" in r.stderr and "exiting anyway" in r.stderr


def test_config_built_in_python_is_type_checked():
    from gspo.config import Config

    with pytest.raises(GspoError, match="config field 'name': expects str, got dict"):
        Config(name={"a": 1}).validate()  # type: ignore[arg-type]
    with pytest.raises(GspoError, match="config field 'steps': expects int, got str"):
        Config(steps="10").validate()  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# rewards


def _safe(fn, on_error="error", n=2):
    from gspo.tasks.rewards import safe_rewards

    return safe_rewards(fn, ["p"] * n, ["c"] * n, ["a"] * n, on_error=on_error, name="my:fn")


def test_reward_that_overflows_float32_names_the_reward():
    with pytest.raises(GspoError, match=r"reward function my:fn returned 1e\+39, which overflows float32"):
        _safe(lambda p, c, a: [1e39, 0.0])
    assert _safe(lambda p, c, a: [1e39, 0.0], on_error="zero") == ([0.0, 0.0], 1)
    assert _safe(lambda p, c, a: [3e38, 0.0]) == ([3e38, 0.0], 0)  # float32's max is 3.4e38


def test_reward_plus_overlong_penalty_checked_finite_in_float32():
    import torch

    from gspo.training.scoring import check_finite_rewards

    check_finite_rewards(torch.tensor([1.0, 0.0]), torch.zeros(2), "r", 1.0)
    with pytest.raises(GspoError, match="reward function r: sample 1's reward plus the overlong penalty"):
        check_finite_rewards(torch.tensor([1.0, 3e38]) + torch.tensor([0.0, 3e38]), torch.ones(2), "r", 1.0)


def test_reward_systemexit_and_keyboardinterrupt_are_the_rewards_errors():
    def exits(p, c, a):
        raise SystemExit(3)

    def interrupts(p, c, a):
        raise KeyboardInterrupt

    with pytest.raises(GspoError, match="reward function my:fn raised SystemExit: 3"):
        _safe(exits)
    with pytest.raises(GspoError, match=r"failed on all 2 samples.*raised SystemExit: 3"):
        _safe(exits, on_error="zero")  # counted as errors: all of them, so still an error
    calls = []

    def sometimes(p, c, a):
        calls.append(c)
        if len(c) > 1 or len(calls) == 2:
            raise SystemExit(1)
        return [1.0]

    assert _safe(sometimes, on_error="zero") == ([0.0, 1.0], 1)
    old = signal.signal(signal.SIGINT, lambda *a: None)  # as under `gspo train`: signals never raise it
    try:
        with pytest.raises(GspoError, match="reward function my:fn raised KeyboardInterrupt"):
            _safe(interrupts)
    finally:
        signal.signal(signal.SIGINT, old)
    # Python's default handler (set here: an earlier test in the same process may have left another):
    # a real Ctrl-C looks the same
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _safe(interrupts)
    finally:
        signal.signal(signal.SIGINT, old)


def test_reward_exit_and_overflow_through_the_command(tmp_path, capsys, monkeypatch):
    """Before: exit 3 and no message; exit 0 with every update skipped, the message blaming lr."""
    (tmp_path / "r.py").write_text(
        "def exits(p, c, a):\n    raise SystemExit(3)\n\ndef huge(p, c, a):\n    return [1e39] * len(c)\n"
    )
    monkeypatch.chdir(tmp_path)
    for fn, want in (("exits", "raised SystemExit: 3"), ("huge", "overflows float32")):
        line = _train(
            capsys, tmp_path, "--name", fn, "--reward", f"r.py:{fn}", want=f"reward function r.py:{fn}"
        )
        assert want in line


def test_reward_returning_an_endless_generator_or_a_huge_int():
    import itertools

    with pytest.raises(GspoError, match="reward function my:fn returned 3 values for 2 samples"):
        _safe(lambda p, c, a: itertools.count())  # islice: no hang
    with pytest.raises(GspoError, match="returned int too large for a float for sample 0"):
        _safe(lambda p, c, a: [10**400, 0])


def test_builtin_rewards_run_under_the_reward_time_limit():
    from gspo.tasks.rewards import load_reward

    fn = load_reward("format:(a|aa)+b", timeout_s=0.5)  # catastrophic backtracking on "aaaa...a"
    t0 = time.time()
    with pytest.raises(GspoError, match=r"reward function format:\(a\|aa\)\+b timed out after 0.5 s"):
        fn(["p"], ["a" * 5000], [""])
    assert time.time() - t0 < 5
    assert fn(["p"], ["aab", "ba"], ["", ""]) == [1.0, 0.0]
    for spec in ("boxed", "format:x+"):
        assert load_reward(spec, timeout_s=7).timeout_s == 7
    assert not hasattr(load_reward("exact_match", timeout_s=7), "timeout_s")  # a strip and a compare


def test_reward_timeout_past_what_threading_can_wait_is_one_line():
    from gspo.tasks.rewards import with_timeout

    with pytest.raises(GspoError, match="timeout_s must be <= 604800 s"):
        with_timeout(lambda p, c, a: [0.0] * len(c), "f", 1e30)


# ------------------------------------------------------------------------------------------------
# the command line itself


def test_unknown_flag_names_the_subcommand_help(capsys):
    one_line(capsys, ["train", "--bogus"], "unrecognized arguments: --bogus (see 'gspo train --help')")
    one_line(capsys, ["eval", "x", "--bogus"], "(see 'gspo eval --help')")
    one_line(capsys, ["compare", "--bogus"], "unrecognized arguments: --bogus (see 'gspo compare --help')")


def test_version(capsys):
    """``gspo --version``: the installed package's version (metadata), exit 0."""
    from importlib.metadata import version

    from gspo import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"gspo {version('gspo')}"
    assert version("gspo") == __version__


def test_bad_environment_spec_fails_before_the_warm_start(tmp_path, capsys):
    """`--env file.py:Missing` with a warm start of a million steps: the one line comes at once, not
    after the warm start (before the fix: only once the warm start was done)."""
    envs = tmp_path / "envs.py"
    envs.write_text("class Fine:\n    def reset(self, ex):\n        return ex.prompt\n")
    args = ["--model", "embedded:tiny-dense", "--task", "add_long", "--sft-steps", "1000000"]
    args += ["--env", f"{envs}:Missing", "--max-trajectory-tokens", "40"]
    _train(capsys, tmp_path, *args, want=f"config field 'env': {envs} has no callable 'Missing'")
