"""Issue 49 item 6's last sub-case: "an extra ``SystemError`` line from export". CPython raises
``SystemError`` when a C call returns while an exception is pending (a Ctrl-C landing inside
safetensors' writer or a torch op during ``gspo export``), chained to that exception: the CLI says the
chained interrupt (or gspo error) in its one line, and re-raises any other ``SystemError``."""

import pytest

import gspo.cli as cli
from gspo.errors import GspoError


def _system_error_from(inner: BaseException):
    def export(*_a, **_k):
        try:
            raise inner
        except BaseException as e:  # noqa: BLE001  (what CPython's C-call check does with a pending error)
            raise SystemError(
                "<built-in function serialize_file> returned a result with an exception set"
            ) from e

    return export


@pytest.mark.parametrize(
    ("inner", "rc", "says"),
    [
        (KeyboardInterrupt(), 130, "gspo: interrupted; the last checkpoint is kept"),
        (GspoError("--out o: no space left on device"), 2, "gspo: error: --out o: no space left on device"),
    ],
)
def test_a_system_error_chained_to_an_interrupt_or_gspo_error_is_its_one_line(
    tmp_path, monkeypatch, capsys, inner, rc, says
):
    monkeypatch.setattr(cli, "_export", _system_error_from(inner))
    assert cli.main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == rc
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line]
    assert out == "" and len(lines) == 1 and lines[0].startswith(says), err
    assert "SystemError" not in err and "Traceback" not in err


def test_any_other_system_error_is_raised_as_the_bug_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_export", _system_error_from(ValueError("a real bug")))
    with pytest.raises(SystemError) as e:
        cli.main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")])
    assert isinstance(e.value.__cause__, ValueError)
