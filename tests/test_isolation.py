"""The suite never works in the checkout or in the folder pytest was started from: a user who runs the
README's first command (``gspo train``: ``runs/`` in the current folder) and then the tests keeps that
run folder as it was (``.ci/run`` checks it byte for byte, and that the checkout gained no file)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_each_test_runs_in_a_fresh_folder_outside_the_checkout(request):
    cwd = Path.cwd().resolve()
    assert not cwd.is_relative_to(ROOT), cwd
    assert cwd != Path(request.config.invocation_params.dir).resolve()
    assert list(cwd.iterdir()) == []  # fresh: nothing left by another test


def test_the_default_output_folder_is_the_tests_own(request):
    """``Config()``'s relative ``output_dir`` resolves inside the test's folder, never the user's."""
    from gspo.config import Config

    out = Path(Config().output_dir).resolve()
    assert out.is_relative_to(Path.cwd().resolve())
    assert out != (Path(request.config.invocation_params.dir) / Config().output_dir).resolve()
