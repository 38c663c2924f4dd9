"""The layout the README describes, checked on the source: the config stops at the top (below it,
stages take plans) and no module imports from a layer above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gspo"

# low -> high; a module may import its own layer and the ones below (README: "Layout")
LAYERS = [
    {"errors", "plans", "data", "procs", "compat", "memory", "repro"},  # the ground floor
    # the algorithm: pure tensor functions
    {"advantages", "loss_prologue", "losses", "losses_trust", "correction"},
    {"model", "tasks"},
    {"capacity", "capacity_comm", "limits"},  # what fits: read by the config's checks and the engines
    {"envs"},
    {"rollout"},
    {"training"},
    {"config", "resolve", "launch", "cli", "compare", "checkpoint_eval", "study", "__init__", "__main__"},
]
BELOW_THE_CONFIG = ("training", "rollout", "envs", "model")


def _layer(name: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if name in layer)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _gspo_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, gspo module) of every import, function-level ones included."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gspo":
            names = [f"gspo.{a.name}" for a in node.names] if node.module == "gspo" else [node.module]
            out += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("gspo.")]
    return out


def _modules() -> list[tuple[str, Path, ast.AST]]:
    return [(str(p.relative_to(SRC)), p, ast.parse(p.read_text(), str(p))) for p in sorted(SRC.rglob("*.py"))]


def test_every_package_has_a_layer():
    names = {p.relative_to(SRC).parts[0].removesuffix(".py") for p in SRC.rglob("*.py")}
    assert not {n for n in names if not any(n in layer for layer in LAYERS)}, "place it in LAYERS"


def test_no_import_reaches_a_higher_layer():
    bad = []
    for rel, _, tree in _modules():
        own = _layer(rel.split("/")[0].removesuffix(".py"))
        for line, module in _gspo_imports(tree):
            target = _package(module)
            if target in {"__version__"}:
                continue
            if _layer(target) > own:
                bad.append(f"{rel}:{line} imports {module}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", BELOW_THE_CONFIG)
def test_the_config_stops_at_the_top(package):
    """Below ``gspo.train(cfg)`` / the CLI, no module imports the config or takes a ``cfg``: each
    stage takes its plan (gspo.plans), resolved once (gspo.resolve)."""
    bad = []
    for rel, _, tree in _modules():
        if not rel.startswith(package + "/"):
            continue
        for line, module in _gspo_imports(tree):
            if module == "gspo.config" or module.startswith("gspo.config."):
                bad.append(f"{rel}:{line} imports {module}")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                if "cfg" in names:
                    bad.append(f"{rel}:{node.lineno} {node.name}() takes cfg")
    assert not bad, "\n".join(bad)


def test_one_name_one_class():
    """A class name means one thing across the package (there were two ``Run`` and two ``Task``)."""
    where: dict[str, list[str]] = {}
    for rel, _, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(rel)
    assert not {k: v for k, v in where.items() if len(v) > 1}


def _import_graph() -> dict[str, set[str]]:
    """gspo module -> the gspo modules it imports anywhere (function bodies included)."""
    names = {}
    for p in SRC.rglob("*.py"):
        parts = p.relative_to(SRC.parent).with_suffix("").parts
        names[".".join(parts).removesuffix(".__init__")] = p
    graph = {}
    for name, p in names.items():
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gspo"):
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def test_no_import_cycle_even_in_function_bodies():
    """gspo.train was a callable package whose __call__ imported gspo.launch, which imports the
    package: a cycle hidden in a function body. None is left anywhere."""
    graph, seen, on_path, cycles = _import_graph(), set(), [], []

    def visit(v: str) -> None:
        seen.add(v)
        on_path.append(v)
        for w in sorted(graph[v]):
            if w in on_path:
                cycles.append(" -> ".join(on_path[on_path.index(w) :] + [w]))
            elif w not in seen:
                visit(w)
        on_path.pop()

    for v in sorted(graph):
        if v not in seen:
            visit(v)
    assert not cycles, "\n".join(cycles)


def test_the_top_package_exports_every_loss():
    import gspo
    from gspo.losses import LOSSES

    assert {spec.fn.__name__ for spec in LOSSES.values()} <= set(gspo.__all__)
    # every public name resolves (most on first use, PEP 562) to what its module defines
    for name in gspo.__all__:
        assert getattr(gspo, name) is not None, name
    assert gspo.loss_inputs.__module__ == "gspo.loss_prologue" and gspo.train.__module__ == "gspo.launch"


def test_a_refused_flag_imports_neither_transformers_nor_the_study_tools(tmp_path):
    """``gspo train`` with a bad value answers after importing torch only: transformers, scipy and the
    study's runner are imported when a run or a compare needs them (each ``gspo`` command a user or
    a test starts used to pay for all three first: ~5 s of a 7.5 s refusal on this machine)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from gspo.cli import main\n"
        "assert main(['train', '--lr', 'inf', '--output-dir', sys.argv[1]]) == 2\n"
        "print(sorted(m for m in ('transformers', 'scipy.stats', 'gspo.study.runner', 'gspo.launch')"
        " if m in sys.modules))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", p.stdout


