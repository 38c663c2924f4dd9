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


class Observer:
    """Answers each of the first two turns with an observation, then ends the trajectory; the reward
    depends on what the model wrote, so the advantages differ within a group."""

    def reset(self, example):
        self.n = 0
        return example.prompt

    def step(self, model_turn):
        self.n += 1
        return Step("out 42;" if self.n < 3 else None, 0.5 * self.n + 0.1 * len(model_turn))
