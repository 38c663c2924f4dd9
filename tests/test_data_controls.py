"""Dynamic sampling, overlong handling and dropout: closed forms and behaviour through the public path."""

import torch

from gspo import Config, train
from gspo.advantages import overlong_penalty
from gspo.data import TrainBatch


def test_overlong_penalty_closed_form():
    """DAPO eq. 13 with L_max = 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at 10."""
    got = overlong_penalty(torch.tensor([1, 6, 7, 9, 10]), max_len=10, buffer=4, factor=1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0]
    assert overlong_penalty(torch.tensor([10]), 10, 4, factor=0.5).tolist() == [-0.5]
    assert overlong_penalty(torch.tensor([10]), 10, 0).tolist() == [0.0]


def test_rollout_data_cat_pads_and_keeps_rows():
    a = TrainBatch(
        torch.tensor([[0, 5]]), torch.tensor([[0, 1]]), torch.tensor([[7]]), torch.tensor([[1]]),
        torch.tensor([[-0.5]]), torch.tensor([1.0]), torch.tensor([1.0]),
    )  # fmt: skip
    b = TrainBatch(
        torch.tensor([[4, 5, 6]]), torch.tensor([[1, 1, 1]]), torch.tensor([[8, 9]]), torch.tensor([[1, 1]]),
        torch.tensor([[-0.1, -0.2]]), torch.tensor([-1.0]), torch.tensor([0.0]),
    )  # fmt: skip
    c = TrainBatch.cat([a, b])
    assert c.prompt_ids_BP.tolist() == [[0, 0, 5], [4, 5, 6]] and c.prompt_mask_BP.tolist() == [
        [0, 0, 1],
        [1, 1, 1],
    ]
    assert c.response_ids_BT.tolist() == [[7, 0], [8, 9]] and c.response_mask_BT.tolist() == [[1, 0], [1, 1]]
    assert c.adv_B.tolist() == [1.0, -1.0] and c.reward_B.tolist() == [1.0, 0.0]


def test_group_filter_keeps_informative_groups_and_fills_with_dropped():
    """The one dynamic-sampling filter (sync and async): groups with unequal rewards kept, rounds until
    ``want`` are kept or the extra rounds run out, the batch filled with dropped groups."""
    from gspo.rollout.sampler import GroupFilter

    f = GroupFilter(want=3, G=2, max_rounds=1)
    f.add(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), ["a", "b", "c"])  # only "a" informative
    assert f.short and not f.done()
    assert f.done(lambda short: False)  # no rank short: done
    f.add(torch.tensor([0.0, 1.0, 2.0, 2.0]), ["d", "e"])  # "d" informative; the extra round spent
    assert f.short and f.done(lambda short: 1 / 0)  # rounds ran out: no collective asked
    assert f.chosen() == ["a", "d", "b"]
    assert f.metrics() == {
        "rollout/filtered_groups": 3.0,
        "rollout/filled_groups": 1.0,
        "rollout/sampling_rounds": 2.0,
    }


def test_group_filter_with_more_informative_groups_than_wanted_fills_none():
    """Issue 57 gap 11: a round can bring more informative groups than the batch takes; the batch is
    the first ``want`` of them and no group is filled (0, not a negative count)."""
    from gspo.rollout.sampler import GroupFilter

    f = GroupFilter(want=2, G=2, max_rounds=2)
    f.add(torch.tensor([1.0, 0.0, 0.0, 0.0]), ["a", "b"])  # "a" informative
    f.add(torch.tensor([0.0, 1.0, 2.0, 1.0, 3.0, 3.0]), ["c", "d", "e"])  # "c", "d" informative
    assert not f.short and f.done(lambda short: short)
    assert f.chosen() == ["a", "c"]
    assert f.metrics() == {
        "rollout/filtered_groups": 2.0,
        "rollout/filled_groups": 0.0,
        "rollout/sampling_rounds": 2.0,
    }


TINY = dict(
    steps=3, sft_steps=40, eval_size=8, prompts_per_step=4, group_size=4, max_new_tokens=10, eval_every=0,
    threads=1, progress=False,
)  # fmt: skip


def _rows(run_dir):
    import json

    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]


def test_dynamic_sampling_drops_uninformative_groups_and_resumes_exactly(tmp_path):
    """Every step of a run with dynamic sampling filters groups (a weak policy solves none of many),
    draws more rounds, and a run resumed from step 2 ends with the uninterrupted run's weights."""
    cfg = dict(TINY, dynamic_sampling=True, dynamic_sampling_max_rounds=2, output_dir=str(tmp_path))
    full = train(Config(name="full", **cfg))
    rows = _rows(full.run_dir)
    assert all(r["rollout/sampling_rounds"] >= 1 for r in rows)
    assert sum(r["rollout/filtered_groups"] for r in rows) > 0
    for r in rows:  # rounds stop once the batch is full, or after the last one, filling the rest
        assert r["rollout/sampling_rounds"] <= 3
        assert r["rollout/filled_groups"] == 0 or r["rollout/sampling_rounds"] == 3
    part = train(Config(name="part", **{**cfg, "steps": 2}))
    assert part.final_dir is not None
    resumed = train(Config(name="part", resume=True, **cfg))
    for (k, v), w in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)


