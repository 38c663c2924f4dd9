"""reasoning-gym tasks (``--task rg:NAME``): examples, the dataset's own scorer as reward, seeds, errors,
and a tiny ``gspo train`` run. Needs ``pip install "gspo[rg]"`` (skipped otherwise, except the
test of the not-installed message)."""

import json
import math
import os
import subprocess
import sys

import pytest

from gspo.errors import GspoError
from gspo.tasks import build_task

# Datasets with one reference answer per question whose scorer gives it 1.0 (checked below).
DATASETS = ["leg_counting", "basic_arithmetic", "spell_backward", "chain_sum"]


@pytest.fixture(scope="module")
def rg():
    return pytest.importorskip("reasoning_gym")


def _task(spec, seed=0, eval_size=30, reward="exact_match", eval_task=None):
    return build_task(spec, reward, seed, eval_size, eval_task)


@pytest.mark.parametrize("name", DATASETS)
def test_examples_and_scorer_reward(rg, name):
    t = _task(f"rg:{name}:size=200")
    assert len(t.train) == 200 and len(t.eval) == 30
    assert t.reward_name.startswith("rg")
    for ex in t.train + t.eval:
        assert isinstance(ex.prompt, str) and ex.prompt.strip()
        assert isinstance(ex.answer, str) and ex.answer.strip()
        assert ex.meta["rg_dataset"] == name and "metadata" in ex.meta
    exs = t.eval + t.train[:30]
    prompts, refs = [e.prompt for e in exs], [e.answer for e in exs]
    assert t.reward(prompts, refs, refs) == [1.0] * len(exs)
    # reasoning-gym's answer format: the last <answer> tag is what gets scored
    tagged = [f"let me think: 1 2 3 <answer>no</answer> so <answer>{a}</answer>" for a in refs]
    assert t.reward(prompts, tagged, refs) == [1.0] * len(exs)
    wrong = [f"zz{a}zz" if i % 2 else "" for i, a in enumerate(refs)]
    scores = t.reward(prompts, wrong, refs)
    assert all(isinstance(s, float) and math.isfinite(s) and 0.0 <= s < 1.0 for s in scores)
    # the scorer is the dataset's own, on the same entry
    ds = rg.create_dataset(name, seed=t.eval[1].meta["rg_seed"], size=len(t.eval) * 4)
    entry = ds[t.eval[1].meta["rg_index"]]
    assert entry["question"] == t.eval[1].prompt
    assert ds.score_answer(answer=wrong[1], entry=entry) == scores[1]


@pytest.mark.parametrize("name", DATASETS[:2])
def test_held_out_disjoint_and_deterministic_by_seed(rg, name):
    a, b, c = (
        _task(f"rg:{name}:size=300", seed=0),
        _task(f"rg:{name}:size=300", seed=0),
        _task(f"rg:{name}:size=300", seed=1),
    )
    key = lambda t: [(e.prompt, e.answer) for e in t.train + t.eval]  # noqa: E731
    assert key(a) == key(b)
    assert key(a) != key(c)
    assert not {e.prompt for e in a.eval} & {e.prompt for e in a.train}
    assert {e.meta["rg_seed"] for e in a.eval} != {e.meta["rg_seed"] for e in a.train}


def test_default_train_size_and_config_params(rg):
    from gspo.tasks.reasoning_gym import TRAIN_SIZE

    assert len(_task("rg:leg_counting", eval_size=5).train) == TRAIN_SIZE
    t = _task("rg:chain_sum:size=50,min_terms=2,max_terms=2,min_digits=1,max_digits=1", eval_size=5)
    for ex in t.train:
        terms = ex.meta["metadata"]["expression"].split()
        assert len(terms) == 3 and all(len(x.lstrip("-")) == 1 for x in terms[::2])


def test_explicit_rg_reward_and_other_rewards(rg):
    t = _task("rg:basic_arithmetic:size=20", reward="rg", eval_size=5)
    assert t.reward_name.startswith("rg")
    e = t.eval[0]
    assert t.reward([e.prompt], [e.answer], [e.answer]) == [1.0]
    # any other reward gets the reference answers like any dataset's
    t = _task("rg:basic_arithmetic:size=20", reward="boxed", eval_size=5)
    assert t.reward_name == "boxed"
    e = t.eval[0]
    assert t.reward([e.prompt], [f"\\boxed{{{e.answer}}}"], [e.answer]) == [1.0]


def test_eval_task_from_another_rg_dataset(rg):
    t = _task("rg:chain_sum:size=20", eval_size=5, eval_task="rg:basic_arithmetic")
    assert all(e.meta["rg_dataset"] == "basic_arithmetic" for e in t.eval)
    for e in (t.train[0], t.eval[0]):
        assert t.reward([e.prompt], [e.answer], [e.answer]) == [1.0]
    with pytest.raises(GspoError, match="eval_task"):
        _task("rg:chain_sum:size=20", eval_size=5, eval_task="data.jsonl")


