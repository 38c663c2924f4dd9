"""vLLM's in-process engine teardown (private: ``LLM.llm_engine.engine_core``, the module
``vllm.distributed.parallel_state``) and a patch of ``torch.distributed.destroy_process_group`` that
keeps the trainer's process group alive through it.

vLLM has no public way to end an in-process engine and free its parallel state, which a process must
do before it makes another engine (vLLM keeps that state per process). Its own tests do what
:meth:`gspo.rollout.vllm.VLLMRolloutEngine.close` does: shut the engine core client down
(:func:`core_client`), drop the ``LLM``, then ``cleanup_dist_env_and_memory``
(:func:`end_vllm_groups`). That
ends vLLM's groups and then torch's default group (``destroy_distributed_environment`` calls
``torch.distributed.destroy_process_group()``), which under torchrun is the trainer's:
:func:`keeping_default_group` turns that one call into a no-op while it runs.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch

#: vLLM versions whose teardown internals this module is written for (verified by the tests);
#: elsewhere the same calls are made, best effort (tests/test_compat.py says which names moved)
VERSIONS = ("0.32.",)

UPSTREAM: list[tuple[str, str]] = [
    ("vllm.v1.engine.llm_engine", "LLMEngine"),  # its ``engine_core`` attribute: SOURCE_MARKS
    ("vllm.v1.engine.core_client", "EngineCoreClient.shutdown"),
    ("vllm.distributed.parallel_state", "cleanup_dist_env_and_memory"),
    ("vllm.distributed.parallel_state", "destroy_distributed_environment"),
]

#: what the upstream source must say for :func:`core_client` and :func:`keeping_default_group` to work:
#: ``(module, dotted function, text in its source)``
SOURCE_MARKS: list[tuple[str, str, str]] = [
    ("vllm.v1.engine.llm_engine", "LLMEngine.__init__", "self.engine_core ="),
    # called through the module attribute, so the patch of keeping_default_group reaches it
    (
        "vllm.distributed.parallel_state",
        "destroy_distributed_environment",
        "torch.distributed.destroy_process_group()",
    ),
]


def applies(version: str) -> bool:
    """Whether vLLM ``version`` is one whose teardown internals this module is written for."""
    return version.startswith(VERSIONS)


@contextlib.contextmanager
def keeping_default_group() -> Iterator[None]:
    """While held, ``torch.distributed.destroy_process_group`` ends only the groups it is given, not
    the default one (vLLM's teardown calls it without a group)."""
    real = torch.distributed.destroy_process_group

    def destroy(group: Any = None) -> None:
        if group is not None and group is not torch.distributed.group.WORLD:
            real(group)

    torch.distributed.destroy_process_group = destroy
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = real


def core_client(llm: Any) -> Any:
    """The engine core client of ``llm`` (its ``shutdown()`` ends the in-process engine), None when
    ``llm`` has none."""
    return getattr(getattr(llm, "llm_engine", None), "engine_core", None)


def end_vllm_groups() -> None:
    """vLLM's parallel groups ended and its memory freed (and torch's default group, unless
    :func:`keeping_default_group` is held), after its engine core was shut down and the last reference
    to the ``LLM`` dropped."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()
