"""vLLM rollout engine (GPU, optional: ``pip install gspo[vllm]``); imported only when selected.

The engine keeps its own copy of the weights inside vLLM. After each policy update the trainer
calls :meth:`VLLMRolloutEngine.sync_weights`, which streams the trainer's weights, named as in a
Hugging Face checkpoint, into vLLM's ``load_weights``. Sampler log-probs are vLLM's log-probs of the
sampled tokens (``logprobs=0`` returns exactly the sampled token's), after temperature
(``logprobs_mode="processed_logprobs"`` where the installed vLLM supports it).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from gspo.errors import GspoError
from gspo.rollout.base import RolloutBatch


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError:
        raise GspoError(
            "config field 'rollout_engine': vllm is not installed (pip install gspo[vllm])"
        ) from None
    return vllm


def outputs_to_batch(
    prompt_ids: Sequence[Sequence[int]], completions: Sequence[Any], eos_token_id: int, pad_token_id: int
) -> RolloutBatch:
    """Convert vLLM ``CompletionOutput``-like objects (``token_ids``, ``logprobs``) to a RolloutBatch.

    ``logprobs`` is a list, one entry per generated token, of ``{token_id: Logprob(logprob=...)}``
    (or plain floats); the sampled token's entry is used. Tokens after the first EOS are dropped,
    matching the HF engine's per-row stop.
    """
    rows: list[tuple[list[int], list[float]]] = []
    for c in completions:
        ids = list(c.token_ids)
        if c.logprobs is None:
            raise GspoError("vLLM returned no log-probs; SamplingParams(logprobs=0) is required")
        lps = []
        for tok, entry in zip(ids, c.logprobs, strict=True):
            v = entry[tok]
            lps.append(float(getattr(v, "logprob", v)))
        if eos_token_id in ids:
            cut = ids.index(eos_token_id) + 1
            ids, lps = ids[:cut], lps[:cut]
        rows.append((ids, lps))
    T = max([len(r[0]) for r in rows] + [1])
    ids_BT = torch.full((len(rows), T), pad_token_id, dtype=torch.long)
    mask_BT = torch.zeros((len(rows), T), dtype=torch.long)
    logp_BT = torch.zeros((len(rows), T), dtype=torch.float32)
    for i, (ids, lps) in enumerate(rows):
        n = len(ids)
        if n:
            ids_BT[i, :n] = torch.tensor(ids)
            mask_BT[i, :n] = 1
            logp_BT[i, :n] = torch.tensor(lps)
    return RolloutBatch([list(p) for p in prompt_ids], ids_BT, mask_BT, logp_BT)


def hf_checkpoint_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs exactly as ``save_pretrained`` writes them (the names vLLM loaders expect).

    transformers 5 keeps some weights in fused in-memory layouts (e.g. MoE experts) and converts on
    save; going through ``save_pretrained`` reuses that conversion instead of re-implementing it.
    """
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="gspo-sync-") as d:
        model.save_pretrained(d, safe_serialization=True)
        for f in sorted(Path(d).glob("*.safetensors")):
            yield from load_file(str(f)).items()


class VLLMRolloutEngine:
    """Rollouts with vLLM; the trainer's weights are pushed in by :meth:`sync_weights`."""

    def __init__(
        self, llm: Any, trainer_model: Any, eos_token_id: int, pad_token_id: int, seed: int = 0
    ) -> None:
        self.llm = llm
        self.trainer_model = trainer_model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.calls = 0

    @classmethod
    def from_trainer(
        cls, cfg: Any, model: Any, tokenizer: Any, gpu_memory_utilization: float = 0.3
    ) -> VLLMRolloutEngine:
        vllm = _import_vllm()
        folder = Path(tempfile.mkdtemp(prefix="gspo-vllm-"))
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        kwargs: dict[str, Any] = dict(
            model=str(folder),
            dtype=cfg.dtype if cfg.dtype != "float32" else "auto",
            gpu_memory_utilization=gpu_memory_utilization,
            seed=cfg.seed,
            enable_prefix_caching=True,
        )
        try:
            llm = vllm.LLM(**kwargs, logprobs_mode="processed_logprobs")
        except TypeError:  # older vLLM: no logprobs_mode (log-probs are then before temperature)
            llm = vllm.LLM(**kwargs)
        return cls(llm, model, tokenizer.eos_token_id, tokenizer.pad_token_id, cfg.seed)

    def generate(
        self, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False
    ) -> RolloutBatch:
        vllm = _import_vllm()
        self.calls += 1
        params = vllm.SamplingParams(
            n=1,
            temperature=0.0 if greedy else temperature,
            max_tokens=max_new_tokens,
            logprobs=0,
            seed=self.seed * 1_000_003 + self.calls,
            stop_token_ids=[self.eos_token_id],
        )
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return outputs_to_batch(
            prompt_ids, [o.outputs[0] for o in outs], self.eos_token_id, self.pad_token_id
        )

    def sync_weights(self) -> None:
        weights = list(hf_checkpoint_weights(self.trainer_model))
        load_into_vllm(self.llm, weights)
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()  # cached KV blocks were computed with the old weights


def load_into_vllm(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Hand weights to the model inside vLLM (``LLM.apply_model`` in vLLM >= 0.9, else the V0 path)."""
    weights = list(weights)
    if hasattr(llm, "apply_model"):
        llm.apply_model(lambda m: m.load_weights(weights))
        return
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    runner.model.load_weights(weights)
