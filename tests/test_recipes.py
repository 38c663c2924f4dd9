"""recipes/*.yaml: each parses and validates with gspo's config loader (every key exists, every value
is legal, batch sizes divide at the documented world size), its data-preparation command writes the
files the recipe reads, and the reward is wired to those files' fields. No model is loaded (the
recipes' models are hub checkpoints this test never downloads)."""

import re
from pathlib import Path

import pytest

from gspo.config import make_config
from gspo.config.algorithm import loss_params
from gspo.tasks import build_task

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
YAMLS = sorted(RECIPES.glob("*.yaml"))
QWEN3_CONTEXT = 40960  # max_position_embeddings of Qwen3-0.6B, Qwen3-30B-A3B and Qwen3-235B-A22B
WORLD = {
    "qwen3-0.6b-gsm8k.yaml": [1, 8],
    "qwen3-30b-a3b-1node.yaml": [8],
    "qwen3-30b-a3b-multinode.yaml": [32],
    "qwen3-30b-a3b-2node.yaml": [16],
    "qwen3-235b-a22b-4node.yaml": [32],
}


def test_the_recipes_exist():
    assert {p.name for p in YAMLS} >= set(WORLD)
    assert (RECIPES / "README.md").is_file()


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_recipe_parses_and_validates(path):
    cfg = make_config(str(path))  # unknown keys, bad types and illegal values raise GspoError
    for n in WORLD.get(path.name, [1]):
        make_config(str(path), {"nproc": n})  # prompts_per_step and minibatches divide by the ranks
    assert cfg.model.startswith("Qwen/Qwen3-")
    assert cfg.max_prompt_tokens + cfg.max_new_tokens <= QWEN3_CONTEXT
    assert cfg.sft_steps == 0 and cfg.chat_template and cfg.reward == "math"
    assert cfg.rollout_engine == "vllm" and cfg.rollout_dtype == "bfloat16"
    assert cfg.algo == "gspo" and loss_params(cfg) == {"eps_low": 3e-4, "eps_high": 4e-4}


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_preparation_command_writes_the_files_the_recipe_reads(path):
    cfg = make_config(str(path))
    written = re.findall(r"to_json\('([^']+)'\)", path.read_text())
    assert cfg.task in written and cfg.eval_task in written


def test_readme_launch_commands_name_existing_recipes():
    text = (RECIPES / "README.md").read_text()
    named = set(re.findall(r"recipes/([\w.-]+\.yaml)", text))
    assert named >= {p.name for p in YAMLS}
    assert all((RECIPES / n).is_file() for n in named)


# Rows shaped like the hub datasets the preparation commands download, written the same way
# (datasets.Dataset.to_json), so the recipes' fields and reward are checked without a download.
ROWS = {
    "qwen3-0.6b-gsm8k.yaml": (
        {
            "question": [f"Tom has {n} apples and buys {n} more. How many apples now?" for n in range(1, 6)],
            "answer": [
                f"He has {n} + {n} = <<{n}+{n}={2 * n}>>{2 * n} apples.\n#### {2 * n}" for n in range(1, 6)
            ],
        },
        # Qwen3 with /no_think: an empty think block, then the answer
        lambda i, ok: (
            f"<think>\n\n</think>\n\n{i + 1} + {i + 1} is \\boxed{{{2 * (i + 1) + (0 if ok else 1)}}}."
        ),
    ),
    "qwen3-30b-a3b-multinode.yaml": (
        {
            "problem": [f"What is $\\frac{{1}}{{{n}}} + \\frac{{1}}{{{n}}}$?" for n in range(2, 7)],
            "solution": [f"It is $\\boxed{{\\frac{{2}}{{{n}}}}}$." for n in range(2, 7)],
            "answer": [f"\\frac{{2}}{{{n}}}" for n in range(2, 7)],
        },
        lambda i, ok: f"<think>add</think> so \\boxed{{\\frac{{{2 if ok else 3}}}{{{i + 2}}}}}",
    ),
}
for _name in ("qwen3-30b-a3b-1node.yaml", "qwen3-30b-a3b-2node.yaml", "qwen3-235b-a22b-4node.yaml"):
    ROWS[_name] = ROWS["qwen3-30b-a3b-multinode.yaml"]  # the same data and reward


@pytest.mark.parametrize("name", sorted(ROWS))
def test_recipe_fields_and_reward_on_prepared_files(tmp_path, name):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("math_verify")
    cfg = make_config(str(RECIPES / name))
    columns, completion = ROWS[name]
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    datasets.Dataset.from_dict(columns).to_json(str(train))
    datasets.Dataset.from_dict(columns).to_json(str(test))
    task = build_task(str(train), cfg.reward, cfg.seed, 5, str(test), cfg.prompt_field, cfg.answer_field)
    assert len(task.train) == 5 and len(task.eval) == 5
    exs = task.eval  # the eval file's rows, in order
    prompts, answers = [e.prompt for e in exs], [e.answer for e in exs]
    assert prompts == columns[cfg.prompt_field]
    good = [completion(i, True) for i in range(len(exs))]
    bad = [completion(i, False) for i in range(len(exs))]
    assert task.reward(prompts, good, answers) == [1.0] * len(exs)
    assert task.reward(prompts, bad, answers) == [0.0] * len(exs)
