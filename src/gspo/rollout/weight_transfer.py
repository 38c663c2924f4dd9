"""Weights from trainer rank 0 to an async sampler on devices of its own (``rollout_devices``), over a
process group the two join: the way vLLM's RLHF examples (a weight-update group between the
trainer and the inference workers) and verl's checkpoint engine do it.

The group is its own: a TCPStore that rank 0 serves on a free port of this host and a two-member
backend (rank 0: trainer rank 0, rank 1: the sampler process), beside the trainers' default group.
Its backend is NCCL when the sampler's device is a GPU, gloo on the CPU. Each version crosses one
tensor at a time (a broadcast from rank 0, in the sampler's dtype, in the order of ``names``) into
buffers the sampler's receiving thread owns, so the trainer never waits for a generation to finish.

Only gloo is tested (processes on the CPU); the NCCL group is written for the GPU and untested.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gspo.errors import GspoError, one_line

# one tensor's broadcast (and joining the group): a sampler that hangs this long is lost; a run
# gives its dist_timeout_min (gspo.rollout.async_sampler), this is for callers that give none
TIMEOUT_S = 600.0
_JOINED = "sampler-joined"
Alive = Callable[[], bool]


@dataclass(frozen=True)
class Rendezvous:
    """Where the sampler process joins the group (picklable: it crosses the spawn)."""

    host: str
    port: int
    backend: str  # "nccl" or "gloo"
    timeout_s: float


def backend_for(devices: tuple[str, ...]) -> str:
    return "nccl" if devices and devices[0].startswith("cuda") else "gloo"


def check_rollout_devices(devices: tuple[str, ...], trainer: torch.device) -> None:
    """The sampler's devices exist and are none of this rank's (before any weight is read)."""
    if not devices:
        return
    got = ",".join(devices)
    if devices[0].startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        missing = [d for d in devices if torch.device(d).index is None or torch.device(d).index >= n]
        if missing:
            raise GspoError(
                f"config field 'rollout_devices': {missing[0]} does not exist ({n} GPUs) (got {got!r})"
            )
        if trainer.type != "cuda":
            raise GspoError(
                f"config field 'rollout_devices': GPUs take the weights over NCCL, which needs the trainer on a "
                f"GPU too (it is on {trainer}) (got {got!r})"
            )
        mine = torch.device(
            "cuda", trainer.index if trainer.index is not None else torch.cuda.current_device()
        )
        if any(torch.device(d) == mine for d in devices):
            raise GspoError(
                f"config field 'rollout_devices': {mine} is also a trainer device (this rank's): the sampler "
                f"needs GPUs the trainer does not use (got {got!r})"
            )


def visible_devices(devices: tuple[str, ...]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the sampler process: its GPUs, numbered as this process numbers
    them (through a ``CUDA_VISIBLE_DEVICES`` already set), so they become its cuda:0, cuda:1, ..."""
    index = [str(torch.device(d).index) for d in devices]
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent:
        ids = [x.strip() for x in parent.split(",")]
        index = [ids[int(i)] for i in index]
    return ",".join(index)


def _group(store: dist.Store, rank: int, backend: str, timeout_s: float) -> Any:
    """A two-member backend of this store (not the default group: trainer rank 0 is in that one)."""
    timeout = timedelta(seconds=timeout_s)  # both backends: without it NCCL's is its 10 minutes
    if backend == "nccl":  # written for the GPU, untested here
        return dist.ProcessGroupNCCL(dist.PrefixStore("weights", store), rank, 2, timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("weights", store), rank, 2, timeout)


