"""A study of RL algorithms: seeds x variants of a preset, statistics on scipy.stats, reports.

- :mod:`gspo.study.presets`: regimes and their pre-registered endpoints (``primary``, ``family``)
- :mod:`gspo.study.runner`: warm starts (shared with ``gspo train``) and the worker pool
- :mod:`gspo.study.metrics`: one run's numbers from its metrics
- :mod:`gspo.study.statistics`: intervals, paired t and sign-flip tests, Holm, verdicts, power
- :mod:`gspo.study.report`, :mod:`gspo.study.combine`, :mod:`gspo.study.plots`: what is written
"""

from __future__ import annotations

import importlib
from typing import Any

# imported when first used (as gspo's own names): the command line reads the presets' names
# without the runner's and the reports' imports
_EXPORTS = {
    "VARIANTS": "gspo.study.presets",
    "Preset": "gspo.study.presets",
    "list_presets": "gspo.study.presets",
    "load_preset": "gspo.study.presets",
    "run_compare": "gspo.study.runner",
    "write_report": "gspo.study.report",
    "write_study": "gspo.study.combine",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gspo.study' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