def test_scorer_that_raises_scores_zero(rg):
    t = _task("rg:prime_factorization:size=10", eval_size=3)
    e = t.eval[0]
    assert t.reward([e.prompt] * 2, ["not a factorization", e.answer], [e.answer] * 2) == [0.0, 1.0]


def test_datasets_without_a_single_answer(rg):
    """graph_color has many valid colorings: answer is "", the scorer checks the completion."""
    t = _task("rg:graph_color:size=10", eval_size=3)
    e = t.eval[0]
    assert e.answer == ""
    assert t.reward([e.prompt], ["not a coloring"], [e.answer]) == [0.0]


def test_prompt_not_from_the_task_is_an_error(rg):
    t = _task("rg:leg_counting:size=10", eval_size=3)
    with pytest.raises(GspoError, match="not an example of rg:leg_counting"):
        t.reward(["how many legs?"], ["4"], ["4"])


@pytest.mark.parametrize(
    "spec, match",
    [
        ("rg:leg_count", r"unknown reasoning-gym dataset 'leg_count' \(close: leg_counting"),
        ("rg:spell_backwards", r"close: spell_backward"),
        ("rg:chain_sum:min_term=2", r"no config key 'min_term' \(did you mean min_terms"),
        ("rg:chain_sum:min_terms=0", r"reasoning-gym rejected the config \(AssertionError: min_terms"),
        ("rg:chain_sum:size=0", r"size must be an integer >= 1"),
        ("rg:chain_sum:size=many", r"size must be an integer >= 1"),
        ("rg:chain_sum:seed=3", r"seed comes from the run's 'seed' field"),
        ("rg:chain_sum:min_terms", r"expected key=value"),
    ],
)
def test_bad_specs_are_one_line_errors(rg, spec, match):
    with pytest.raises(GspoError, match=match) as e:
        _task(spec, eval_size=3)
    assert "\n" not in str(e.value)


def test_not_installed_is_a_one_line_error_with_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    with pytest.raises(GspoError, match=r"pip install \"gspo\[rg\]\"") as e:
        _task("rg:leg_counting", eval_size=3)
    assert "\n" not in str(e.value) and "pip install reasoning-gym" in str(e.value)


@pytest.mark.slow
def test_tiny_train_run_logs_finite_rewards(rg, tmp_path):
    """`gspo train --task rg:...` on the embedded tiny MoE runs and logs finite rewards (chain_sum:
    its questions' only character outside the tiny character vocabulary is the capital 'S', which
    is one warning line; the point is that it runs, not that the random tiny model learns)."""
    spec = "rg:chain_sum:size=200,min_terms=2,max_terms=2,max_digits=1"
    args = ["--task", spec, "--model", "embedded:tiny-moe", "--steps", "3", "--sft-steps", "5"]
    args += ["--eval-size", "8", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "6"]
    args += ["--eval-every", "1", "--threads", "1", "--no-progress", "--output-dir", str(tmp_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, "-m", "gspo", "train", *args, "--name", "r"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "unknown token" in r.stderr  # the 'S' of "State the final answer..."
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["rollout/reward_mean"] for row in rows if "rollout/reward_mean" in row]
    assert len(rewards) == 3 and all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in rewards)
    assert all(row["rollout/reward_errors"] == 0 for row in rows if "rollout/reward_errors" in row)
    assert any("eval/accuracy" in row for row in rows)
    assert (tmp_path / "r" / "final" / "config.json").is_file()


def test_held_out_with_no_question_outside_train_is_an_error(rg):
    # one animal, one instance: 37 distinct questions, all of them among 500 train items
    spec = "rg:leg_counting:size=500,min_animals=1,max_animals=1,min_instances=1,max_instances=1"
    with pytest.raises(GspoError, match="every held-out question also occurs"):
        _task(spec, eval_size=10)


def test_scorer_that_accepts_anything_is_a_warning(rg, capsys):
    # reasoning-gym 0.1.25's game_of_life_halting scores bool(answer) == bool(reference): any
    # non-empty answer gets 1.0
    ds = rg.create_dataset("game_of_life_halting", size=1, seed=0)
    if ds.score_answer(answer="zq", entry=ds[0]) < 1.0:
        pytest.skip("this reasoning-gym's game_of_life_halting scorer no longer accepts anything")
    _task("rg:game_of_life_halting:size=5", eval_size=3)
    assert "full marks to a nonsense answer" in capsys.readouterr().err
    _task("rg:leg_counting:size=5", eval_size=3)
    assert "full marks" not in capsys.readouterr().err
