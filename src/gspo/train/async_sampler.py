"""Asynchronous rollouts with bounded staleness: a sampler process runs ahead of the trainer.

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
from typing import Any

import torch
from torch import multiprocessing as mp
from torch import nn

from gspo.errors import GspoError
from gspo.rollout.base import RolloutBatch


class AsyncSampler:
    """The trainer's side: publish weights after each update, receive batches in step order."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        prompt_ids: list[list[int]],
        cfg: Any,
        version: int,
        pending: list[tuple[int, int, RolloutBatch]] | None = None,
    ) -> None:
        """``version``: the number of finished steps (the weights of ``model``); ``pending``: the saved
        in-flight batches ``(step, version, batch)`` of a resumed run."""
        self.K = cfg.async_staleness
        self.pending: deque[tuple[int, int, RolloutBatch]] = deque(pending or [])
        self.slots = [
            {n: p.detach().clone().share_memory_() for n, p in model.named_parameters()}
            for _ in range(self.K + 1)
        ]
        ctx = mp.get_context("spawn")
        self.versions: Any = ctx.Queue()
        self.batches: Any = ctx.Queue()
        first = version + self.K + 1 if pending else 1  # the first step the sampler makes a batch for
        if pending:
            assert [b[0] for b in pending] == list(range(version + 1, version + self.K + 1)), (
                "bad in-flight batches"
            )
        settings = _settings(cfg) | ({"env": (cfg, tokenizer)} if getattr(cfg, "env", None) else {})
        args = (model.config, tokenizer.eos_token_id, tokenizer.pad_token_id, prompt_ids, settings)
        self.proc = ctx.Process(
            target=_sampler_main, args=(*args, self.slots, self.versions, self.batches, first), daemon=True
        )
        self.proc.start()
        self.publish(model, version)

    def publish(self, model: nn.Module, version: int) -> None:
        """Hand the weights after ``version`` steps to the sampler."""
        with torch.no_grad():
            for n, p in model.named_parameters():
                self.slots[version % (self.K + 1)][n].copy_(p.detach())
        self.versions.put(version)

    def batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """The responses of ``step`` (blocking) and the async metrics: how stale, how long waited. The
        batch stays in flight until :meth:`done` (a step that fails before its update keeps it)."""
        t0 = time.time()
        while not self.pending:
            self.pending.append(self._receive())
        got, version, rb = self.pending[0]
        assert got == step, (got, step)
        return rb, {"async/staleness": float(step - 1 - version), "async/queue_wait_s": time.time() - t0}

    def done(self, step: int) -> None:
        """Step ``step`` has used its batch."""
        assert self.pending and self.pending[0][0] == step
        self.pending.popleft()

    def in_flight(self, step: int) -> list[tuple[int, int, RolloutBatch]]:
        """The batches of steps ``step+1 .. step+K`` (waits for them): what a checkpoint after ``step``
        must hold, since they were sampled from versions it does not keep."""
        while not self.pending or self.pending[-1][0] < step + self.K:
            self.pending.append(self._receive())
        return [b for b in self.pending if step < b[0] <= step + self.K]

    def _receive(self) -> tuple[int, int, RolloutBatch]:
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

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)


# A batch crosses the process boundary as numpy arrays, pickled by value: torch tensors would go
# through shared-memory file descriptors, ~4 ms per batch on this CPU (a twentieth of a tiny step).
def _to_wire(t: int, version: int, rb: RolloutBatch) -> tuple[Any, ...]:
    from gspo.envs.rollout import env_fields

    arrays = (rb.response_ids_BT, rb.response_mask_BT, rb.sampler_logp_BT.float())
    return (t, version, rb.prompt_ids, *(a.numpy() for a in arrays), rb.gen_s, env_fields(rb))  # type: ignore[attr-defined]


def _from_wire(msg: tuple[Any, ...]) -> tuple[int, int, RolloutBatch]:
    from gspo.envs.rollout import with_env_fields

    t, version, prompt_ids, ids, mask, logp, gen_s, env = msg
    rb = RolloutBatch(prompt_ids, *(torch.from_numpy(a) for a in (ids, mask, logp)))
    rb.gen_s = gen_s  # type: ignore[attr-defined]
    return t, version, with_env_fields(rb, env)  # multi-turn trajectories: gspo.envs


