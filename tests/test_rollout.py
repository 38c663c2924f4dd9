"""HF rollout engine: sampler log-probs, EOS handling, padding invariance."""

import torch

from gspo.data import left_pad
from gspo.model.logprobs import response_logprobs
from gspo.rollout.hf import HFRolloutEngine, _sample


def _prompts(tok):
    return [tok(p).input_ids for p in ["rev:1=", "rev:12345678=", "add:3+4=", "sort:987="]]


def test_sampler_logp_matches_trainer_logp(tiny_moe):
    """The log-probs the engine returns equal the trainer's forward on the same tokens (same model)."""
    model, tok = tiny_moe
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    rb = eng.generate(_prompts(tok) * 3, 10, temperature=0.7)  # repeated prompts: shared prefill
    ids, mask = left_pad(rb.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        lp = response_logprobs(model, ids, mask, rb.response_ids_BT, rb.response_mask_BT, temperature=0.7)
    assert rb.response_mask_BT.sum() > 0
    torch.testing.assert_close(lp, rb.sampler_logp_BT, atol=1e-5, rtol=0)
    assert torch.all(rb.sampler_logp_BT[rb.response_mask_BT == 0] == 0)


def test_greedy_is_independent_of_batch_padding(tiny_moe):
    """Greedy output for a prompt is the same alone and inside a left-padded batch."""
    model, tok = tiny_moe
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    prompts = _prompts(tok)
    batch = eng.generate(prompts, 8, greedy=True)
    for i, p in enumerate(prompts):
        alone = eng.generate([p], 8, greedy=True)
        n = int(alone.response_mask_BT.sum())
        assert int(batch.response_mask_BT[i].sum()) == n
        assert torch.equal(batch.response_ids_BT[i, :n], alone.response_ids_BT[0, :n])


def test_rows_stop_at_eos_and_are_padded(tiny_moe):
    """After a row emits EOS its mask is 0 and its tokens are padding; EOS itself is kept."""
    model, tok = tiny_moe
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(1))
    rb = eng.generate(_prompts(tok) * 8, 12, temperature=1.5)
    for ids, m in zip(rb.response_ids_BT, rb.response_mask_BT, strict=True):
        n = int(m.sum())
        assert torch.all(m[:n] == 1) and torch.all(m[n:] == 0)
        assert torch.all(ids[n:] == tok.pad_token_id)
        eos = (ids[:n] == tok.eos_token_id).nonzero()
        assert len(eos) <= 1 and (len(eos) == 0 or int(eos[0]) == n - 1)


def test_generator_makes_sampling_reproducible(tiny_moe):
    """Two engines with equally seeded generators sample identical tokens."""
    model, tok = tiny_moe
    a = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(3))
    b = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(3))
    ra, rb = a.generate(_prompts(tok), 8), b.generate(_prompts(tok), 8)
    assert torch.equal(ra.response_ids_BT, rb.response_ids_BT)


def test_repeated_prompts_share_the_prefill_and_match_lone_greedy(tiny_moe):
    """A prompt repeated in the batch (prefilled once, its cache copied) gives each copy the greedy
    output of that prompt generated alone."""
    model, tok = tiny_moe
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id)
    prompts = _prompts(tok)
    batch = eng.generate([p for p in prompts for _ in range(3)], 8, greedy=True)
    for i, p in enumerate(prompts):
        alone = eng.generate([p], 8, greedy=True)
        n = int(alone.response_mask_BT.sum())
        for r in range(3 * i, 3 * i + 3):
            assert int(batch.response_mask_BT[r].sum()) == n
            assert torch.equal(batch.response_ids_BT[r, :n], alone.response_ids_BT[0, :n])
            torch.testing.assert_close(
                batch.sampler_logp_BT[r, :n], alone.sampler_logp_BT[0, :n], atol=1e-5, rtol=0
            )


def test_a_batch_past_max_batch_size_is_played_in_parts_each_row_kept(tiny_moe):
    """Issue 57 gap 1: a batch larger than the engine's ``max_batch_size`` (default 256: the default
    batch is exactly that) is played a part at a time; every row of every part gets its own prompt's
    greedy output, as in one batch, and sampled rows the log-probs of their tokens."""
    model, tok = tiny_moe
    prompts = [tok(p).input_ids for p in ["rev:1=", "rev:12=", "add:3+4=", "sort:987=", "rev:9=", "add:1+1="]]
    prompts = prompts + prompts[:1]  # 7 rows: parts of 3, 3 and 1
    whole = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id).generate(prompts, 8, greedy=True)
    split = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch_size=3)
    parts = split.generate(prompts, 8, greedy=True)
    assert parts.response_mask_BT.sum(-1).min() > 0
    assert torch.equal(parts.response_mask_BT, whole.response_mask_BT)
    assert torch.equal(parts.response_ids_BT, whole.response_ids_BT)
    torch.testing.assert_close(parts.sampler_logp_BT, whole.sampler_logp_BT, atol=1e-5, rtol=0)
    split.reseed(0)
    rb = split.generate(prompts, 8, temperature=1.0)  # sampled: each row's log-probs its own tokens'
    ids, mask = left_pad(rb.prompt_ids, tok.pad_token_id)
    with torch.no_grad():
        lp = response_logprobs(model, ids, mask, rb.response_ids_BT, rb.response_mask_BT)
    assert rb.response_mask_BT.sum(-1).min() > 0
    torch.testing.assert_close(lp, rb.sampler_logp_BT, atol=1e-5, rtol=0)


