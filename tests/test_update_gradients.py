"""The gradient of every optimizer step of ``policy_update`` is the gradient of the loss on that whole
minibatch, computed directly with the loss's own default normalizer: for every algorithm and
aggregation, in one pass and with micro-batches. (tests/test_distributed.py adds 2 ranks.)

This pins the loop's normalizer: a unit-correct loss divided by the wrong count (sequences instead
of tokens for ``token_mean``) scales this gradient and fails here.
"""

import copy

import pytest
import torch
from step_helpers import plan_update

from gspo.config import Config
from gspo.config.algorithm import loss_params
from gspo.data import TrainBatch, left_pad
from gspo.loss_prologue import loss_inputs
from gspo.losses import LOSSES
from gspo.model.logprobs import response_logprobs
from gspo.rollout.hf import HFRolloutEngine
from gspo.training.update import policy_update


def _cases():
    for algo, spec in LOSSES.items():
        for agg in ("seq_mean_token_mean", "token_mean") if spec.aggregation is not None else (None,):
            for micro in (0, 3):
                # Clip-Cov / KL-Cov select among the tokens of one call (a micro-batch, as verl): with
                # micro-batches the step is not the whole minibatch's loss (gspo.losses_trust)
                if not (micro and algo in ("clip_cov", "kl_cov")):
                    yield algo, agg, micro


CASES = list(_cases())


@pytest.fixture(scope="module")
def batch(tiny_moe):
    model, tok = tiny_moe
    prompts = [tok(f"rev:{n}=").input_ids for n in [1, 12, 123, 1234, 12345, 123456, 1234567, 98] * 2]
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(1))
    rb = eng.generate(prompts, 10, temperature=1.0)
    ids, mask = left_pad(prompts, tok.pad_token_id)
    adv = torch.linspace(-1.5, 1.5, 16)[torch.randperm(16, generator=torch.Generator().manual_seed(0))]
    # a sampler slightly off the trainer, so that pi_old = recompute differs from the sampler's numbers
    sampler = rb.sampler_logp_BT + 0.01 * rb.response_mask_BT
    return TrainBatch(ids, mask, rb.response_ids_BT, rb.response_mask_BT, sampler, adv)