class WeightSender:
    """Trainer rank 0's side: serves the store, joins once the sampler has, broadcasts each version."""

    def __init__(self, backend: str, device: torch.device, timeout_s: float = TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(
            "127.0.0.1", 0, world_size=2, is_master=True, timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )  # fmt: skip
        self.rendezvous = Rendezvous("127.0.0.1", self.store.port, backend, timeout_s)
        # gloo moves CPU tensors; NCCL sends from the trainer's GPU
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.group: Any = None

    def connect(self, alive: Alive) -> None:
        """Join the group once the sampler has (``alive``: False once its process died)."""
        t0 = time.time()
        while not self.store.check([_JOINED]):
            if not alive():
                raise GspoError("the async sampler process died before it joined the weight transfer")
            if time.time() - t0 > self.timeout_s:
                raise GspoError(
                    f"the async sampler did not join the weight transfer within {self.timeout_s:.0f} s"
                )
            time.sleep(0.05)
        self.group = _group(self.store, 0, self.rendezvous.backend, self.timeout_s)

    def send(
        self, stream: Iterable[tuple[str, torch.Tensor]], names: list[str], dtype: torch.dtype, alive: Alive
    ) -> None:
        """Broadcast every tensor of ``stream`` (its names must be ``names``, in order), cast to the
        sampler's ``dtype``. A failed transfer (the sampler's process died, a timeout) raises
        GspoError in one line."""
        i = -1
        for i, (n, t) in enumerate(stream):
            if i >= len(names) or n != names[i]:
                raise GspoError(
                    f"weight transfer: tensor {i} is {n!r}, the sampler expects {names[i : i + 1]}"
                )
            self.send_one(t.to(self.device, dtype).contiguous(), alive)
        if i + 1 != len(names):
            raise GspoError(f"weight transfer: {i + 1} tensors sent, the sampler expects {len(names)}")

    def send_one(self, t: torch.Tensor, alive: Alive) -> None:
        """One broadcast, watched: a gloo send to a dead peer does not fail, it waits out its timeout."""
        try:
            work = self.group.broadcast(t, 0)
            t0, pause = time.time(), 0.0
            while not work.is_completed():
                if not alive():
                    raise GspoError("the async sampler process died during the weight transfer")
                if time.time() - t0 > self.timeout_s:
                    raise GspoError(
                        f"the weight transfer to the async sampler timed out ({self.timeout_s:.0f} s)"
                    )
                time.sleep(pause)
                pause = min(2 * pause + 1e-5, 0.01)
            work.wait()  # raises the backend's error, if any
        except GspoError:
            raise
        except Exception as e:  # noqa: BLE001 (gloo/NCCL errors are RuntimeError subclasses of their own)
            if _dies(alive):  # the peer's reset: say what happened, not the backend's words
                raise GspoError("the async sampler process died during the weight transfer") from None
            why = one_line(e, typed=False)
            raise GspoError(f"the weight transfer to the async sampler failed mid-way ({why})") from None

    def close(self) -> None:
        self.group = None


def _dies(alive: Alive, within_s: float = 2.0) -> bool:
    """Whether the sampler's process is gone, or goes within ``within_s`` (a reset socket comes first)."""
    t0 = time.time()
    while alive():
        if time.time() - t0 > within_s:
            return False
        time.sleep(0.05)
    return True


class WeightReceiver:
    """The sampler process's side: joins the group, receives each version into its own buffers."""

    def __init__(self, rendezvous: Rendezvous) -> None:
        r = rendezvous
        store = dist.TCPStore(
            r.host, r.port, world_size=2, is_master=False, timeout=timedelta(seconds=r.timeout_s)
        )
        store.set(_JOINED, "1")
        self.backend = r.backend
        self.group = _group(store, 1, r.backend, r.timeout_s)

    def receive(self, names: list[str], into: dict[str, torch.Tensor]) -> None:
        """Every tensor of one version, in ``names`` order, into ``into`` (full shapes, its dtype)."""
        for n in names:
            self.group.broadcast(into[n], 0).wait()
        if self.backend == "nccl":  # the main thread reads these buffers on its own stream
            torch.cuda.synchronize()


@dataclass(frozen=True)
class SamplerLink:
    """What the sampler process needs to take versions over the process group (rollout devices)."""

    rendezvous: Rendezvous
    names: list[str]  # the order the tensors cross in
    cuda_visible: str | None  # the process's CUDA_VISIBLE_DEVICES (None: on the CPU)


def receive_versions(
    receiver: WeightReceiver, names: list[str], slots: list[dict[str, torch.Tensor]], versions: Any
) -> queue.Queue:
    """A thread that receives each announced version into its slot while the process samples, and
    the queue it puts each finished version on (or its error, one line)."""
    arrived: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            while True:
                v = versions.get()
                receiver.receive(names, slots[v % len(slots)])
                arrived.put(v)
        except Exception as e:  # noqa: BLE001 (reported through the main thread)
            arrived.put(f"the weight transfer failed in the sampler ({type(e).__name__}: {str(e)[:200]})")

    threading.Thread(target=run, daemon=True, name="gspo-weights").start()
    return arrived
