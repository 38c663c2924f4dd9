"""When a trajectory whose turn ended goes on: the deterministic ticks of multi-turn play.

An engine's ``play`` (:meth:`gspo.rollout.hf.HFRolloutEngine.play`,
:meth:`gspo.rollout.vllm.VLLMRolloutEngine.play`) counts its own decode steps. When a trajectory's
turn ends in step ``t``, ``turn_end`` answers at once (the observation, or None: done) or with a
*pending* answer, an object whose ``result()`` gives it (the environment's step running in a worker
pool, :func:`gspo.envs.episodes.run_episodes`). Every ``tick`` steps comes a tick: a trajectory
whose answer was pending goes on at the first tick after its turn ended, which waits for the answer
if it is not there yet (all the answers due at a tick are waited for together); between ticks the
engine decodes the other trajectories and never waits. Steps in which no trajectory decodes are
skipped: the count jumps to the next tick a trajectory is due at.

So which trajectories share a decode step is a function of the data (tokens, observations, the
step counts), never of how long a tool took: the batched forward's numerics and the order of the
random draws, hence every token and log-prob, are the same whatever order the tools finish in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Pending(Protocol):
    """An answer still being computed (a ``concurrent.futures.Future``-like ``result()``)."""

    def result(self) -> tuple[list[int], int] | None: ...


#: (row, the turn's token ids, their sampler log-probs) -> (observation ids, next budget), None, or
#: a :class:`Pending` answer
TurnEnd = Callable[[int, list[int], list[float]], "tuple[list[int], int] | Pending | None"]


def is_pending(answer: Any) -> bool:
    return answer is not None and not isinstance(answer, tuple) and callable(getattr(answer, "result", None))


class Ticks:
    """The trajectories waiting for their environment: each one's due step (a tick: a multiple of
    ``tick``, 1: every step) and pending answer."""

    parked: dict[int, tuple[int, Pending]]  # row -> (due step, pending answer)

    def __init__(self, tick: int = 1) -> None:
        if tick < 1:
            raise ValueError(f"tick must be >= 1 decode step, got {tick}")
        self.tick, self.parked = tick, {}

    def park(self, row: int, step: int, answer: Pending) -> None:
        """``row``'s turn ended in ``step``; its answer is pending: due at the first tick after."""
        self.parked[row] = ((step // self.tick + 1) * self.tick, answer)

    def next_due(self) -> int:
        return min(due for due, _ in self.parked.values())

    def due(self, step: int) -> list[tuple[int, tuple[list[int], int] | None]]:
        """The rows due by ``step`` with their answers, in row order (waits for each answer; an
        environment's error is raised here, the first due row's first)."""
        rows = sorted(r for r, (due, _) in self.parked.items() if due <= step)
        return [(r, self.parked.pop(r)[1].result()) for r in rows]
