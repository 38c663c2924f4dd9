"""A study of RL algorithms: seeds x variants of a preset, statistics on scipy.stats, reports.

- :mod:`gspo.study.presets`: regimes and their pre-registered endpoints (``primary``, ``family``)
- :mod:`gspo.study.runner`: warm starts (shared with ``gspo train``) and the worker pool
- :mod:`gspo.study.metrics`: one run's numbers from its metrics
- :mod:`gspo.study.statistics`: intervals, paired t and sign-flip tests, Holm, verdicts, power
- :mod:`gspo.study.report`, :mod:`gspo.study.combine`, :mod:`gspo.study.plots`: what is written
"""

from gspo.study.combine import write_study
from gspo.study.presets import VARIANTS, Preset, list_presets, load_preset
from gspo.study.report import write_report
from gspo.study.runner import run_compare

__all__ = ["VARIANTS", "Preset", "list_presets", "load_preset", "run_compare", "write_report", "write_study"]
