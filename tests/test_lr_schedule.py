"""The learning rate of optimizer step s is lr x min(1, (s + 1) / warmup_steps) (torch's LinearLR
warm-up), and a scheduler restored from its state continues the same sequence."""

from __future__ import annotations

import pytest
import torch

from gspo import Config
from gspo.resolve import optim_plan
from gspo.training.run import make_optimizer


def _lrs(warmup: int, steps: int, resume_at: int | None = None) -> list[float]:
    model = torch.nn.Linear(2, 2)
    opt, sched = make_optimizer(model, optim_plan(Config(lr=3e-4, warmup_steps=warmup)))
    out = []
    for s in range(steps):
        if s == resume_at:  # a fresh optimizer and scheduler, loaded from the saved states
            state = (opt.state_dict(), sched.state_dict())
            opt, sched = make_optimizer(model, optim_plan(Config(lr=3e-4, warmup_steps=warmup)))
            opt.load_state_dict(state[0])
            sched.load_state_dict(state[1])
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("warmup", [0, 1, 4, 64])
def test_warmup_is_linear_then_flat(warmup):
    got = _lrs(warmup, 80)
    want = [3e-4 * min(1.0, (s + 1) / max(warmup, 1)) for s in range(80)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)


def test_a_restored_scheduler_continues_the_sequence():
    assert _lrs(64, 80, resume_at=30) == _lrs(64, 80)
