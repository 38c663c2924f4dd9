"""policy_update: packing, micro-batching and pi_old reuse change cost, never the update."""

import copy

import pytest
import torch
from step_helpers import plan_update

from gspo.config import Config
from gspo.data import TrainBatch, left_pad
from gspo.model.logprobs import response_logprobs
from gspo.rollout.hf import HFRolloutEngine
from gspo.training.update import policy_update


@pytest.fixture(scope="module")
def batch(tiny_moe):
    """A 16-row rollout of the tiny MoE with varied lengths and fixed advantages."""
    model, tok = tiny_moe
    prompts = [tok(f"rev:{n}=").input_ids for n in [1, 12, 123, 1234, 12345, 123456, 1234567, 9] * 2]
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))
    rb = eng.generate(prompts, 10, temperature=1.0)
    ids, mask = left_pad(prompts, tok.pad_token_id)
    adv = torch.linspace(-1.5, 1.5, 16)
    return TrainBatch(ids, mask, rb.response_ids_BT, rb.response_mask_BT, rb.sampler_logp_BT, adv)


def _run(model, data, **kw):
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = Config(prompts_per_step=2, group_size=8, log_volatility=False, max_grad_norm=0, **kw).validate()
    metrics = policy_update(m, opt, sched, data, plan_update(cfg, m, True), 1)
    return m, metrics


@pytest.mark.parametrize("layout", ["packed", "shared_prefix"])
def test_layouts_give_the_same_logprobs_entropy_and_grads(tiny_moe, batch, layout):
    """Packing all rows into one sequence, and computing each shared prompt once for all of its
    responses (rows shuffled, so a group's rows are not contiguous), give the per-row layout's
    log-probs, entropies and gradients."""
    model, _ = tiny_moe
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    b = batch.rows(perm)
    out = []
    for lay in ("rows", layout):
        model.zero_grad()
        lp, ent = response_logprobs(
            model,
            b.prompt_ids_BP,
            b.prompt_mask_BP,
            b.response_ids_BT,
            b.response_mask_BT,
            temperature=0.8,
            return_entropy=True,
            layout=lay,
        )
        (lp * b.adv_B[:, None]).sum().backward()
        out.append((lp.detach(), ent, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(out[0][0], out[1][0], atol=2e-5, rtol=0)
    torch.testing.assert_close(out[0][1], out[1][1], atol=2e-5, rtol=0)
    assert len(out[0][2]) == len(out[1][2])
    for g0, g1 in zip(out[0][2], out[1][2], strict=True):
        torch.testing.assert_close(g0, g1, atol=2e-5, rtol=1e-4)
    model.zero_grad()


def test_small_batches_take_the_plain_lm_head_with_the_same_result(tiny_moe, batch, monkeypatch):
    """Below PLAIN_HEAD_MAX_LOGITS the LM head runs under plain autograd instead of the chunked kernel:
    same log-probs, entropies and gradients (the tiny model's batches take the plain path)."""
    from gspo.model import logprobs as F

    model, _ = tiny_moe
    assert batch.response_mask_BT.sum() * model.config.vocab_size <= F.PLAIN_HEAD_MAX_LOGITS
    out = []
    for limit in (F.PLAIN_HEAD_MAX_LOGITS, 0):  # plain, then forced chunked (chunks of 7 rows)
        monkeypatch.setattr(F, "PLAIN_HEAD_MAX_LOGITS", limit)
        model.zero_grad()
        lp, ent = response_logprobs(
            model, batch.prompt_ids_BP, batch.prompt_mask_BP, batch.response_ids_BT,
            batch.response_mask_BT, temperature=0.8, chunk_size=7, return_entropy=True,
        )  # fmt: skip
        (lp * batch.adv_B[:, None]).sum().backward()
        out.append((lp.detach(), ent, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-5, rtol=0)
    for g0, g1 in zip(out[0][2], out[1][2], strict=True):
        torch.testing.assert_close(g0, g1, atol=1e-5, rtol=1e-4)
    model.zero_grad()


def test_shared_prefix_layout_closed_form():
    """Two rows share prompt [5, 6] (a third row has prompt [4]): one sequence
    [5, 6, 7, 8, 9] with positions [0, 1, 2, 3, 2], each response seeing the prompt and itself only,
    and the first token of each response predicted from the prompt's last token."""
    from gspo.model.logprobs import make_layout

    p_ids = torch.tensor([[5, 6], [5, 6], [4, 0]])
    p_mask = torch.tensor([[1, 1], [1, 1], [1, 0]])  # padding on either side
    r_ids = torch.tensor([[7, 8], [9, 0], [3, 0]])
    r_mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    lay = make_layout(p_ids, p_mask, r_ids, r_mask, "shared_prefix")
    L = lay.input_ids_RL.shape[1]
    assert L == 5
    k = int((lay.input_ids_RL[:, 0] == 5).nonzero())  # sequence order is not part of the contract
    u = 1 - k
    assert lay.input_ids_RL[k].tolist() == [5, 6, 7, 8, 9] and lay.input_ids_RL[u, :2].tolist() == [4, 3]
    assert lay.position_ids_RL[k].tolist() == [0, 1, 2, 3, 2]
    assert lay.position_ids_RL[u, :2].tolist() == [0, 1]
    # targets 7, 8, 9, 3 in row-major order of r_mask: predicted from columns 1, 2, 1 (row k) and 0 (row u)
    assert lay.pred_pos.tolist() == [k * L + 1, k * L + 2, k * L + 1, u * L + 0]
    assert lay.response_pos_RL[k].tolist() == [False, False, True, True, True]
    see = lay.attention_mask_R1LL[k, 0] == 0
    expect = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 0, 0, 1],  # response 2 sees the prompt and itself, not response 1
        ],
        dtype=torch.bool,
    )
    assert torch.equal(see, expect)


