"""vLLM engine adapter logic that runs without vLLM or a GPU."""

from types import SimpleNamespace

import pytest
import torch

from gspo.errors import GspoError
from gspo.rollout.vllm import hf_checkpoint_weights, outputs_to_batch


def _lp(x):
    return SimpleNamespace(logprob=x)


def test_outputs_to_batch_pads_and_cuts_at_eos():
    """vLLM completions become a right-padded RolloutBatch; tokens after the first EOS are dropped."""
    eos, pad = 1, 0
    outs = [
        SimpleNamespace(token_ids=[5, 6, eos], logprobs=[{5: _lp(-0.5)}, {6: _lp(-1.0)}, {eos: _lp(-0.1)}]),
        SimpleNamespace(token_ids=[7], logprobs=[{7: _lp(-2.0), 9: _lp(-3.0)}]),
        SimpleNamespace(token_ids=[8, eos, 8], logprobs=[{8: -0.2}, {eos: -0.3}, {8: -0.4}]),
    ]
    b = outputs_to_batch([[3], [3, 4], [4]], outs, eos, pad)
    assert b.response_ids_BT.tolist() == [[5, 6, eos], [7, pad, pad], [8, eos, pad]]
    assert b.response_mask_BT.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    torch.testing.assert_close(
        b.sampler_logp_BT, torch.tensor([[-0.5, -1.0, -0.1], [-2.0, 0, 0], [-0.2, -0.3, 0]])
    )
    assert b.prompt_ids == [[3], [3, 4], [4]]


def test_outputs_without_logprobs_is_an_error():
    """Asking vLLM without logprobs would silently break pi_old; it is a clear error instead."""
    with pytest.raises(GspoError, match="logprobs=0"):
        outputs_to_batch([[1]], [SimpleNamespace(token_ids=[2], logprobs=None)], 1, 0)


def test_sync_weights_use_checkpoint_names(tiny_moe, tmp_path):
    """Weights streamed to vLLM carry the on-disk HF names (per-expert MoE tensors), same values."""
    from safetensors.torch import load_file

    model, tok = tiny_moe
    model.save_pretrained(tmp_path, safe_serialization=True)
    disk = load_file(str(tmp_path / "model.safetensors"))
    streamed = dict(hf_checkpoint_weights(model))
    assert streamed.keys() == disk.keys()
    assert any(".experts.0.gate_proj.weight" in k for k in streamed)
    for k in disk:
        assert torch.equal(streamed[k], disk[k])


def test_selecting_vllm_without_it_installed_is_one_line_error(tiny_moe):
    """--rollout-engine vllm without vllm installed names the fix."""
    pytest.importorskip("transformers")
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed")
    except ImportError:
        pass
    from gspo.config import Config
    from gspo.train.loop import make_engine

    model, tok = tiny_moe
    with pytest.raises(GspoError, match=r"pip install gspo\[vllm\]"):
        make_engine(Config(rollout_engine="vllm"), model, tok, torch.Generator())
