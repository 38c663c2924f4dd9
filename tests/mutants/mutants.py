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
    python tests/mutants/mutants.py --list         # the mutants, whether each snippet still occurs
                                                   # exactly once and each named test still exists
                                                   # (its file defines it; read, nothing run)
    python tests/mutants/mutants.py --baseline     # each mutant's tests on the unmutated code: they
                                                   # must pass, or a "kill" proves nothing

Exit status: 0 when every mutant run was killed; 1 when one survived, its snippet is no longer in
its file exactly once (a refactor moved the code: update the mutant, do not drop it) or one of its
tests no longer exists (a renamed test: update the node id).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
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
        "            self.queue[r] = list(obs)\n",
        "            pass\n",
        ("tests/test_multiturn.py::test_kept_kv_cache_plays_the_turns_of_one_generate_per_turn",),
        "the HF engine's multi-turn loop never feeds the observation tokens into the kept KV cache",
    ),
    Mutant(
        "hf-steps-in-the-loop-without-its-cache",
        "src/gspo/rollout/hf.py",
        "    plays_inline = True  #",
        "    plays_inline = False  #",
        ("tests/test_multiturn.py::test_kept_kv_cache_plays_the_turns_of_one_generate_per_turn",),
        "issue 61: with tool_concurrency=0 the HF engine takes one generate call per turn (each prefilling "
        "its context) instead of its kept-cache loop",
    ),
    Mutant(
        "ticks-follow-the-tools-timing",
        "src/gspo/rollout/turns.py",
        "rows = sorted(r for r, (due, _) in self.parked.items() if due <= step)",
        "rows = sorted(r for r, (due, a) in self.parked.items() if due <= step or getattr(a, 'fut', a).done())",
        ("tests/test_multiturn.py::test_tool_latencies_never_change_the_trajectories",),
        "issue 61: a trajectory whose tool returned joins before its tick: which rows share a decode step "
        "(and so the tokens) follows the tools' timing",
    ),
    Mutant(
        "whole-observation-positions",
        "src/gspo/rollout/hf.py",
        "pos_Bw = d.pos + (torch.arange(1, w + 1, device=dev) - (w - n_B)[:, None]).clamp(min=1)",
        "pos_Bw = d.pos + torch.arange(1, w + 1, device=dev).expand(len(feeds), w)",
        ("tests/test_multiturn.py::test_pooled_trajectories_logprobs_equal_the_trainers",),
        "issue 61: an observation fed in one forward takes the positions of the step's padded width",
    ),
    Mutant(
        "whole-observation-not-causal",
        "src/gspo/rollout/hf.py",
        "mask[..., -w:].masked_fill_(later_ww, torch.finfo(mask.dtype).min)",
        "pass",
        ("tests/test_multiturn.py::test_pooled_trajectories_logprobs_equal_the_trainers",),
        "issue 61: an observation fed in one forward sees its own later tokens",
    ),
    Mutant(
        "waiting-row-samples-after-its-padding",
        "src/gspo/rollout/hf.py",
        "                self.d.logits_BV[self.rows.index(r)] = stashed\n",
        "                pass\n",
        ("tests/test_multiturn.py::test_pooled_trajectories_logprobs_equal_the_trainers",),
        "issue 61: a row back from waiting with an empty observation samples from its masked column's logits",
    ),
    Mutant(
        "tools-inside-the-decode-loop",
        "src/gspo/envs/episodes.py",
        'pool = ThreadPoolExecutor(spec.workers, "gspo-env") if pooled else None',
        "pool = None",
        ("tests/test_multiturn.py::test_tools_run_beside_the_decoding",),
        "issue 61: the environment's steps run in the decode loop, one at a time, whatever tool_concurrency says",
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
    # issue 57: the mutation audit's gaps (each test passes on the code and fails on its mutant)
    Mutant(
        "seq-mask-bounds-swapped",
        "src/gspo/losses.py",
        "    low_B, high_B = clip_masks(s_B, adv_B, eps_low, eps_high)\n    keep_B = ~(low_B | high_B)\n",
        "    low_B, high_B = clip_masks(s_B, adv_B, eps_high, eps_low)\n    keep_B = ~(low_B | high_B)\n",
        ("tests/test_losses.py::test_grpo_seq_mask_takes_each_bound_on_its_own_side",),
        "issue 57 gap 4: grpo_seq_mask with eps_low and eps_high swapped",
    ),
    Mutant(
        "filled-groups-negative",
        "src/gspo/rollout/sampler.py",
        '"rollout/filled_groups": float(max(0, self.want - len(self.kept))),',
        '"rollout/filled_groups": float(self.want - len(self.kept)),',
        (
            "tests/test_data_controls.py::test_group_filter_with_more_informative_groups_than_wanted_fills_none",
        ),
        "issue 57 gap 11: more informative groups than wanted logs a negative filled_groups",
    ),
    Mutant(
        "hf-batch-parts-row-index",
        "src/gspo/rollout/hf.py",
        "lambda j, ids, lp, i=i: turn_end(i + j, ids, lp)",
        "lambda j, ids, lp, i=i: turn_end(j, ids, lp)",
        ("tests/test_rollout.py::test_a_batch_past_max_batch_size_is_played_in_parts_each_row_kept",),
        "issue 57 gap 1: the rows of a batch's second part (past max_batch_size) written over the first's",
    ),
    Mutant(
        "opsm-given-pi-old",
        "src/gspo/training/update.py",
        "a = ADJUSTMENTS[name](a, mb, f.logp_BT, trainer_BT, plan)",
        "a = ADJUSTMENTS[name](a, mb, old_logp_BT, trainer_BT, plan)",
        ("tests/test_opsm.py::test_opsm_under_the_default_old_logp_compares_the_sampler_with_this_forward",),
        "issue 57 gap 3: OPSM's divergence against pi_old (the sampler's own under old_logp=rollout): never masks",
    ),
    Mutant(
        "opsm-metrics-dropped",
        "src/gspo/training/update.py",
        "    return Adjusted(weight, a.mask_BT, a.metrics | opsm)",
        "    return Adjusted(weight, a.mask_BT, a.metrics)",
        ("tests/test_opsm.py::test_opsm_under_the_default_old_logp_compares_the_sampler_with_this_forward",),
        "issue 57 (a crash-only kill made an assertion): mismatch/opsm_frac_seq and _tok not logged",
    ),
    Mutant(
        "launch-line-flags-unquoted",
        "src/gspo/capacity_comm.py",
        "*map(shlex.quote, flags)]",
        "*flags]",
        ("tests/test_plan_nodes.py::test_the_launch_line_quotes_each_word_for_the_shell",),
        "issue 57 (a crash-only kill made an assertion): gspo plan's launch line leaves its flags unquoted",
    ),
    Mutant(
        "study-family-alpha-ignored",
        "src/gspo/study/binding.py",
        "alpha = preset.family.alpha if preset.family else ALPHA",
        "alpha = ALPHA",
        ("tests/test_study_binding_seeds.py::test_the_familys_own_alpha_is_the_level",),
        "issue 57 gap 8: a family's own alpha ignored (the look's level is 0.05 whatever it declares)",
    ),
    Mutant(
        "study-one-arm-extra-seeds",
        "src/gspo/study/binding.py",
        "if not empty and union in allowed and all(s == union for s in ran.values()):",
        "if not empty and set.intersection(*ran.values()) in allowed:",
        ("tests/test_study_binding_seeds.py::test_one_arm_on_undeclared_seeds_is_not_preregistered",),
        "issue 57 gap 8: one arm on extra undeclared seeds still pre-registered",
    ),
    Mutant(
        "study-secondary-arms-unchecked",
        "src/gspo/study/report.py",
        "arms = {x for e in preset.primary + preset.secondary for x in e.arms}",
        "arms = {x for e in preset.primary for x in e.arms}",
        ("tests/test_study_binding_seeds.py::test_a_secondary_endpoints_arm_is_seed_checked_too",),
        "issue 57 gap 8: secondary endpoints' arms not seed-checked",
    ),
    Mutant(
        "study-declared-at-ignores-seeds",
        "src/gspo/study/binding.py",
        'for k in ("primary", "family", "seeds")',
        'for k in ("primary", "family")',
        ("tests/test_study_binding_seeds.py::test_declared_at_compares_the_seeds_too",),
        "issue 57 gap 8: the report's 'same declaration' at declared_at ignores the seeds",
    ),
    Mutant(
        "study-commit-same-second-as-start",
        "src/gspo/study/binding.py",
        'if decl["commit_time"] >= starts[first]:',
        'if decl["commit_time"] > starts[first]:',
        (
            "tests/test_study_binding_seeds.py::test_a_declaration_committed_in_the_same_second_as_the_first_start_is_not_before_it",
        ),
        "issue 57 gap 8: a declaration committed in the same second as the first run's start counts as before it",
    ),
    Mutant(
        "compare-folder-dangling-symlink",
        "src/gspo/study/folders.py",
        "if (out / f).exists() or (out / f).is_symlink()]",
        "if (out / f).exists()]",
        ("tests/test_compare_folders.py::test_a_dangling_report_symlink_is_refused_not_written_through",),
        "issue 57 gap 9: a dangling report.md symlink in --out is written through (a file outside --out)",
    ),
    Mutant(
        "compare-folder-one-key-legacy",
        "src/gspo/study/folders.py",
        "legacy = isinstance(data, dict) and all(k in data for k in keys)",
        "legacy = isinstance(data, dict) and any(k in data for k in keys)",
        (
            "tests/test_compare_folders.py::test_a_users_summary_with_one_of_compares_keys_is_not_taken_for_compares",
        ),
        "issue 57 gap 9: a user's summary.json with one of compare's keys taken as compare's (their report.md overwritten)",
    ),
    Mutant(
        "tensorboard-purges-the-resumed-step",
        "src/gspo/training/trackers.py",
        "purge = None if resume_step is None else resume_step + 1",
        "purge = None if resume_step is None else resume_step",
        ("tests/test_tracking.py::test_tensorboard_on_resume_purges_only_the_steps_after_the_checkpoint",),
        "issue 57 gap 10: a resumed run's TensorBoard purges the checkpoint's own step",
    ),
    Mutant(
        "trackers-left-open-on-a-failed-start",
        "src/gspo/training/trackers.py",
        "            close_all(started)\n",
        "",
        ("tests/test_tracking.py::test_trackers_started_before_one_that_fails_to_start_are_closed",),
        "issue 57 gap 10: trackers already started left open when a later one fails to start",
    ),
    Mutant(
        "failed-resume-deletes-the-run",
        "src/gspo/training/checkpoints.py",
        "        if fresh and self._rank == 0:\n            files.remove_traces(self.run_dir)",
        "        if self._rank == 0:\n            files.remove_traces(self.run_dir)",
        ("tests/test_mutation_gaps.py::test_a_resume_that_fails_at_start_up_keeps_the_run",),
        "issue 57 gap 2: a resume that fails at start-up deletes the whole run (as a new run's start would)",
    ),
    Mutant(
        "final-files-not-fsynced",
        "src/gspo/training/checkpoint_files.py",
        '                with open(f, "rb") as fh:\n                    os.fsync(fh.fileno())\n',
        "                pass\n",
        ("tests/test_mutation_gaps.py::test_final_files_are_fsynced_before_final_is_renamed_into_place",),
        "issue 57 gap 11: final/'s files not fsynced before the folder is renamed into place",
    ),
    Mutant(
        "sync-rounds-same-prompts",
        "src/gspo/rollout/sampler.py",
        "            data, more = self._one(step, pos)\n            pos += P\n",
        "            data, more = self._one(step, pos)\n",
        ("tests/test_data_controls.py::test_sync_dynamic_sampling_rounds_draw_the_next_prompts",),
        "issue 57 gap 5: synchronous dynamic sampling's extra rounds redraw the first round's prompts, the data position stays",
    ),
    # issue 58: the trust-region losses, the entropy controls and MaxRL (one per new function)
    Mutant(
        "dppo-tv-sign-flipped",
        "src/gspo/losses_trust.py",
        "    return torch.exp(logp_BT) - torch.exp(old_logp_BT)\n",
        "    return torch.exp(old_logp_BT) - torch.exp(logp_BT)\n",
        ("tests/test_losses_trust.py::test_binary_divergences_hand_computed",),
        "issue 58: Binary-TV measured pi_old - pi_theta (a token that rose is taken to have fallen)",
    ),
    Mutant(
        "dppo-kl-second-term-dropped",
        "src/gspo/losses_trust.py",
        "    return p_old_BT * (old_logp_BT - logp_BT) + second_BT\n",
        "    return p_old_BT * (old_logp_BT - logp_BT)\n",
        ("tests/test_losses_trust.py::test_binary_divergences_hand_computed",),
        "issue 58: Binary-KL without the (1 - p_old) log((1 - p_old) / (1 - p_theta)) term",
    ),
    Mutant(
        "dppo-mask-ignores-the-advantage",
        "src/gspo/losses_trust.py",
        "    return low_BT & (adv_BT < 0) & inp.valid_BT, high_BT & (adv_BT > 0) & inp.valid_BT\n",
        "    return low_BT & inp.valid_BT, high_BT & inp.valid_BT\n",
        ("tests/test_losses_trust.py::test_dppo_value_and_gradient_match_reference_every_region",),
        "issue 58: DPPO drops a token outside the region on either side, whatever its advantage's sign",
    ),
    Mutant(
        "dppo-weight-not-truncated",
        "src/gspo/losses_trust.py",
        "    w_BT = torch.exp(inp.log_r_BT.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).clamp(max=max_weight)\n",
        "    w_BT = torch.exp(inp.log_r_BT.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))\n",
        ("tests/test_losses_trust.py::test_dppo_value_and_gradient_match_reference_every_region",),
        "issue 58: DPPO's importance weight not truncated at C",
    ),
    Mutant(
        "dppo-kl-uses-tv",
        "src/gspo/losses_trust.py",
        '    return _dppo(inp, "kl", delta_low, delta_high, max_weight, aggregation)\n',
        '    return _dppo(inp, "tv", delta_low, delta_high, max_weight, aggregation)\n',
        ("tests/test_losses_trust.py::test_dppo_value_and_gradient_match_reference_every_region",),
        "issue 58: dppo_kl measures the trust region with Binary-TV",
    ),
    Mutant(
        "dppo-tv-uses-kl",
        "src/gspo/losses_trust.py",
        '    return _dppo(inp, "tv", delta_low, delta_high, max_weight, aggregation)\n',
        '    return _dppo(inp, "kl", delta_low, delta_high, max_weight, aggregation)\n',
        ("tests/test_losses_trust.py::test_dppo_tv_hand_computed",),
        "issue 58: dppo_tv measures the trust region with Binary-KL",
    ),
    Mutant(
        "dppo-zero-threshold-accepted",
        "src/gspo/losses_trust.py",
        "        if not (math.isfinite(v) and v > 0):\n",
        "        if not (math.isfinite(v) and v >= 0):\n",
        ("tests/test_losses_trust.py::test_dppo_rejects_nonpositive_thresholds",),
        "issue 58: a zero DPPO threshold or cap accepted by the loss",
    ),
    Mutant(
        "cov-logp-not-centered",
        "src/gspo/losses_trust.py",
        "    c_logp_BT = torch.where(inp.valid_BT, logp_BT - (logp_BT / n).sum(), torch.zeros_like(logp_BT))\n",
        "    c_logp_BT = torch.where(inp.valid_BT, logp_BT, torch.zeros_like(logp_BT))\n",
        ("tests/test_losses_trust.py::test_token_covariance_hand_computed",),
        "issue 58: the covariance's log-prob term not centered by the mean log-prob",
    ),
    Mutant(
        "cov-count-rounded-up",
        "src/gspo/losses_trust.py",
        "    k = torch.floor(fraction * n_tok.double()).clamp(min=1)",
        "    k = torch.ceil(fraction * n_tok.double()).clamp(min=1)",
        ("tests/test_losses_trust.py::test_select_top_count_is_verls_floor_with_at_least_one",),
        "issue 58: Clip-Cov / KL-Cov select ceil(ratio n) tokens, not verl's max(1, int(ratio n))",
    ),
    Mutant(
        "cov-fraction-of-one-accepted",
        "src/gspo/losses_trust.py",
        "    if not (math.isfinite(value) and 0 < value < 1):\n",
        "    if not (math.isfinite(value) and 0 < value <= 1):\n",
        ("tests/test_losses_trust.py::test_cov_losses_reject_bad_fractions_and_band",),
        "issue 58: a selected fraction of 1 accepted by the loss",
    ),
    Mutant(
        "cov-threshold-is-the-largest",
        "src/gspo/losses_trust.py",
        "    lowest = torch.where(selected_BT, cov_BT, torch.full_like(cov_BT, big)).amin()\n",
        "    lowest = torch.where(selected_BT, cov_BT, torch.full_like(cov_BT, -big)).amax()\n",
        ("tests/test_losses_trust.py::test_kl_cov_value_and_gradient_match_reference",),
        "issue 58: the logged covariance threshold is the largest selected covariance",
    ),
    Mutant(
        "clip-cov-selects-clipped-tokens",
        "src/gspo/losses_trust.py",
        "    pool_BT = inp.valid_BT & ~(low_BT | high_BT) & band_BT\n",
        "    pool_BT = inp.valid_BT & band_BT\n",
        ("tests/test_losses_trust.py::test_clip_cov_value_and_gradient_match_reference_every_region",),
        "issue 58: Clip-Cov spends its count on tokens GRPO's clip already drops",
    ),
    Mutant(
        "kl-cov-penalty-sign",
        "src/gspo/losses_trust.py",
        "    obj_BT = (torch.exp(log_r_BT) * adv_BT - penalty_BT) * inp.mask_BT\n",
        "    obj_BT = (torch.exp(log_r_BT) * adv_BT + penalty_BT) * inp.mask_BT\n",
        ("tests/test_losses_trust.py::test_kl_cov_hand_computed",),
        "issue 58: KL-Cov rewards the selected tokens' divergence instead of penalising it",
    ),
    Mutant(
        "maxrl-negative-mean-flips",
        "src/gspo/advantages.py",
        "    denom_N1 = torch.where(mean_N1 > 0, mean_N1 + torch.full_like(unit_N1, eps) / unit_N1, torch.inf)\n",
        "    denom_N1 = torch.where(mean_N1 != 0, mean_N1 + torch.full_like(unit_N1, eps) / unit_N1, torch.inf)\n",
        ("tests/test_maxrl.py::test_groups_whose_mean_is_zero_or_negative_get_zero",),
        "issue 58: MaxRL divides by a negative group mean (every advantage's sign flipped)",
    ),
    Mutant(
        "maxrl-eps-dropped",
        "src/gspo/advantages.py",
        "        return maxrl_advantages(rewards_NG, eps)\n",
        "        return maxrl_advantages(rewards_NG, 0.0)\n",
        ("tests/test_maxrl.py::test_hand_values",),
        "issue 58: group_advantages ignores eps for maxrl",
    ),
    Mutant(
        "maxrl-negative-reward-accepted",
        "src/gspo/advantages.py",
        "    bad = (rewards_B < 0).nonzero()\n",
        "    bad = (rewards_B < -1).nonzero()\n",
        ("tests/test_maxrl.py::test_negative_rewards_are_refused_naming_the_reward_and_the_sample",),
        "issue 58: maxrl's reward check lets small negative rewards through",
    ),
    Mutant(
        "maxrl-reward-check-not-wired",
        "src/gspo/training/scoring.py",
        '    if plan.adv_scale == "maxrl":  # it divides by the group\'s mean: a negative reward stops the run\n',
        "    if False:\n",
        ("tests/test_maxrl.py::test_a_negative_reward_stops_a_maxrl_run_in_one_line",),
        "issue 58: gspo train never checks the rewards under adv_scale maxrl",
    ),
    Mutant(
        "maxrl-with-overlong-penalty-accepted",
        "src/gspo/config/algorithm.py",
        '        if cfg.adv_scale == "maxrl" and cfg.overlong_buffer > 0:\n',
        '        if cfg.adv_scale == "maxrl" and cfg.overlong_buffer > 4:\n',
        ("tests/test_new_algo_cli.py::test_bad_option_is_one_line_naming_the_field",),
        "issue 58: maxrl accepted with an overlong penalty (rewards below 0)",
    ),
    Mutant(
        "dppo-zero-threshold-accepted-by-config",
        "src/gspo/config/algorithm.py",
        '        if cfg.algo in ("dppo_tv", "dppo_kl") and getattr(cfg, f) == 0:\n',
        '        if cfg.algo in ("dppo_tv", "dppo_kl") and getattr(cfg, f) == -1:\n',
        ("tests/test_new_algo_cli.py::test_bad_option_is_one_line_naming_the_field",),
        "issue 58: --eps-low 0 accepted for DPPO (a zero trust region)",
    ),
    Mutant(
        "cov-fields-on-any-loss",
        "src/gspo/config/algorithm.py",
        '    | {f: ("clip_cov",) for f in COV_FIELDS[:3]}\n',
        '    | {f: ("clip_cov", "grpo") for f in COV_FIELDS[:3]}\n',
        ("tests/test_new_algo_cli.py::test_bad_option_is_one_line_naming_the_field",),
        "issue 58: clip_cov_* silently ignored on another loss (grpo)",
    ),
    Mutant(
        "abandoned-step-generator-not-rewound",
        "src/gspo/training/loop.py",
        "        state.sample_gen.set_state(gen_state)\n",
        "",
        (
            "tests/test_mutation_gaps.py::test_a_step_abandoned_before_its_update_is_rewound_and_the_resume_is_exact",
        ),
        "issue 57 gap 7: an abandoned step's sampling generator not rewound (save_every > 1: the resume draws other responses)",
    ),
    Mutant(
        "async-batches-seeded-by-version",
        "src/gspo/rollout/async_sampler.py",
        "sampler.engine.reseed(plan.seed * 1_000_003 + t)",
        "sampler.engine.reseed(plan.seed * 1_000_003 + need)",
        ("tests/test_async.py::test_async_batches_are_seeded_by_their_step_not_their_version",),
        "issue 57 gap 6: async batches seeded by their policy version instead of their step (K=2: batches 1-3 share a seed)",
    ),
    Mutant(
        "diverged-only-when-all-updates-skipped",
        "src/gspo/training/loop.py",
        'return metrics["loss/skipped_updates"] > 0 or not math.isfinite(loss)',
        'return metrics["loss/skipped_updates"] >= 4',
        (
            "tests/test_sweep5.py::test_a_diverged_run_stops_in_one_line_without_final_keeping_its_checkpoints",
        ),
        'issue 57 sweep: a diverged run skipping some of each step\'s updates (NaN losses) ends "done"',
    ),
    Mutant(
        "diverged-last-step-ends-done",
        "src/gspo/training/loop.py",
        "or (step == last and skipped == ran)",
        "or False",
        (
            "tests/test_sweep5.py::test_a_diverged_run_stops_in_one_line_without_final_keeping_its_checkpoints",
        ),
        "issue 57 sweep: a run shorter than the stop rule's 3 steps writes final/ from diverged steps",
    ),
    Mutant(
        "two-trainings-in-one-process",
        "src/gspo/launch.py",
        "if not _TRAINING.acquire(blocking=False):",
        "if not (_TRAINING.acquire(blocking=False) or True):",
        ("tests/test_sweep5.py::test_a_second_train_in_another_thread_is_refused_and_the_first_finishes",),
        "issue 57 sweep: a second gspo.train in another thread runs beside the first",
    ),
    Mutant(
        "unguarded-script-trains-twice",
        "src/gspo/launch.py",
        "    raise SystemExit(REIMPORTED_MAIN_EXIT)\n",
        "    return\n",
        (
            "tests/test_sweep5.py::test_a_script_without_a_main_guard_is_one_line_naming_it_not_a_second_training",
        ),
        "issue 57 sweep: the async sampler's process re-runs an unguarded script into a second training",
    ),
    Mutant(
        "compare-reuses-a-truncated-final",
        "src/gspo/study/runner.py",
        'damaged = _damaged_weights(run / "final") if finished else ""',
        'damaged = ""',
        ("tests/test_compare_folders.py::test_a_run_whose_final_folder_lacks_its_weights_is_not_reused",),
        'issue 57 sweep: gspo compare reuses a final/model.safetensors cut short as "done already"',
    ),
    Mutant(
        "file-size-limit-unnamed",
        "src/gspo/model/export.py",
        "limit = _file_size_limit() if number == errno.EFBIG or writer else None",
        "limit = None",
        ("tests/test_sweep5.py::test_a_file_size_limit_is_named_not_torchs_zip_writer",),
        "issue 57 sweep: ulimit -f reported as torch's 'enforce fail at inline_container.cc'",
    ),
    Mutant(
        "tracker-import-exit-uncaught",
        "src/gspo/training/trackers.py",
        "    except BaseException as e:  # noqa: BLE001 (a package whose import calls sys.exit is broken too)\n",
        "    except ImportError as e:\n",
        ("tests/test_sweep5.py::test_a_tracker_whose_import_exits_is_one_line_naming_it",),
        "issue 57 sweep: a tracker package whose import calls sys.exit(3) exits gspo with 3, nothing said",
    ),
    Mutant(
        "eval-blames-a-missing-config-json",
        "src/gspo/checkpoint_eval.py",
        '    if not (folder / "config.json").is_file():\n        raise GspoError(_not_a_model(folder, path))\n',
        "",
        ("tests/test_sweep5.py::test_eval_names_what_is_missing_not_a_config_json",),
        "issue 57 sweep: gspo eval of a run folder blames a config.json that does not exist",
    ),
    Mutant(
        "tracker-store-not-checked",
        "src/gspo/training/trackers.py",
        "why = self.failed or store_problem(self.store)",
        "why = self.failed",
        ("tests/test_trackers_failure.py::test_gspo_train_goes_on_when_every_trackers_store_fills",),
        "issue 57 trackers: W&B's offline writer loses everything on a full disk and nothing is said",
    ),
    Mutant(
        "mlflow-tracebacks-logged",
        "src/gspo/training/trackers.py",
        '        return _held("mlflow")\n',
        "        return contextlib.nullcontext()\n",
        (
            "tests/test_trackers_failure.py::test_trackers_whose_store_fills_stop_in_one_line_each_and_the_log_goes_on",
        ),
        "issue 57 trackers: MLflow logs ~300 lines of database tracebacks before gspo's one line",
    ),
    Mutant(
        "tensorboard-thread-traceback",
        "src/gspo/training/trackers.py",
        "        _quiet_tensorboard_threads()\n",
        "",
        (
            "tests/test_trackers_failure.py::test_trackers_whose_store_fills_stop_in_one_line_each_and_the_log_goes_on",
        ),
        "issue 57 trackers: TensorBoard's writer thread prints its traceback beside gspo's line",
    ),
    Mutant(
        "mesh-groups-torch-default-timeout",
        "src/gspo/training/distributed.py",
        "    ranks = torch.arange(math.prod(shape)).view(shape)\n",
        "    return init_device_mesh(device_type, shape, mesh_dim_names=names)\n",
        ("tests/test_dist_timeout.py::test_every_group_of_a_two_rank_start_waits_dist_timeout_min",),
        "issue 57 waits: HSDP's and EP's meshes from init_device_mesh, their groups on torch's 10-minute default",
    ),
    Mutant(
        "subgroup-without-timeout",
        "src/gspo/training/distributed.py",
        "    return dist.new_subgroups_by_enumeration(ranks, timeout=_TIMEOUT)[0]",
        "    return dist.new_subgroups_by_enumeration(ranks)[0]",
        ("tests/test_dist_timeout.py::test_every_group_of_a_two_rank_start_waits_dist_timeout_min",),
        "issue 57 waits: a mesh's groups made without dist_timeout_min",
    ),
    Mutant(
        "vllm-groups-default-timeout",
        "src/gspo/rollout/vllm_colocate.py",
        "        distributed_timeout_seconds=seconds, cpu_distributed_timeout_seconds=seconds,\n",
        "",
        ("tests/test_dist_timeout.py::test_vllms_own_groups_under_torchrun_wait_dist_timeout_min",),
        "issue 57 waits: vLLM's own groups under external_launcher on torch's defaults",
    ),
    Mutant(
        "nccl-weight-group-default-timeout",
        "src/gspo/rollout/weight_transfer.py",
        'return dist.ProcessGroupNCCL(dist.PrefixStore("weights", store), rank, 2, timeout)',
        'return dist.ProcessGroupNCCL(dist.PrefixStore("weights", store), rank, 2)',
        ("tests/test_dist_timeout.py::test_the_weight_transfer_group_waits_its_timeout_on_both_backends",),
        "issue 57 waits: the NCCL weight-transfer group on NCCL's 10 minutes",
    ),
    Mutant(
        "every-rank-asks-the-hub",
        "src/gspo/launch.py",
        "        if hub and dctx.world_size > 1:\n",
        "        if False:\n",
        ("tests/test_hub_start.py::test_several_ranks_read_a_hub_model_from_the_node_snapshot",),
        "issue 57 start-up: every rank reads the hub id's config and tokenizer before the node's snapshot",
    ),
    Mutant(
        "resume-asks-the-hub",
        "src/gspo/launch.py",
        "    if hub and resume_from is not None and (sharded or not checkpoints.is_sharded(resume_from)):\n",
        "    if False:\n",
        ("tests/test_hub_start.py::test_a_resume_of_a_hub_model_needs_no_hub_nor_cache",),
        "issue 57 start-up: a resume reads the hub (or its cache) again, then overwrites the weights",
    ),
    Mutant(
        "plan-asks-the-hub-for-the-dtype",
        "src/gspo/resolve.py",
        "        save = AUTO_DTYPE if is_hub_id(cfg.model) else stored_dtype(cfg.model)\n",
        "        save = stored_dtype(cfg.model)\n",
        ("tests/test_hub_start.py::test_the_plan_asks_no_hub_for_a_hub_models_dtype",),
        "issue 57 start-up: every rank's AutoConfig of the hub id at plan time (save_dtype auto)",
    ),
    Mutant(
        "sharded-resume-reads-the-models-weights",
        "src/gspo/launch.py",
        "    empty = sharded and from_shards\n",
        "    empty = False\n",
        ("tests/test_hub_shards.py::test_two_ranks_read_their_own_shards_of_a_hub_snapshot[dense]",),
        "issue 57 start-up: a sharded checkpoint's resume reads the model's weights first (slow test)",
    ),
    Mutant(
        "cache-lock-never-taken",
        "src/gspo/model/hub_lock.py",
        "            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
        "",
        (
            "tests/test_hub_start.py::test_the_cache_lock_waits_bounded_and_a_killed_holders_lock_goes_with_it",
        ),
        "issue 57 start-up: nodes sharing a cache download at once",
    ),
    Mutant(
        "kv-cache-without-the-cuda-context",
        "src/gspo/capacity.py",
        "    kv_bytes -= (CUDA_CONTEXT_GIB + VLLM_NON_KV_GIB) * 2**30  # see the constants\n",
        "",
        ("tests/test_capacity.py::test_the_kv_cache_leaves_room_for_the_cuda_context_and_vllms_own_memory",),
        "issue 57 plan: vLLM's KV cache counted as its share less its weights alone",
    ),
    Mutant(
        "gpu-check-timeout-without-kill",
        "benchmarks/gpu_check.sh",
        '  timeout -k "$GRACE" "$secs" "$@"',
        '  timeout "$secs" "$@"',
        ("tests/test_gpu_check.py::test_a_hanging_dependency_check_is_killed_and_named",),
        "issue 57 gpu_check: a process deaf to SIGTERM outlives its budget for ever",
    ),
    Mutant(
        "gpu-check-dependency-check-unbounded",
        "benchmarks/gpu_check.sh",
        '  py_missing=$(GPU_CHECK_MODULES="$modules" bounded "$(left)" python3 - <<\'EOF\'',
        "  py_missing=$(GPU_CHECK_MODULES=\"$modules\" python3 - <<'EOF'",
        ("tests/test_gpu_check.py::test_a_hanging_dependency_check_is_killed_and_named",),
        "issue 57 gpu_check: a hung dependency check hangs the script",
    ),
    Mutant(
        "gpu-check-memory-never-over-the-plan",
        "benchmarks/memory_probe.py",
        '    if r["peak_1"] <= plan * (1 + margin):',
        "    if True:",
        (
            "tests/test_gpu_check.py::test_the_memory_step_fails_a_peak_above_the_plan_by_more_than_the_margin",
        ),
        "issue 57 gpu_check: a measured peak far above the plan passes",
    ),
    Mutant(
        "dense-twin-one-expert-wide",
        "src/gspo/model/load.py",
        "    width = top_k * _SMALL_EXPERT_FFN\n",
        "    width = _SMALL_EXPERT_FFN\n",
        ("tests/test_volatility_calibration.py::test_shapes_build_with_their_twin_of_equal_active_width",),
        "issue 59: a dense twin as wide as one expert, not the k active ones (fewer active parameters)",
    ),
    Mutant(
        "calibration-later-steps-include-the-first",
        "benchmarks/volatility_calibration.py",
        '        "vol_later": mean_of(r.get(VOL) for r in steps[1:]),',
        '        "vol_later": mean_of(r.get(VOL) for r in steps),',
        ("tests/test_volatility_calibration.py::test_summarize_means_over_rl_steps",),
        "issue 59: the later steps' volatility mixed with a fresh Adam's first step (2-5x larger)",
    ),
    Mutant(
        "study-dirty-checkout-bound",
        "src/gspo/study/binding.py",
        "checks = (_settings(records), _seeds_analysed(preset, analysed), _clean(records))",
        "checks = (_settings(records), _seeds_analysed(preset, analysed))",
        ("tests/test_study_binding_gaps.py::test_a_run_from_a_dirty_checkout_is_not_preregistered",),
        "issue 59 step 5: runs from a checkout with uncommitted changes (gspo_dirty) still pre-registered",
    ),
    Mutant(
        "study-resolved-config-unbound",
        "src/gspo/study/binding.py",
        'why = "; and ".join(w for w in checks if w) or _resolved(preset, records, criteria)',
        'why = "; and ".join(w for w in checks if w)',
        ("tests/test_study_binding_gaps.py::test_a_code_default_changed_after_the_declaration_is_caught",),
        "issue 59 step 5: a code default changed after the declaration (the resolved config) goes unnoticed",
    ),
    Mutant(
        "study-declared-hash-without-study-defaults",
        "src/gspo/study/binding.py",
        "base = make_config(None, study_values(preset))",
        "base = make_config(None, dict(preset.config))",
        ("tests/test_study_binding_gaps.py::test_the_resolution_holds_what_the_code_decides",),
        "issue 59: the hash python -m gspo.study.binding prints resolves the preset without the studies'"
        " reproducible default (a declaration no compare's runs can match)",
    ),
    Mutant(
        "study-earlier-commit-date",
        "src/gspo/study/binding.py",
        "when = max(int(at), int(ct)) if at and ct else None",
        "when = min(int(at), int(ct)) if at and ct else None",
        (
            "tests/test_study_binding_seeds.py::test_the_later_of_author_and_committer_date_is_the_declarations",
        ),
        "issue 59 step 5: the declaration dated by the earlier of author and committer date (either can be backdated)",
    ),
    Mutant(
        "study-empty-arm-as-missing-seeds",
        "src/gspo/study/binding.py",
        "ran = {v: set(s) for v, s in analysed.items() if s}",
        "ran = {v: set(s) for v, s in analysed.items()}",
        ("tests/test_study_binding_gaps.py::test_a_subset_with_an_arm_without_runs_names_the_arm",),
        "issue 59 step 5: an arm without runs reported as missing every seed the others ran ('missing 300')",
    ),
    Mutant(
        "repro-aten-isa-unpinned",
        "src/gspo/repro.py",
        '    "ATEN_CPU_CAPABILITY": "default",\n',
        "",
        ("tests/test_repro.py::test_two_cpu_capabilities_give_identical_numbers_in_reproducible_mode",),
        "issue 59 step 4: the reproducible mode leaves ATen on the CPU's own kernels (bits differ by ISA)",
    ),
    Mutant(
        "resume-config-written-before-start-up",
        "src/gspo/launch.py",
        "        if state is None and (checkpoints.dctx is None or checkpoints.dctx.rank == 0):",
        "        if checkpoints.dctx is None or checkpoints.dctx.rank == 0:",
        ("tests/test_mutation_gaps.py::test_a_resume_that_fails_at_start_up_keeps_the_run",),
        "issue 57: a --resume that fails at start-up rewrote config.yaml with settings the run never ran",
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


def _defined(path: Path) -> set[tuple[str, ...]]:
    """The names a test file defines, as the paths of node ids: ``(name,)`` for a module-level
    function, class or assignment, ``(Class, method)`` for a method, its own or one a base class of
    the same file defines (read with ``ast``, nothing run)."""
    names: set[tuple[str, ...]] = set()
    classes: dict[str, ast.ClassDef] = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add((node.name,))
        if isinstance(node, ast.ClassDef):
            classes[node.name] = node
        if isinstance(node, ast.Assign):  # test_x = some_factory(...)
            names |= {(t.id,) for t in node.targets if isinstance(t, ast.Name)}

    def methods(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        cls = classes.get(name)
        if cls is None or name in seen:
            return set()
        own = {f.name for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
        bases = [b.id for b in cls.bases if isinstance(b, ast.Name)]
        return own.union(*(methods(b, seen | {name}) for b in bases))

    return names | {(c, f) for c in classes for f in methods(c)}


def missing_tests(m: Mutant, root: Path = ROOT) -> list[str]:
    """The mutant's node ids whose file is gone or does not define the named test (a parametrized
    id's ``[...]`` part is not checked: pytest makes it at collection)."""
    gone = []
    for node in m.tests:
        file, *parts = node.split("::")
        path = root / file
        if not path.is_file():
            gone.append(f"{node} (no file {file})")
            continue
        parts = [re.sub(r"\[.*\]$", "", p) for p in parts]
        if parts and tuple(parts) not in _defined(path):
            gone.append(f"{node} (no {'::'.join(parts)} in {file})")
    return gone


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
    if _count(m, ROOT) != 1 or missing_tests(m):
        return "stale"
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        copy = Path(tmp) / "repo"
        for f in files:
            (copy / f).parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copy2(ROOT / f, copy / f)
            except FileNotFoundError:  # removed since it was listed (an edit while mutants run)
                continue
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
        gone = {m.name: missing_tests(m) for m in chosen}
        for m in chosen:
            state = "STALE" if m in stale else "NO TEST" if gone[m.name] else "ok"
            print(f"{m.name:40s} {state}  {m.file}  ({m.why})")
            for g in gone[m.name]:
                print(f"    test not found: {g}")
        return 1 if stale or any(gone.values()) else 0
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
