"""Training. ``gspo.train(cfg)`` runs RL post-training as configured, the same as ``gspo train``;
the pieces are the submodules (``loop``, ``run``, ``update``, ``batch``, ``rollout``, ``sft``, ...).

``gspo.train`` is this package *and* the function: a subpackage import (``gspo.train.loop``) binds
the name ``gspo.train`` to the package, so the package itself is made callable (a module subclass,
the documented way to customise a module's behaviour) instead of a function it would shadow.
"""

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, cfg: Any) -> Any:
        """Run RL post-training as configured; returns a :class:`gspo.train.loop.TrainResult`."""
        from gspo.launch import train  # the entry above the package: where the config is resolved

        return train(cfg)


sys.modules[__name__].__class__ = _CallablePackage
