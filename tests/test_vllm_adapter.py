"""vLLM engine adapter logic that runs without vLLM or a GPU (real vLLM: tests/test_vllm_real.py)."""

from types import SimpleNamespace

import pytest
import torch

import gspo.rollout.vllm as gv
from gspo.compat import transformers_model
from gspo.config import Config
from gspo.data import SampleBatch
from gspo.errors import GspoError
from gspo.model.export import hf_checkpoint_weights
from gspo.resolve import engine_plan
from gspo.rollout.vllm_batch import VLLMSampleBatch, outputs_to_batch, routing_rows_layout


def _lp(x):
    return SimpleNamespace(logprob=x)


def test_outputs_to_batch_pads_and_cuts_at_eos():
    """vLLM completions become a right-padded SampleBatch; tokens after the first EOS are dropped."""
    eos, pad = 1, 0
    outs = [
        SimpleNamespace(token_ids=[5, 6, eos], logprobs=[{5: _lp(-0.5)}, {6: _lp(-1.0)}, {eos: _lp(-0.1)}]),
        SimpleNamespace(token_ids=[7], logprobs=[{7: _lp(-2.0), 9: _lp(-3.0)}]),
        SimpleNamespace(token_ids=[8, eos, 8], logprobs=[{8: -0.2}, {eos: -0.3}, {8: -0.4}]),
    ]
    b = outputs_to_batch([[3], [3, 4], [4]], outs, eos, pad)
    assert isinstance(b, SampleBatch) and isinstance(b, VLLMSampleBatch)
    assert b.response_ids_BT.tolist() == [[5, 6, eos], [7, pad, pad], [8, eos, pad]]
    assert b.response_mask_BT.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    torch.testing.assert_close(
        b.sampler_logp_BT, torch.tensor([[-0.5, -1.0, -0.1], [-2.0, 0, 0], [-0.2, -0.3, 0]])
    )
    assert b.prompt_ids == [[3], [3, 4], [4]]
    assert b.routed_experts is None and b.routed_layers is None


def test_outputs_without_logprobs_is_an_error():
    """Asking vLLM without logprobs would silently break pi_old; it is a clear error instead."""
    with pytest.raises(GspoError, match="logprobs=0"):
        outputs_to_batch([[1]], [SimpleNamespace(token_ids=[2], logprobs=None)], 1, 0)


def test_routing_rows_layout_places_each_row_from_column_zero():
    """R3 data [P + R - 1, L, k] per row -> the trainer's rows layout {layer: [B, max(P + R), k]}."""
    b = outputs_to_batch(
        [[3, 4], [5]],
        [
            SimpleNamespace(token_ids=[6, 1], logprobs=[{6: -1.0}, {1: -1.0}]),
            SimpleNamespace(token_ids=[7, 8, 1], logprobs=[{7: -1.0}, {8: -1.0}, {1: -1.0}]),
        ],
        1,
        0,
    )
    r0 = torch.tensor([[[5, 6], [1, 2]], [[6, 7], [2, 3]], [[7, 4], [3, 4]]])  # P + R - 1 = 3 tokens
    r1 = torch.tensor([[[1, 0], [7, 6]]] * 3)  # 1 + 3 - 1 = 3 tokens
    b.routed_experts, b.routed_layers = [r0, r1], ["layer0", "layer1"]
    routing = routing_rows_layout(b)
    assert sorted(routing) == ["layer0", "layer1"]
    assert routing["layer0"].shape == (2, 4, 2)  # L = max(2 + 2, 1 + 3)
    assert routing["layer0"][0, :3].tolist() == r0[:, 0].tolist()
    assert routing["layer1"][1, :3].tolist() == r1[:, 1].tolist()
    assert routing["layer0"][0, 3].tolist() == [0, 1]  # filler: the last token predicts nothing
    with pytest.raises(GspoError, match="return_routing"):
        routing_rows_layout(
            outputs_to_batch([[1]], [SimpleNamespace(token_ids=[2], logprobs=[{2: 0.0}])], 1, 0)
        )


def test_sync_weights_use_checkpoint_names(tiny_moe, tmp_path):
    """Weights streamed to vLLM carry the on-disk HF names (per-expert MoE tensors), same values: pins
    the use of transformers' save-time conversion (fails if transformers changes it)."""
    from safetensors.torch import load_file

    model, tok = tiny_moe
    model.save_pretrained(tmp_path, safe_serialization=True)
    disk = load_file(str(tmp_path / "model.safetensors"))
    streamed = dict(hf_checkpoint_weights(model))
    assert streamed.keys() == disk.keys()
    assert any(".experts.0.gate_proj.weight" in k for k in streamed)
    for k in disk:
        assert torch.equal(streamed[k], disk[k])


