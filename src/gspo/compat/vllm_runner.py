"""vLLM's V1 model runner internals (private: ``GPUModelRunner._model_forward``, ``input_batch``,
``query_start_loc``) and its routed-experts capture hook, for the experts vLLM routes each token to on
CPU (R3), where vLLM's own output (``enable_return_routed_experts``) needs a GPU runner."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from gspo.errors import GspoError

#: vLLM versions whose V1 model runner internals :class:`CPURoutingCapture` reads (verified by the tests)
VERSIONS = ("0.32.",)

UPSTREAM: list[tuple[str, str]] = [
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner._model_forward"),  # the runner on CPU
    ("vllm.model_executor.layers.fused_moe.routed_experts_capturer", "bind_routed_experts_capturer"),
    ("vllm.model_executor.layers.fused_moe.layer", "MoERunner"),
]


def applies(version: str) -> bool:
    """Whether vLLM ``version`` is one whose runner internals :class:`CPURoutingCapture` reads."""
    return version.startswith(VERSIONS)


class CPURoutingCapture:
    """The experts vLLM routes each token to, recorded inside its forward (CPU backend).

    vLLM 0.32's own R3 output (``enable_return_routed_experts``) needs its Model Runner V2, which
    needs Triton, which the CPU build lacks. This records the same thing from the V1 runner: a
    capture function on every MoE router (vLLM's ``bind_routed_experts_capturer``, the hook its own
    capturer uses) gets each layer's ``topk_ids [num_tokens, k]``, and a wrapper around the runner's
    ``_model_forward`` (its documented override point) notes which request and position each row of
    the step belongs to. Prefix caching must be off (cached prompt tokens are not recomputed and so
    not routed); the engine turns it off when it uses this class.

    Guarded by :data:`VERSIONS`; tests/test_vllm_real.py checks the recorded experts against the
    HF model's routing, tests/test_compat.py that the runner's names below still exist.
    """

    def __init__(self, llm: Any) -> None:
        self.layer_ids: list[int] = []
        self._step: dict[int, torch.Tensor] = {}
        self._rows: dict[str, dict[int, torch.Tensor]] = {}  # request id -> position -> [L, k]
        self.enabled = False
        (self.layer_ids,) = llm.collective_rpc(self._install)

    def _install(self, worker: Any) -> list[int]:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        runner = worker.model_runner
        model = runner.get_model()
        bind_routed_experts_capturer(model, self)  # calls self.capture(layer_id, topk_ids)
        layer_ids = moe_layer_ids(model)
        orig = runner._model_forward

        def model_forward(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return orig(*args, **kwargs)
            req_ids = list(runner.input_batch.req_ids)
            qsl = runner.query_start_loc.np[: len(req_ids) + 1].copy()
            positions = kwargs.get("positions")
            self._step = {}
            out = orig(*args, **kwargs)
            if req_ids and positions is not None and self._step:
                self._commit(req_ids, qsl, positions)
            return out

        runner._model_forward = model_forward
        return layer_ids

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self.enabled:
            self._step[layer_id] = topk_ids.detach().to("cpu", torch.long, copy=True)

    def _commit(self, req_ids: list[str], qsl: Any, positions: torch.Tensor) -> None:
        n = int(qsl[-1])
        if set(self._step) != set(self.layer_ids):
            raise GspoError(
                f"vLLM routing capture: step routed layers {sorted(self._step)}, expected {self.layer_ids}"
            )
        step_NLk = torch.stack([self._step[j][:n] for j in self.layer_ids], 1)
        pos_N = positions[:n].to("cpu").tolist()
        for r, rid in enumerate(req_ids):
            rows = self._rows.setdefault(rid, {})
            for t in range(int(qsl[r]), int(qsl[r + 1])):
                rows[pos_N[t]] = step_NLk[t]  # a recomputed (preempted) position overwrites

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self._rows, self.enabled = {}, True
        try:
            yield
        finally:
            self.enabled = False

    def take(self, request_id: str, n_tokens: int) -> torch.Tensor:
        """``[n_tokens, L, k]`` for the request whose external id is ``request_id`` (vLLM's internal
        id is ``<external>-<random suffix>``)."""
        keys = [k for k in self._rows if k == request_id or k.rsplit("-", 1)[0] == request_id]
        if len(keys) != 1:
            raise GspoError(
                f"vLLM routing capture: request {request_id!r} matched {len(keys)} recorded requests"
            )
        rows = self._rows.pop(keys[0])
        missing = [t for t in range(n_tokens) if t not in rows]
        if missing:
            raise GspoError(
                f"vLLM routing capture: request {request_id!r} has no routing for positions {missing[:5]}"
            )
        return torch.stack([rows[t] for t in range(n_tokens)]) if n_tokens else torch.zeros(0, 0, 0)


def moe_layer_ids(model: torch.nn.Module) -> list[int]:
    """``layer_id`` of every MoE layer of a vLLM model, sorted."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return sorted({int(m.layer_id) for m in model.modules() if isinstance(m, MoERunner)})
