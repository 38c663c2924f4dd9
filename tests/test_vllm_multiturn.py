"""Multi-turn rollouts (gspo.envs) with the vLLM engine against real vLLM (vllm-cpu, on a CPU).

Runs only where vllm imports, i.e. in the venv made by ``.ci/vllm_env.sh``::

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .venv-vllm/bin/python -m pytest -q tests/test_vllm_multiturn.py
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

vllm = pytest.importorskip("vllm")

import json  # noqa: E402

import torch  # noqa: E402

from gspo.config import Config  # noqa: E402
from gspo.data import left_pad  # noqa: E402
from gspo.envs.base import Limits, Step  # noqa: E402
from gspo.envs.load import EnvSpec  # noqa: E402
from gspo.envs.rollout import run_episodes  # noqa: E402
from gspo.model.load import load_model_and_tokenizer  # noqa: E402
from gspo.model.logprobs import make_layout, response_logprobs  # noqa: E402
from gspo.resolve import engine_plan  # noqa: E402
from gspo.rollout.vllm import VLLMRolloutEngine  # noqa: E402
from gspo.tasks.datasets import Example  # noqa: E402

TOL = 1e-5


class _Observe:
    """Answers every turn with an observation (so every trajectory has several turns)."""

    def reset(self, example):
        return example.prompt

    def step(self, model_turn):
        return Step("=12 ", 0.5)


@pytest.mark.parametrize("layout", ["rows", "shared_prefix"])
def test_vllm_trajectories_masks_and_logprobs_equal_the_trainers(layout):
    model, tok = load_model_and_tokenizer("embedded:tiny-dense-h32", seed=0)
    model.eval()
    plan = engine_plan(
        Config(rollout_engine="vllm", model="embedded:tiny-dense-h32", dtype="float32", seed=0,
               max_prompt_tokens=16, max_new_tokens=12, env="x", max_trajectory_tokens=40)
    )  # fmt: skip
    eng = VLLMRolloutEngine.from_trainer(plan, model, tok, block_size=32)
    try:
        prompts = ["rev:123=", "rev:4567=", "rev:89="]  # a random model: some turns end at EOS
        ex = [Example(p, "") for p in prompts for _ in range(8)]
        ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in ex]
        eb = run_episodes(eng, tok, EnvSpec(_Observe, "observe", None), ex, ids, Limits(3, 12, 40), 1.0)
    finally:
        eng.close()
    m, o = eb.response_mask_BT, eb.obs_mask_BT
    assert ((m + o) <= 1).all() and o.sum() > 0 and (eb.turns_B > 1).any()
    assert ((m + o).sum(-1) <= 40).all() and (eb.sampler_logp_BT[~m.bool()] == 0).all()
    p_ids, p_mask = left_pad(eb.prompt_ids, tok.pad_token_id)
    lay = make_layout(p_ids, p_mask, eb.response_ids_BT, m, layout, torch.float32, obs_mask_BT=o)
    with torch.no_grad():
        logp = response_logprobs(model, p_ids, p_mask, eb.response_ids_BT, m, layout=lay)
    assert (logp - eb.sampler_logp_BT).abs().max() < TOL


def test_gspo_train_multi_turn_with_vllm_end_to_end(tmp_path):
    from gspo import Config, train

    res = train(Config(
        model="embedded:tiny-dense-h32", rollout_engine="vllm", task="add_long", env="tools:calc",
        max_new_tokens=20, max_turns=2, max_trajectory_tokens=40, sft_steps=20, sft_batch_size=16, steps=2,
        prompts_per_step=4, group_size=4, eval_size=8, eval_every=0, threads=1, progress=False,
        output_dir=str(tmp_path), name="vllm-mt",
    ))  # fmt: skip
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 2 and "env/turns_mean" in rows[-1]
    assert rows[-1]["mismatch/token_abs_logp_diff"] < TOL
