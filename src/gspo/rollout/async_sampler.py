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

N trainer ranks (FSDP2 or DDP): one sampler process, beside rank 0. Every rank joins the publication
(each tensor gathered whole in turn, :func:`~gspo.model.unwrap.full_tensor`: one tensor more than a
shard at a time) and rank 0 alone writes the slot, so one stream reaches the sampler. The sampler
makes the whole step's batch (all ``prompts_per_step`` prompts) and rank 0 scatters it: rank ``r``
takes the groups of the prompts the synchronous path gives it (``r * P/N .. (r+1) * P/N``), so N ranks
train on the batch one process would.

LoRA: the sampler's plain model receives merged weights, ``W + scaling * B @ A`` per adapted layer,
computed one layer at a time from the trainer's adapters (nothing else of PEFT crosses).

Rollout devices (``rollout_devices``): the sampler process runs on devices the trainer does not
use and takes each version over a process group it joins with trainer rank 0
(:mod:`gspo.rollout.weight_transfer`: NCCL on GPUs, gloo on the CPU), one tensor at a time, into
``K + 1`` buffers of its own that a receiving thread fills while the main thread samples; the same
slot argument holds, and the batches are those of the shared-memory path, bit for bit.

Dynamic sampling (DAPO): the sampler process scores its own rounds (the trainer's scoring, passed in
as ``score``), draws more prompts until the batch holds ``prompts_per_step`` informative groups (or
the rounds run out) and sends the filled batch with the training prompts it holds and the data
position after every prompt it drew; batch ``t`` still depends on version ``t-1-K`` and ``t`` only.

