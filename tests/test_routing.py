"""Routing capture / replay / volatility (gspo.model.routing) on tiny random-init MoE models."""

from __future__ import annotations

import importlib
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gspo.compat import transformers_moe
from gspo.errors import GspoError
from gspo.model import routing as R

V = 40
B, L = 3, 9


# the fields every tiny model shares; each architecture adds its own (experts, attention, norms)
COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
)
# name: (transformers' <prefix>Config / <prefix>ForCausalLM, init seed, its own fields); qwen3_moe
# is gspo's own tiny model (gspo.model.load)
ARCHS: dict[str, tuple[str, int, dict]] = {
    "qwen3_moe": ("Qwen3Moe", 0, {}),
    "mixtral": (
        "Mixtral",
        1,
        dict(num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
    ),
    "olmoe": (
        "Olmoe",
        2,
        dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    ),
    "qwen2_moe_no_norm": (
        "Qwen2Moe",
        3,
        dict(
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3",
        4,
        dict(
            moe_intermediate_size=16,
            first_k_dense_replace=0,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        ),
    ),
    "granitemoe": (
        "GraniteMoe",
        5,
        dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    ),
}


def make_moe(arch: str = "qwen3_moe") -> nn.Module:
    """A fresh tiny random-init MoE of ``arch`` (two layers; the same weights on every call)."""
    prefix, seed, own = ARCHS[arch]
    if arch == "qwen3_moe":
        from gspo.model.load import build_tiny_moe

        return build_tiny_moe(V, seed=seed)
    import transformers

    cfg = getattr(transformers, f"{prefix}Config")(**COMMON, **own)
    torch.manual_seed(seed)
    return getattr(transformers, f"{prefix}ForCausalLM")(cfg)


def _batch(seed: int = 0, b: int = B, seq: int = L):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (b, seq), generator=g)
    mask = torch.ones(b, seq, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, :1] = 0
    ids[mask == 0] = 0
    return ids, mask


def _logits(model, ids, mask, **kw):
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **kw).logits


def _capture(model, ids, mask):
    with R.capture_routing(model) as rec:
        out = _logits(model, ids, mask)
    return out, R.routing_snapshot(rec)


def _hook_state(model):
    return [
        (
            name,
            tuple(m._forward_hooks),
            tuple(m._forward_pre_hooks),
            tuple(m._forward_hooks_with_kwargs),
            tuple(m._forward_pre_hooks_with_kwargs),
        )
        for name, m in model.named_modules()
    ]


def _perturb_routers(model, seed=5, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in R.find_routers(model).values():
            r.weight.add_(torch.randn(r.weight.shape, generator=g) * scale)


def _same(a: R.Routing, b: R.Routing) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------
# discovery and the registry


def test_find_routers_names_and_is_moe():
    """Qwen3-MoE routers are found as layer0/layer1 and is_moe is True; a dense model has none and
    capture on it raises GspoError."""
    from gspo.model.load import build_tiny_dense

    m = make_moe()
    routers = R.find_routers(m)
    assert list(routers) == ["layer0", "layer1"]
    assert all(type(r).__name__ == "Qwen3MoeTopKRouter" for r in routers.values())
    assert R.is_moe(m)
    dense = build_tiny_dense(V)
    assert R.find_routers(dense) == {} and not R.is_moe(dense)
    with pytest.raises(GspoError, match="no MoE routers"):
        with R.capture_routing(dense):
            pass


def test_unsupported_router_or_block_gives_helpful_error():
    """An unregistered router-like class, or a transformers-4-style block (nn.Linear gate + experts
    list, routing inline), raises GspoError naming the supported classes; is_moe warns and is False."""

    class FancyTopKRouter(nn.Module):
        pass

    class OldSparseMoeBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 2, bias=False)
            self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    for m in (nn.Sequential(nn.Linear(2, 2), FancyTopKRouter()), nn.Sequential(OldSparseMoeBlock())):
        with pytest.raises(GspoError, match="unsupported MoE router.*Qwen3MoeTopKRouter"):
            R.find_routers(m)
        with pytest.warns(UserWarning, match="unsupported"):
            assert not R.is_moe(m)


