"""The embedded shapes of the volatility calibration (``embedded:moe-l<L>-e<E>-k<k>`` and its dense
twin ``dense-l<L>-k<k>``) and ``benchmarks/volatility_calibration.py``'s summary of a run."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from gspo.errors import GspoError
from gspo.model.load import load_model_and_tokenizer
from gspo.model.routing import capture_routing, routing_share_changed

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import volatility_calibration as vc  # noqa: E402


def _mlp_params(layer: torch.nn.Module, top_k: int | None) -> int:
    """Parameters of one layer's MLP a token uses: the whole MLP, or ``top_k`` experts (router aside)."""
    if top_k is None:
        return sum(p.numel() for p in layer.mlp.parameters())
    experts = layer.mlp.experts
    per_expert = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // experts.num_experts
    return top_k * per_expert


def test_shapes_build_with_their_twin_of_equal_active_width() -> None:
    moe, tok = load_model_and_tokenizer("embedded:moe-l3-e12-k3", seed=1)
    dense, _ = load_model_and_tokenizer("embedded:dense-l3-k3", seed=1)
    c = moe.config
    assert (c.num_hidden_layers, c.num_experts, c.num_experts_per_tok, c.hidden_size) == (3, 12, 3, 96)
    assert dense.config.num_hidden_layers == 3 and dense.config.intermediate_size == 3 * 48
    assert _mlp_params(moe.model.layers[0], 3) == _mlp_params(dense.model.layers[0], None)
    ids = torch.tensor([tok.encode("12+34=")])
    assert moe(ids).logits.shape == dense(ids).logits.shape == (1, 6, len(tok))


def test_l6_e16_k4_is_small_moe_weight_for_weight() -> None:
    for named, shape in (("small-moe", "moe-l6-e16-k4"), ("small-dense", "dense-l6-k4")):
        a = load_model_and_tokenizer(f"embedded:{named}", seed=7)[0].state_dict()
        b = load_model_and_tokenizer(f"embedded:{shape}", seed=7)[0].state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["moe-l0-e8-k2", "moe-l2-e4-k5", "moe-l2-e512-k2", "dense-l49-k2"])
def test_shapes_out_of_range_are_one_line(name: str) -> None:
    with pytest.raises(GspoError, match=f"embedded shape '{name}'"):
        load_model_and_tokenizer(f"embedded:{name}")


def test_unknown_name_still_refused() -> None:
    with pytest.raises(GspoError, match="unknown embedded model 'moe-l2-e8'"):
        load_model_and_tokenizer("embedded:moe-l2-e8")


def test_summarize_means_over_rl_steps() -> None:
    rows = [
        {"step": 0, "eval/accuracy": 0.3},
        {"step": 1, "loss/loss": 0.1, "moe/volatility_experts": 0.10, "moe/volatility": 0.2,
         "loss/ratio_min": 0.5, "loss/ratio_max": 2.0},
        {"step": 2, "loss/loss": 0.1, "moe/volatility_experts": 0.02, "moe/volatility": 0.04,
         "loss/ratio_min": 0.25, "loss/ratio_max": 4.0},
        {"step": 3, "loss/loss": 0.1, "moe/volatility_experts": 0.03, "moe/volatility": 0.06,
         "loss/ratio_min": 1.0, "loss/ratio_max": 1.0},
        {"step": 3, "eval/accuracy": 0.25},
    ]  # fmt: skip
    s = vc.summarize(rows)
    assert s["vol_experts"] == pytest.approx(0.05) and s["vol_tokens"] == pytest.approx(0.1)
    assert s["vol_first"] == pytest.approx(0.10) and s["vol_later"] == pytest.approx(0.025)
    assert s["ratio_spread"] == pytest.approx((math.log(4) + math.log(16) + 0) / 3)
    assert (s["acc_start"], s["acc_end"], s["rl_steps"]) == (0.3, 0.25, 3)
    # a sequence-ratio loss: the token ratios it logs beside its own s_i
    gspo_row = {"loss/loss": 0.0, "loss/ratio_min": 0.9, "loss/ratio_max": 1.1}
    gspo_row |= {"loss/tok_ratio_min": 0.5, "loss/tok_ratio_max": 3.0}
    assert vc.summarize([gspo_row])["ratio_spread"] == pytest.approx(math.log(6))
    dense = vc.summarize([{"loss/loss": 0.0, "loss/ratio_min": 0.5, "loss/ratio_max": 2.0}])
    assert dense["vol_experts"] is None and dense["ratio_spread"] == pytest.approx(math.log(4))


def test_paper_unit_is_share_of_activated_experts() -> None:
    """What the trainer logs as ``moe/volatility_experts`` (and the calibration averages): over tokens,
    |new \\ old| / k, counted here by hand after moving one router."""
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer("embedded:moe-l2-e16-k4", seed=3)
    ids = torch.tensor([tok.encode("0123456789abcdef")] * 2)
    with torch.no_grad(), capture_routing(model) as rec:
        model(ids)
    old = {k: v.clone() for k, v in rec.items()}
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.add_(
            torch.randn_like(model.model.layers[1].mlp.gate.weight) * 0.05
        )
        with capture_routing(model) as rec:
            model(ids)
    new = dict(rec.items())
    mask_BT = torch.ones(ids.shape, dtype=torch.bool)
    by_hand = []
    for name in old:
        o, n = old[name].reshape(-1, 4).tolist(), new[name].reshape(-1, 4).tolist()
        by_hand.append(sum(len(set(b) - set(a)) / 4 for a, b in zip(o, n, strict=True)) / len(o))
    assert by_hand[0] == 0 and by_hand[1] > 0  # the first layer's router did not move
    assert float(routing_share_changed(old, new, mask_BT)) == pytest.approx(sum(by_hand) / 2)