def test_shared_prefix_falls_back_to_rows_without_shared_prompts():
    """No two rows share a prompt: the plain causal per-row layout (no mask), real tokens left-aligned."""
    from gspo.model.logprobs import make_layout

    p_ids, p_mask = torch.tensor([[0, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]])
    r_ids, r_mask = torch.tensor([[8, 0], [9, 9]]), torch.tensor([[1, 0], [1, 1]])
    lay = make_layout(p_ids, p_mask, r_ids, r_mask, "shared_prefix")
    assert lay.attention_mask_R1LL is None
    assert lay.input_ids_RL.tolist() == [[5, 8, 0, 0], [6, 7, 9, 9]]
    assert lay.position_ids_RL.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert lay.pred_pos.tolist() == [0, 4 + 1, 4 + 2]


@pytest.mark.parametrize(
    "kw", [{"micro_batch_size": 3}, {"packing": "on"}, {"micro_batch_size": 2, "packing": "on"}]
)
def test_micro_batching_and_packing_do_not_change_the_update(tiny_moe, batch, kw):
    """Length-bucketed micro-batches (grad accumulation) and packing give the whole-minibatch update."""
    model, _ = tiny_moe
    ref, ref_m = _run(model, batch, num_minibatches=2)
    got, got_m = _run(model, batch, num_minibatches=2, **kw)
    for (n, p), q in zip(ref.named_parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=n)
    assert abs(ref_m["loss/loss"] - got_m["loss/loss"]) < 1e-6
    assert abs(ref_m["loss/clip_frac_tok"] - got_m["loss/clip_frac_tok"]) < 1e-6


def _count_forwards(model, data, **kw):
    m = copy.deepcopy(model)
    cfg = Config(prompts_per_step=2, group_size=8, **kw).validate()
    plan = plan_update(cfg, m, True)  # the one-time layout probe of a model is not part of an update
    calls = []
    base = getattr(m, m.base_model_prefix)
    h = base.register_forward_pre_hook(lambda *a: calls.append(1))
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    policy_update(m, opt, sched, data, plan, 1)
    h.remove()
    return len(calls)


def test_pi_old_is_not_recomputed_when_it_is_known(tiny_moe, batch):
    """pi_old costs no forward for minibatch 1 (its own first pass), none at all with rollout log-probs."""
    model, _ = tiny_moe
    kw = dict(log_volatility=False, old_logp="recompute")
    assert _count_forwards(model, batch, num_minibatches=1, **kw) == 1
    assert _count_forwards(model, batch, num_minibatches=4, **kw) == 4 + 3
    # auto: the HF engine in float32 is the trainer itself, so its log-probs are pi_old
    assert _count_forwards(model, batch, num_minibatches=4, log_volatility=False) == 4
    assert _count_forwards(model, batch, num_minibatches=4, log_volatility=False, old_logp="rollout") == 4
    # volatility: pi_old's routing of minibatch 2; after the first optimizer step its own training
    # forward shows the new routing (no extra look)
    assert _count_forwards(model, batch, num_minibatches=4, old_logp="rollout") == 1 + 4
    # replay needs pi_old's routing of minibatches 2-4 (and volatility the same one look)
    assert _count_forwards(model, batch, num_minibatches=4, routing_replay=True) == 3 + 4 + 1
    assert _count_forwards(model, batch, num_minibatches=1, old_logp="rollout") == 1 + 1


