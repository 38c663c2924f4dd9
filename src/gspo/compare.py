"""``gspo compare``: the names the command line and older code import, now in :mod:`gspo.study`.

Runs every variant of a preset on the same seeds from one warm start per seed, then writes
``report.md`` (pre-registered endpoints with Holm-adjusted verdicts; everything else exploratory,
with raw intervals), ``summary.json`` and ``per_seed.csv``; :func:`write_study` combines folders.
"""

from gspo.study.combine import welch_interval, write_study
from gspo.study.metrics import (
    PAIR_KEYS,
    PAIRS,
    PAPER_VOLATILITY,
    SUMMARY_KEYS,
    Criteria,
    auc,
    collapse_index,
    moving_average,
    run_stats,
    spike_indices,
)
from gspo.study.presets import (
    DEFAULT_SEEDS,
    DEFAULT_VARIANTS,
    PRESETS_DIR,
    VARIANTS,
    Preset,
    list_presets,
    load_preset,
)
from gspo.study.report import collect, write_report
from gspo.study.runner import plan_run, run_compare, warm_start_folder, warm_start_job
from gspo.study.statistics import (
    CONSISTENT,
    INCONCLUSIVE,
    INCONSISTENT,
    Interval,
    bootstrap_interval,
    holm,
    interval,
    paired_interval,
    sign_flip_p,
    t_interval,
    t_quantile,
    t_test_p,
    verdict,
)

__all__ = [
    "CONSISTENT", "DEFAULT_SEEDS", "DEFAULT_VARIANTS", "INCONCLUSIVE", "INCONSISTENT", "PAIRS", "PAIR_KEYS",
    "PAPER_VOLATILITY", "PRESETS_DIR", "SUMMARY_KEYS", "VARIANTS", "Criteria", "Interval", "Preset", "plan_run",
    "auc", "bootstrap_interval", "collapse_index", "collect", "holm", "interval", "list_presets",
    "load_preset", "moving_average", "paired_interval", "run_compare", "run_stats", "sign_flip_p",
    "spike_indices", "t_interval", "t_quantile", "t_test_p", "verdict", "warm_start_folder",
    "warm_start_job", "welch_interval", "write_report", "write_study",
]  # fmt: skip
