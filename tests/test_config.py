"""Config: defaults, YAML + CLI overrides, validation messages, --help documentation."""

import dataclasses

import pytest
import yaml

from gspo.cli import build_parser, main
from gspo.config import GROUPS, Config, coerce, field_docs, field_type, load_yaml, make_config, save_yaml
from gspo.config.algorithm import loss_params
from gspo.errors import GspoError


def test_every_field_has_a_docstring():
    """Each config field carries documentation that --help shows."""
    docs = field_docs()
    missing = [f.name for f in dataclasses.fields(Config) if not docs.get(f.name)]
    assert missing == []
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--group-size" in help_text and "Responses sampled per prompt" in help_text
    squeezed = "".join(help_text.split())  # argparse wraps lines (also at hyphens)
    for f in dataclasses.fields(Config):
        assert "--" + f.name.replace("_", "-") in help_text
        assert "".join(docs[f.name].split()) in squeezed, f.name


def test_groups_compose_one_flat_config():
    """Each group declares its own fields; Config inherits them all, in the order config.yaml lists."""
    names = [f.name for g in GROUPS for f in dataclasses.fields(g)]
    assert names == [f.name for f in dataclasses.fields(Config)]
    assert len(GROUPS) > 5 and len(set(names)) == len(names)
    cfg = dataclasses.replace(Config(), seed=1, lr=0.5)
    assert (cfg.seed, cfg.lr, dataclasses.asdict(cfg)["lr"], cfg.to_dict()["seed"]) == (1, 0.5, 0.5, 1)


def _other_value(f: dataclasses.Field):
    """A value of the field's type other than its default (not necessarily a valid config)."""
    if field_type(f.name) is float and f.default is None:  # float | None
        return 0.25
    if isinstance(f.default, bool):
        return not f.default
    if isinstance(f.default, (int, float)):
        return f.default + 1
    return "value-of-" + f.name


def test_every_field_round_trips_through_yaml(tmp_path):
    """default -> config.yaml -> load is the same Config; so is a changed value of every field, and the
    YAML keys are the flat field names (config.yaml of existing runs keeps loading)."""
    p = tmp_path / "config.yaml"
    save_yaml(Config(), p)
    assert make_config(str(p)) == Config()
    assert list(yaml.safe_load(p.read_text())) == [f.name for f in dataclasses.fields(Config)]
    changed = Config(**{f.name: _other_value(f) for f in dataclasses.fields(Config)})
    assert all(getattr(changed, f.name) != f.default for f in dataclasses.fields(Config))
    save_yaml(changed, p)
    assert load_yaml(str(p)) == changed.to_dict()
    assert Config(**load_yaml(str(p))) == changed


def test_paper_defaults():
    """Defaults follow the paper: GSPO, clip 3e-4/4e-4, 4 minibatches; GRPO baseline 0.2/0.27."""
    cfg = Config().validate()
    assert cfg.algo == "gspo" and loss_params(cfg) == {"eps_low": 3e-4, "eps_high": 4e-4}
    assert cfg.num_minibatches == 4
    assert loss_params(Config(algo="grpo")) == {"eps_low": 0.2, "eps_high": 0.27}
    assert loss_params(Config(algo="grpo", eps_low=0.1)) == {"eps_low": 0.1, "eps_high": 0.27}
    assert loss_params(Config(algo="sapo", sapo_tau_pos=0.5)) == {"tau_neg": 1.05, "tau_pos": 0.5}


def test_sapo_temperatures_are_fields_of_their_own():
    """SAPO's soft gate has temperatures, not a clip range: ``sapo_tau_neg`` / ``sapo_tau_pos`` set
    them (``eps_low`` / ``eps_high`` did, one word for two things), the clip range is refused."""
    assert loss_params(Config(algo="sapo_token", sapo_tau_neg=1.2).validate())["tau_neg"] == 1.2
    with pytest.raises(GspoError, match="^config field 'eps_low': sapo has no clip range .*sapo_tau_neg"):
        Config(algo="sapo", eps_low=0.5).validate()
    with pytest.raises(
        GspoError, match="^config field 'sapo_tau_pos': applies to algo sapo / sapo_token only"
    ):
        Config(sapo_tau_pos=0.5).validate()
    with pytest.raises(GspoError, match="^config field 'sapo_tau_neg': "):
        Config(algo="sapo", sapo_tau_neg=0.0).validate()


