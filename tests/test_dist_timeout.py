"""The process group's timeout is a config field (dist_timeout_min, default 120 minutes: a cold-cache
start of the 235B recipe), passed to init_process_group; it was never passed (torch's 10 minutes)."""

from datetime import timedelta

import pytest

from gspo.config import make_config
from gspo.errors import GspoError
from gspo.resolve import dist_plan
from gspo.training import distributed as D


def _init_kwargs(monkeypatch, cfg):
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(D, "die_with_parent", lambda: None)
    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(D.dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    monkeypatch.setattr(D, "_TIMEOUT", None)
    D.setup(dist_plan(cfg))
    return seen


def test_process_group_timeout_default_and_override(monkeypatch):
    cfg = make_config(None, {"device": "cpu", "threads": 1})
    assert cfg.dist_timeout_min == 120
    seen = _init_kwargs(monkeypatch, cfg)
    assert seen == {"backend": "gloo", "timeout": timedelta(minutes=120)}
    assert D.pg_timeout() == timedelta(minutes=120) and "dist_timeout_min = 120 min" in D.timeout_note()
    seen = _init_kwargs(
        monkeypatch, make_config(None, {"device": "cpu", "threads": 1, "dist_timeout_min": 7})
    )
    assert seen["timeout"] == timedelta(minutes=7)


@pytest.mark.parametrize("bad", [0, -5, 10081])
def test_process_group_timeout_out_of_range_is_one_line(bad):
    with pytest.raises(GspoError, match="dist_timeout_min"):
        make_config(None, {"dist_timeout_min": bad})


def test_the_engine_plan_carries_the_timeout_for_vllms_groups():
    from gspo.resolve import engine_plan

    assert engine_plan(make_config(None, {"dist_timeout_min": 7})).dist_timeout_min == 7
    assert engine_plan(make_config(None, {})).dist_timeout_min == 120