def test_volatility_from_the_training_forward_equals_a_separate_look(tiny_moe, batch, monkeypatch):
    """The volatility the update takes from minibatch 2's training forward equals a separate no-grad
    look at minibatch 2 right after the first optimizer step (the forward it saves)."""
    from gspo.training import update as U

    model, _ = tiny_moe
    m = copy.deepcopy(model)
    cfg = Config(prompts_per_step=2, group_size=8, num_minibatches=4, max_grad_norm=0, algo="grpo").validate()
    plan, prepared, real_prepare = plan_update(cfg, m, True), [], U.record_pi_old

    def recording_prepare(*a, **k):
        prepared.append(real_prepare(*a, **k))
        return prepared[-1]

    monkeypatch.setattr(U, "record_pi_old", recording_prepare)
    opt = torch.optim.SGD(m.parameters(), lr=5.0)
    looked = []

    def look(*_):  # minibatch 2, right after the first optimizer step, against pi_old's routing
        mbs = prepared[0][1]
        looked or looked.append(
            U.measure_volatility(U.as_policy(m), mbs, [mb.old_routing for mb in mbs], plan)
        )

    opt.register_step_post_hook(look)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    got = policy_update(m, opt, sched, batch, plan, 1)
    assert 0.0 < got["moe/volatility"] <= 1.0
    # a changed position counts 1 in the set-change unit, |new - old| / k <= 1 in the paper's unit
    assert 0.0 < got["moe/volatility_experts"] <= got["moe/volatility"]
    vols = sorted(looked[0])
    assert len(vols) >= 3 and [got[k] for k in vols] == pytest.approx([looked[0][k] for k in vols], abs=1e-6)


def test_first_minibatch_is_exactly_on_policy(tiny_moe, batch):
    """With one minibatch the ratio is exactly 1: pi_old is the same forward's detached log-probs."""
    model, _ = tiny_moe
    _, m = _run(model, batch, num_minibatches=1, old_logp="recompute")
    assert m["loss/ratio_min"] == m["loss/ratio_max"] == 1.0
    assert m["loss/clip_frac_tok"] == 0.0 and m["loss/approx_kl"] == 0.0


@pytest.mark.parametrize("replay", [False, True])
def test_volatility_is_zero_without_change_and_positive_with_it(tiny_moe, batch, replay):
    """Expert volatility is exactly 0 when parameters do not move and in (0, 1] when they move a lot."""
    model, _ = tiny_moe
    for lr, check in [(0.0, lambda v: v == 0.0), (50.0, lambda v: 0.0 < v <= 1.0)]:
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        cfg = Config(
            prompts_per_step=2,
            group_size=8,
            num_minibatches=4,
            max_grad_norm=0,
            routing_replay=replay,
            algo="grpo",
        ).validate()
        out = policy_update(m, opt, sched, batch, plan_update(cfg, m, True), 1)
        assert check(out["moe/volatility"]), (lr, out["moe/volatility"])
        assert {"moe/volatility/layer0", "moe/volatility/layer1"} <= out.keys()


def test_prefix_sharing_on_needs_a_model_that_takes_4d_masks():
    """``prefix_sharing=on`` with an attention that cannot take a ready 4D mask is a one-line config
    error naming the field; ``auto`` falls back to per-row sequences."""
    from gspo.errors import GspoError
    from gspo.model.load import load_model_and_tokenizer
    from gspo.resolve import choose_layout, layout_plan

    model, _ = load_model_and_tokenizer("embedded:tiny-dense")
    assert choose_layout(model, layout_plan(Config(prefix_sharing="auto").validate())) == "shared_prefix"
    model.config._attn_implementation_internal = "flex_attention"
    assert choose_layout(model, layout_plan(Config(prefix_sharing="auto").validate())) == "rows"
    with pytest.raises(GspoError, match="config field 'prefix_sharing': 'on' needs a model"):
        choose_layout(model, layout_plan(Config(prefix_sharing="on").validate()))


