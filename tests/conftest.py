import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_moe():
    """The embedded tiny Qwen3-MoE and its tokenizer (fresh random init, seed 0)."""
    from gspo.model.load import load_model_and_tokenizer

    return load_model_and_tokenizer("embedded:tiny-moe", seed=0)