def _registered_routers():
    out = []
    for (mod_name, cls_name), fn in transformers_moe.SCORE_FNS.items():
        try:
            out.append(pytest.param(getattr(importlib.import_module(mod_name), cls_name), fn, id=cls_name))
        except (ImportError, AttributeError):
            pass
    return out


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls,score_fn", _registered_routers())
def test_registered_score_fn_reproduces_router_scores_bitwise(cls, score_fn, dtype, norm):
    """For every registered router class: its score function at the router's own indices equals the
    router's own scores bit for bit (and dtype), so the registry replicates each router's formula."""
    cfg = SimpleNamespace(
        num_experts_per_tok=2,
        num_experts=8,
        num_local_experts=8,
        norm_topk_prob=norm,
        hidden_size=16,
        routed_scaling_factor=2.5,
        n_group=2,
        topk_group=1,
    )
    torch.manual_seed(0)
    router = cls(cfg)
    with torch.no_grad():
        router.weight.normal_()
        if hasattr(router, "e_score_correction_bias"):  # choice != score: the bias must drop out
            router.e_score_correction_bias.normal_()
    router = router.to(dtype)
    h_NH = torch.randn(12, 16, dtype=dtype)
    logits, scores, idx = router(h_NH)
    assert idx.shape == (12, 2)
    forced = score_fn(router, logits, idx).to(scores.dtype)
    assert torch.equal(forced, scores)


# ------------------------------------------------------------------------------------------------
# replay


