"""Config: defaults, YAML + CLI overrides, validation messages, --help documentation."""

import dataclasses

import pytest

from gspo.cli import build_parser, main
from gspo.config import Config, coerce, field_docs, make_config
from gspo.errors import GspoError


def test_every_field_has_a_docstring():
    """Each config field carries documentation that --help shows."""
    docs = field_docs()
    missing = [f.name for f in dataclasses.fields(Config) if not docs.get(f.name)]
    assert missing == []
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "--group-size" in help_text and "Responses sampled per prompt" in help_text


def test_paper_defaults():
    """Defaults follow the paper: GSPO, clip 3e-4/4e-4, 4 minibatches; GRPO baseline 0.2/0.27."""
    cfg = Config().validate()
    assert cfg.algo == "gspo" and cfg.clip_range() == (3e-4, 4e-4) and cfg.num_minibatches == 4
    assert Config(algo="grpo").clip_range() == (0.2, 0.27)
    assert Config(algo="grpo", eps_low=0.1).clip_range() == (0.1, 0.27)


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