class _Recorder(torch.optim.SGD):
    """SGD that keeps (parameters, gradients) as they are at each step."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen = []

    def step(self, closure=None):
        ps = [p for g in self.param_groups for p in g["params"]]
        self.seen.append(
            ([p.detach().clone() for p in ps], [p.grad.clone() if p.grad is not None else None for p in ps])
        )
        return super().step(closure)


def _direct_grads(model, params, rows: TrainBatch, old_logp_BT, algo, agg, cfg):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p, v in zip(m.parameters(), params, strict=True):
            p.copy_(v)
    lp = response_logprobs(
        m,
        rows.prompt_ids_BP,
        rows.prompt_mask_BP,
        rows.response_ids_BT,
        rows.response_mask_BT,
        cfg.temperature,
    )
    inp = loss_inputs(lp, old_logp_BT, rows.response_mask_BT, rows.adv_B)
    loss = LOSSES[algo](inp, agg, **loss_params(cfg)).loss
    loss.backward()
    return [p.grad for p in m.parameters()]


@pytest.mark.parametrize(
    ("algo", "agg", "micro"), CASES, ids=[f"{a}-{g}-{m}" if g else f"{a}-{m}" for a, g, m in CASES]
)
def test_update_step_gradient_is_the_whole_minibatch_loss_gradient(tiny_moe, batch, algo, agg, micro):
    model, _ = tiny_moe
    kw = {"aggregation": agg} if agg else {}
    cfg = Config(
        prompts_per_step=2, group_size=8, num_minibatches=2, micro_batch_size=micro, algo=algo,
        old_logp="recompute", max_grad_norm=0, log_volatility=False, temperature=0.9, **kw,
    ).validate()  # fmt: skip
    m = copy.deepcopy(model)
    opt = _Recorder(m.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    policy_update(m, opt, sched, batch, plan_update(cfg, m, True), 1)
    assert len(opt.seen) == 2
    init = [p.detach().clone() for p in model.parameters()]
    for i, (params, grads) in enumerate(opt.seen):
        rows = batch.rows(slice(8 * i, 8 * (i + 1)))
        with torch.no_grad():  # pi_old: the policy before the update
            old = response_logprobs(
                model,
                rows.prompt_ids_BP,
                rows.prompt_mask_BP,
                rows.response_ids_BT,
                rows.response_mask_BT,
                0.9,
            )
        want = _direct_grads(model, params if i else init, rows, old, algo, agg, cfg)
        scale = max(float(g.abs().max()) for g in want if g is not None)
        assert scale > 0, "the case makes no gradient: it could not fail"
        for g_got, g_want in zip(grads, want, strict=True):
            if g_want is None:
                assert g_got is None or float(g_got.abs().max()) == 0.0
                continue
            torch.testing.assert_close(g_got, g_want, atol=2e-6 * max(scale, 1.0), rtol=1e-4)


@pytest.mark.parametrize("kind", ["seq_tis", "seq_mask", "token_mask"])
@pytest.mark.parametrize("algo", ["gspo", "grpo"])
def test_mismatch_correction_enters_the_update_as_the_pure_functions_say(tiny_moe, batch, kind, algo):
    """With a sampler far from the trainer (per-row offsets: rho_i from 0.4 to 2.7, so some sequences
    are truncated, some dropped), the first step's gradient is the whole-minibatch loss gradient
    with gspo.correction's weight (or token mask) applied directly."""
    from gspo import correction as C

    model, _ = tiny_moe
    off_B = torch.linspace(-0.9, 1.0, 16)[:, None] * batch.response_mask_BT
    far = batch.rows(slice(None))
    far.sampler_logp_BT = batch.sampler_logp_BT - 0.01 * batch.response_mask_BT - off_B
    cfg = Config(
        prompts_per_step=2, group_size=8, num_minibatches=1, algo=algo, old_logp="recompute",
        max_grad_norm=0, log_volatility=False, temperature=0.9, mismatch_correction=kind,
    ).validate()  # fmt: skip
    m = copy.deepcopy(model)
    opt = _Recorder(m.parameters(), lr=0.05)
    metrics = policy_update(
        m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), far, plan_update(cfg, m, True), 1
    )
    rows = far.rows(slice(None))
    with torch.no_grad():
        old = response_logprobs(
            model, rows.prompt_ids_BP, rows.prompt_mask_BP, rows.response_ids_BT, rows.response_mask_BT, 0.9
        )
    mask = rows.response_mask_BT
    weight = None
    if kind == "seq_tis":
        weight = C.sequence_tis_weights(old, rows.sampler_logp_BT, mask, cfg.mismatch_cap)
        assert 0 < metrics["mismatch/tis_trunc_frac_seq"] < 1
    elif kind == "seq_mask":
        weight = C.sequence_mask(old, rows.sampler_logp_BT, mask, 0.5, 2.0)
        assert 0 < metrics["mismatch/seq_mask_frac_seq"] < 1
    else:
        mask = mask * C.token_mask(old, rows.sampler_logp_BT, mask, 0.5, 5.0).long()
        assert 0 < metrics["mismatch/tok_mask_frac_tok"] < 1
    mm = copy.deepcopy(model)
    lp = response_logprobs(
        mm, rows.prompt_ids_BP, rows.prompt_mask_BP, rows.response_ids_BT, rows.response_mask_BT, 0.9
    )
    loss = LOSSES[algo](loss_inputs(lp, old, mask, rows.adv_B, weight=weight), **loss_params(cfg)).loss
    loss.backward()
    ((_, grads),) = opt.seen
    for g_got, p in zip(grads, mm.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(g_got, p.grad, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "kw",
    [
        dict(algo="gspo"),
        dict(algo="grpo", routing_replay=True),  # R2: the recomputed forwards replay pi_old's experts
        dict(algo="gspo", routing_replay=True, num_minibatches=1, micro_batch_size=4),
    ],
    ids=["gspo", "grpo-replay", "gspo-replay-micro"],
)
def test_activation_checkpointing_leaves_every_gradient_unchanged(tiny_moe, batch, kw):
    """Every optimizer step's gradient (float32) is the same with and without per-layer activation
    checkpointing: the backward's recomputed forward is the forward, Routing Replay included (its
    hooks stay on through the backward)."""
    from gspo.model.load import enable_activation_checkpointing

    model, _ = tiny_moe
    cfg = Config(
        prompts_per_step=2,
        group_size=8,
        old_logp="recompute",
        max_grad_norm=0,
        **{"num_minibatches": 2, **kw},
    ).validate()
    seen = []
    for checkpointing in (False, True):
        m = copy.deepcopy(model)
        if checkpointing:
            enable_activation_checkpointing(m)
        opt = _Recorder(m.parameters(), lr=0.05)
        policy_update(
            m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), batch, plan_update(cfg, m, True), 1
        )
        seen.append(opt.seen)
    assert len(seen[0]) == cfg.num_minibatches
    for (_, plain), (_, ckpt) in zip(*seen, strict=True):
        assert any(g is not None and float(g.abs().max()) > 0 for g in plain)
        for a, b in zip(plain, ckpt, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(b, a, atol=0, rtol=0)


def test_activation_checkpointing_recomputes_and_needs_the_replay_in_the_backward(
    tiny_moe, batch, monkeypatch
):
    """The checkpointed update recomputes every decoder layer in its backward (one more call each), and
    a replay that ended before the backward (the bug the update avoids) is caught by torch."""
    from gspo.model import routing as R
    from gspo.model.load import enable_activation_checkpointing

    model, _ = tiny_moe
    cfg = Config(prompts_per_step=2, group_size=8, routing_replay=True, log_volatility=False).validate()
    calls = {}
    for checkpointing in (False, True):
        m = copy.deepcopy(model)
        if checkpointing:
            enable_activation_checkpointing(m)
        n = []  # calls inside the first decoder layer (the layer's own hooks stay outside the checkpoint)
        h = m.model.layers[0].self_attn.register_forward_pre_hook(lambda *a, n=n: n.append(1))
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        policy_update(
            m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), batch, plan_update(cfg, m, True), 1
        )
        h.remove()
        calls[checkpointing] = len(n)
    assert calls[True] == calls[False] + cfg.num_minibatches  # one recompute per training forward

    real = R.replay_routing
    monkeypatch.setattr(
        R, "replay_routing", lambda model, routing, backward_inside=False: real(model, routing)
    )
    from gspo.training import update as U

    def backward_outside(policy, mb, plan, normalizer, world_size, capture, observers):  # replay ends first
        with U.nullcontext() if mb.replay is None else real(U.unwrap(policy, "transformers"), mb.replay):
            f = U.forward(policy, mb, plan, entropy=True)
        f.logp_BT.sum().backward()
        return f.logp_BT.sum().detach(), {}, None

    monkeypatch.setattr(U, "_train_micro_batch", backward_outside)
    m = copy.deepcopy(model)
    enable_activation_checkpointing(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    with (
        pytest.raises(torch.utils.checkpoint.CheckpointError),
        pytest.warns(UserWarning, match="checkpointing"),
    ):
        policy_update(
            m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), batch, plan_update(cfg, m, True), 1
        )
