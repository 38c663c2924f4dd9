"""Keep the sampling mask (DeepSeek-V3.2): with top-k / top-p the trainer's log-probs are taken over the
sampler's truncated support, renormalized, so sampler and trainer agree as they do without truncation."""

from __future__ import annotations

import pytest
import torch

from gspo.config import Config
from gspo.data import left_pad
from gspo.errors import GspoError
from gspo.model.lm_head import logprobs_from_hidden, naive_logprobs_from_hidden, truncation_mask
from gspo.model.logprobs import response_logprobs
from gspo.rollout.hf import HFRolloutEngine

F64 = torch.float64


def test_truncation_mask_hand_computed():
    """p = (0.05, 0.5, 0.15, 0.3): top-p 0.75 keeps {0.5, 0.3} (0.05 + 0.15 <= 0.25 dropped); top-k 3 keeps
    three; top-k 3 then top-p 0.75 renormalizes (0.5, 0.3, 0.15)/0.95 and keeps two; top-p 0.1 keeps the
    most likely token only; top-k 0 / top-p 1 is no truncation (None)."""
    z = torch.tensor([[0.05, 0.5, 0.15, 0.3]], dtype=F64).log()
    assert truncation_mask(z, 0, 0.75).tolist() == [[False, True, False, True]]
    assert truncation_mask(z, 3, 1.0).tolist() == [[False, True, True, True]]
    assert truncation_mask(z, 3, 0.75).tolist() == [[False, True, False, True]]
    assert truncation_mask(z, 0, 0.1).tolist() == [[False, True, False, False]]
    assert truncation_mask(z, 0, 1.0) is None and truncation_mask(z, 4, 1.0) is None


@pytest.mark.parametrize("trunc", [(0, 0.7), (5, 1.0), (7, 0.9)])
def test_chunked_head_equals_the_reference_with_truncation(trunc):
    """The chunked LM head's truncated log-probs, entropies and gradients (hidden and weight, float64)
    equal plain autograd over the masked logits, and the closed form d logp_y / d z_v = 1[v = y] - p~_v
    on the support, 0 outside it; the sampled token is always in the support."""
    k, p = trunc
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, 6, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(20, 6, generator=g, dtype=F64, requires_grad=True)
    tgt = torch.randint(0, 20, (9,), generator=g)

    def float64_reference(h, w, tgt, chunk_size, temperature, return_entropy, top_k, top_p):
        z = h @ w.T / temperature
        keep = truncation_mask(z.detach(), top_k, top_p)
        keep[torch.arange(len(tgt)), tgt] = True
        logp = torch.log_softmax(torch.where(keep, z, float("-inf")), -1)
        ent = -torch.where(keep, logp.exp() * logp, 0.0).sum(-1)
        return logp[torch.arange(len(tgt)), tgt], ent.detach()

    out = []
    for fn in (float64_reference, logprobs_from_hidden, naive_logprobs_from_hidden):
        lp, ent = fn(h, w, tgt, 4, 0.8, True, k, p)
        gh, gw = torch.autograd.grad((lp * torch.arange(1.0, 10.0, dtype=lp.dtype)).sum(), (h, w))
        out.append((lp, ent, gh, gw))
    for a, b, c in zip(*out, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)  # the chunked kernel, in float64
        torch.testing.assert_close(a.to(c.dtype), c, atol=1e-5, rtol=0)  # plain autograd, in float32
    z = (h @ w.T / 0.8).detach()
    keep = truncation_mask(z, k, p)
    keep[torch.arange(9), tgt] = True
    pt = torch.where(keep, z, float("-inf")).softmax(-1)
    assert torch.allclose(out[0][0], pt[torch.arange(9), tgt].log(), atol=1e-12)
    zz = z.clone().requires_grad_(True)
    lp = torch.log_softmax(torch.where(keep, zz, float("-inf")), -1)[torch.arange(9), tgt]
    (gz,) = torch.autograd.grad(lp.sum(), zz)
    want = torch.nn.functional.one_hot(tgt, 20).to(F64) - pt
    assert torch.allclose(gz, torch.where(keep, want, 0.0), atol=1e-12)
    assert torch.isfinite(out[0][0]).all() and torch.isfinite(out[0][1]).all()


