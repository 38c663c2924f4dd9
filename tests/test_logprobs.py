import pytest
import torch

from gspo.model.lm_head import DEFAULT_CHUNK_SIZE, logprobs_from_hidden, naive_logprobs_from_hidden


def _close(actual, expected, rtol, atol):
    """Strict elementwise |a - e| <= atol + rtol * |e| with equal shape and dtype.

    Same criterion as ``torch.testing.assert_close``, whose first call costs seconds of lazy imports.
    """
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    a, e = actual.detach().double(), expected.detach().double()
    err = (a - e).abs()
    tol = atol + rtol * e.abs()
    assert torch.isfinite(a).all() and torch.isfinite(e).all()
    assert (err <= tol).all(), (
        f"max abs err {err.max().item():.3e}, max err/tol {(err / tol).max().item():.3f}"
    )


def _inputs(N=37, H=16, V=101, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) * scale).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    return h, w, t


def _grads(fn, h, w, t, g_N, **kw):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    out = fn(h, w, t, **kw)
    (out * g_N).sum().backward()
    return out.detach(), h.grad, w.grad


def _naive_exact(h, w, t, temperature=1.0):
    """Naive autograd reference that keeps float64 inputs in float64 (the library naive casts to float32)."""
    logits = (h @ w.T).to(torch.promote_types(h.dtype, torch.float32)) / temperature
    return torch.log_softmax(logits, -1).gather(-1, t[:, None]).squeeze(-1)