@pytest.mark.parametrize("arch", ["gpt2", "bloom"])
def test_other_architectures_get_a_layout_that_is_exact(arch):
    """Learned absolute positions (GPT-2) take the shared-prefix layout; ALiBi (Bloom), whose biases
    come from the 2D mask, fails the 4D-mask probe and keeps per-row sequences. Either way the
    log-probs equal the per-row layout's."""
    from transformers import BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel

    from gspo.model.logprobs import shared_prefix_is_exact, takes_additive_mask
    from gspo.resolve import choose_layout, layout_plan

    torch.manual_seed(0)
    if arch == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=1)
        )
    else:
        model = BloomForCausalLM(BloomConfig(vocab_size=40, hidden_size=32, n_layer=2, n_head=4))
    model.eval()  # GPT-2 has dropout
    layout = choose_layout(model, layout_plan(Config().validate()))
    assert layout == ("shared_prefix" if arch == "gpt2" else "rows")
    assert takes_additive_mask(model) == shared_prefix_is_exact(model) == (arch == "gpt2")
    p_ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]])
    p_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])
    r_ids = torch.tensor([[10, 11, 12], [13, 0, 0], [14, 15, 0]])
    r_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    with torch.no_grad():
        got = response_logprobs(model, p_ids, p_mask, r_ids, r_mask, layout=layout)
        ref = response_logprobs(model, p_ids, p_mask, r_ids, r_mask, layout="rows")
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ["granitemoe", "gemma2"])
def test_models_that_post_process_logits_get_their_own_logits(arch):
    """Granite divides its logits by ``logits_scaling``, Gemma 2 soft-caps them: the LM-head probe sees
    that and the log-probs then come from the model's own logits, equal to a lone-row reference and to
    the sampler's (which samples from those logits too)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, GraniteMoeConfig, GraniteMoeForCausalLM

    from gspo.model.logprobs import lm_head_is_plain

    torch.manual_seed(0)
    small = dict(vocab_size=40, hidden_size=32, intermediate_size=32, num_hidden_layers=2)
    small.update(num_attention_heads=4, num_key_value_heads=2, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    if arch == "granitemoe":
        cfg = GraniteMoeConfig(num_local_experts=4, num_experts_per_tok=2, logits_scaling=4.0, **small)
        model = GraniteMoeForCausalLM(cfg)
    else:
        model = Gemma2ForCausalLM(Gemma2Config(head_dim=8, final_logit_softcapping=0.5, **small))
    model.eval()
    assert not lm_head_is_plain(model)
    prompts = [[5, 6], [5, 6], [7, 8, 9]]
    eng = HFRolloutEngine(model, 1, 0, torch.Generator().manual_seed(0))
    rb = eng.generate(prompts, 4, temperature=0.9)
    ids, mask = left_pad(prompts, 0)
    with torch.no_grad():
        lp = response_logprobs(model, ids, mask, rb.response_ids_BT, rb.response_mask_BT, temperature=0.9)
    torch.testing.assert_close(lp, rb.sampler_logp_BT, atol=1e-5, rtol=0)
    for b, p in enumerate(prompts):  # reference: the row alone, the model's own logits
        n = int(rb.response_mask_BT[b].sum())
        seq = torch.tensor([p + rb.response_ids_BT[b, :n].tolist()])
        with torch.no_grad():
            ref = torch.log_softmax(model(seq).logits[0].float() / 0.9, -1)
        want = ref[len(p) - 1 : len(p) - 1 + n].gather(-1, seq[0, len(p) :, None]).squeeze(-1)
        torch.testing.assert_close(lp[b, :n], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_norm", [1e-4, 1e4])
def test_gradient_clipping_closed_form(tiny_moe, batch, max_norm):
    """One SGD step (lr 1) moves the parameters by the clipped gradient: by exactly ``max_norm`` when
    the gradient norm exceeds it, by the reported (unclipped) norm when it does not."""
    model, _ = tiny_moe
    m = copy.deepcopy(model)
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    cfg = Config(
        prompts_per_step=2, group_size=8, num_minibatches=1, log_volatility=False, max_grad_norm=max_norm
    ).validate()
    metrics = policy_update(m, opt, sched, batch, plan_update(cfg, m, True), 1)
    step = torch.linalg.vector_norm(
        torch.stack([(p - b).norm() for p, b in zip(m.parameters(), before, strict=True)])
    )
    assert metrics["loss/grad_norm"] > 1e-3  # the advantages make a real gradient
    want = max_norm if metrics["loss/grad_norm"] > max_norm else metrics["loss/grad_norm"]
    assert step.item() == pytest.approx(want, rel=1e-4)


def test_attn_implementation_is_read_where_transformers_sets_it():
    """gspo reads the attention kernel in one place, from a field transformers keeps private
    (``config._attn_implementation``); this fails if transformers moves it."""
    from gspo.model.load import load_model_and_tokenizer
    from gspo.model.logprobs import attn_implementation

    model, _ = load_model_and_tokenizer("embedded:tiny-dense")
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        assert attn_implementation(model) == impl


@pytest.mark.parametrize(
    "kw, want",
    [
        (
            {},
            dict(
                pi_old="rollout",
                trainer_pi_old=False,
                replay=None,
                volatility="free",
                volatility_minibatch=1,
                # the decisions derived from those, once: the update reads them as plain fields
                sampler_pi_old=True,
                replays_sampler=False,
                replays_pi_old=False,
                volatility_free=True,
                volatility_forward=False,
                own_routing=(False, True, False, False),
                plain_head=True,  # the LM head probed once for the loaded model
            ),
        ),
        (dict(old_logp="recompute"), dict(pi_old="recompute", trainer_pi_old=True)),
        (dict(dtype="bfloat16"), dict(pi_old="recompute", trainer_pi_old=True)),  # auto: numerics differ
        (dict(async_staleness=1), dict(pi_old="rollout")),  # auto: the batch's own policy
        (dict(mismatch_correction="seq_tis"), dict(pi_old="rollout", trainer_pi_old=True)),
        (
            dict(routing_replay=True),
            dict(
                replay="R2", volatility="forward", replays_pi_old=True, own_routing=(False, True, True, True)
            ),
        ),
        (dict(num_minibatches=1), dict(volatility="forward", volatility_minibatch=0)),
        (dict(log_volatility=False), dict(volatility=None, volatility_minibatch=None)),
        (
            dict(algo="grpo"),
            dict(
                loss_kwargs=(("eps_low", 0.2), ("eps_high", 0.27), ("aggregation", "seq_mean_token_mean")),
                aggregation="seq_mean_token_mean",
                token_normalizer=False,
            ),
        ),
        (
            dict(algo="sapo", sapo_tau_neg=2.0),
            dict(loss_kwargs=(("tau_neg", 2.0), ("tau_pos", 1.0)), aggregation=None),
        ),
        (
            dict(algo="vespo", vespo_k_neg=1.5),
            dict(
                loss_kwargs=(
                    ("k_pos", 2.0),
                    ("lambda_pos", 3.0),
                    ("k_neg", 1.5),
                    ("lambda_neg", 2.0),
                    ("aggregation", "token_mean"),
                ),
                aggregation="token_mean",
                token_normalizer=True,
            ),
        ),
    ],
)
def test_the_update_plan_is_decided_once_from_the_config(tiny_moe, kw, want):
    """Each decision of an update (where pi_old comes from, replay, how volatility is measured, the
    clip range) is a field of the plan, resolved from the config in one place."""
    model, _ = tiny_moe
    plan = plan_update(Config(**kw).validate(), model, is_moe=True)
    assert {k: getattr(plan, k) for k in want} == want
    assert plan_update(Config(**kw).validate(), model, is_moe=False).volatility is None  # dense: no experts


def test_gradients_are_freed_after_the_last_optimizer_step(tiny_moe, batch):
    """The rollout and weight sync after an update hold no gradient memory."""
    model, _ = tiny_moe
    m = copy.deepcopy(model)
    cfg = Config(prompts_per_step=2, group_size=8).validate()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    out = policy_update(
        m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), batch, plan_update(cfg, m, True), 1
    )
    assert out["loss/grad_norm"] > 0 and out["loss/skipped_updates"] == 0
    assert all(p.grad is None for p in m.parameters())
