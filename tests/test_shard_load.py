"""Each rank of a sharded start reads its own shards from the HF folder's safetensors (no full copy
anywhere): the weights equal ``from_pretrained``'s, MoE experts fused in memory and stored one by one
included; a folder the files cannot feed falls back to rank 0 reading for all, said in one line.
Through ``gspo train --nproc 2``: tests/test_hub_shards.py (a hub snapshot, MoE and dense) and
tests/test_distributed.py's sharded start (a local folder)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from gspo.compat import transformers_model
from gspo.model.load import build_char_tokenizer, build_tiny_dense, build_tiny_moe, save_pretrained
from gspo.model.shard_load import load_own_shards, readable

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["moe", "dense"])
def folder(request, tmp_path_factory) -> Path:
    """A tiny model stored in bfloat16 (the MoE's experts one tensor each on disk, fused in memory)."""
    path = tmp_path_factory.mktemp(request.param)
    tok = build_char_tokenizer()
    build = build_tiny_moe if request.param == "moe" else build_tiny_dense
    save_pretrained(build(len(tok), seed=1).to(torch.bfloat16), tok, path)
    return path


def _meta_model(folder: Path) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)


def test_one_process_reads_the_weights_from_pretrained_reads(folder):
    model = _meta_model(folder)
    assert readable(model, folder) == ""
    model.to_empty(device="cpu")
    model.tie_weights()  # FSDP2 keeps ties through to_empty; a plain module needs them re-made
    transformers_model.init_buffers(model)
    load_own_shards(model, folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    buffers = dict(ref.named_buffers())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())


def test_a_folder_the_files_cannot_feed_says_why(folder, tmp_path):
    model = _meta_model(folder)
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    assert "no safetensors files" in readable(model, tmp_path)
    weights = load_file(folder / "model.safetensors")
    name = next(k for k in weights if "layers.1." in k)
    save_file({k: v for k, v in weights.items() if k != name}, tmp_path / "model.safetensors")
    assert f"has no tensor {name!r}" in readable(model, tmp_path)
    save_file({**weights, name: weights[name][:1].contiguous()}, tmp_path / "model.safetensors")
    assert f"{name!r} is [1" in readable(model, tmp_path)


def _gspo(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-m", "gspo", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, (args, p.stdout[-3000:], p.stderr[-6000:])
    return p


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")
def test_without_safetensors_rank_0_reads_for_all_and_says_so(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny_dense(len(tok), seed=1)
    save_pretrained(model, tok, tmp_path / "bin")  # then as an older checkpoint: pytorch_model.bin only
    (tmp_path / "bin" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    args = ["train", "--model", str(tmp_path / "bin"), "--nproc", "2", "--sft-steps", "0", "--steps", "1"]
    args += ["--eval-size", "4", "--eval-every", "0", "--prompts-per-step", "4", "--group-size", "2"]
    args += ["--max-new-tokens", "4", "--threads", "1", "--no-progress", "--output-dir", "out", "--name", "r"]
    p = _gspo(tmp_path, *args)
    assert "rank 0 reads the whole model for every rank" in p.stderr and "no safetensors files" in p.stderr


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs the gloo backend")
def test_each_rank_reads_only_its_own_experts(tmp_path):
    """Issue 47: experts stored one per tensor and fused in memory took the slow path, where every
    rank read every layer whole. Under FSDP2 over 2 ranks each holds 4 of a layer's 8 experts: it
    reads those experts' tensors only, and its shards equal its rows of ``from_pretrained``'s."""
    import socket

    tok = build_char_tokenizer()
    folder = tmp_path / "moe"
    save_pretrained(build_tiny_moe(len(tok), seed=2).to(torch.bfloat16), tok, folder)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    worker = ROOT / "tests" / "shard_read_worker.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), "2", port, str(folder), str(tmp_path)],
            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    want = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in got["opened"] if ".experts." in n}
        assert experts == set(range(4 * r, 4 * r + 4)), (r, sorted(experts))
        for k, v in got["local"].items():
            rows = -(-want[k].shape[0] // 2) if want[k].dim() else 0
            assert torch.equal(v, want[k][r * rows : r * rows + v.shape[0]] if want[k].dim() else want[k]), k


def test_the_layout_index_is_exact_past_2_to_the_24():
    """The flat index that finds where each stored value goes is an integer tensor, exact past 2^24
    elements (float32 holds integers exactly only below 2^24: a real layer's tensors pass it). One
    MoE layer whose first tensor is made 2^24 + 64 elements long (on the meta device; the index
    itself is 64 MiB of int32): the stored tensors the conversion makes of the fused experts hold
    every index after it exactly once."""
    from gspo.model.export import layer_groups
    from gspo.model.shard_load import layout_of

    with torch.device("meta"):
        model = build_tiny_moe(len(build_char_tokenizer()))
    sd = dict(transformers_model.save_state_dict(model))
    group = next(g for g in layer_groups(sd) if any(".experts." in k for k in g))
    first = group[0]
    assert ".experts." not in first
    sd[first] = torch.empty(2**18 + 1, 64, device="meta")  # 2^24 + 64 elements
    total = sum(sd[k].numel() for k in group)
    index = layout_of(model, sd, group)
    assert all(not t.is_floating_point() for t in index.values()), {k: t.dtype for k, t in index.items()}
    assert set(group) - set(index), "the experts were not converted (nothing to check)"
    head = index.pop(first).flatten()
    assert torch.equal(head, torch.arange(sd[first].numel(), dtype=head.dtype))
    rest = torch.cat([t.flatten().long() for t in index.values()]).sort().values
    assert torch.equal(rest, torch.arange(sd[first].numel(), total))


def test_stored_tensors_that_leave_a_hole_are_refused(tmp_path, monkeypatch):
    """A layer whose stored tensors do not cover every in-memory element (here one expert's tensor
    missing from the conversion's layout) stops the load in one line naming the layer, rather than
    leaving that expert's weights as the uninitialized memory ``to_empty`` gave them."""
    from gspo.errors import GspoError
    from gspo.model import shard_load

    tok = build_char_tokenizer()
    save_pretrained(build_tiny_moe(len(tok), seed=1), tok, tmp_path / "m")
    model = _meta_model(tmp_path / "m")
    model.to_empty(device="cpu")
    model.tie_weights()
    layout = shard_load.layout_of

    def with_a_hole(model, sd, names):
        out = layout(model, sd, names)
        return {k: v for k, v in out.items() if ".experts.1." not in k}

    monkeypatch.setattr(shard_load, "layout_of", with_a_hole)
    with pytest.raises(GspoError, match=r"the stored tensors do not cover 'model\.layers\.0\.") as e:
        load_own_shards(model, tmp_path / "m")
    assert "\n" not in str(e.value)
