"""Training prompts as the policy sees them: the order they are drawn in, their token ids, and the
responses decoded back to text."""

from __future__ import annotations

from typing import Any

import torch

from gspo.errors import GspoError, warn
from gspo.plans import PromptPlan
from gspo.tasks.datasets import Example


def prompt_order(n_train: int, data_pos: int, count: int, seed: int) -> list[int]:
    """Indices ``data_pos .. data_pos+count`` of an epoch-wise shuffled order (deterministic, resumable):
    the one order training prompts are drawn in, by the trainer and by the async sampler."""
    out = []
    for pos in range(data_pos, data_pos + count):
        epoch, k = divmod(pos, n_train)
        perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(int(perm[k]))
    return out


def encode_prompts(tokenizer: Any, examples: list[Example], plan: PromptPlan) -> list[list[int]]:
    """Token ids per prompt (chat template if asked); too-long prompts are an error naming the prompt."""
    from gspo.tasks.datasets import apply_chat_template, is_chat, prompt_text

    if (plan.chat_template or plan.system_prompt is not None) and not getattr(
        tokenizer, "chat_template", None
    ):
        flag = "chat_template" if plan.chat_template else "system_prompt"  # else silently ignored
        raise GspoError(
            f"config field '{flag}': the tokenizer has no chat template (an instruct model's has)"
        )
    templated = [plan.chat_template or is_chat(ex.prompt) for ex in examples]  # messages always need it
    texts = [
        apply_chat_template(tokenizer, ex.prompt, plan.system_prompt) if t else ex.prompt
        for ex, t in zip(examples, templated, strict=True)
    ]
    out: list[list[int]] = [[] for _ in examples]
    for flag in (False, True):  # one batched call per setting (the rows' ids equal single calls')
        rows = [i for i, t in enumerate(templated) if bool(t) == flag]
        if rows:
            ids_N = tokenizer([texts[i] for i in rows], add_special_tokens=not flag).input_ids
            for i, ids in zip(rows, ids_N, strict=True):
                out[i] = list(ids)
    unk = getattr(tokenizer, "unk_token_id", None)
    with_unk: list[str] = []
    for ex, ids in zip(examples, out, strict=True):
        shown = prompt_text(ex.prompt)[:60]
        if not ids:
            raise GspoError(f"prompt is empty after tokenization: {shown!r}")
        if len(ids) > plan.max_prompt_tokens:
            raise GspoError(
                f"prompt has {len(ids)} tokens > max_prompt_tokens={plan.max_prompt_tokens}: {shown!r}"
            )
        if unk is not None and unk in ids:
            if all(t == unk or t in tokenizer.all_special_ids for t in ids):
                raise GspoError(f"prompt is only unknown tokens for this tokenizer: {shown!r}")
            with_unk.append(shown)
    if with_unk:
        warn(
            f"{len(with_unk)} of {len(examples)} prompts hold characters the tokenizer maps to its unknown "
            f"token, which the policy cannot see (e.g. {with_unk[0][:60]!r})"
        )
    return out


def completion_texts(tokenizer: Any, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> list[str]:
    """Decoded responses without their final EOS (one batched tokenizer call)."""
    from transformers import PreTrainedTokenizerFast

    seqs = []
    for ids, n in zip(ids_BT.tolist(), mask_BT.sum(-1).tolist(), strict=True):
        ids = ids[:n]
        seqs.append(ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids)
    # exactly transformers' fast tokenizer (no subclass that could change decoding) without clean-up:
    # decode the batch in one backend call (4x faster than its per-sequence loop, same strings)
    plain = type(tokenizer) is PreTrainedTokenizerFast
    if plain and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.backend_tokenizer.decode_batch(seqs, skip_special_tokens=True)
    return tokenizer.batch_decode(seqs, skip_special_tokens=True)