def in_flight_to_state(pending: list[tuple[int, int, RolloutBatch]]) -> list[dict[str, Any]]:
    """In-flight batches as tensors and plain values (a checkpoint is read with ``weights_only``)."""
    return [
        {
            "step": t,
            "version": v,
            "prompt_ids": rb.prompt_ids,
            "response_ids": rb.response_ids_BT,
            "response_mask": rb.response_mask_BT,
            "sampler_logp": rb.sampler_logp_BT,
            "gen_s": float(getattr(rb, "gen_s", 0.0)),
            **_env_state(rb),
        }
        for t, v, rb in pending
    ]


def _env_state(rb: RolloutBatch) -> dict[str, Any]:
    """A multi-turn batch's own fields (gspo.envs) as tensors and ints, for the checkpoint."""
    from gspo.envs.rollout import env_fields

    env = env_fields(rb)
    return {} if env is None else {"env": {k: torch.as_tensor(v) for k, v in env.items()}}


def in_flight_from_state(items: list[dict[str, Any]]) -> list[tuple[int, int, RolloutBatch]]:
    out = []
    for d in items:
        rb = RolloutBatch(d["prompt_ids"], d["response_ids"], d["response_mask"], d["sampler_logp"])
        rb.gen_s = d["gen_s"]  # type: ignore[attr-defined]
        if "env" in d:  # a multi-turn batch (gspo.envs)
            from gspo.envs.rollout import with_env_fields

            rb = with_env_fields(rb, d["env"])
        out.append((d["step"], d["version"], rb))
    return out


def _settings(cfg: Any) -> dict[str, Any]:
    return {
        k: getattr(cfg, k)
        for k in (
            "seed",
            "prompts_per_step",
            "group_size",
            "max_new_tokens",
            "temperature",
            "dtype",
            "async_staleness",
        )
    }


def batch_prompts(n_train: int, step: int, prompts_per_step: int, seed: int) -> list[int]:
    """Prompt indices of RL ``step`` (1-based): positions ``(step-1) * prompts_per_step ..`` of the
    epoch-wise shuffled order the synchronous loop uses."""
    from gspo.train.loop import prompt_order

    return prompt_order(n_train, (step - 1) * prompts_per_step, prompts_per_step, seed)


def _sampler_main(
    config: Any,
    eos_id: int,
    pad_id: int,
    prompt_ids: list[list[int]],
    s: dict[str, Any],
    slots: list[dict[str, torch.Tensor]],
    versions: Any,
    batches: Any,
    first_step: int,
) -> None:
    """The sampler process: for step t = first_step, ...: wait for version max(t-1-K, 0), load it,
    generate step t's responses with a generator seeded by t, send them."""
    import signal

    from transformers import AutoModelForCausalLM

    from gspo.rollout.hf import HFRolloutEngine
    from gspo.train.distributed import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and then ends this process
    die_with_parent()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, s["dtype"])).eval()
        params = dict(model.named_parameters())
        K, G, latest, loaded = s["async_staleness"], s["group_size"], -1, -1
        env = None
        if "env" in s:  # multi-turn: this process plays the trajectories (gspo.envs)
            from gspo.envs.rollout import async_env, async_generate

            env = async_env(*s["env"])
        for t in range(first_step, 1 << 62):
            need = max(t - 1 - K, 0)
            while latest < need:
                latest = versions.get()
            if loaded != need:
                with torch.no_grad():
                    for n, p in params.items():
                        p.copy_(slots[need % (K + 1)][n])
                loaded = need
            gen = torch.Generator().manual_seed(s["seed"] * 1_000_003 + t)
            engine = HFRolloutEngine(model, eos_id, pad_id, gen)
            idx = batch_prompts(len(prompt_ids), t, s["prompts_per_step"], s["seed"])
            rep = [prompt_ids[i] for i in idx for _ in range(G)]
            t0 = time.time()
            if env is None:
                rb = engine.generate(rep, s["max_new_tokens"], s["temperature"])
            else:
                rb = async_generate(engine, env, idx, prompt_ids, G)
            rb.gen_s = time.time() - t0  # type: ignore[attr-defined]
            batches.put(_to_wire(t, need, rb))
    except Exception as e:  # noqa: BLE001 (reported to the trainer as one line)
        batches.put(f"{type(e).__name__}: {e}")
