"""Training: the RL loop (``loop``), the policy update (``update``), the supervised warm start
(``sft``), checkpoints, distribution and logging. ``gspo.train(cfg)`` (:mod:`gspo.launch`) runs it."""
