"""``final/`` holds the weights in the model's own dtype (the one it was stored in), whatever dtype it
trained in, unless ``save_dtype`` asks otherwise; the values are the trained ones, cast."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from gspo import Config, train
from gspo.model.load import build_char_tokenizer, build_tiny_moe, save_pretrained


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """A tiny MoE stored in bfloat16, as most released checkpoints are."""
    path = tmp_path_factory.mktemp("bf16-model")
    tok = build_char_tokenizer()
    save_pretrained(build_tiny_moe(len(tok), seed=0).to(torch.bfloat16), tok, path)
    return path


def _run(tmp_path, model: str, **kw):
    cfg = Config(
        model=model, output_dir=str(tmp_path), name="r", steps=1, sft_steps=0, eval_every=0, eval_size=4,
        prompts_per_step=2, group_size=2, num_minibatches=1, max_new_tokens=4, threads=1, progress=False,
        save_every=0, **kw,
    )  # fmt: skip
    return train(cfg)


def _load(final):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(final)  # the dtype its config.json records


def _stored(final) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(final.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out |= {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118 (safe_open has no iteration)
    return out


def test_final_is_saved_in_the_dtype_the_model_was_stored_in(tmp_path, bf16_folder):
    res = _run(tmp_path, str(bf16_folder), dtype="float32")
    assert next(res.model.parameters()).dtype == torch.float32  # trained in float32
    assert json.loads((res.final_dir / "config.json").read_text())["dtype"] == "bfloat16"
    stored = _stored(res.final_dir)
    assert stored and all(t.dtype == torch.bfloat16 for t in stored.values())
    back = _load(res.final_dir)
    assert next(back.parameters()).dtype == torch.bfloat16
    for (k, t), (_, want) in zip(back.state_dict().items(), res.model.state_dict().items(), strict=True):
        assert torch.equal(t, want.to(torch.bfloat16)), k


def test_save_dtype_keeps_the_trained_precision_when_asked(tmp_path, bf16_folder):
    res = _run(tmp_path, str(bf16_folder), dtype="float32", save_dtype="float32")
    assert json.loads((res.final_dir / "config.json").read_text())["dtype"] == "float32"
    assert all(t.dtype == torch.float32 for t in _stored(res.final_dir).values())
    back = _load(res.final_dir)
    assert next(back.parameters()).dtype == torch.float32
    for (k, t), (_, want) in zip(back.state_dict().items(), res.model.state_dict().items(), strict=True):
        assert torch.equal(t, want), k


def test_embedded_models_are_saved_as_trained(tmp_path):
    res = _run(tmp_path, "embedded:tiny-moe")
    assert json.loads((res.final_dir / "config.json").read_text())["dtype"] == "float32"
    assert all(t.dtype == torch.float32 for t in _stored(res.final_dir).values())