@pytest.mark.parametrize("arch", list(ARCHS))
def test_replay_unchanged_params_reproduces_logits_exactly(arch):
    """With unchanged params, replaying captured routing (padded batch) gives bit-identical logits, and
    capture inside replay returns the same indices; the recorder is a mapping of [B, T, k] LongTensors."""
    model = make_moe(arch).eval()
    ids, mask = _batch()
    with torch.no_grad():
        with R.capture_routing(model) as rec:
            ref = _logits(model, ids, mask)
        routing = R.routing_snapshot(rec)
        assert set(routing) == {"layer0", "layer1"} and set(rec) == set(routing) and len(rec) == 2
        for name, idx in routing.items():
            assert idx.shape == (B, L, 2) and idx.dtype == torch.long
            assert torch.equal(rec[name], idx)
        with R.replay_routing(model, routing), R.capture_routing(model) as rec2:
            out = _logits(model, ids, mask)
    assert torch.equal(out, ref)
    assert _same(dict(rec2), routing)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_replay_after_perturbation_forces_recorded_indices(arch):
    """After perturbing routers, capture inside replay (either nesting) returns the recorded indices and
    logits differ from the free (non-replay) forward, whose routing did change."""
    model = make_moe(arch).eval()
    ids, mask = _batch()
    with torch.no_grad():
        before, old = _capture(model, ids, mask)
        _perturb_routers(model)
        free, new = _capture(model, ids, mask)
        overall, _ = R.routing_volatility(old, new, mask)
        assert overall > 0.2  # routing really changed
        with R.replay_routing(model, old), R.capture_routing(model) as rec:
            replayed = _logits(model, ids, mask)
        with R.capture_routing(model) as rec2, R.replay_routing(model, old):  # other nesting order
            replayed2 = _logits(model, ids, mask)
    assert _same(R.routing_snapshot(rec), old) and _same(R.routing_snapshot(rec2), old)
    assert torch.equal(replayed, replayed2)
    assert not torch.allclose(replayed, free, atol=1e-4)
    assert not torch.equal(replayed, before)  # the scores still come from the perturbed router


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe_no_norm"])
def test_replay_router_grads_match_closed_form(arch):
    """Under replay every router.weight gets a nonzero grad equal to the closed-form softmax-gather
    (renormalised or not) gradient computed from the router input and d loss / d scores."""
    model = make_moe(arch).train()
    if hasattr(model.config, "router_jitter_noise"):
        assert model.config.router_jitter_noise == 0
    ids, mask = _batch()
    with torch.no_grad():
        _, old = _capture(model, ids, mask)
        _perturb_routers(model, scale=0.3)
    routers = R.find_routers(model)
    saved: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def saver(name):
        def hook(_m, args, out):
            out[1].retain_grad()
            saved[name] = (args[0].detach().reshape(-1, args[0].shape[-1]), out[1], out[2])

        return hook

    with R.replay_routing(model, old):
        hs = [r.register_forward_hook(saver(n)) for n, r in routers.items()]  # runs after replay's hook
        try:
            logits = _logits(model, ids, mask)
        finally:
            for h in hs:
                h.remove()
    model.zero_grad()
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
    (logits * w).sum().backward()
    renorm = getattr(model.config, "norm_topk_prob", True)  # Mixtral always renormalises
    for name, router in routers.items():
        h_NH, scores_Nk, idx_Nk = saved[name]
        assert torch.equal(idx_Nk, old[name].reshape(-1, 2))
        g_Nk = scores_Nk.grad
        p_NE = torch.softmax(h_NH @ router.weight.detach().T, -1)
        p_sel = p_NE.gather(-1, idx_Nk)
        s_Nk = p_sel / p_sel.sum(-1, keepdim=True) if renorm else p_sel
        assert torch.allclose(s_Nk, scores_Nk.detach(), atol=1e-6)
        g_NE = torch.zeros_like(p_NE).scatter(-1, idx_Nk, g_Nk)
        inner_N1 = (g_Nk * s_Nk).sum(-1, keepdim=True)
        # renorm: s = softmax over the selected logits only; no renorm: s = full softmax at idx
        base_NE = torch.zeros_like(p_NE).scatter(-1, idx_Nk, s_Nk) if renorm else p_NE
        dz_NE = base_NE * (g_NE - inner_N1)
        ref = dz_NE.T @ h_NH
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
        assert torch.allclose(router.weight.grad, ref, rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("arch", list(ARCHS))
def test_replay_router_grads_match_finite_differences(arch):
    """Under replay (routing fixed, so the loss is smooth in the router weights) every router.weight
    gets a nonzero grad whose directional derivative along a random direction matches a central finite
    difference (float64 model; routers and RMSNorm still compute in float32, hence eps=3e-3, 1%)."""
    model = make_moe(arch).double().eval()
    model.set_experts_implementation("eager")  # the default grouped_mm kernel has no float64
    ids, mask = _batch()
    w = torch.randn(B, L, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        _, old = _capture(model, ids, mask)
        _perturb_routers(model, scale=0.3)

    def loss():
        with R.replay_routing(model, old):
            return (_logits(model, ids, mask) * w).sum()

    model.zero_grad()
    loss().backward()
    g = torch.Generator().manual_seed(7)
    eps = 3e-3
    for name, router in R.find_routers(model).items():
        grad = router.weight.grad
        assert grad is not None and grad.abs().sum() > 0, name
        d = torch.randn(router.weight.shape, generator=g, dtype=torch.float64)
        w0 = router.weight.detach().clone()
        with torch.no_grad():
            router.weight.copy_(w0 + eps * d)
            up = loss()
            router.weight.copy_(w0 - eps * d)
            down = loss()
            router.weight.copy_(w0)
        fd = (up - down) / (2 * eps)
        assert torch.isclose(fd, (grad * d).sum(), rtol=1e-2), (name, float(fd), float((grad * d).sum()))


def test_replay_rejects_wrong_shapes_and_missing_layers():
    """Replay checks the exact [B, T] of every call (not just B*T) and that every router has routing."""
    model = make_moe().eval()
    ids, mask = _batch()
    with torch.no_grad():
        _, routing = _capture(model, ids, mask)
        transposed = {k: v.reshape(L, B, 2) for k, v in routing.items()}  # same token count
        with pytest.raises(GspoError, match=r"forced routing has shape \[9, 3, 2\]"):
            with R.replay_routing(model, transposed):
                _logits(model, ids, mask)
        with pytest.raises(GspoError, match="no entry for router"):
            with R.replay_routing(model, {"layer0": routing["layer0"]}):
                pass


def test_replay_under_activation_checkpointing_warns_and_backward_inside_is_exact():
    """With activation checkpointing on (and grad enabled) replay warns that a recompute after exit would
    not be replayed; a backward inside the context gives the same router grads as without checkpointing.
    Without checkpointing there is no warning."""
    model = make_moe().train()
    ids, mask = _batch()
    with torch.no_grad():
        _, routing = _capture(model, ids, mask)
        _perturb_routers(model)

    def router_grads():
        model.zero_grad()
        with R.replay_routing(model, routing):
            _logits(model, ids, mask).pow(2).mean().backward()
        return [r.weight.grad.clone() for r in R.find_routers(model).values()]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = router_grads()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with pytest.warns(UserWarning, match="activation checkpointing"):
        got = router_grads()
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(got, ref, strict=True))


# ------------------------------------------------------------------------------------------------
# hooks, generate, multi-forward


def test_hooks_removed_after_contexts_and_on_exception():
    """After capture/replay (normal exit, exception inside, shape error raised from a hook) no hooks are
    left (every module's hook dicts are empty) and outputs equal the baseline."""
    model = make_moe().eval()
    ids, mask = _batch()
    with torch.no_grad():
        base = _logits(model, ids, mask)
        empty = _hook_state(model)
        assert all(not any(s[1:]) for s in empty)
        _, routing = _capture(model, ids, mask)
        with R.replay_routing(model, routing), R.capture_routing(model):
            assert _hook_state(model) != empty  # hooks are live inside
            _logits(model, ids, mask)
        assert _hook_state(model) == empty
        with pytest.raises(RuntimeError, match="boom"):
            with R.replay_routing(model, routing), R.capture_routing(model):
                _logits(model, ids, mask)
                raise RuntimeError("boom")
        assert _hook_state(model) == empty
        bad = {k: v[:1] for k, v in routing.items()}
        with pytest.raises(GspoError, match="forced routing has shape"):
            with R.replay_routing(model, bad):
                _logits(model, ids, mask)
        assert _hook_state(model) == empty
        assert torch.equal(_logits(model, ids, mask), base)
    for r in R.find_routers(model).values():
        assert not r._forward_hooks and not r._forward_pre_hooks


def test_replay_with_transformers_router_logits_recorder():
    """output_router_logits=True makes transformers install its own persistent router hooks: replay
    still reproduces logits and router_logits exactly, and on exit those hooks are left as they were."""
    model = make_moe().eval()
    ids, mask = _batch()
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        kw = dict(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, output_router_logits=True
        )
        with R.capture_routing(model) as rec:
            ref = model(**kw)
        state = _hook_state(model)  # now includes transformers' output-capturing hooks
        assert any(s[1] for s in state)
        with R.replay_routing(model, R.routing_snapshot(rec)):
            out = model(**kw)
        assert _hook_state(model) == state
    assert torch.equal(out.logits, ref.logits)
    assert all(torch.equal(a, b) for a, b in zip(out.router_logits, ref.router_logits, strict=True))
    assert torch.equal(out.aux_loss, ref.aux_loss)


def test_generate_unaffected_outside_contexts_and_capturable_inside():
    """Greedy KV-cached generate gives the same tokens before and after routing contexts were used (no
    context active); inside capture_routing it records each step, which dim=1 joins into the routing
    of every fed position, equal to one full forward over those tokens; dim=0 refuses (lengths differ)."""
    model = make_moe().eval()
    ids = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    g0 = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    with torch.no_grad():
        _, routing = _capture(model, *_batch())
        with R.replay_routing(model, routing):
            _logits(model, *_batch())
    g1 = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(g0, g1)
    with R.capture_routing(model) as rec:
        g2 = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(g0, g2)
    assert [list(c.shape) for c in rec.calls["layer0"]] == [[2, 5, 2]] + [[2, 1, 2]] * 5
    steps = R.routing_snapshot(rec, dim=1)
    fed = g2[:, :-1]  # the last sampled token is never fed back
    with torch.no_grad():
        _, full = _capture(model, fed, torch.ones_like(fed))
    assert _same(steps, full)
    with pytest.raises(GspoError, match="cannot be concatenated along dim 0"):
        R.routing_snapshot(rec)


def test_base_model_call_and_multi_forward_concatenation():
    """Calling the base model (as the training loop does) is captured; several forwards cat along B;
    slice/cat round-trip."""
    model = make_moe().eval()
    ids, mask = _batch()
    base = getattr(model, model.base_model_prefix)
    with torch.no_grad():
        _, full = _capture(model, ids, mask)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with R.capture_routing(model) as rec:
            base(input_ids=ids[:1], attention_mask=mask[:1], position_ids=pos[:1], use_cache=False)
            base(input_ids=ids[1:], attention_mask=mask[1:], position_ids=pos[1:], use_cache=False)
    assert len(rec.calls["layer0"]) == 2
    assert _same(R.routing_snapshot(rec), full) and _same(dict(rec), full)
    parts = [{k: v[:1] for k, v in full.items()}, {k: v[1:] for k, v in full.items()}]
    assert parts[0]["layer0"].shape == (1, L, 2)
    assert _same({k: torch.cat([p[k] for p in parts]) for k in full}, full)


# ------------------------------------------------------------------------------------------------
# volatility


def test_expert_volatility_properties():
    """Volatility: 0 identical, 1 disjoint, order-insensitive, respects the mask, empty mask -> 0."""
    g = torch.Generator().manual_seed(0)
    old = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(12)]).reshape(3, 4, 2)
    ones = torch.ones(3, 4)
    v = R.expert_volatility(old, old.clone(), ones)
    assert v.dim() == 0 and v.dtype == torch.float32 and v == 0
    assert R.expert_volatility(old, old.flip(-1), ones) == 0
    disjoint = torch.stack(
        [torch.tensor([e for e in range(8) if e not in row][:2]) for row in old.reshape(-1, 2)]
    )
    assert R.expert_volatility(old, disjoint.reshape(3, 4, 2), ones) == 1
    changed = old.clone()
    changed[0, 0] = disjoint[0]
    mask = ones.clone()
    mask[0, 0] = 0
    assert R.expert_volatility(old, changed, mask) == 0
    assert torch.isclose(R.expert_volatility(old, changed, ones), torch.tensor(1 / 12))
    assert R.expert_volatility(old, changed, torch.zeros(3, 4)) == 0
    with pytest.raises(GspoError, match="do not match"):
        R.expert_volatility(old, old, torch.ones(3, 5))


