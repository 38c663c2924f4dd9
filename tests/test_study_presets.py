"""Pre-registered presets, the long-response task, and the warm start shared with `gspo train`."""

import random
from pathlib import Path

import pytest

from gspo.errors import GspoError
from gspo.study.binding import declaration
from gspo.study.presets import list_presets, load_preset

DECLARED = """
description: d
runtime: r
seeds: [0, 1]
variants: [gspo, grpo, grpo_replay]
primary:
  - {metric: acc_final, contrast: gspo - grpo_replay, direction: greater, margin: -0.02}
  - {metric: score_final, contrast: gspo - grpo, direction: greater}
family: {name: fam, size: 3, test: t}
"""


def _preset(tmp_path: Path, text: str):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return load_preset(str(path))


def test_a_declared_preset_loads_its_endpoints_and_family(tmp_path):
    p = _preset(tmp_path, DECLARED)
    assert [(e.metric, e.a, e.b, e.direction, e.margin) for e in p.primary] == [
        ("acc_final", "gspo", "grpo_replay", "greater", -0.02),
        ("score_final", "gspo", "grpo", "greater", 0.0),
    ]
    assert (p.family.name, p.family.size, p.family.alpha, p.family.test) == ("fam", 3, 0.05, "t")
    assert p.primary[0].text() == "acc_final: gspo - grpo_replay > -0.02"
    # outside a git checkout: the declaration's commit is unknown, never invented
    assert declaration(p)["file_commit"] is None


def test_family_defaults_to_the_presets_own_endpoints(tmp_path):
    p = _preset(tmp_path, DECLARED.replace("family: {name: fam, size: 3, test: t}\n", ""))
    assert (p.family.name, p.family.size, p.family.test) == ("p", 2, "permutation")


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("contrast: gspo - grpo_replay", "contrast: gspo - sapo"),
        ("metric: acc_final", "metric: accuracy"),
        ("direction: greater, margin", "direction: up, margin"),
        ("size: 3", "size: 1"),
        ("test: t", "test: wilcoxon"),
    ],
)
def test_a_bad_declaration_is_a_one_line_error(tmp_path, bad, match):
    with pytest.raises(GspoError):
        _preset(tmp_path, DECLARED.replace(bad, match, 1))


def test_old_presets_are_exploratory_and_new_ones_declared():
    """The presets that ran before issue 21 declared nothing (declaring now, after seeing their
    results, would not be a pre-registration); long-response-dense and the confirmatory ones do.
    long-response's declaration was withdrawn before it ran (superseded by confirm-long-response)."""
    assert "WITHDRAWN" in load_preset("long-response").description
    for name in list_presets():
        p = load_preset(name)
        if name.startswith("confirm-") or name == "long-response-dense":
            assert p.primary and p.family is not None, name
            assert len(p.seeds) >= 16, name
        else:
            assert not p.primary and p.family is None, name
    families: dict[str, list[str]] = {}
    for name in [n for n in list_presets() if n.startswith("confirm-")]:
        p = load_preset(name)
        families.setdefault(p.family.name, []).append(name)
        assert not set(p.seeds) & set(range(5)), f"{name}: a confirmation needs fresh seeds"
    assert len(families.pop("issue21-confirm")) == 4  # one endpoint each of the family of 4
    assert families == {
        "clip-mechanism": ["confirm-clip-mechanism"],
        "moe-interaction": ["confirm-moe-interaction"],
        "routing-replay-control": ["confirm-routing-replay-control"],
    }
    moe = load_preset("confirm-moe-interaction")  # declared, not yet run (issue 46 item 3)
    assert moe.primary[0].contrast == "(gspo - grpo) - (gspo_dense - grpo_dense)" and moe.family.size == 1
    assert moe.secondary_family.size == len(moe.secondary) == 3 and len(moe.seeds) >= 28
    assert not set(moe.seeds) & set(range(300)), "fresh seeds: none used by an earlier preset"
    mech = load_preset("confirm-clip-mechanism")
    assert mech.family.size == len(mech.primary) == 2
    assert not set(mech.seeds) & set(range(200)), "fresh seeds: none used by an earlier preset"


def test_progression_task_is_long_and_fits_the_embedded_context():
    from gspo.config import make_config
    from gspo.model.load import build_char_tokenizer, build_tiny_moe
    from gspo.tasks.synthetic import progression_task

    tok = build_char_tokenizer()
    rng = random.Random(0)
    pairs = [progression_task(rng) for _ in range(3000)]
    lengths = [len(tok(a, add_special_tokens=False).input_ids) + 1 for _, a in pairs]  # + EOS
    assert min(lengths) >= 64 and max(lengths) == 256
    assert all(tok.unk_token_id not in tok(p + a).input_ids for p, a in pairs[:200])
    for name in ("long-response", "long-response-dense", "confirm-long-response"):
        cfg = make_config(None, load_preset(name).config)
        assert cfg.max_new_tokens >= 256
        ctx = build_tiny_moe(len(tok)).config.max_position_embeddings
        longest_prompt = max(len(tok(p).input_ids) for p, _ in pairs)
        assert longest_prompt + cfg.max_new_tokens <= ctx and longest_prompt <= cfg.max_prompt_tokens