def _prompts(tok):
    return [tok(p).input_ids for p in ["rev:1=", "rev:12345678=", "add:3+4=", "sort:987="]] * 3


@pytest.mark.parametrize("trunc", [(0, 0.6), (3, 1.0), (4, 0.8)])
def test_sampler_and_trainer_logprobs_agree_with_truncation(tiny_moe, trunc):
    """With top-p < 1 / top-k the HF engine's log-probs equal the trainer's (same rule over its own
    logits) to 1e-5, as at top-p = 1; the untruncated trainer log-probs do not (the mask matters); every
    sampled token is inside the support."""
    model, tok = tiny_moe
    k, p = trunc
    eng = HFRolloutEngine(
        model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0), top_k=k, top_p=p
    )
    rb = eng.generate(_prompts(tok), 10, temperature=0.9)
    ids, mask = left_pad(rb.prompt_ids, tok.pad_token_id)
    args = (model, ids, mask, rb.response_ids_BT, rb.response_mask_BT)
    with torch.no_grad():
        lp = response_logprobs(*args, temperature=0.9, top_k=k, top_p=p)
        full = response_logprobs(*args, temperature=0.9)
    m = rb.response_mask_BT.bool()
    assert m.sum() > 20
    torch.testing.assert_close(lp, rb.sampler_logp_BT, atol=1e-5, rtol=0)
    assert (full - rb.sampler_logp_BT)[m].abs().max() > 1e-3  # truncation renormalizes: log p~ >= log p
    assert torch.all(rb.sampler_logp_BT[m] >= full[m] - 1e-5)
    assert torch.isfinite(lp).all()


def test_a_tiny_top_p_keeps_exactly_the_most_likely_token():
    """top-p 1e-8: 1 - top_p rounds to 1 in float32, so the cumulative probability of every token but
    the last reaches it: the support is the argmax alone (never empty: no -inf row, no NaN log-prob),
    in float32 as in float64, and its log-prob is 0."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, F64):
        z = torch.randn(2000, 50, generator=g).to(dtype) * 3
        keep = truncation_mask(z, 0, 1e-8)
        assert torch.equal(keep, torch.nn.functional.one_hot(z.argmax(-1), 50).bool()), dtype
        lp = naive_logprobs_from_hidden(z, torch.eye(50, dtype=dtype), z.argmax(-1), top_p=1e-8)
        assert torch.isfinite(lp).all() and torch.equal(lp, torch.zeros_like(lp)), dtype


@pytest.mark.parametrize("trunc", [{"top_k": 1}, {"top_p": 1e-8}])
def test_top_k_1_samples_greedily(tiny_moe, trunc):
    """top-k 1, or a top-p so small that only the most likely token reaches it, leaves one token:
    sampling is greedy decoding and every sampler log-prob is 0."""
    model, tok = tiny_moe
    eng = HFRolloutEngine(
        model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(1), **trunc
    )
    rb = eng.generate(_prompts(tok)[:4], 8, temperature=1.0)
    greedy = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id).generate(
        _prompts(tok)[:4], 8, greedy=True
    )
    assert torch.equal(rb.response_ids_BT, greedy.response_ids_BT)
    assert torch.all(rb.sampler_logp_BT == 0)


@pytest.mark.parametrize(("field", "value"), [("top_p", 0.0), ("top_p", 1.5), ("top_k", -1)])
def test_bad_truncation_settings(field, value):
    with pytest.raises(GspoError, match=field):
        Config(**{field: value}).validate()


def test_vllm_truncation_params():
    """vLLM's SamplingParams get only the truncation that is on (its defaults differ across versions)."""
    from gspo.rollout.vllm import truncation_params

    assert truncation_params(0, 1.0) == {}
    assert truncation_params(5, 0.9) == {"top_k": 5, "top_p": 0.9}