def test_sync_weights_stream_layer_by_layer(tiny_moe, monkeypatch):
    """The conversion runs one decoder layer at a time, lazily (peak extra memory ~ one layer), in
    state-dict order: embeddings, layer 0, layer 1, final norm; and nothing is written to disk."""
    model, _ = tiny_moe
    calls = []
    real = transformers_model.revert_weight_conversion
    monkeypatch.setattr(
        transformers_model, "revert_weight_conversion", lambda m, sd: calls.append(sorted(sd)) or real(m, sd)
    )
    monkeypatch.setattr(type(model), "save_pretrained", lambda *a, **k: pytest.fail("sync wrote to disk"))
    it = hf_checkpoint_weights(model)
    first = next(it)
    assert first[0] == "model.embed_tokens.weight" and len(calls) == 1
    rest = list(it)
    assert len(calls) == 4  # embeddings, layer 0, layer 1, final norm (lm_head is tied: dropped)
    assert all(k.startswith("model.layers.0.") for k in calls[1]) and all(
        k.startswith("model.layers.1.") for k in calls[2]
    )
    assert calls[3] == ["model.norm.weight"]
    names = [first[0]] + [n for n, _ in rest]
    assert "lm_head.weight" not in names and len(names) == len(set(names))


def test_sync_weights_refuse_lora(tiny_moe):
    """LoRA models are not streamed (the adapters would have to be merged): a clear error."""
    peft = pytest.importorskip("peft")
    import copy

    model, _ = tiny_moe
    lora = peft.get_peft_model(
        copy.deepcopy(model), peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")
    )
    with pytest.raises(GspoError, match="LoRA"):
        next(hf_checkpoint_weights(lora))


def test_one_line_summary_of_vllm_errors():
    """vLLM's pydantic config errors are summarised to their 'Value error' line."""
    msg = "1 validation error for VllmConfig\n  Value error, AuxOutput needs X; set Y. [type=value_error, input=..]\n    see"
    assert gv._config_error_line(ValueError(msg)) == "AuxOutput needs X; set Y."
    assert gv._config_error_line(RuntimeError("first\nsecond")) == "first"
    assert gv._config_error_line(RuntimeError("")) == "RuntimeError"
    long = gv._config_error_line(
        ValueError(
            "Model architectures ['X'] are not supported for now. Supported architectures: " + "a" * 900
        )
    )
    assert long == "Model architectures ['X'] are not supported for now."
    assert len(gv._config_error_line(RuntimeError("b" * 900))) == 300


def test_selecting_vllm_without_it_installed_is_one_line_error(tiny_moe):
    """--rollout-engine vllm without vllm installed names the fix (GPU and CPU routes)."""
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed")
    except ImportError:
        pass
    from gspo.rollout.factory import make_engine

    model, tok = tiny_moe
    with pytest.raises(GspoError, match=r"pip install \"gspo\[vllm\]\".*\.ci/vllm_env\.sh") as e:
        make_engine(engine_plan(Config(rollout_engine="vllm")), model, tok, torch.Generator())
    assert "\n" not in str(e.value)


def test_vllm_memory_share_and_tensor_parallel_size_come_from_the_config():
    """On a GPU the engine asks vLLM for the configured memory share and tensor-parallel size (and for
    sleep mode); on the CPU neither applies."""
    from gspo.model.load import build_char_tokenizer, build_tiny_moe_h32
    from gspo.rollout.vllm import _llm_kwargs

    model = build_tiny_moe_h32(len(build_char_tokenizer()))
    plan = engine_plan(
        Config(  # tp 2 spans 2 ranks (tests/test_vllm_colocate.py)
            rollout_engine="vllm", vllm_gpu_memory_utilization=0.55, vllm_tensor_parallel_size=2, nproc=2
        ).validate()
    )
    gpu = _llm_kwargs(
        plan, model, on_cpu=False, cpu_capture=False, gpu_memory_utilization=0.55, sleep_mode=True
    )
    assert (gpu["gpu_memory_utilization"], gpu["tensor_parallel_size"], gpu["enable_sleep_mode"]) == (
        0.55,
        2,
        True,
    )
    cpu = _llm_kwargs(
        plan, model, on_cpu=True, cpu_capture=False, gpu_memory_utilization=0.55, sleep_mode=False
    )
    assert "gpu_memory_utilization" not in cpu and "tensor_parallel_size" not in cpu and cpu["enforce_eager"]
    with pytest.raises(GspoError, match="vllm_gpu_memory_utilization"):
        Config(vllm_gpu_memory_utilization=1.5).validate()