def test_share_of_activated_experts_changed_is_the_papers_unit():
    """|new \\ old| / k per position: top-2 sets {0,1} -> {0,2} change one of two experts (0.5, where
    the set-change volatility counts 1); identical or reordered sets 0; disjoint 1; masked positions out."""
    old = torch.tensor([[[0, 1], [3, 4], [5, 6]]])  # B=1, T=3, k=2
    new = torch.tensor([[[2, 0], [4, 3], [1, 2]]])
    mask = torch.ones(1, 3)
    assert torch.isclose(R.expert_share_changed(old, new, mask), torch.tensor((0.5 + 0.0 + 1.0) / 3))
    assert torch.isclose(R.expert_volatility(old, new, mask), torch.tensor(2 / 3))
    assert torch.isclose(
        R.expert_share_changed(old, new, torch.tensor([[1.0, 1.0, 0.0]])), torch.tensor(0.25)
    )
    assert R.expert_share_changed(old, old.flip(-1), mask) == 0
    assert R.expert_share_changed(old, new, torch.zeros(1, 3)) == 0
    two_layers = R.routing_share_changed({"a": old, "b": old}, {"a": new, "b": old}, mask)
    assert torch.isclose(two_layers, torch.tensor(0.25))


def test_volatility_closed_form_example():
    """Hand-computed: 1 of 3 masked positions changes in layer0 (a swap is no change, one replaced
    expert is), none in layer1 -> 1/3, 0, mean 1/6."""
    old = torch.tensor([[[0, 1], [2, 3], [4, 5], [6, 7]]])
    new = torch.tensor([[[1, 0], [2, 4], [5, 4], [7, 0]]])  # pos1 and pos3 change; pos3 is masked out
    mask = torch.tensor([[1, 1, 1, 0]])
    assert torch.isclose(R.expert_volatility(old, new, mask), torch.tensor(1 / 3))
    overall, per = R.routing_volatility({"layer0": old, "layer1": old}, {"layer0": new, "layer1": old}, mask)
    assert set(per) == {"layer0", "layer1"}
    assert torch.isclose(per["layer0"], torch.tensor(1 / 3)) and per["layer1"] == 0
    assert overall.dim() == 0 and torch.isclose(overall, torch.tensor(1 / 6))
    with pytest.raises(GspoError, match="layer names differ"):
        R.routing_volatility({"layer0": old}, {"layer1": old}, mask)
