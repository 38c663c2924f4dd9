"""Mutants the suite must kill, and a runner that checks it does (not collected by pytest: the file's
name does not start with ``test_``).

Each mutant is one exact snippet of ``src/gspo`` replaced by a wrong one (a bug a later change
could bring back) and the tests that must fail on it. For each mutant the runner copies the
checkout's files (git's tracked and untracked-not-ignored ones: src/, tests/, pyproject.toml, ...)
to a temporary folder, applies the mutant there (never in the checkout), and runs its tests from
that copy with the copy's ``src`` first on ``PYTHONPATH`` (subprocesses the tests start, such as
multi-rank runs, import the copy's code as well). A mutant is killed when one of its tests fails.

    python tests/mutants/mutants.py                # every mutant (slow: minutes each for some)
    python tests/mutants/mutants.py --only NAME    # one mutant (repeatable)
    python tests/mutants/mutants.py --list         # the mutants and whether each snippet still
                                                   # occurs exactly once (runs no test)
    python tests/mutants/mutants.py --baseline     # each mutant's tests on the unmutated code: they
                                                   # must pass, or a "kill" proves nothing

Exit status: 0 when every mutant run was killed; 1 when one survived or its snippet is no longer in
its file exactly once (a refactor moved the code: update the mutant, do not drop it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    original: str  # must occur exactly once in ``file``
    replacement: str
    tests: tuple[str, ...]  # pytest node ids (relative to the repository root); one must fail
    why: str = ""


MUTANTS: list[Mutant] = [
    Mutant(
        "resumed-sampler-data-position",
        "src/gspo/rollout/async_sampler.py",
        "first = (version + self.K + 1, pending[-1].data_end)",
        "first = (version + self.K + 1, pending[0].data_end)",
        ("tests/test_async.py::test_async_dynamic_sampling_fills_the_batch_ahead_and_resumes_exactly",),
        "issue 44 gap 1: a resumed sampler draws its first batch from the first in-flight batch's end",
    ),
    Mutant(
        "ep-forward-never-restored",
        "src/gspo/model/expert_parallel.py",
        "            m.forward = ep_forward",
        "            pass",
        ("tests/test_expert_parallel.py::test_expert_parallel_run_trains_its_experts",),
        "issue 44 gap 2: after sampling, the experts run on detached gathered copies (frozen)",
    ),
    Mutant(
        "in-flight-token-versions-dropped",
        "src/gspo/rollout/async_state.py",
        'else {"sampler_version": a.out.batch.sampler_version_BT}',
        "else {}",
        ("tests/test_async.py::test_in_flight_batches_round_trip_through_a_checkpoint",),
        "issue 44 gap 3: resumed in-flight batches lose their per-token versions",
    ),
    Mutant(
        "top-p-drops-the-most-likely-token",
        "src/gspo/model/lm_head.py",
        "        drop_sorted[:, -1] = False  # the most likely token stays\n",
        "",
        ("tests/test_sampling_mask.py::test_a_tiny_top_p_keeps_exactly_the_most_likely_token",),
        "issue 44 gap 4: top-p 1e-8 empties the support in float32 (every logit -inf, NaN)",
    ),
    Mutant(
        "skyrl-gym-keeps-the-last-observation",
        "src/gspo/envs/packages.py",
        'chat = _as_chat(out.get("observations") or [], "step() observations")',
        'chat = _as_chat(out.get("observations") or [], "step() observations")[-1:]',
        ("tests/test_env_packages.py::test_skyrl_gym_step_with_several_observations_shows_them_all",),
        "issue 44 gap 6: a step's observation messages but the last are lost",
    ),
    Mutant(
        "skyrl-gym-chat-keeps-the-last-observation",
        "src/gspo/envs/packages.py",
        'out["reward"], chat or None)',
        'out["reward"], chat[-1:] or None)',
        ("tests/test_env_packages.py::test_skyrl_gym_step_with_several_observations_shows_them_all",),
        "issue 44 gap 6: under --chat-template, a step's messages but the last are lost",
    ),
    Mutant(
        "verifiers-trace-drops-env-messages",
        "src/gspo/envs/packages.py",
        "        if message is not None:\n            message = _message_text(",
        "        if False:\n            message = _message_text(",
        ("tests/test_env_packages.py::test_verifiers_trace_holds_the_environments_messages",),
        "issue 44 gap 6: the trace the task scores lacks the environment's messages",
    ),
    Mutant(
        "kept-cache-drops-observations",
        "src/gspo/rollout/hf.py",
        "                        queue[r], budget[r] = list(nxt[0]), nxt[1]\n",
        "                        queue[r], budget[r] = [], nxt[1]\n",
        ("tests/test_multiturn.py::test_kept_kv_cache_plays_the_turns_of_one_generate_per_turn",),
        "the HF engine's multi-turn loop never feeds the observation tokens into the kept KV cache",
    ),
    Mutant(
        "random-drop-ignores-draws",
        "src/gspo/correction.py",
        "    keep_B = (u_B >= p).to(mask.dtype)\n",
        "    keep_B = torch.ones_like(u_B).to(mask.dtype)\n",
        ("tests/test_opsm.py::test_random_drop_hand_computed",),
        "--random-seq-drop drops nothing",
    ),
    Mutant(
        "seq-mask-drops-both-sides",
        "src/gspo/losses.py",
        "    keep_B = ~(low_B | high_B)\n",
        "    keep_B = (s_B - 1.0).abs() <= eps_high\n",
        ("tests/test_losses.py::test_grpo_seq_mask_value_and_gradient_match_reference",),
        "grpo_seq_mask drops every sequence outside the range, whatever its advantage's sign (GSPO's clip is one-sided)",
    ),
    Mutant(
        "gguf-dequantization-bar-kept",
        "src/gspo/model/load.py",
        'kept = [ln for ln in lines if ln.strip() and "de-quantizing GGUF tensors" not in ln]',
        "kept = [ln for ln in lines if ln.strip()]",
        ("tests/test_gguf.py::test_loading_draws_no_progress_bar",),
        "a GGUF load draws transformers' dequantization bar on stderr (the check moved to the default tier)",
    ),
    Mutant(
        "one-node-ep-crosses-nodes",
        "src/gspo/capacity_comm.py",
        "crosses = across and holders > 1",
        "crosses = holders > 1",
        ("tests/test_plan_nodes.py::test_one_node_runs_on_nvlink",),
        "issue 44 gap 7: EP on one node is timed over IB",
    ),
    Mutant(
        "shard-load-float-index",
        "src/gspo/model/shard_load.py",
        "dtype = torch.int32 if offset + n < 2**31 else torch.int64",
        "dtype = torch.float32",
        ("tests/test_shard_load.py::test_the_layout_index_is_exact_past_2_to_the_24",),
        "issue 44 gap 8: float32 indices are exact only below 2^24 elements",
    ),
    Mutant(
        "shard-load-coverage-unchecked",
        "src/gspo/model/shard_load.py",
        "    if not bool(filled.all()):",
        "    if False:",
        ("tests/test_shard_load.py::test_stored_tensors_that_leave_a_hole_are_refused",),
        "issue 44 gap 8: a layer the stored tensors do not cover loads uninitialized memory",
    ),
    Mutant(
        "rank-share-rows-not-scaled-by-group",
        "src/gspo/rollout/async_state.py",
        "rows = slice(groups.start * G, groups.stop * G)",
        "rows = slice(groups.start, groups.stop)",
        ("tests/test_async_ranks.py::test_each_rank_gets_the_rows_of_its_groups",),
        "issue 44 gap 9: a rank's share takes its groups' count of rows instead of G rows each",
    ),
]


def _files() -> list[str]:
    """The checkout's files as git sees them (tracked, and untracked but not ignored)."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def _count(m: Mutant, root: Path) -> int:
    return (root / m.file).read_text().count(m.original)


