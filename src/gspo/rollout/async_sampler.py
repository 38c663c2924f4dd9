"""Asynchronous rollouts with bounded staleness: a :class:`~gspo.data.Sampler` whose process runs
ahead of the trainer.

With ``async_staleness = K`` the responses of RL step ``t`` are sampled from policy version
``max(t - 1 - K, 0)`` (version ``v`` = the weights after ``v`` steps), so while the trainer updates on
step ``t``'s batch the sampler is already generating steps ``t+1 .. t+K``. ``K = 0`` is the synchronous
loop (version ``t - 1``). GSPO suits this: pi_old is the sampler's own log-probs, so the ratio
measures how far the policy moved since the batch was sampled, and the sequence-level clip bounds it.

Deterministic by construction: batch ``t`` is a function of version ``t-1-K``'s weights and a
generator seeded by ``t`` only (the sampler waits for exactly that version, never a newer one), so
timing cannot change what is sampled. A checkpoint after step ``s`` stores the batches ``s+1 .. s+K``
(sampled from versions the checkpoint no longer holds); later batches are regenerated on resume from
the checkpoint's weights, exactly as they would have been.

Weights travel through ``K + 1`` shared-memory slots (version ``v`` in slot ``v % (K+1)``): the
trainer can be at most ``K`` versions past the one the sampler reads, so a slot is never overwritten
while it is read. The sampler process dies with the trainer (daemon + parent-death signal) and
ignores Ctrl-C, which the trainer handles.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import multiprocessing as mp
from torch import nn

from gspo.data import SampleBatch, SamplerOutput
from gspo.errors import GspoError
from gspo.plans import SamplePlan
from gspo.procs import die_with_parent
from gspo.rollout.hf import copy_tensors

Pending = tuple[int, int, SamplerOutput]  # (step, the policy version it was sampled from, its responses)


class AsyncSampler:
    """The trainer's side: publish weights after each update, receive batches in step order."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        prompt_ids: list[list[int]],
        plan: SamplePlan,
        version: int,
        state: dict[str, Any] | None = None,
        make_engine: Callable[..., Any] | None = None,
    ) -> None:
        """``model``: the trainer's HF model, after ``version`` updates; ``state``: what a checkpoint
        kept (:meth:`state`), whose batches in flight a resumed run must use; ``make_engine``: the
        engine factory (:func:`gspo.rollout.factory.make_engine`), which the process builds its own
        engine with, once, from ``plan.engine``."""
        self.K = self.staleness = plan.async_staleness
        self.model, self.G = model, plan.group_size
        pending = in_flight_from_state(state["in_flight"]) if state and "in_flight" in state else []
        self.pending: deque[Pending] = deque(pending)
        dtype = getattr(torch, plan.engine.rollout_dtype or plan.dtype)  # the sampler's precision
        self.slots = [
            {n: p.detach().to(dtype).clone().share_memory_() for n, p in model.named_parameters()}
            for _ in range(self.K + 1)
        ]
        ctx = mp.get_context("spawn")
        self.versions: Any = ctx.Queue()
        self.batches: Any = ctx.Queue()
        first = version + self.K + 1 if pending else 1  # the first step the sampler makes a batch for
        if pending and [b[0] for b in pending] != list(range(version + 1, version + self.K + 1)):
            raise GspoError("the checkpoint's async batches in flight do not follow its step")
        args = (plan, make_engine, model.config, tokenizer, prompt_ids, self.slots, self.versions)
        self.proc = ctx.Process(target=_sampler_main, args=(*args, self.batches, first), daemon=True)
        self.proc.start()
        self._publish(version)

    def sample(self, step: int, examples: list[Any], prompt_ids: list[list[int]]) -> SamplerOutput:
        """The responses of ``step`` (blocking), with how stale and how long waited. The batch stays in
        flight until the update of ``step`` is synced (a step that fails before its update keeps it)."""
        t0 = time.time()
        while not self.pending:
            self.pending.append(self._receive())
        got, version, s = self.pending[0]
        if got != step or s.batch.prompt_ids != [p for p in prompt_ids for _ in range(self.G)]:
            raise GspoError(f"async sampler: its batch for step {got} does not answer step {step}'s prompts")
        info = {"async/staleness": float(step - 1 - version), "async/queue_wait_s": time.time() - t0}
        return SamplerOutput(s.batch, s.gen_s, info)

    def sync(self, version: int) -> None:
        """Step ``version`` has used its batch; hand the weights after it to the sampler."""
        while self.pending and self.pending[0][0] <= version:
            self.pending.popleft()
        self._publish(version)

    def state(self, step: int) -> dict[str, Any]:
        """The batches of steps ``step+1 .. step+K`` (waits for them): a checkpoint after ``step`` must
        hold them, since they were sampled from versions it does not keep."""
        while not self.pending or self.pending[-1][0] < step + self.K:
            self.pending.append(self._receive())
        return {"in_flight": in_flight_to_state([b for b in self.pending if step < b[0] <= step + self.K])}

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)

    def _publish(self, version: int) -> None:
        copy_tensors(self.slots[version % (self.K + 1)], self.model.named_parameters())
        self.versions.put(version)

    def _receive(self) -> Pending:
        while True:
            try:
                msg = self.batches.get(timeout=1.0)
            except Exception:  # noqa: BLE001 (queue.Empty): check the sampler is alive
                if not self.proc.is_alive():
                    raise GspoError(
                        f"the async sampler process died (exit code {self.proc.exitcode})"
                    ) from None
                continue
            if isinstance(msg, str):
                raise GspoError(f"async sampler: {msg}")
            return _from_wire(msg)


