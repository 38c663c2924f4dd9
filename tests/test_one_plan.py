"""One plan, built once (issue 45, items 1 and 4): ``gspo.train`` resolves the config once into a
:class:`gspo.plans.RunPlan`; the capacity model and the limits take its typed section; the rollout
engines are told apart only through their registry entry (:data:`gspo.plans.ENGINES`)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from gspo.config import Config
from gspo.plans import ENGINES, CapacityPlan, RunPlan

SRC = Path(__file__).resolve().parents[1] / "src" / "gspo"
ENGINE_NAMES = set(ENGINES)

# the modules that may read the config (``cfg.<field>``), and how often: the config's own checks,
# resolve, the CLI / compare / study front doors; launch.py only in its run-folder code (claimed and
# checked against the run being resumed, before the plan's stages start)
CONFIG_READERS = {"config", "resolve.py", "launch.py", "cli.py", "compare.py", "checkpoint_eval.py", "study"}
LAUNCH_READERS = {"check_run_dir", "_check_resumable"}  # the config of the run being resumed


def _modules() -> list[tuple[str, ast.AST]]:
    return [(p.relative_to(SRC).as_posix(), ast.parse(p.read_text())) for p in sorted(SRC.rglob("*.py"))]


def _engine_string_tests(tree: ast.AST) -> list[int]:
    """Lines comparing something with an engine's name (``== "vllm"``, ``in ("hf", ...)``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                elts = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
                if any(isinstance(e, ast.Constant) and e.value in ENGINE_NAMES for e in elts):
                    lines.append(node.lineno)
    return lines


def test_no_engine_name_is_tested_outside_the_registry():
    """Before: 15 ``"hf"``/``"vllm"`` tests in 8 files (factory, limits, capacity x3, capacity_comm x3,
    resolve x2, launch, config x2); now none: each reads its engine's registry entry."""
    bad = [f"{rel}:{line}" for rel, tree in _modules() for line in _engine_string_tests(tree)]
    assert not bad, bad


def test_the_config_field_offers_the_registered_engines():
    choices = Config.__dataclass_fields__["rollout_engine"].type
    assert Config().rollout_engine in ENGINES
    for name in ENGINES:
        assert Config(rollout_engine=name).validate().rollout_engine == name
    assert "OneOf(tuple(ENGINES))" in (SRC / "config" / "sampling.py").read_text(), choices


def test_every_engine_builds_through_the_factory():
    """Adding an engine touches its registry entry (plans.py), its builder (rollout/factory.py) and
    its own module: 3 files."""
    import importlib

    for spec in ENGINES.values():
        module, name = spec.build.split(":")
        assert module == "gspo.rollout.factory"
        assert callable(getattr(importlib.import_module(module), name))


def _config_reads(rel: str, tree: ast.AST) -> dict[str, int]:
    """``cfg.<field>`` reads per function of one module."""
    out: dict[str, int] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            n = sum(
                isinstance(x, ast.Attribute)
                and isinstance(x.value, ast.Name)
                and x.value.id == "cfg"
                and x.attr != "validate"  # the config checking itself, not a field read
                for x in ast.walk(fn)
            )
            if n:
                out[fn.name] = out.get(fn.name, 0) + n
    return out


def test_only_the_top_reads_the_config():
    """Before: 282 ``cfg.`` reads in 16 modules, capacity.py (50), capacity_comm.py (27) and
    limits.py (21) among them, and launch.py's 38 spread over its whole build."""
    bad = []
    for rel, tree in _modules():
        reads = _config_reads(rel, tree)
        if rel == "launch.py":
            bad += [f"launch.py {f}() reads cfg" for f in reads if f not in LAUNCH_READERS]
        elif reads and rel.split("/")[0] not in CONFIG_READERS:
            bad.append(f"{rel} reads cfg {sum(reads.values())} times")
    assert not bad, bad


def test_capacity_and_limits_take_the_plan_typed():
    """No ``cfg: Any`` in the capacity model or the limits (there were 23)."""
    bad = []
    for name in ("capacity.py", "capacity_comm.py", "limits.py"):
        for fn in ast.walk(ast.parse((SRC / name).read_text())):
            if isinstance(fn, ast.FunctionDef):
                for a in fn.args.args:
                    if a.arg in ("cfg", "plan") and "Plan" not in ast.unparse(
                        a.annotation or ast.Constant("")
                    ):
                        bad.append(f"{name} {fn.name}({a.arg})")
    assert not bad, bad


def test_train_resolves_once():
    """launch.py resolves the config once (was 14 resolve calls, 4 plans built twice)."""
    tree = ast.parse((SRC / "launch.py").read_text())
    calls = [
        ast.unparse(n.func)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func).startswith("resolve.")
    ]
    assert sorted(set(calls)) == ["resolve.for_model", "resolve.resolve"], calls
    # resolve.resolve: in train, and open_run's default when called alone; for_model: once per path
    assert calls.count("resolve.resolve") == 2


def test_the_plan_is_whole_and_frozen():
    from gspo.resolve import resolve

    plan = resolve(Config().validate())
    assert isinstance(plan, RunPlan) and isinstance(plan.capacity, CapacityPlan)
    for f in dataclasses.fields(plan):
        assert dataclasses.is_dataclass(getattr(plan, f.name)), f.name
    # shared sub-plans are one object, built once
    assert plan.sampling.task is plan.load.task
    assert plan.sampling.engine.spec is plan.capacity.engine_spec
    assert plan.update.pi_old == plan.capacity.pi_old


def test_a_bad_value_names_its_config_field():
    """The hard bounds read the config's own values, by field name, before any plan is built."""
    import pytest

    from gspo.errors import GspoError
    from gspo.limits import check_config

    values = {**dataclasses.asdict(Config().validate()), "prompts_per_step": 10**7}
    with pytest.raises(GspoError, match="^config field 'prompts_per_step': "):
        check_config(values)


def test_the_capacity_plan_is_copied_from_the_sections_by_name():
    """Issue 60: ``CapacityPlan.of(source: Any)`` copied a Config into a mirror by duck typing (twice
    per ``gspo.train``); now resolve copies each field by name from the plan's typed sections, and no
    plan is filled by ``getattr``."""
    tree = ast.parse((SRC / "resolve.py").read_text())
    getattrs = [
        n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "getattr"
    ]
    assert not getattrs, getattrs
    assert not hasattr(CapacityPlan, "of")
    from gspo.resolve import capacity_plan, resolve

    cfg = Config(rollout_devices="cpu", async_staleness=1).validate()
    assert capacity_plan(cfg) == resolve(cfg).capacity
    assert capacity_plan(cfg).rollout_devices == resolve(cfg).sampling.rollout_devices == ("cpu",)


def test_the_config_is_validated_once(monkeypatch):
    """The CLI validates the config it built; ``gspo.train`` then finds it validated as it stands.
    A changed value is checked again."""
    from gspo.config import schema

    calls = []
    real = schema.check_types
    monkeypatch.setattr(schema, "check_types", lambda cfg: (calls.append(1), real(cfg))[1])
    cfg = Config(steps=3).validate()
    assert cfg.validate() is cfg and len(calls) == 1
    cfg.steps = 4
    cfg.validate()
    assert len(calls) == 2 and Config(steps=4).validate() == cfg
