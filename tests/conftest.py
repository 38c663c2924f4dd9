import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _own_working_folder(tmp_path_factory, monkeypatch):
    """Every test runs in a fresh folder of its own: code that defaults to paths relative to the
    current directory (``runs/``, a compare's ``--out``) can never reach the checkout or a user's
    run folders in the directory pytest was started from."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="session")
def tiny_moe():
    """The embedded tiny Qwen3-MoE and its tokenizer (fresh random init, seed 0)."""
    from gspo.model.load import load_model_and_tokenizer

    return load_model_and_tokenizer("embedded:tiny-moe", seed=0)