# A batch crosses the process boundary as numpy arrays, pickled by value: torch tensors would go
# through shared-memory file descriptors, ~4 ms per batch on this CPU (a twentieth of a tiny step).
def _to_wire(t: int, version: int, s: SamplerOutput) -> tuple[Any, ...]:
    from gspo.envs.rollout import env_fields

    rb = s.batch
    arrays = (rb.response_ids_BT, rb.response_mask_BT, rb.sampler_logp_BT.float())
    return (t, version, rb.prompt_ids, *(a.numpy() for a in arrays), s.gen_s, env_fields(rb))


def _from_wire(msg: tuple[Any, ...]) -> Pending:
    from gspo.envs.rollout import with_env_fields

    t, version, prompt_ids, ids, mask, logp, gen_s, env = msg
    rb = SampleBatch(prompt_ids, *(torch.from_numpy(a) for a in (ids, mask, logp)))
    return (
        t,
        version,
        SamplerOutput(with_env_fields(rb, env), gen_s, {}),
    )  # multi-turn trajectories: gspo.envs


def in_flight_to_state(pending: list[Pending]) -> list[dict[str, Any]]:
    """In-flight batches as tensors and plain values (a checkpoint is read with ``weights_only``)."""
    return [
        {
            "step": t,
            "version": v,
            "prompt_ids": s.batch.prompt_ids,
            "response_ids": s.batch.response_ids_BT,
            "response_mask": s.batch.response_mask_BT,
            "sampler_logp": s.batch.sampler_logp_BT,
            "gen_s": float(s.gen_s),
            **_env_state(s.batch),
        }
        for t, v, s in pending
    ]


def _env_state(rb: SampleBatch) -> dict[str, Any]:
    """A multi-turn batch's own fields (gspo.envs) as tensors and ints, for the checkpoint."""
    from gspo.envs.rollout import env_fields

    env = env_fields(rb)
    return {} if env is None else {"env": {k: torch.as_tensor(v) for k, v in env.items()}}


def in_flight_from_state(items: list[dict[str, Any]]) -> list[Pending]:
    from gspo.envs.rollout import with_env_fields

    out = []
    for d in items:
        rb = SampleBatch(d["prompt_ids"], d["response_ids"], d["response_mask"], d["sampler_logp"])
        rb = with_env_fields(rb, d.get("env"))  # a multi-turn batch (gspo.envs)
        out.append((d["step"], d["version"], SamplerOutput(rb, d["gen_s"], {})))
    return out


def _sampler_main(
    plan: SamplePlan,
    make_engine: Callable[..., Any],
    config: Any,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    slots: list[dict[str, torch.Tensor]],
    versions: Any,
    batches: Any,
    first_step: int,
) -> None:
    """The sampler process: one engine over its own model, then for step t = first_step, ...: wait
    for version max(t-1-K, 0), load it into the model, sample step t's responses (the synchronous
    sampler, its generator seeded by t), send them."""
    import signal

    from transformers import AutoModelForCausalLM

    from gspo.rollout.sampler import SyncSampler
    from gspo.tasks.prompts import prompt_order

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and then ends this process
    die_with_parent()
    torch.set_num_threads(1)
    try:
        dtype = getattr(torch, plan.engine.rollout_dtype or plan.dtype)  # rollout_dtype: a lower precision
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        params = dict(model.named_parameters())
        K, P, latest, loaded = plan.async_staleness, plan.prompts_per_step, -1, -1
        task = None
        if plan.env is not None:  # multi-turn: this process plays the trajectories (gspo.envs)
            from gspo.tasks import task_from_config

            task = task_from_config(plan.task)
        gen = torch.Generator()
        # the HF engine samples from ``model`` itself; vLLM streams it into its own copy at each sync
        sampler = SyncSampler(make_engine(plan.engine, model, tokenizer, gen), tokenizer, task, plan)
        for t in range(first_step, 1 << 62):
            need = max(t - 1 - K, 0)
            while latest < need:
                latest = versions.get()
            if loaded != need:
                copy_tensors(params, slots[need % (K + 1)].items())
                sampler.sync(need)  # an engine with its own copy (vLLM) takes the model's weights
                loaded = need
            sampler.engine.reseed(plan.seed * 1_000_003 + t)  # batch t depends on t and its version only
            idx = prompt_order(len(prompt_ids), (t - 1) * P, P, plan.seed)  # as the trainer draws them
            examples = [task.train[i] for i in idx] if task is not None else []
            batches.put(_to_wire(t, need, sampler.sample(t, examples, [prompt_ids[i] for i in idx])))
    except Exception as e:  # noqa: BLE001 (reported to the trainer as one line)
        batches.put(f"{type(e).__name__}: {e}")
