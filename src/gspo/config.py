"""The one training config: a flat dataclass, each field documented by the string below it.

Values come from (later wins) the defaults here, a YAML file (``--config run.yaml``) and CLI flags
(``--group-size 8``; dashes or underscores). Every value is validated in :meth:`Config.validate`;
bad input raises :class:`GspoError` naming the field.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import numbers
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gspo.errors import GspoError


@dataclass
class Config:
    # --- run -----------------------------------------------------------------------------------
    name: str | None = None
    """Run name; outputs go to ``<output_dir>/<name>``. Default: ``<algo>-<task>-s<seed>``."""
    output_dir: str = "runs"
    """Directory that holds one folder per run."""
    seed: int = 0
    """Seed for model init (embedded models), data order and sampling."""
    device: str = "auto"
    """``auto`` (cuda if available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16. Log-probs and losses are always float32."""
    threads: int = 0
    """torch CPU threads per process (0: leave torch's default)."""
    resume: bool = False
    """Continue ``<output_dir>/<name>`` from its newest complete checkpoint instead of starting fresh."""
    overwrite: bool = False
    """Start ``<output_dir>/<name>`` over, deleting the run it holds (without it such a folder is refused)."""

    # --- model and task --------------------------------------------------------------------------
    model: str = "embedded:tiny-moe"
    """``embedded:tiny-moe`` / ``embedded:tiny-dense`` (random init, built locally), a local HF
    directory or a hub id loaded with ``AutoModelForCausalLM.from_pretrained``."""
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
    reward_timeout_s: float = 60.0
    """Seconds one call of the reward function (user ``pkg.mod:fn`` / ``file.py:fn`` and the built-ins
    but ``code``, whose programs have their own limits) may take before the run stops with a message
    naming it (0: no limit; at most a week)."""
    reward_on_error: str = "error"
    """When the reward raises or returns NaN/inf: ``error`` (stop with a message) or ``zero``
    (score 0, count a warning)."""
    chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template (instruct models)."""
    system_prompt: str | None = None
    """System message used with ``chat_template``."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are an error naming the example."""

    # --- warm start ------------------------------------------------------------------------------
    sft_steps: int = 200
    """Supervised steps on (prompt, answer) before RL, so the policy starts with partial accuracy
    (0 to skip; use 0 for pretrained instruct models)."""
    sft_lr: float = 3e-3
    """Learning rate of the supervised warm start."""
    sft_batch_size: int = 64
    """Examples per supervised step."""

    # --- algorithm -----------------------------------------------------------------------------
    algo: str = "gspo"
    """``gspo`` (sequence ratio), ``gspo_token`` (GSPO-token) or ``grpo`` (token ratio baseline)."""
    eps_low: float | None = None
    """Lower clip range (default per algo: gspo 3e-4, grpo 0.2)."""
    eps_high: float | None = None
    """Upper clip range (default per algo: gspo 4e-4, grpo 0.27)."""
    aggregation: str | None = None
    """Token aggregation of the token-level losses (grpo, sapo_token, cispo): ``seq_mean_token_mean``
    (per-sequence token mean, then mean over sequences: GRPO paper) or ``token_mean`` (sum over all
    tokens of the optimizer step / their count: DAPO, CISPO). Default: the loss's own (grpo and
    sapo_token: seq_mean_token_mean; cispo: token_mean)."""
    adv_scale: str = "group"
    """Advantage scaling: ``group`` std, ``batch`` std, or ``none`` (center only)."""
    old_logp: str = "auto"
    """pi_old log-probs: ``recompute`` with the trainer before the update, ``rollout`` (use the
    sampler's log-probs, the paper's infrastructure simplification), or ``auto``: ``rollout`` when
    the sampler is the trainer's own module in float32 (its log-probs are the trainer's), else
    ``recompute``."""
    routing_replay_source: str = "pi_old"
    """Which experts Routing Replay forces: ``pi_old`` (R2: the trainer's own pi_old forward) or
    ``rollout`` (R3: the experts the rollout engine routed each token to; vLLM engine)."""
    mismatch_correction: str = "none"
    """Train/inference mismatch correction, from the trainer's pi_old vs the sampler's log-probs:
    ``seq_tis`` (weight each sequence by min(rho_i, mismatch_cap), rho_i the length-normalized ratio
    pi_old/pi_sampler), ``seq_mask`` (drop sequences with rho_i outside [mismatch_low,
    mismatch_high]), ``token_mask`` (IcePop: drop tokens whose ratio is outside the band; for GRPO),
    or ``none``."""
    mismatch_cap: float = 2.0
    """``seq_tis``: the largest sequence weight C."""
    mismatch_low: float = 0.5
    """``seq_mask`` / ``token_mask``: lowest ratio pi_old/pi_sampler kept."""
    mismatch_high: float | None = None
    """``seq_mask`` / ``token_mask``: highest ratio kept (default 2 for sequences, 5 for tokens: IcePop)."""
    async_staleness: int = 0
    """Asynchronous rollouts: a sampler process (its own model copy, one thread) generates up to K
    policy versions ahead of the trainer, so generation and training overlap; step t's responses come
    from the weights after step t-1-K and the sampler's log-probs are pi_old. 0: synchronous."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (no gradient under group-normalized advantages) and
    draw more prompts until the batch is full (DAPO); see ``dynamic_sampling_max_rounds``."""
    dynamic_sampling_max_rounds: int = 4
    """Extra sampling rounds dynamic sampling may draw per step; a batch still short after them is
    filled with dropped groups (zero advantage: no gradient, counted in ``rollout/filtered_groups``)."""
    overlong_filter: bool = False
    """Give responses cut off at ``max_new_tokens`` (no EOS) zero advantage: out of the loss (DAPO)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: responses within the last N tokens before ``max_new_tokens`` get a
    reward penalty growing linearly to ``overlong_penalty`` (0 disables)."""
    overlong_penalty: float = 1.0
    """Largest soft overlong penalty (reward units), reached at ``max_new_tokens``."""
    keep_dropout: bool = False
    """Keep the model's dropout on in training forwards. Off by default (as TRL): sampling runs in
    eval mode, so dropout alone would move ratios out of GSPO's 3e-4 clip range."""
    routing_replay: bool = False
    """MoE only: force pi_old's experts in pi_theta's forward (Routing Replay; needed by GRPO)."""
    log_volatility: bool = True
    """MoE only: log the fraction of response tokens whose top-k experts changed over one optimizer
    step (measured on the second minibatch; costs one no-grad forward of it)."""

    # --- rollout -------------------------------------------------------------------------------
    steps: int = 200
    """RL steps (one rollout batch each)."""
    prompts_per_step: int = 32
    """Prompts per rollout batch."""
    group_size: int = 8
    """Responses sampled per prompt (G)."""
    max_new_tokens: int = 12
    """Generation limit per response."""
    temperature: float = 1.0
    """Sampling temperature (also applied to the trainer's log-probs)."""
    rollout_dtype: str | None = None
    """Weights dtype of the sampler (default: ``dtype``). ``bfloat16`` with a float32 trainer samples
    from a bf16 copy (HF engine) or a bf16 vLLM: the paper's precision mismatch between inference and
    training, whose log-probs ``old_logp=rollout`` then takes as pi_old."""
    rollout_engine: str = "hf"
    """``hf`` (the training model itself, KV cache) or ``vllm`` (GPU, ``pip install gspo[vllm]``)."""
    env: str | None = None
    """Multi-turn environment (None: single-turn rollouts). ``tools`` (calculator and Python in the
    code sandbox, called from the model's turn: ``<calc>12+34</calc>``, ``<python>...</python>``, a
    chat-template ``<tool_call>{json}</tool_call>`` or ``calc(12+34)``; a turn without a call is the
    answer the task's reward scores), ``tools:calc``, ``tools:python``, ``task`` (the task as a
    one-step environment), or ``pkg.mod:Factory`` / ``file.py:Factory`` making an object with
    ``reset(example) -> prompt`` and ``step(model_turn) -> (observation | None, reward)`` (each call
    limited to ``reward_timeout_s``). Turns end at EOS; ``max_new_tokens`` is the per-turn budget."""
    max_turns: int = 4
    """Multi-turn (``env``): model turns per trajectory; a trajectory still going after them is
    truncated (its reward so far; ``overlong_filter`` drops it from the loss)."""
    max_trajectory_tokens: int = 256
    """Multi-turn (``env``): tokens after the prompt per trajectory, model turns and observations
    together (the overlong penalty counts against it); past it the trajectory is truncated."""

    # --- optimization --------------------------------------------------------------------------
    num_minibatches: int = 4
    """Optimizer steps per rollout batch (the paper splits each batch into 4)."""
    micro_batch_size: int = 0
    """Sequences per forward/backward inside a minibatch (0: whole minibatch at once)."""
    lr: float = 3e-4
    """AdamW learning rate for RL."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.99
    """AdamW beta2."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 disables)."""
    warmup_steps: int = 0
    """Linear learning-rate warmup in optimizer steps."""
    packing: str = "auto"
    """Training forward layout: ``on`` packs all sequences of a micro-batch into one row (no padding
    compute), ``off`` keeps one row per sequence (or per group, see ``prefix_sharing``), ``auto`` packs
    only with flash attention (dense-mask attention makes packing cost more than the padding it saves)."""
    prefix_sharing: str = "auto"
    """Training forward layout for rows that share a prompt (a group's G samples): ``on`` computes
    each prompt once and lets its G responses attend to it through a 4D mask (the same log-probs and
    gradients for less compute), ``off`` gives every row its own copy, ``auto`` shares when the model
    takes a 4D mask (sdpa or eager attention, no sliding window) and ``packing`` is off; large
    sequences fall back to separate rows (the shared mask is dense)."""
    logp_chunk_size: int = 512
    """Positions per LM-head chunk when computing log-probs (memory vs speed)."""

    lora_rank: int = 0
    """LoRA rank via PEFT (0: train all weights). MoE routers are never adapted."""
    lora_alpha: float = 16.0
    """LoRA scaling alpha."""
    lora_target_modules: str = "all-linear"
    """Modules that get adapters: ``all-linear`` or comma-separated names (e.g. ``q_proj,v_proj``)."""

    # --- evaluation, logging, checkpoints --------------------------------------------------------
    eval_every: int = 10
    """Held-out greedy accuracy every N RL steps (0: only at start and end)."""
    eval_size: int = 200
    """Held-out examples."""
    save_every: int = 50
    """Checkpoint every N RL steps (always at the end)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs ``pip install wandb``)."""
    progress: bool = True
    """Show a progress line on stderr."""

    # --- distributed ---------------------------------------------------------------------------
    nproc: int = 1
    """Processes for data-parallel training (``gspo train --nproc N`` launches torchrun)."""
    parallel: str = "fsdp"
    """Data-parallel wrapper when more than one process: ``fsdp`` (FSDP2) or ``ddp``."""

    # ------------------------------------------------------------------------------------------
    def validate(self) -> Config:
        """Check every value; raise GspoError naming the first bad field."""
        from gspo.advantages import SCALES
        from gspo.losses import LOSSES

        def bad(field: str, msg: str) -> GspoError:
            return GspoError(f"config field '{field}': {msg} (got {getattr(self, field)!r:.80})")

        _check_types(self)
        choices = {
            "algo": tuple(LOSSES),
            "adv_scale": SCALES,
            "old_logp": ("auto", "recompute", "rollout"),
            "reward_on_error": ("error", "zero"),
            "dtype": ("float32", "bfloat16", "float16"),
            "rollout_dtype": (None, "float32", "bfloat16", "float16"),
            "aggregation": (None, "seq_mean_token_mean", "token_mean"),
            "routing_replay_source": ("pi_old", "rollout"),
            "mismatch_correction": ("none", "seq_tis", "seq_mask", "token_mask"),
            "rollout_engine": ("hf", "vllm"),
            "parallel": ("fsdp", "ddp"),
            "packing": ("auto", "on", "off"),
            "prefix_sharing": ("auto", "on", "off"),
        }
        for f, allowed in choices.items():
            if getattr(self, f) not in allowed:
                raise bad(f, f"must be one of {', '.join(str(a) for a in allowed if a is not None)}")
        positive = [
            "steps",
            "prompts_per_step",
            "group_size",
            "max_new_tokens",
            "num_minibatches",
            "eval_size",
            "sft_batch_size",
            "logp_chunk_size",
            "nproc",
            "max_prompt_tokens",
            "max_turns",
            "max_trajectory_tokens",
        ]
        for f in positive:
            if getattr(self, f) < 1:
                raise bad(f, "must be >= 1")
        for f in [
            "sft_steps",
            "micro_batch_size",
            "warmup_steps",
            "eval_every",
            "save_every",
            "threads",
            "lora_rank",
            "dynamic_sampling_max_rounds",
            "overlong_buffer",
            "overlong_penalty",
            "async_staleness",
            "reward_timeout_s",
        ]:
            if getattr(self, f) < 0:
                raise bad(f, "must be >= 0")
        for f in dataclasses.fields(self):  # inf or nan passes every comparison below: refuse it first
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise bad(f.name, "must be a finite number")
        from gspo.limits import check_config

        check_config(self)  # upper bounds before any relation between fields is computed from them
        for f in ["lr", "sft_lr", "temperature", "lora_alpha"]:
            if not getattr(self, f) > 0:
                raise bad(f, "must be > 0")
        for f in ["weight_decay", "max_grad_norm"]:
            if getattr(self, f) < 0:
                raise bad(f, "must be >= 0")
        for f in ["adam_beta1", "adam_beta2"]:
            if not 0 <= getattr(self, f) < 1:
                raise bad(f, "must be in [0, 1)")
        for f in ["eps_low", "eps_high"]:
            v = getattr(self, f)
            if v is not None and v < 0:
                raise bad(f, "must be >= 0")
        if self.eps_low is not None and self.algo in ("gspo", "gspo_token", "grpo") and self.eps_low > 1:
            raise bad("eps_low", f"must be <= 1 for {self.algo} (the ratio's lower clip is 1 - eps_low)")
        if self.overlong_buffer > (self.max_trajectory_tokens if self.env else self.max_new_tokens):
            limit = "max_trajectory_tokens" if self.env else "max_new_tokens"
            raise bad("overlong_buffer", f"must be <= {limit}={getattr(self, limit)}")
        if self.env is not None and not self.env.strip():
            raise bad("env", "must name an environment (tools, tools:calc, task, pkg.mod:Factory) or be None")
        if self.env and self.routing_replay_source == "rollout":
            raise bad("routing_replay_source", "'rollout' (R3) is not supported with a multi-turn env yet")
        if self.routing_replay_source == "rollout" and self.rollout_engine != "vllm":
            raise bad(
                "routing_replay_source",
                "'rollout' (R3) needs rollout_engine vllm (the HF engine is the trainer)",
            )
        if self.routing_replay_source == "rollout" and not self.routing_replay:
            raise bad("routing_replay_source", "'rollout' (R3) applies with routing_replay on")
        if self.mismatch_cap < 1:
            raise bad("mismatch_cap", "must be >= 1")
        high = self.mismatch_high_resolved()
        if not 0 <= self.mismatch_low < 1 < high:
            raise bad(
                "mismatch_low",
                f"the band [mismatch_low, mismatch_high] = [{self.mismatch_low}, {high}] must hold 1",
            )
        if self.async_staleness:
            for f, ok in [
                ("nproc", self.nproc == 1), ("rollout_engine", self.rollout_engine == "hf"),
                ("dynamic_sampling", not self.dynamic_sampling), ("lora_rank", self.lora_rank == 0),
                ("old_logp", self.old_logp != "recompute"), ("rollout_dtype", self.rollout_dtype in (None, self.dtype)),
            ]:  # fmt: skip
                if not ok:
                    raise bad(f, "is not supported with async_staleness > 0 yet")
        if self.group_size < 2:
            raise bad(
                "group_size",
                "must be >= 2: a group of one response always has advantage 0 (nothing to learn)",
            )
        if self.prompts_per_step % self.nproc:
            raise bad("prompts_per_step", f"must divide by nproc={self.nproc} (each rank samples its share)")
        if (self.prompts_per_step * self.group_size) % (self.num_minibatches * self.nproc):
            raise bad(
                "num_minibatches",
                f"prompts_per_step*group_size = {self.prompts_per_step * self.group_size}"
                f" must divide evenly into num_minibatches x nproc = {self.num_minibatches * self.nproc}",
            )
        if self.name is not None and (
            not self.name.strip() or self.name.strip(".") == "" or any(c in self.name for c in "/\\\0")
        ):  # '.', '..' or a path would put the run outside <output_dir>/<its own folder>
            raise bad("name", "must be a plain folder name (not '.' or '..', no '/' or '\\')")
        if self.name is not None and (
            any(ord(c) < 32 or ord(c) == 127 for c in self.name) or len(self.name.encode()) > 200
        ):  # a newline breaks every printed path; filesystems stop at 255 bytes (with suffixes added)
            raise bad("name", "must be at most 200 bytes without control characters (newline, tab, ...)")
        return self

    @property
    def run_name(self) -> str:
        task = Path(self.task).stem if ("/" in self.task or "." in self.task) else self.task
        task = re.sub(r"[^A-Za-z0-9._-]+", "_", task)  # rg:name:size=8 -> rg_name_size_8
        return self.name or f"{self.algo}-{task}-s{self.seed}"

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    def resolved_old_logp(self) -> str:
        """``recompute`` or ``rollout`` (``auto`` resolved)."""
        if self.old_logp != "auto":
            return self.old_logp
        if self.async_staleness:  # the batch's own policy: the sampler's log-probs
            return "rollout"
        same_numerics = (
            self.rollout_engine == "hf"
            and self.dtype == "float32"
            and self.rollout_dtype in (None, "float32")
        )
        return "rollout" if same_numerics else "recompute"

    def mismatch_high_resolved(self) -> float:
        if self.mismatch_high is not None:
            return self.mismatch_high
        return 5.0 if self.mismatch_correction == "token_mask" else 2.0

    def clip_range(self) -> tuple[float, float]:
        from gspo.losses import LOSSES

        _, lo, hi = LOSSES[self.algo]
        return (lo if self.eps_low is None else self.eps_low, hi if self.eps_high is None else self.eps_high)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def field_docs() -> dict[str, str]:
    """Field name -> its docstring, read from the class source (the string under each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(Config)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[attr-defined]
    return docs


def _field_type(f: dataclasses.Field) -> type:
    """The non-None type of a field annotation (``int | None`` -> int)."""
    hint = typing.get_type_hints(Config)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(Config)


def _check_types(cfg: Config) -> None:
    """Every value of the annotated type (a Config built in Python skips :func:`coerce`): a mapping as
    ``name`` or a string as ``steps`` fails here, naming the field, not deep inside training."""
    hints = _hints()
    for f in dataclasses.fields(cfg):
        v, hint = getattr(cfg, f.name), hints[f.name]
        if v is None and type(None) in typing.get_args(hint):
            continue
        typ = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if typ is bool:
            ok = isinstance(v, bool) or (isinstance(v, numbers.Integral) and v in (0, 1))
        elif typ in (int, float):
            ok = isinstance(v, numbers.Integral if typ is int else numbers.Real) and not isinstance(v, bool)
        else:
            ok = isinstance(v, typ)
        if not ok:
            raise GspoError(
                f"config field '{f.name}': expects {typ.__name__}, got {type(v).__name__} {v!r:.60}"
            )


def coerce(name: str, value: Any, source: str) -> Any:
    """Convert ``value`` (a CLI string or YAML scalar) to field ``name``'s type; GspoError if it won't."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    if name not in fields:
        close = [k for k in fields if k.startswith(name[:3])]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise GspoError(f"{source}: unknown config key '{name}'{hint}")
    typ = _field_type(fields[name])
    hint = typing.get_type_hints(Config)[name]
    optional = type(None) in typing.get_args(hint)
    if isinstance(value, (dict, list, tuple, set)):  # e.g. a YAML mapping (or alias bomb) as a name
        raise GspoError(f"{source}: config key '{name}' expects {typ.__name__}, got a {type(value).__name__}")
    if isinstance(value, str) and "\0" in value:
        raise GspoError(f"{source}: config key '{name}' holds a NUL character")
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise GspoError(f"{source}: config key '{name}' must not be empty")
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError, OverflowError):
        raise GspoError(f"{source}: config key '{name}' expects {typ.__name__}, got {value!r:.80}") from None


MAX_CONFIG_BYTES = 1 << 20  # a config is a few dozen keys: anything larger is not one


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping of config keys; errors name the file (and line for syntax errors)."""
    p = Path(path)
    if p.is_dir():
        raise GspoError(f"config file {path} is a directory")
    if not p.exists():
        raise GspoError(f"config file not found: {path}")
    if not p.is_file():  # a FIFO or a device would block or never end
        raise GspoError(f"config file {path} is not a regular file")
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise GspoError(f"{path}: config file is larger than {MAX_CONFIG_BYTES >> 20} MiB")
        raw = p.read_bytes()
    except OSError as e:
        raise GspoError(f"{path}: cannot read config file: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(raw.decode("utf-8-sig")) or {}
    except UnicodeDecodeError as e:
        raise GspoError(f"{path}: config file is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise GspoError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise GspoError(f"{path}: invalid YAML: nested too deeply") from None
    if not isinstance(data, dict):
        raise GspoError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    for k in data:
        if not isinstance(k, str):
            raise GspoError(f"{path}: config keys must be names, got {type(k).__name__} {k!r:.40}")
    return {k.replace("-", "_"): coerce(k.replace("-", "_"), v, path) for k, v in data.items()}


def make_config(yaml_path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults <- YAML file <- overrides (already coerced), validated."""
    values: dict[str, Any] = load_yaml(yaml_path) if yaml_path else {}
    values.update(overrides or {})
    return Config(**values).validate()


def save_yaml(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