def test_position_credit_rewards_the_terms_right_in_place():
    from gspo.tasks.synthetic import position_credit

    want = "347,349,351,353"
    got = ["347,349,351,353", "347,349,351", "347,349,351,353,355", "347,348,350,352", "", "347,349,351,353 "]
    assert position_credit([""] * 6, got, [want] * 6) == pytest.approx([1.0, 0.75, 0.8, 0.25, 0.0, 1.0])
    from gspo.tasks.rewards import load_reward

    assert load_reward("gspo.tasks.synthetic:position_credit")(["p"], [want], [want]) == [1.0]


def test_compare_warm_start_opens_the_task_as_train_does(tmp_path, monkeypatch):
    """The compare warm start goes through gspo.training.sft.load_start, which builds the task from the
    whole config: reward_timeout_s (which compare's own copy dropped) reaches the reward."""
    import gspo.tasks
    from gspo.config import make_config
    from gspo.study.runner import warm_start_job

    seen = {}

    def spy(*args, **kw):
        seen["args"] = args
        raise RuntimeError("stop here")

    monkeypatch.setattr(gspo.tasks, "build_task", spy)
    base = make_config(None, {"model": "embedded:tiny-moe", "sft_steps": 2, "reward_timeout_s": 7.5})
    with pytest.raises(RuntimeError, match="stop here"):
        warm_start_job(base, 3, tmp_path / "out", None, tmp_path / "warm")
    assert seen["args"][2] == 3 and seen["args"][-1] == 7.5  # seed, reward_timeout_s


ARMS = """
description: d
runtime: r
seeds: [0]
variants: [gspo, grpo_tight, gspo_noclip]
arms:
  grpo_tight: {algo: grpo, eps_low: 0.02, eps_high: 0.027}
  gspo_noclip: {algo: gspo, eps_low: 1.0, eps-high: 1.0e6}
primary:
  - {metric: acc_final, contrast: grpo_tight - gspo_noclip, direction: greater}
family: {name: fam, size: 1}
"""


def test_a_preset_defines_its_own_arms_and_the_runs_take_them(tmp_path):
    from gspo.config import Config
    from gspo.study.runner import Jobs

    p = _preset(tmp_path, ARMS)
    assert p.arms["grpo_tight"] == {
        "routing_replay": False,
        "algo": "grpo",
        "eps_low": 0.02,
        "eps_high": 0.027,
    }
    assert set(p.settings()) >= {"gspo", "grpo", "grpo_tight", "gspo_noclip"}
    base = Config(steps=1, sft_steps=0, eval_size=4)
    jobs = Jobs(base, [0], p.variants, tmp_path / "out", None, tmp_path / "warm", arms=p.arms)
    tight, noclip, gspo = (jobs.run_cfg(v, 0, None) for v in ("grpo_tight", "gspo_noclip", "gspo"))
    assert (tight.algo, tight.eps_low, tight.eps_high) == ("grpo", 0.02, 0.027)
    assert (noclip.algo, noclip.eps_low, noclip.eps_high) == ("gspo", 1.0, 1.0e6)
    assert (gspo.eps_low, gspo.eps_high) == (None, None)  # the built-in variant is unchanged


@pytest.mark.parametrize(
    "arms, match",
    [
        ("arms: [grpo]", "must be a mapping"),
        ("arms: {grpo: {algo: grpo}}", "must be a new name"),
        ("arms: {x: {eps_low: 0.1}}", "with 'algo'"),
        ("arms: {x: {algo: grpo, eps_lo: 0.1}}", "eps_lo"),
    ],
)
def test_a_bad_arm_is_a_one_line_error(tmp_path, arms, match):
    with pytest.raises(GspoError, match=match):
        _preset(tmp_path, f"description: d\nseeds: [0]\nvariants: [gspo]\n{arms}\n")


def test_an_unknown_variant_names_the_arms_it_could_have_been(tmp_path):
    from gspo.study.runner import run_compare

    path = tmp_path / "p.yaml"
    path.write_text("description: d\nseeds: [0]\nvariants: [gspo, mine]\narms: {other: {algo: grpo}}\n")
    with pytest.raises(GspoError, match=r"--variants: unknown mine \(known: .*other"):
        run_compare(None, {}, preset=str(path), out_dir=str(tmp_path / "o"))