def test_left_pad_closed_form():
    ids, mask = left_pad([[3], [4, 5, 6], []], pad_id=0)
    assert ids.tolist() == [[0, 0, 3], [4, 5, 6], [0, 0, 0]]
    assert mask.tolist() == [[0, 0, 1], [1, 1, 1], [0, 0, 0]]


def test_inverse_cdf_sampler_matches_the_distribution():
    """Frequencies of 64,000 draws are within 0.01 of the probabilities (6 sigma at p = 0.5);
    zero-probability tokens are never drawn, even at the ends of the vocabulary."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([-float("inf"), 0.0, 1.0, -float("inf"), 2.0, 0.5, -float("inf")])
    logp = torch.log_softmax(logits, -1)
    counts = torch.zeros(7)
    for _ in range(100):
        counts += torch.bincount(_sample(logp.expand(640, 7), g), minlength=7)
    freq = counts / counts.sum()
    assert counts[[0, 3, 6]].sum() == 0
    assert (freq - logp.exp()).abs().max() < 0.01


def test_completion_texts_match_the_tokenizers_own_decode():
    """The one-call backend decode gives transformers' strings: final EOS dropped, special tokens
    skipped, padding ignored; a tokenizer that cleans up spaces takes transformers' own path."""
    from gspo.model.load import build_char_tokenizer
    from gspo.tasks.prompts import completion_texts

    tok = build_char_tokenizer()
    rows = [tok("ab c").input_ids + [tok.eos_token_id], tok("x .y").input_ids, [tok.eos_token_id], []]
    rows[1] = rows[1][:2] + [tok.bos_token_id] + rows[1][2:]  # a special token inside
    ids, mask = left_pad([r[::-1] for r in rows], tok.pad_token_id)  # right-padded after flipping back
    ids, mask = ids.flip(-1), mask.flip(-1)
    want = ["ab c", "x .y", "", ""]
    assert completion_texts(tok, ids, mask) == want
    tok.clean_up_tokenization_spaces = True  # transformers' path: clean-up turns " ." into "."
    assert completion_texts(tok, ids, mask) == ["ab c", "x.y", "", ""]


def test_a_copy_in_another_precision_takes_the_trainers_weights_with_each_sync(tiny_moe):
    """The HF engine over a bf16 copy owns it: built with ``make_engine(..., trainer=)`` it holds the
    trainer's weights cast to bf16, and after the trainer's weights change it
    holds the old ones until ``sync_weights``, then the new ones; over the trainer's own module it
    has nothing to copy."""
    import copy

    from gspo.config import Config
    from gspo.model.logprobs import PolicyLogprobs
    from gspo.resolve import engine_plan
    from gspo.rollout.factory import make_engine

    shared, tok = tiny_moe
    model = copy.deepcopy(shared)  # the fixture is shared: its weights stay as they are
    policy = PolicyLogprobs(model)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    for p in bf16.parameters():
        p.data.zero_()
    plan = engine_plan(Config(rollout_engine="hf"))
    engine = make_engine(plan, bf16, tok, trainer=policy)

    def matches() -> bool:
        src = dict(model.named_parameters())
        return all(torch.equal(p, src[n].to(torch.bfloat16)) for n, p in bf16.named_parameters())

    assert matches()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    assert not matches()
    engine.sync_weights()
    assert matches()
    assert make_engine(plan, model, tok, trainer=policy).trainer is None


def test_the_engine_probes_its_model_once_the_weights_are_real():
    """An async sampler builds its model from the config and loads the trainer's weights later: the
    engine probes how to call the model (its LM head) at its first prefill, not when it is built. On
    zero weights a soft-capped head looks plain (every logit 0 either way); sampling from the loaded
    weights must still use the model's own, soft-capped logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    small = dict(vocab_size=40, hidden_size=32, intermediate_size=32, num_hidden_layers=2, head_dim=8)
    small.update(num_attention_heads=4, num_key_value_heads=2, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    cfg = Gemma2Config(final_logit_softcapping=0.5, **small)
    trained = Gemma2ForCausalLM(cfg).eval()
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    eng = HFRolloutEngine(model, 1, 0, torch.Generator().manual_seed(0))
    model.load_state_dict(trained.state_dict())  # the trainer's weights arrive
    prompts = [[5, 6], [7, 8, 9]]
    rb = eng.generate(prompts, 4, temperature=1.0)
    for b, p in enumerate(prompts):  # the model's own logits, the row alone
        n = int(rb.response_mask_BT[b].sum())
        seq = torch.tensor([p + rb.response_ids_BT[b, :n].tolist()])
        with torch.no_grad():
            ref = torch.log_softmax(model(seq).logits[0].float(), -1)
        want = ref[len(p) - 1 : len(p) - 1 + n].gather(-1, seq[0, len(p) :, None]).squeeze(-1)
        torch.testing.assert_close(rb.sampler_logp_BT[b, :n], want, atol=1e-5, rtol=0)