def _pytest_args() -> list[str]:
    """pytest without the project's addopts (a parallel ``-n`` would not help one test) and without
    xdist where its dependency is missing (a half-installed plugin stops pytest at start-up)."""
    args = ["-q", "-x", "-rfE", "-o", "addopts=", "-p", "no:cacheprovider"]
    try:
        import execnet  # noqa: F401
    except ImportError:
        args += ["-p", "no:xdist", "-p", "no:xdist.looponfail"]
    return args


def run(m: Mutant, files: list[str], timeout: float, mutate: bool = True) -> str:
    """'killed', 'survived' or 'stale' (the snippet is not in the file exactly once); without
    ``mutate``, the same tests on the copy as it is ('survived': they pass, as they must)."""
    if _count(m, ROOT) != 1:
        return "stale"
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        copy = Path(tmp) / "repo"
        for f in files:
            (copy / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, copy / f)
        target = copy / m.file
        if mutate:
            target.write_text(target.read_text().replace(m.original, m.replacement))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy / "src"), str(copy)]))
        env["OMP_NUM_THREADS"], env["COLUMNS"] = "1", "240"  # COLUMNS: the failure summary unclipped
        cmd = [sys.executable, "-m", "pytest", *_pytest_args(), *m.tests]
        try:
            p = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"  {m.name}: its tests ran past {timeout:.0f} s (counted as killed: a hang)")
            return "killed"
        lines = (p.stdout + p.stderr).strip().splitlines()
        why = [ln[:300] for ln in lines if ln.startswith(("FAILED", "ERROR"))] or lines[-1:] or [""]
        if p.returncode == 0:
            return "survived"
        if p.returncode in (4, 5):  # usage error / no test collected: a wrong node id, not a kill
            print(p.stdout[-2000:] + p.stderr[-2000:])
            return "stale"
        print("\n".join(f"  {ln}" for ln in why))
        return "killed"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], help="run this mutant alone (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants, check their snippets, run nothing")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per mutant's tests")
    ap.add_argument(
        "--baseline", action="store_true", help="run each mutant's tests unmutated: they must pass"
    )
    a = ap.parse_args()
    names = {m.name for m in MUTANTS}
    unknown = [n for n in a.only if n not in names]
    if unknown:
        print(f"unknown mutant(s) {unknown}; known: {sorted(names)}", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if not a.only or m.name in a.only]
    if a.list:
        stale = [m for m in chosen if _count(m, ROOT) != 1]
        for m in chosen:
            print(f"{m.name:40s} {'ok' if m not in stale else 'STALE'}  {m.file}  ({m.why})")
        return 1 if stale else 0
    files, results = _files(), {}
    for m in chosen:
        t0 = time.time()
        results[m.name] = run(m, files, a.timeout, mutate=not a.baseline)
        shown = (
            {"survived": "passes", "killed": "FAILS"}.get(results[m.name], "stale")
            if a.baseline
            else results[m.name]
        )
        print(f"{m.name}: {shown} ({time.time() - t0:.0f} s)", flush=True)
    if a.baseline:
        bad = {n: r for n, r in results.items() if r != "survived"}
        print(
            f"unmutated: {len(results) - len(bad)}/{len(results)} pass" + (f"; failing: {bad}" if bad else "")
        )
        return 1 if bad else 0
    bad = {n: r for n, r in results.items() if r != "killed"}
    print(f"{len(results) - len(bad)}/{len(results)} killed" + (f"; not killed: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