def test_the_run_has_no_hub_and_checkpoints_import_no_part_of_it():
    """Issue 60 item 1: a 13-field ``Run`` held every part of a run, with its own ``evaluate()``; the
    checkpoint manager imported it and reached into its trainer, state, tokenizer and sampler. Now
    the manager saves the weights it is given and each part's piece through ``state_dict`` /
    ``load_state_dict`` (one more piece of state touches the part that owns it), and imports none of
    the parts; the held-out evaluation is the rollout side's."""
    tree = ast.parse((SRC / "training" / "checkpoints.py").read_text())
    parts = {"gspo.training.run", "gspo.training.loop", "gspo.rollout", "gspo.launch"}
    reached = [m for _, m in _gspo_imports(tree) if any(m == p or m.startswith(p + ".") for p in parts)]
    assert not reached, reached
    from gspo.training import run
    from gspo.training.checkpoints import Stateful

    assert not hasattr(run, "Run")
    for part in (run.RunState, run.Trainer, run.Rollout):  # each keeps its own piece of a checkpoint
        assert all(callable(getattr(part, m, None)) for m in ("state_dict", "load_state_dict")), part
    assert {m for m in dir(Stateful) if not m.startswith("_")} == {"state_dict", "load_state_dict"}


def test_diagnostics_attach_from_outside_the_step():
    """Issue 60 item 2: what only reports on a step (its phases' times and memory, an MoE's expert
    volatility, the train/rollout mismatch where no correction uses it) is an observer the plan
    chose, called at named points; the default update adjusts no loss weight or mask (a correction,
    OPSM, a random drop: each an entry of the plan's ``adjustments``, none by default)."""
    from gspo.config import Config
    from gspo.resolve import loop_plan, update_plan

    cfg = Config().validate()
    plan = update_plan(cfg)
    assert plan.adjustments == () and plan.observers == ("volatility", "mismatch")
    assert update_plan(Config(log_volatility=False).validate()).observers == ("mismatch",)
    assert update_plan(Config(mismatch_correction="seq_tis", opsm_threshold=0.5).validate()).adjustments == (
        "correction",
        "opsm",
    )
    assert loop_plan(cfg).observers == ("timings", "memory")
    assert loop_plan(Config(async_staleness=1).validate()).observers == ("timings", "memory", "async_idle")
    step = ast.parse((SRC / "training" / "loop.py").read_text())
    rl_step = next(n for n in ast.walk(step) if isinstance(n, ast.FunctionDef) and n.name == "rl_step")
    body = ast.unparse(rl_step)
    assert "time.time" not in body and "phase_peak" not in body and "async/" not in body
