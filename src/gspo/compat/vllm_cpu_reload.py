"""vLLM's CPU weight repacking after an in-place ``reload_weights`` (private: fused-MoE and embedding
internals of ``vllm.model_executor.layers``), for the vLLM releases whose CPU backend skips it."""

from __future__ import annotations

import torch

from gspo.compat import vllm_version
from gspo.errors import GspoError

#: vLLM versions whose CPU reload bugs :func:`post_reload_fixes` works around (verified by the tests)
VERSIONS = ("0.32.",)

UPSTREAM: list[tuple[str, str]] = [
    ("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts"),
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod"),
    (
        "vllm.model_executor.layers.vocab_parallel_embedding",
        "UnquantizedEmbeddingMethod.process_weights_after_loading",
    ),
]


def applies(version: str) -> bool:
    """Whether vLLM ``version`` is one whose CPU reload bugs :func:`post_reload_fixes` works around."""
    return version.startswith(VERSIONS)


def post_reload_fixes(model: torch.nn.Module) -> int:
    """Redo the CPU weight packing that vLLM 0.32's in-place ``reload_weights`` skips; returns the
    number of modules fixed. Runs inside vLLM's worker (``LLM.apply_model``), after every reload.

    Two bugs of vLLM 0.32 on CPU (dense log-probs off by ~1, MoE by ~1.6 after a reload without this):

    * MoE experts: on a weight update ``UnquantizedFusedMoEMethod`` copies the new weights into the
      existing expert tensors but skips the experts' ``process_weights_after_loading``, which on CPU
      repacks them into the grouped-GEMM layout; the kernel then reads unpacked weights as packed.
    * Tied embeddings: the LM head shares the embedding's weight, receives no checkpoint tensor of
      its own, so reload leaves it alone, but on CPU its GEMM runs on a packed copy of that weight
      made at load time (``cpu_linear``), which goes stale.

    Guarded by :data:`VERSIONS`; tests/test_vllm_real.py fails when the bugs are gone (time to drop
    this) or these internals change, tests/test_compat.py when the names below move.
    """
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    fixed = 0
    for mod in model.modules():
        qm = getattr(mod, "quant_method", None)
        if isinstance(mod, RoutedExperts) and isinstance(qm, UnquantizedFusedMoEMethod):
            kernel = getattr(qm, "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is None or not hasattr(experts, "process_weights_after_loading"):
                raise GspoError(
                    f"vLLM {vllm_version()}: MoE layer {type(mod).__name__} has no moe_kernel.fused_experts; "
                    "gspo's CPU reload workaround (gspo/compat/vllm_cpu_reload.py) needs updating"
                )
            experts.process_weights_after_loading(mod)
            fixed += 1
        elif isinstance(qm, UnquantizedEmbeddingMethod) and hasattr(mod, "cpu_linear"):
            qm.process_weights_after_loading(mod)  # re-dispatch the CPU GEMM from the current weight
            fixed += 1
    return fixed
