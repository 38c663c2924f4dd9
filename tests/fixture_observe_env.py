"""A user's environment module, loaded by path (``--env tests/fixture_observe_env.py:Observe``)."""

from gspo.envs.base import Step


class Observe:
    """Every turn but the third gets an observation; reward from the text (not seeded by a rank)."""

    def reset(self, example):
        self.n = 0
        return example.prompt

    def step(self, turn):
        self.n += 1
        return Step("ok;" if self.n < 3 else None, 0.25 * self.n + 0.05 * len(turn))
