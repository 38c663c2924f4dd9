"""The HF engine keeps each trajectory's KV cache across turns (``HFRolloutEngine.multi_turn``):
the same tokens and log-probs as re-prefilling the whole context, within float32 rounding."""

import copy
import math

import torch

from gspo.envs.base import Limits, Step
from gspo.envs.load import EnvSpec
from gspo.envs.rollout import run_episodes
from gspo.rollout.hf import HFRolloutEngine
from gspo.tasks.datasets import Example


class _Answers:
    """Answers each turn with an observation of 1-4 tokens (varied, so rows need padding)."""

    n = 0

    def reset(self, example: Example) -> str:
        return example.prompt

    def step(self, turn: str) -> Step:
        _Answers.n += 1
        return Step(" ok" + "=" * (_Answers.n % 4), 0.0)


class _Plain:
    """The engine without ``multi_turn``: every turn re-prefills its whole context."""

    def __init__(self, engine: HFRolloutEngine) -> None:
        self.engine = engine

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)


def _eos_likely(model, tok, p: float = 0.15):
    """A copy of ``model`` with a bias on the LM head that makes EOS ~``p`` likely, so turns end at
    EOS and go on."""
    model = copy.deepcopy(model)
    bias = torch.zeros(model.get_output_embeddings().weight.shape[0])
    bias[tok.eos_token_id] = math.log(len(tok) * p / (1 - p))
    model.get_output_embeddings().bias = torch.nn.Parameter(bias, requires_grad=False)
    return model


def _both(model, tok, greedy: bool):
    ex = [Example(p, "") for p in ["rev:123=", "rev:4567=", "add:1+2=", "sort:987="] for _ in range(3)]
    ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in ex]
    out = []
    for wrap in (lambda e: e, _Plain):
        _Answers.n = 0
        eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
        out.append(
            run_episodes(
                wrap(eng), tok, EnvSpec(_Answers, "answers", None), ex, ids, Limits(4, 10, 50), 1.0, greedy
            )
        )
        assert eng._kept is None  # released when the episodes end
    return out


def test_kept_cache_gives_the_reprefill_tokens_and_logprobs(tiny_moe):
    model, tok = tiny_moe
    model = _eos_likely(model, tok)
    for greedy in (True, False):  # sampled: the same generator draws the same tokens
        kept, plain = _both(model, tok, greedy)
        assert kept.turns_B.max() > 1
        assert torch.equal(kept.response_ids_BT, plain.response_ids_BT)
        assert torch.equal(kept.response_mask_BT, plain.response_mask_BT)
        assert torch.equal(kept.obs_mask_BT, plain.obs_mask_BT)
        # float32: a chunk attending to a cache rounds differently from one prefill (~5e-7 seen)
        torch.testing.assert_close(kept.sampler_logp_BT, plain.sampler_logp_BT, atol=1e-5, rtol=0)


def test_a_later_turn_prefills_only_the_new_tokens(tiny_moe):
    """Turn 2 feeds the last sampled token and the observation, not the context; a prompt that
    extends no kept row (a new one, or one shorter than its row's cache) is prefilled whole."""
    model, tok = tiny_moe
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    fresh = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    widths = []
    feed = eng._last_logits
    eng._last_logits = lambda ids, *a: widths.append(ids.shape[1]) or feed(ids, *a)
    p = [tok(s, add_special_tokens=False).input_ids for s in ["rev:123=", "add:12+34=", "sort:5="]]
    obs = tok(" ok=", add_special_tokens=False).input_ids
    with eng.multi_turn():
        first = eng.generate(p, 6, greedy=True)
        n = first.response_mask_BT.sum(-1).tolist()
        turn = [q + first.response_ids_BT[i, : n[i]].tolist() + obs for i, q in enumerate(p)]
        new = tok("rev:99=", add_special_tokens=False).input_ids
        prompts = [turn[0], new, turn[1][:3], turn[2]]
        widths.clear()
        second = eng.generate(prompts, 6, greedy=True)
        assert eng._kept is not None and len(eng._kept) == 4
    assert eng._kept is None
    assert widths[0] == max(len(new), 3, 1 + len(obs))  # the longest uncached part, not the context
    alone = fresh.generate(prompts, 6, greedy=True)
    assert torch.equal(second.response_ids_BT, alone.response_ids_BT)
    torch.testing.assert_close(second.sampler_logp_BT, alone.sampler_logp_BT, atol=1e-5, rtol=0)
