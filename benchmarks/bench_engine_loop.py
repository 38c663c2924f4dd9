"""The HF engine's decode loop against an older commit's, on the default run's sampling (32 prompts x 8
samples, 12 tokens, the embedded tiny MoE, one thread): paired repeats, alternating which goes first,
the ratio new / old of ``generate``'s wall time (median [min, max]). Both must sample the same tokens.

    python benchmarks/bench_engine_loop.py --baseline 86d3661     # the loop before play (issue 45)
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gspo.model.load import load_model_and_tokenizer  # noqa: E402
from gspo.rollout.hf import HFRolloutEngine  # noqa: E402


def old_engine(commit: str) -> type:
    """``HFRolloutEngine`` as ``commit`` wrote it (its other imports from this checkout)."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:src/gspo/rollout/hf.py"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "old_hf.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("old_hf", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.HFRolloutEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="86d3661")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model_and_tokenizer("embedded:tiny-moe", seed=0)
    prompts = [tok(f"rev:{n}=").input_ids for n in range(1000, 1032) for _ in range(8)]
    make = lambda cls: cls(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(0))  # noqa: E731
    engines = {"old": make(old_engine(args.baseline)), "new": make(HFRolloutEngine)}
    a, b = (engines[k].generate(prompts, 12) for k in ("old", "new"))
    assert torch.equal(a.response_ids_BT, b.response_ids_BT) and torch.equal(
        a.sampler_logp_BT, b.sampler_logp_BT
    )
    ratios = []
    for r in range(args.repeats):
        t = {}
        for name in ("old", "new")[:: 1 if r % 2 == 0 else -1]:
            engines[name].reseed(r)
            t0 = time.perf_counter()
            engines[name].generate(prompts, 12)
            t[name] = time.perf_counter() - t0
        ratios.append(t["new"] / t["old"])
    print(f"generate, new / {args.baseline}: median {statistics.median(ratios):.3f} "
          f"[{min(ratios):.3f}, {max(ratios):.3f}] over {len(ratios)} paired repeats (same tokens)")  # fmt: skip


if __name__ == "__main__":
    main()