def test_yaml_then_cli_override(tmp_path):
    """CLI values override YAML values, which override defaults."""
    p = tmp_path / "c.yaml"
    p.write_text("group_size: 4\nlr: 1.0e-5\nrouting-replay: true\n")
    cfg = make_config(str(p), {"lr": 2e-5})
    assert (cfg.group_size, cfg.lr, cfg.routing_replay) == (4, 2e-5, True)


@pytest.mark.parametrize(
    "text, msg",
    [
        ("group_sise: 4\n", "unknown config key 'group_sise'"),
        ("group_size: four\n", "config key 'group_size' expects int, got 'four'"),
        ("algo: ppo\n", "config field 'algo': must be one of gspo, gspo_token, grpo"),
        ("group_size: 0\n", "config field 'group_size': must be >= 1"),
        ("a: [1\n", ":2: invalid YAML"),
        ("zzz: 1\nsteps: x\n", "unknown config key 'zzz'"),  # the first bad key of the file
        ("steps: x\nzzz: 1\n", "config key 'steps' expects int, got 'x'"),
        ("steps: true\n", "config key 'steps' expects int, got True"),
        ("resume: t\n", "config key 'resume' expects bool, got 't'"),
        ("device:\n", "config key 'device' must not be empty"),
        ("seed: 1.0e+50\n", "config field 'seed': must be <= 4,294,967,295"),  # an int, out of range
    ],
)
def test_bad_yaml_names_the_key(tmp_path, text, msg):
    """Bad YAML input raises a one-line GspoError naming the file/line or key."""
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(GspoError) as e:
        make_config(str(p), {})
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_coerce_types():
    """CLI strings convert to the field's type; None-able fields accept 'none'."""
    assert coerce("lr", "1e-3", "cli") == 1e-3
    assert coerce("routing_replay", "yes", "cli") is True
    assert coerce("eps_low", "none", "cli") is None
    with pytest.raises(GspoError, match="expects bool"):
        coerce("routing_replay", "maybe", "cli")
    with pytest.raises(GspoError, match="expects int"):
        coerce("steps", 1.5, "cli")
    with pytest.raises(GspoError, match="expects int"):
        coerce("steps", "2.0", "cli")  # Python's int syntax, not pydantic's looser one
    assert coerce("steps", 2.0, "yaml") == 2 and coerce("steps", " 1_000 ", "cli") == 1000
    assert coerce("name", 2024, "yaml") == "2024" and coerce("device", "none", "cli") == "none"
    assert coerce("mismatch_high", "NULL", "cli") is None and coerce("progress", "Off", "cli") is False
    with pytest.raises(GspoError, match=r"^cli: unknown config key 'stepz' \(did you mean steps\?\)$"):
        coerce("stepz", 1, "cli")


def test_minibatch_divisibility_is_checked():
    """A rollout batch that cannot split into equal minibatches is rejected, naming the field."""
    with pytest.raises(GspoError, match="num_minibatches"):
        Config(prompts_per_step=3, group_size=3, num_minibatches=4).validate()


def test_cli_prints_one_line_error(capsys):
    """`gspo train --algo nope` exits 2 with one line on stderr and no traceback."""
    assert main(["train", "--algo", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gspo: error: config field 'algo'") and "\n" not in err and "Traceback" not in err


def test_cli_missing_config_file(capsys):
    """A missing YAML file is named in a one-line error."""
    assert main(["train", "--config", "/nonexistent/x.yaml"]) == 2
    assert "config file not found: /nonexistent/x.yaml" in capsys.readouterr().err


def test_mixed_precision_needs_fsdp2_and_float32_master_weights():
    """bf16 mixed precision is FSDP2's (float32 master weights): anything else is refused by name."""
    assert Config(nproc=2, mixed_precision="bf16").validate().mixed_precision == "bf16"
    for kw in (dict(), dict(nproc=2, parallel="ddp"), dict(nproc=2, dtype="bfloat16")):
        with pytest.raises(GspoError, match="config field 'mixed_precision'"):
            Config(mixed_precision="bf16", **kw).validate()