R3 (vLLM's routing replayed): the experts the engine routed each token to cross with the batch
(:mod:`gspo.rollout.async_state`). Partial rollouts: :mod:`gspo.rollout.partial`.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import multiprocessing as mp
from torch import nn

from gspo.data import SampleBatch, SamplerOutput, StepBatch
from gspo.errors import REIMPORTED_MAIN_EXIT, SAMPLER_PROCESS, GspoError, reimported_main
from gspo.model.unwrap import full_tensor, is_peft, reshard, unwrap
from gspo.plans import SamplePlan
from gspo.procs import die_with_parent
from gspo.rollout.async_state import Ahead, from_wire, in_flight_from_state, in_flight_to_state, to_wire
from gspo.rollout.hf import copy_tensors
from gspo.rollout.sampler import GroupFilter, rank_world, share
from gspo.rollout.weight_transfer import (
    SamplerLink,
    WeightReceiver,
    WeightSender,
    backend_for,
    receive_versions,
    visible_devices,
)


class AsyncSampler:
    """The trainer's side: publish weights after each update, receive batches in step order (rank 0
    talks to the process; the other ranks join the publication and take their share of each batch)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        prompt_ids: list[list[int]],
        plan: SamplePlan,
        version: int,
        state: dict[str, Any] | None = None,
        make_engine: Callable[..., Any] | None = None,
        score: Callable[..., Any] | None = None,
        task: Any = None,
    ) -> None:
        """``model``: the trainer's model (its forward module or the HF model in it), after
        ``version`` updates; ``state``: what a checkpoint
        kept (:meth:`state`), whose batches in flight a resumed run must use; ``make_engine``: the
        engine factory (:func:`gspo.rollout.factory.make_engine`), which the process builds its own
        engine with, once, from ``plan.engine``; ``score``: the trainer's scoring of a batch, which
        scores each step's batch here (and in the process, with dynamic sampling, each round's);
        ``task``: the training examples the batches answer."""
        self.K = self.staleness = plan.async_staleness
        self.policy, self.model = model, unwrap(model, "model")  # FSDP2's root, and the HF model in it
        self.G, self.P = plan.group_size, plan.prompts_per_step
        self.rank, self.world = rank_world()
        self.plan, self.tokenizer, self.task, self.score, self.prompt_ids = (
            plan,
            tokenizer,
            task,
            score,
            prompt_ids,
        )
        self.dtype = getattr(torch, plan.engine.rollout_dtype or plan.dtype)  # the sampler's precision
        self.slots: list[dict[str, torch.Tensor]] = []
        self.proc: Any = None
        self.sender: WeightSender | None = None  # rollout devices: the process group's trainer side
        self.names = weight_names(self.model)  # the order tensors cross in
        self.devices = plan.rollout_devices
        pending = in_flight_from_state(state["in_flight"], self.P) if state and "in_flight" in state else []
        self.pending: deque[Ahead] = deque(pending)
        if pending and [b.step for b in pending] != list(range(version + 1, version + self.K + 1)):
            raise GspoError("the checkpoint's async batches in flight do not follow its step")
        devices = plan.rollout_devices
        if not devices:
            self._publish(version, start=False)  # every rank: the slots are made from the first stream
        if self.rank == 0:
            self._start_process(version, pending, make_engine, score)
        if devices:
            self._publish(version)  # every rank: the first version crosses like every other

    def _start_process(
        self,
        version: int,
        pending: list[Ahead],
        make_engine: Callable[..., Any] | None,
        score: Callable[..., Any] | None,
    ) -> None:
        """Rank 0: the sampler process, started from the trainer's ``version`` (and the batches a
        resumed run has in flight), with the queues it talks through."""
        plan, devices, tokenizer, prompt_ids = self.plan, self.devices, self.tokenizer, self.prompt_ids
        check_spawnable()
        ctx = mp.get_context("spawn")
        self.versions: Any = ctx.Queue()
        self.batches: Any = ctx.Queue()
        # what the process starts from goes through a queue, not the spawn's own pipe: CPython
        # writes a process's arguments to a pipe its child reads, and a child that dies before
        # reading them (e.g. it cannot re-run the main script) would block start() for ever; nor
        # may the exit wait on the queue's thread still writing them to that dead child
        self.setup: Any = ctx.Queue()
        self.setup.cancel_join_thread()
        first = (version + self.K + 1, pending[-1].data_end) if pending else (1, 0)  # step, data position
        weights: Any = self.slots
        if devices:  # the process joins a group with this one and receives every version
            self.sender = WeightSender(
                backend_for(devices), next(self.model.parameters()).device,
                timeout_s=60.0 * plan.engine.dist_timeout_min,  # as every collective of the run
            )  # fmt: skip
            cuda = visible_devices(devices) if devices[0].startswith("cuda") else None
            weights = SamplerLink(self.sender.rendezvous, self.names, cuda)
        args = (
            plan,
            make_engine,
            score if plan.dynamic_sampling else None,  # the process scores its rounds
            self.model.config,
            tokenizer,
            prompt_ids,
            weights,
            first,
        )
        queues = (self.setup, self.versions, self.batches)
        # named: gspo.train, re-run by a main script without a guard, knows its process by it
        self.proc = ctx.Process(target=_sampler_main, args=queues, daemon=True, name=SAMPLER_PROCESS)
        self.proc.start()
        self.setup.put(args)
        if self.sender is None:
            self.versions.put(version)
        else:
            self._connect()

    def next_batch(
        self, step: int, data_pos: int, short_anywhere: Callable[[bool], bool] = bool
    ) -> StepBatch:
        """This rank's share of step ``step``'s batch, scored (blocking; collective on N ranks). The
        process drew its prompts from ``data_pos`` on, and with dynamic sampling its rounds
        (:class:`_Draws`: every rank takes its share of one filled batch, ``short_anywhere`` unused)."""
        assert self.score is not None and self.task is not None, "a trainer's sampler scores"
        s, idx, data_end = self.filled(step)
        if not self.plan.dynamic_sampling and idx != share(
            self.plan, len(self.prompt_ids), data_pos, self.rank, self.world
        ):
            raise GspoError(f"async sampler: its batch for step {step} does not answer step {step}'s prompts")
        examples = [self.task.train[i] for i in idx]
        data, metrics = self.score(s.batch, self.tokenizer, self.task, examples, t_gen=s.gen_s)
        return StepBatch(data, metrics | s.info, data_end)

    def sample(self, step: int, examples: list[Any], prompt_ids: list[list[int]]) -> SamplerOutput:
        """This rank's share of the responses of ``step`` (blocking; collective on N ranks), with how
        stale and how long waited. The batch stays in flight until the update of ``step`` is synced
        (a step that fails before its update keeps it)."""
        s, _, _ = self.filled(step)
        if s.batch.prompt_ids != [p for p in prompt_ids for _ in range(self.G)]:
            raise GspoError(f"async sampler: its batch for step {step} does not answer step {step}'s prompts")
        return s

    def filled(self, step: int) -> tuple[SamplerOutput, list[int], int]:
        """This rank's share of step ``step``'s batch, the training prompts of its groups and the data
        position after the step (dynamic sampling: the prompts the sampler drew for it)."""
        t0 = time.time()
        if self.world == 1:
            a = self._next(step)
        else:  # rank 0 scatters the shares, or the one line that stops every rank
            shares: list[Any] | None = None
            if self.rank == 0:
                try:
                    shares = _shares(self._next(step), self.world, self.G)
                except GspoError as e:
                    shares = [str(e)] * self.world
            mine = _scatter(shares)
            if isinstance(mine, str):
                raise GspoError(mine)
            a = from_wire(mine)
        info = a.out.info | {"async/staleness": float(step - 1 - a.version)}
        ver_BT = a.out.batch.sampler_version_BT
        if ver_BT is not None:  # partial rollouts: how stale the tokens are, on average
            real_BT = a.out.batch.response_mask_BT.bool()
            info["async/token_staleness"] = float((step - 1 - ver_BT[real_BT]).float().mean())
        info["async/queue_wait_s"] = time.time() - t0
        return SamplerOutput(a.out.batch, a.out.gen_s, info), a.idx, a.data_end

    def _next(self, step: int) -> Ahead:
        while not self.pending:
            self.pending.append(self._receive())
        a = self.pending[0]
        if a.step != step:
            raise GspoError(f"async sampler: its batch for step {a.step} does not answer step {step}")
        return a

    def sync(self, version: int) -> None:
        """Step ``version`` has used its batch; hand the weights after it to the sampler (every rank)."""
        while self.pending and self.pending[0].step <= version:
            self.pending.popleft()
        self._publish(version)

    def state(self, step: int) -> dict[str, Any]:
        """The batches of steps ``step+1 .. step+K`` (rank 0; waits for them): a checkpoint after
        ``step`` must hold them, since they were sampled from versions it does not keep."""
        while not self.pending or self.pending[-1].step < step + self.K:
            self.pending.append(self._receive())
        return {"in_flight": in_flight_to_state([b for b in self.pending if step < b.step <= step + self.K])}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.proc is None:
            return
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)

    def _publish(self, version: int, start: bool = True) -> None:
        """Version ``version``'s weights into its slot (every rank gathers; rank 0 writes)."""
        reshard(self.policy)  # no-grad forwards can leave FSDP2's root unsharded (plain tensors)
        stream = merged_weights(self.model)
        if self.sender is not None or (self.rank != 0 and self.devices):
            return self._transfer(version, stream)
        if self.rank != 0:
            for _ in stream:  # the gathers are collective: every rank walks the stream
                pass
            return
        if not self.slots:  # the first stream makes the slots (full shapes, the sampler's dtype)
            first = {n: t.to(self.dtype, copy=True).share_memory_() for n, t in stream}
            empty = lambda: {n: torch.empty_like(t).share_memory_() for n, t in first.items()}  # noqa: E731
            self.slots = [first if i == version % (self.K + 1) else empty() for i in range(self.K + 1)]
        else:
            copy_tensors(self.slots[version % (self.K + 1)], stream)
        if start:
            self.versions.put(version)

    def _connect(self) -> None:
        """Rank 0 joins the weight group once the process has (or says in one line why it did not)."""
        assert self.sender is not None
        try:
            self.sender.connect(self.proc.is_alive)
        except GspoError as e:
            why = f"{e}{self._last_words()}"
            self.close()
            raise GspoError(why) from None

    def _transfer(self, version: int, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Version ``version`` over the process group (rank 0 broadcasts each tensor; every rank walks
        the stream, whose gathers are collective). A failed transfer stops every rank in one line."""
        why = None
        if self.sender is not None:
            self.versions.put(version)  # the process's receiving thread waits for it, then for the tensors
            try:
                self.sender.send(stream, self.names, self.dtype, self.proc.is_alive)
            except GspoError as e:
                why = f"{e}{self._last_words()}"
                self.sender.close()
        for _ in stream:  # the rest of a failed stream: the other ranks' gathers need this rank
            pass
        if self.world > 1:
            box = [why]
            dist.broadcast_object_list(box, src=0)
            why = box[0]
        if why is not None:
            raise GspoError(why)

    def _last_words(self) -> str:
        """The process's own error, if it sent one before it stopped."""
        try:
            msg = self.batches.get(timeout=0.5)
        except Exception:  # noqa: BLE001 (queue.Empty)
            return ""
        return f": {msg}" if isinstance(msg, str) else ""

    def _receive(self) -> Ahead:
        while True:
            try:
                msg = self.batches.get(timeout=1.0)
            except Exception:  # noqa: BLE001 (queue.Empty): check the sampler is alive
                if not self.proc.is_alive():
                    raise GspoError(_died(self.proc.exitcode)) from None
                continue
            if isinstance(msg, str):
                raise GspoError(f"async sampler: {msg}")
            return from_wire(msg)


def _died(code: int | None) -> str:
    """Why the sampler process is gone, in one line."""
    if code == REIMPORTED_MAIN_EXIT:  # it re-ran the main script, which called gspo.train again
        main = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
        return f"the async sampler process could not start: {reimported_main(main)}"
    return f"the async sampler process died (exit code {code})"


def _scatter(shares: list[Any] | None) -> Any:
    """Rank 0's ``shares[r]`` on rank ``r``."""
    out: list[Any] = [None]
    dist.scatter_object_list(out, shares, src=0)
    return out[0]


def _shares(a: Ahead, world: int, G: int) -> list[tuple[Any, ...]]:
    """``a`` split by groups over ``world`` ranks as the synchronous path splits its prompts."""
    n = len(a.idx) // world
    return [to_wire(a, slice(r * n, (r + 1) * n), G) for r in range(world)]


# ------------------------------------------------------------------------------------------------
# the weights the sampler's plain model takes


@torch.no_grad()
def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter of the plain transformers model, each gathered whole in
    turn (collective under FSDP2: every rank walks it); under LoRA the adapters are merged into their
    base weights (``W + scaling * B @ A``), one layer at a time, under the base model's names."""
    if not is_peft(model):
        for n, p in model.named_parameters():
            yield n, full_tensor(p.detach())
        return
    hf = unwrap(model, "transformers")  # the transformers model with LoRA layers in place of its linears
    modules = dict(hf.named_modules())
    for n, p in hf.named_parameters():
        if ".lora_" in n:
            continue
        w = full_tensor(p.detach())
        if n.endswith(".base_layer.weight"):
            w = w + _lora_delta(modules[n.removesuffix(".base_layer.weight")]).to(w.dtype)
        yield n.replace(".base_layer.", "."), w


def weight_names(model: nn.Module) -> list[str]:
    """The names :func:`merged_weights` yields, in its order, without gathering anything."""
    if not is_peft(model):
        return [n for n, _ in model.named_parameters()]
    hf = unwrap(model, "transformers")
    return [n.replace(".base_layer.", ".") for n, _ in hf.named_parameters() if ".lora_" not in n]


def _lora_delta(layer: nn.Module) -> torch.Tensor:
    """``scaling * B @ A`` of a PEFT LoRA linear's active adapters (the merge PEFT's own
    ``merge_and_unload`` makes), from whole adapter matrices."""
    delta = 0
    for name in layer.active_adapters:
        A, B = full_tensor(layer.lora_A[name].weight), full_tensor(layer.lora_B[name].weight)
        delta = delta + (B.float() @ A.float()) * layer.scaling[name]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


# ------------------------------------------------------------------------------------------------
# the sampler process


def check_spawnable() -> None:
    """A spawned process re-runs the parent's main script from its file (multiprocessing's "spawn"
    start method): a script read from standard input has none, and its process would die at start.
    ``python -m``, ``-c``, notebooks and the ``gspo`` command have nothing to re-run: they pass."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is None and isinstance(path, str) and path.startswith("<"):
        raise GspoError(
            f"async_staleness > 0 starts the sampler in a new process, which re-runs the main script, "
            f"and a script read from {path} cannot be re-run: save it to a file, or use python -c"
        )


def _sampler_main(setup: Any, versions: Any, batches: Any) -> None:
    """The sampler process: one engine over its own model, then for step t = first[0], ...: wait
    for version max(t-1-K, 0), load it into the model, sample step t's responses (the synchronous
    sampler, its generator seeded by t; dynamic sampling: its rounds), send them. ``setup`` brings
    what it starts from (:class:`AsyncSampler`'s ``args``): among them ``weights``, the shared-memory
    slots, or the link to the process group that brings each version (rollout devices)."""
    import signal

    from transformers import AutoModelForCausalLM

    from gspo.rollout.sampler import SyncSampler

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and then ends this process
    die_with_parent()
    torch.set_num_threads(1)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):  # torchrun's: this is no rank
        os.environ.pop(k, None)
    try:
        plan, make_engine, score, config, tokenizer, prompt_ids, weights, first = setup.get()
        link = weights if isinstance(weights, SamplerLink) else None
        if link is not None and link.cuda_visible is not None:  # before CUDA starts: its GPUs are cuda:0..
            os.environ["CUDA_VISIBLE_DEVICES"] = link.cuda_visible
        receiver = WeightReceiver(link.rendezvous) if link is not None else None  # join early: rank 0 waits
        dtype = getattr(torch, plan.engine.rollout_dtype or plan.dtype)  # rollout_dtype: a lower precision
        device = torch.device("cuda:0" if link is not None and link.cuda_visible is not None else "cpu")
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().to(device)
        params = dict(model.named_parameters())
        K, arrived, slots = plan.async_staleness, versions, weights
        if link is not None:  # a thread receives each version into K + 1 buffers of this process's own
            slots = [{n: torch.empty_like(params[n]) for n in link.names} for _ in range(K + 1)]
            arrived = receive_versions(receiver, link.names, slots, versions)
        task = None
        if plan.env is not None or score is not None:  # this process plays trajectories or scores rounds
            from gspo.tasks import task_from_config

            task = task_from_config(plan.task)
        gen = torch.Generator()
        # the HF engine samples from ``model`` itself; vLLM streams it into its own copy at each sync
        sampler = SyncSampler(make_engine(plan.engine, model, tokenizer, gen), tokenizer, task, plan)
        loader = _Versions(arrived, slots, params, sampler, K)
        draw = _Draws(sampler, score, task, tokenizer, prompt_ids, plan, loader)
        pos = first[1]
        for t in range(first[0], 1 << 62):
            need = max(t - 1 - K, 0)
            loader.load(need)
            sampler.engine.reseed(plan.seed * 1_000_003 + t)  # batch t depends on t and its version only
            a = draw.step(t, need, pos)
            pos = a.data_end
            batches.put(to_wire(a))
    except Exception as e:  # noqa: BLE001 (reported to the trainer as one line)
        batches.put(f"{type(e).__name__}: {e}")


class _Versions:
    """The sampler process's weights: waits for a version to arrive, loads it into the model and
    its engine (once per version)."""

    def __init__(
        self, arrived: Any, slots: Any, params: dict[str, torch.Tensor], sampler: Any, K: int
    ) -> None:
        self.arrived, self.slots, self.params, self.sampler, self.K = arrived, slots, params, sampler, K
        self.latest = self.loaded = -1

    def load(self, version: int) -> None:
        while self.latest < version:
            self.latest = self.arrived.get()
            if isinstance(self.latest, str):  # the receiving thread's error
                raise GspoError(self.latest)
        if self.loaded != version:
            copy_tensors(self.params, self.slots[version % (self.K + 1)].items())
            self.sampler.sync(version)  # an engine with its own copy (vLLM) takes the model's weights
            self.loaded = version


class _Draws:
    """One step's batch in the sampler process: the step's prompts (as the trainer draws them), and
    with dynamic sampling more rounds until ``prompts_per_step`` groups are informative."""

    def __init__(
        self,
        sampler: Any,
        score: Callable[..., Any] | None,
        task: Any,
        tokenizer: Any,
        prompt_ids: list[list[int]],
        plan: SamplePlan,
        loader: _Versions,
    ) -> None:
        self.sampler, self.score, self.task, self.tokenizer = sampler, score, task, tokenizer
        self.prompt_ids, self.plan, self.loader = prompt_ids, plan, loader

    def one(self, t: int, pos: int, version: int) -> tuple[list[int], SamplerOutput]:
        from gspo.tasks.prompts import prompt_order

        idx = prompt_order(len(self.prompt_ids), pos, self.plan.prompts_per_step, self.plan.seed)
        examples = [self.task.train[i] for i in idx] if self.task is not None else []
        prompts = [self.prompt_ids[i] for i in idx]
        if self.plan.partial_rollout_tokens:
            return idx, self.partial(t, version, prompts)
        return idx, self.sampler.sample(t, examples, prompts)

    def partial(self, t: int, version: int, prompts: list[list[int]]) -> SamplerOutput:
        """Step ``t``'s responses, their first tokens under ``version`` and the rest of the rows
        still going under the next version (:mod:`gspo.rollout.partial`)."""
        from gspo.rollout.partial import generate_partial

        plan, tok, t0 = self.plan, self.tokenizer, time.time()
        rep = [p for p in prompts for _ in range(plan.group_size)]
        nxt = max(t - plan.async_staleness, 0)  # t-K: a checkpoint after step s holds batches to s+K
        rb = generate_partial(
            self.sampler.engine, rep, plan.max_new_tokens, plan.temperature, plan.partial_rollout_tokens,
            (tok.eos_token_id, tok.pad_token_id), (version, nxt), lambda: self.loader.load(nxt),
        )  # fmt: skip
        later_B = (rb.sampler_version_BT > version).any(-1)  # generate_partial always records versions
        info = {"async/partial_rows": float(later_B.float().mean())}
        return SamplerOutput(rb, time.time() - t0, info)

    def step(self, t: int, version: int, pos: int) -> Ahead:
        P, G, plan = self.plan.prompts_per_step, self.plan.group_size, self.plan
        idx, s = self.one(t, pos, version)
        if self.score is None:
            return Ahead(t, version, s, idx, pos + P)
        # (prompt, batch, group) of each group
        groups: GroupFilter[tuple[int, SampleBatch, int]] = GroupFilter(
            P, G, plan.dynamic_sampling_max_rounds
        )
        gen_s = s.gen_s
        while True:
            examples = [self.task.train[i] for i in idx]
            scored, _ = self.score(s.batch, self.tokenizer, self.task, examples, t_gen=0.0)
            groups.add(scored.reward_B, [(idx[g], s.batch, g) for g in range(len(idx))])
            if groups.done():
                break
            pos += P
            idx, s = self.one(t, pos, version)
            gen_s += s.gen_s
        chosen = groups.chosen()
        batch = _groups(chosen, G)
        info = groups.metrics()
        return Ahead(t, version, SamplerOutput(batch, gen_s, info), [i for i, _, _ in chosen], pos + P)


def _groups(chosen: list[tuple[int, SampleBatch, int]], G: int) -> SampleBatch:
    """The chosen groups' rows as one batch, right-padded to the longest."""
    T = max(rb.response_ids_BT.shape[1] for _, rb, _ in chosen)

    def rows(x: torch.Tensor, g: int) -> torch.Tensor:
        return torch.nn.functional.pad(x[g * G : (g + 1) * G], (0, T - x.shape[1]))

    return SampleBatch(
        [p for _, rb, g in chosen for p in rb.prompt_ids[g * G : (g + 1) * G]],
        *(torch.cat([rows(getattr(rb, f), g) for _, rb, g in chosen]) for f in _RESPONSE_FIELDS),
    )


_RESPONSE_FIELDS = ("response_ids_BT", "response_mask_BT", "sampler_logp_BT")
