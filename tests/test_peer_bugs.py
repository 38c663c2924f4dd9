"""Bug-class regression tests: four bugs the peers shipped, each reproduced in a deliberately broken copy
of gspo's loss (or of its normalizer), and the check of gspo's suite that catches it.

| peer bug | broken copy | the check that catches it |
|---|---|---|
| TRL #3823: GSPO's sequence loss broadcast over tokens, then a token mean (length-weighted) | `trl_3823_gspo` | closed form (test_losses.py `ref_gspo`) |
| ROLL #165: GSPO documented with `seq-mean-token-sum` (each sequence's term times its length) | `roll_165_gspo` | closed form (`ref_gspo`) |
| verl #5798: the sequence-mean denominator `global_B * dp_size`, no `* dp_size` on the loss (dp^2 too small) | `verl_5798_step` | 2 ranks == 1 process (simulated here; real: test_distributed*.py) |
| TRL #6654: LUSPO's `(x * L).mean()` on a `[B, T]` per-token loss (weight L^2 / T, quadratic) | `trl_6654_luspo` | closed form (test_losses_luspo_vespo.py `ref_luspo`) |

Each test asserts that the check passes for gspo's own function and fails for the broken copy, so the
suite is shown to be able to fail on each bug class.
"""

from __future__ import annotations

import pytest
import torch
from loss_helpers import tensor_loss
from test_losses import ATOL, F64, GSPO_LR, _batch, _grad, _token_batch, ref_gspo
from test_losses_luspo_vespo import ref_luspo

from gspo.loss_prologue import loss_inputs, sequence_mean


def _seq_objective(logp, old, adv, mask, el, eh):
    """GSPO's per-sequence objective min(s A, clip(s) A), as a peer computes it ([B])."""
    inp = loss_inputs(logp, old, mask, adv)
    s = torch.exp(sequence_mean(inp.log_r_BT, inp.n_tok_B))
    a = inp.seq_advantages()
    return torch.minimum(s * a, s.clamp(1 - el, 1 + eh) * a), inp


def trl_3823_gspo(logp, old, adv, mask, el=3e-4, eh=4e-4, normalizer=None):
    """(B, 1) sequence loss times the (B, T) mask, summed over all tokens / all tokens."""
    obj_B, inp = _seq_objective(logp, old, adv, mask, el, eh)
    return -(obj_B[:, None] * inp.mask_BT).sum() / inp.mask_BT.sum(), {}


def roll_165_gspo(logp, old, adv, mask, el=3e-4, eh=4e-4, normalizer=None):
    """seq-mean-token-sum: each sequence's expanded loss summed over its tokens, mean over sequences."""
    obj_B, inp = _seq_objective(logp, old, adv, mask, el, eh)
    return -(obj_B[:, None] * inp.mask_BT).sum(-1).mean(), {}


def trl_6654_luspo(logp, old, adv, mask, el=2e-3, eh=2.5e-3, normalizer=None):
    """A (B, T) per-token loss (e.g. once a token-level term is added) aggregated as (x * L).mean()."""
    obj_B, inp = _seq_objective(logp, old, adv, mask, el, eh)
    x_BT = obj_B[:, None] * inp.mask_BT  # the sequence objective on each of its tokens
    return -(x_BT * inp.n_tok_B[:, None]).mean(), {}


def closed_form_check(fn, ref, eps, cases):
    """What test_losses.py / test_losses_luspo_vespo.py assert: value and gradient equal the reference."""
    for logp, old, adv, mask in cases:
        loss, _ = fn(logp, old, adv, mask, *eps)
        want, want_g = ref(logp, old, adv, mask, *eps)
        assert abs(loss.item() - want) < ATOL
        if want_g is not None:
            assert torch.allclose(_grad(loss, logp), torch.tensor(want_g, dtype=F64), atol=ATOL, rtol=0)


def _gspo_ref(logp, old, adv, mask, el, eh):
    return ref_gspo(logp, old, adv, mask, el, eh), None


CASES = [_batch(GSPO_LR), _batch([1e-3, -2e-3, 3e-3, 0.0, -1e-3]), _token_batch(seed=2)]


@pytest.mark.parametrize("broken", [trl_3823_gspo, roll_165_gspo], ids=["trl-3823", "roll-165"])
def test_gspo_length_weighting_bugs_are_caught(broken):
    closed_form_check(tensor_loss("gspo"), _gspo_ref, (3e-4, 4e-4), CASES)
    with pytest.raises(AssertionError):
        closed_form_check(broken, _gspo_ref, (3e-4, 4e-4), CASES)


def test_luspo_quadratic_length_bias_is_caught():
    closed_form_check(tensor_loss("luspo"), ref_luspo, (2e-3, 2.5e-3), CASES)
    with pytest.raises(AssertionError):
        closed_form_check(trl_6654_luspo, ref_luspo, (2e-3, 2.5e-3), CASES)


# ----------------------------------------------------------------------------------------------
# verl #5798: the data-parallel sequence normalizer


def gspo_step(fn, shard, n_global, world):
    """gspo's update on one rank: the loss divided by the global sequence count, times the world size
    (DDP / FSDP average the ranks' gradients); gspo.training.update._normalizer / _train_micro_batch."""
    logp, old, adv, mask = shard
    return fn(logp, old, adv, mask, normalizer=n_global)[0] * world


def verl_5798_step(fn, shard, n_global, world):
    """verl before #5798: seq_denominator = global_batch_size * dp_size and no compensation."""
    logp, old, adv, mask = shard
    return fn(logp, old, adv, mask, normalizer=n_global * world)[0]


def ranks_equal_one_process_check(step, fn, world):
    """What test_distributed*.py assert, simulated in one process: the mean over ``world`` ranks of each
    rank's gradient (the all-reduce average) equals the single-process gradient of the whole batch."""
    logp, old, adv, mask = _token_batch(seed=31, scale=0.3)
    B = logp.shape[0] - 1  # 4 rows: 2 per rank at world 2
    full = fn(logp[:B], old[:B], adv[:B], mask[:B])[0]
    g_one = _grad(full, logp)
    rows = torch.arange(B).chunk(world)
    g_ranks = sum(_grad(step(fn, (logp[r], old[r], adv[r], mask[r]), B, world), logp) for r in rows) / world
    assert torch.allclose(g_ranks, g_one, atol=ATOL, rtol=0)


def test_data_parallel_normalizer_bug_is_caught():
    for fn in (tensor_loss("gspo"), tensor_loss("luspo")):
        ranks_equal_one_process_check(gspo_step, fn, world=2)
        ranks_equal_one_process_check(verl_5798_step, fn, world=1)  # invisible on one rank ...
        with pytest.raises(AssertionError):  # ... 1/dp^2 of the update on two
            ranks_equal_one_process_check(verl_5798_step, fn, world=2)