def _ref_float64(h, w, t, temperature=1.0):
    logits = (h.double() @ w.double().T) / temperature
    lp = torch.log_softmax(logits, -1)
    return lp.gather(-1, t[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


def test_forward_matches_log_softmax_gather_float32():
    """Float32 log-probs match log_softmax+gather over full logits within 1e-5."""
    h, w, t = _inputs(N=50, V=257)
    ref = torch.log_softmax((h @ w.T).float(), -1).gather(-1, t[:, None]).squeeze(-1)
    out = logprobs_from_hidden(h, w, t, chunk_size=16)
    assert out.dtype == torch.float32 and out.shape == (50,)
    _close(out, ref, rtol=1e-5, atol=1e-5)
    _close(out, naive_logprobs_from_hidden(h, w, t), rtol=1e-5, atol=1e-5)


def test_forward_float64_inputs_tight():
    """Float64 inputs stay float64 and match the float64 reference to 1e-12."""
    h, w, t = _inputs(N=40, V=99, dtype=torch.float64)
    ref, ref_ent = _ref_float64(h, w, t)
    out, ent = logprobs_from_hidden(h, w, t, chunk_size=7, return_entropy=True)
    assert out.dtype == torch.float64
    _close(out, ref, rtol=1e-12, atol=1e-12)
    _close(ent, ref_ent, rtol=1e-12, atol=1e-12)


def test_grads_match_naive_float32():
    """Hidden and weight gradients under a random upstream grad match naive autograd within 1e-5."""
    h, w, t = _inputs(N=45, H=24, V=131)
    g_N = torch.randn(45, generator=torch.Generator().manual_seed(1))
    o_ref, gh_ref, gw_ref = _grads(naive_logprobs_from_hidden, h, w, t, g_N)
    o, gh, gw = _grads(logprobs_from_hidden, h, w, t, g_N, chunk_size=8)
    _close(o, o_ref, rtol=1e-5, atol=1e-5)
    _close(gh, gh_ref, rtol=1e-5, atol=1e-5)
    _close(gw, gw_ref, rtol=1e-5, atol=1e-5)
    assert gh.dtype == h.dtype and gw.dtype == w.dtype


def test_grads_match_naive_with_temperature_float64():
    """With temperature != 1 gradients in float64 match naive autograd to 1e-10."""
    h, w, t = _inputs(N=23, H=8, V=53, dtype=torch.float64)
    g_N = torch.randn(23, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    _, gh_ref, gw_ref = _grads(_naive_exact, h, w, t, g_N, temperature=0.7)
    _, gh, gw = _grads(logprobs_from_hidden, h, w, t, g_N, chunk_size=5, temperature=0.7)
    _close(gh, gh_ref, rtol=1e-10, atol=1e-10)
    _close(gw, gw_ref, rtol=1e-10, atol=1e-10)


def test_gradcheck_float64():
    """torch.autograd.gradcheck passes w.r.t. hidden and weight on a small float64 case."""
    h, w, t = _inputs(N=6, H=4, V=11, dtype=torch.float64)
    h.requires_grad_(True)
    w.requires_grad_(True)

    def f(h_, w_):
        return logprobs_from_hidden(h_, w_, t, chunk_size=4, temperature=1.3)

    assert torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_entropy_matches_reference_and_is_detached():
    """Entropy matches the float64 reference and carries no grad; log-probs still backprop."""
    h, w, t = _inputs(N=33, V=77, scale=2.0)
    h.requires_grad_(True)
    lp, ent = logprobs_from_hidden(h, w, t, chunk_size=10, temperature=0.8, return_entropy=True)
    ref_lp, ref_ent = _ref_float64(h.detach(), w, t, temperature=0.8)
    _close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    _close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    _, n_ent = naive_logprobs_from_hidden(h, w, t, temperature=0.8, return_entropy=True)
    _close(ent, n_ent, rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad and lp.requires_grad
    lp.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_entropy_without_grad_path():
    """Entropy is also correct on the no-grad path (inference/reference log-probs)."""
    h, w, t = _inputs(N=19, V=64)
    with torch.no_grad():
        lp, ent = logprobs_from_hidden(h, w, t, chunk_size=4, return_entropy=True)
    ref_lp, ref_ent = _ref_float64(h, w, t)
    _close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    _close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature(temperature):
    """Temperature divides the logits before the softmax, matching the reference."""
    h, w, t = _inputs(N=21, V=90)
    ref, _ = _ref_float64(h, w, t, temperature=temperature)
    out = logprobs_from_hidden(h, w, t, chunk_size=6, temperature=temperature)
    _close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 10, 64, 1000])
def test_chunk_sizes_not_dividing_n_and_larger_than_n(chunk_size):
    """Any chunk size (not dividing N, or larger than N) gives the same values and grads."""
    h, w, t = _inputs(N=10, H=12, V=70, dtype=torch.float64)
    g_N = torch.randn(10, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    o_ref, gh_ref, gw_ref = _grads(_naive_exact, h, w, t, g_N)
    o, gh, gw = _grads(logprobs_from_hidden, h, w, t, g_N, chunk_size=chunk_size)
    _close(o, o_ref, rtol=1e-12, atol=1e-12)
    _close(gh, gh_ref, rtol=1e-10, atol=1e-10)
    _close(gw, gw_ref, rtol=1e-10, atol=1e-10)


def test_empty_input():
    """N=0 returns empty float32 outputs and zero weight gradient without error."""
    _, w, _ = _inputs(V=30)
    h = torch.zeros(0, 16, requires_grad=True)
    w.requires_grad_(True)
    t = torch.zeros(0, dtype=torch.long)
    lp, ent = logprobs_from_hidden(h, w, t, return_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,) and lp.dtype == torch.float32
    lp.sum().backward()
    assert h.grad.shape == (0, 16)
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_bfloat16_close_to_float32_and_grad_dtypes():
    """Bfloat16 inputs match naive bf16 log-probs/grads (grads in bf16) and are near exact."""
    h, w, t = _inputs(N=40, H=32, V=300, dtype=torch.bfloat16)
    g_N = torch.randn(40, generator=torch.Generator().manual_seed(4))
    o_ref, gh_ref, gw_ref = _grads(naive_logprobs_from_hidden, h, w, t, g_N)
    o, gh, gw = _grads(logprobs_from_hidden, h, w, t, g_N, chunk_size=16)
    assert o.dtype == torch.float32 and gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    _close(o, o_ref, rtol=1e-5, atol=1e-5)  # same bf16 matmul, float32 softmax
    _close(gh.float(), gh_ref.float(), rtol=2e-2, atol=2e-2)
    _close(gw.float(), gw_ref.float(), rtol=2e-2, atol=2e-2)
    exact, _ = _ref_float64(h, w, t)  # bf16 rounding of the logits dominates (|logit| ~ 6)
    _close(o.double(), exact, rtol=0, atol=0.15)


def test_weight_without_grad():
    """A frozen weight gets no gradient while the hidden gradient still matches naive."""
    h, w, t = _inputs(N=17, V=50)
    g_N = torch.randn(17, generator=torch.Generator().manual_seed(5))
    hr = h.clone().requires_grad_(True)
    (naive_logprobs_from_hidden(hr, w, t) * g_N).sum().backward()
    hc = h.clone().requires_grad_(True)
    (logprobs_from_hidden(hc, w, t, chunk_size=4) * g_N).sum().backward()
    assert w.grad is None
    _close(hc.grad, hr.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("return_entropy", [False, True])
def test_frozen_weight_precomputed_hidden_grad_float64(return_entropy):
    """Frozen weight (hidden grad computed in forward, no recompute) matches naive autograd to 1e-10."""
    h, w, t = _inputs(N=23, H=8, V=53, dtype=torch.float64)
    g_N = torch.randn(23, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    hr = h.clone().requires_grad_(True)
    (_naive_exact(hr, w, t, temperature=0.7) * g_N).sum().backward()
    hc = h.clone().requires_grad_(True)
    out = logprobs_from_hidden(hc, w, t, chunk_size=5, temperature=0.7, return_entropy=return_entropy)
    lp = out[0] if return_entropy else out
    (lp * g_N).sum().backward()
    assert w.grad is None
    _close(hc.grad, hr.grad, rtol=1e-10, atol=1e-10)
    if return_entropy:
        _close(out[1], _ref_float64(h, w, t, temperature=0.7)[1], rtol=1e-12, atol=1e-12)


def test_gradcheck_float64_frozen_weight():
    """torch.autograd.gradcheck passes w.r.t. hidden alone (precomputed-gradient path)."""
    h, w, t = _inputs(N=6, H=4, V=11, dtype=torch.float64)
    h.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda h_: logprobs_from_hidden(h_, w, t, chunk_size=4, temperature=1.3), (h,), eps=1e-6, atol=1e-7
    )


def test_bfloat16_frozen_weight_close_to_naive():
    """Bfloat16 with a frozen weight: bf16 hidden grad close to naive bf16 autograd, no weight grad."""
    h, w, t = _inputs(N=40, H=32, V=300, dtype=torch.bfloat16)
    g_N = torch.randn(40, generator=torch.Generator().manual_seed(9))
    hr = h.clone().requires_grad_(True)
    (naive_logprobs_from_hidden(hr, w, t) * g_N).sum().backward()
    hc = h.clone().requires_grad_(True)
    (logprobs_from_hidden(hc, w, t, chunk_size=16) * g_N).sum().backward()
    assert hc.grad.dtype == torch.bfloat16 and w.grad is None
    _close(hc.grad.float(), hr.grad.float(), rtol=2e-2, atol=2e-2)


def test_hidden_without_grad():
    """Hidden not requiring grad: only the weight gets a gradient, matching naive."""
    h, w, t = _inputs(N=17, V=50)
    g_N = torch.randn(17, generator=torch.Generator().manual_seed(6))
    wr = w.clone().requires_grad_(True)
    (naive_logprobs_from_hidden(h, wr, t) * g_N).sum().backward()
    wc = w.clone().requires_grad_(True)
    (logprobs_from_hidden(h, wc, t, chunk_size=5) * g_N).sum().backward()
    assert h.grad is None
    _close(wc.grad, wr.grad, rtol=1e-5, atol=1e-5)


def test_tied_weights_accumulate_both_paths():
    """A weight used both as embedding and LM head accumulates both gradient contributions."""
    h0, w, t = _inputs(N=12, H=8, V=40, dtype=torch.float64)
    ids = torch.randint(0, 40, (12,), generator=torch.Generator().manual_seed(7))

    def run(fn):
        wt = w.clone().requires_grad_(True)
        hidden = torch.tanh(wt[ids] + h0)  # embedding lookup through the same tensor
        (fn(hidden, wt, t) * torch.linspace(-1, 1, 12, dtype=torch.float64)).sum().backward()
        return wt.grad

    _close(run(lambda *a: logprobs_from_hidden(*a, chunk_size=5)), run(_naive_exact), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("freeze_weight", [False, True])
def test_no_full_logits_saved_for_backward(freeze_weight):
    """The graph saves only inputs, per-row logsumexp and (frozen weight) one [N, H] factor; no N*V."""
    N, H, V = 64, 8, 500
    h, w, t = _inputs(N=N, H=H, V=V)
    h.requires_grad_(True)
    w.requires_grad_(not freeze_weight)
    shapes = []

    def pack(x):
        shapes.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logprobs_from_hidden(h, w, t, chunk_size=16)
    expected = [(N, H), (V, H), (N,), (N,)] + ([(N, H)] if freeze_weight else [])
    assert sorted(shapes) == sorted(expected)


def test_invalid_chunk_size_and_default():
    """A chunk size below 1 is rejected; the default chunk size is a positive int."""
    h, w, t = _inputs()
    with pytest.raises(ValueError):
        logprobs_from_hidden(h, w, t, chunk_size=0)
    assert isinstance(DEFAULT_CHUNK_SIZE, int) and DEFAULT_CHUNK_SIZE >= 1