def test_sync_dynamic_sampling_rounds_draw_the_next_prompts(tiny_moe):
    """Issue 57 gap 5: the synchronous sampler's extra rounds draw the prompts after the ones already
    drawn, and the step's data position moves past all of them. The untrained model solves no
    ``reverse`` prompt, so every group is uninformative and all 1 + 2 rounds are drawn: 3 x 2 prompts
    from position 5, each round's own (the ones ``prompt_order`` puts there)."""
    from gspo.launch import _score
    from gspo.resolve import prompt_plan, sample_plan, score_plan
    from gspo.rollout.hf import HFRolloutEngine
    from gspo.rollout.sampler import SyncSampler
    from gspo.tasks import build_task
    from gspo.tasks.prompts import encode_prompts, prompt_order

    model, tok = tiny_moe
    cfg = Config(
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=4,
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=2,
    ).validate()
    task = build_task("reverse", "exact_match", 0, 8)
    train_ids = encode_prompts(tok, task.train, prompt_plan(cfg))
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    seen: list[list[int]] = []
    generate = eng.generate
    eng.generate = lambda ids, *a, **k: seen.append(ids[::2]) or generate(ids, *a, **k)  # G = 2
    sampler = SyncSampler(eng, tok, task, sample_plan(cfg), _score(score_plan(cfg)), train_ids)
    b = sampler.next_batch(step=3, data_pos=5)
    assert b.metrics["rollout/sampling_rounds"] == 3 and b.metrics["rollout/filtered_groups"] == 6
    assert b.data_end == 5 + 3 * 2
    order = prompt_order(len(train_ids), 5, 6, cfg.seed)
    assert seen == [[train_ids[i] for i in order[r * 2 : r * 2 + 2]] for r in range(3)]


def test_overlong_penalty_and_filter_through_collect_rollout(tiny_moe):
    """The soft penalty enters the rewards (so cut-off responses get advantages of their own), and the
    filter then gives every cut-off response (no EOS) advantage 0 while the others keep theirs."""
    from step_helpers import collect_rollout

    from gspo.resolve import prompt_plan, sample_plan, score_plan
    from gspo.rollout.hf import HFRolloutEngine
    from gspo.rollout.sampler import SyncSampler
    from gspo.tasks import build_task
    from gspo.tasks.prompts import encode_prompts

    model, tok = tiny_moe
    task = build_task("reverse", "exact_match", 0, 8)
    out = {}
    for filt in (False, True):
        cfg = Config(max_new_tokens=3, overlong_buffer=2, overlong_filter=filt, group_size=8).validate()
        eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
        ex = task.train[:8]
        data, m = collect_rollout(
            SyncSampler(eng, tok, task, sample_plan(cfg)), tok, task, ex,
            encode_prompts(tok, ex, prompt_plan(cfg)), score_plan(cfg),
        )  # fmt: skip
        cut_B = ~(data.response_ids_BT == tok.eos_token_id).any(-1)
        out[filt] = (data, cut_B, m)
    data, cut_B, m = out[False]
    assert 0 < cut_B.float().mean() < 1 and m["rollout/overlong_penalty"] < 0
    assert (data.reward_B[cut_B] <= -1.0).all()  # 3 tokens without EOS: the full penalty
    assert data.adv_B[cut_B].abs().sum() > 0
    data_f, cut_f, _ = out[True]
    assert torch.equal(cut_f, cut_B)  # same seed, same samples
    assert (data_f.adv_B[cut_f] == 0).all()
    torch.testing.assert_close(data_f.adv_B[~cut_f], data.adv_B[~cut_B])


def test_dropout_is_off_in_training_unless_kept():
    """A GPT-2 with dropout 0.5 everywhere: two training-mode forwards agree once dropout is disabled."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gspo.training.sft import disable_dropout

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=20, resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5
    )
    model = GPT2LMHeadModel(cfg).train()
    ids = torch.arange(8)[None]
    assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout really is on
    disable_dropout(model)
    torch.testing.assert_close(model(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_chat_prompts_are_templated_and_rewards_see_the_user_text():
    """A prompt given as messages goes through the tokenizer's chat template even without
    --chat-template, and the reward gets the last user message as text."""
    from gspo.model.load import build_char_tokenizer
    from gspo.resolve import prompt_plan
    from gspo.tasks.datasets import Example, prompt_text
    from gspo.tasks.prompts import encode_prompts

    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    chat = Example([{"role": "user", "content": "rev:12"}], "21")
    assert encode_prompts(tok, [chat], prompt_plan(Config())) == [
        tok("rev:12=", add_special_tokens=False).input_ids
    ]
    assert prompt_text(chat.prompt) == "rev:12"
