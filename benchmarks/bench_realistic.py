"""gspo vs TRL 1.16 GRPOTrainer (GSPO mode) at a realistic shape: Qwen3's vocabulary, long responses.

``bench_vs_trl.py`` measures tiny models (vocabulary 43, <= 8 new tokens), where per-op overhead
dominates. Here the vocabulary is Qwen3's (151,936), prompts are 64-96 tokens, responses a fixed
128 tokens (EOS banned in every contender, so lengths are equal), G = 8, 4 minibatches, float32,
randomly initialised Qwen3 / Qwen3-MoE (hidden 256, 4 layers, tied embeddings like Qwen3-0.6B..4B;
no download: a local word-level tokenizer with 151,936 ids, prompts of random token ids, and a
trivial reward, the fraction of even token ids in the completion, so advantages are not zero).

Contenders (each in its own process, so that each one's peak RSS is its own):

- ``trl``: ``GRPOTrainer`` with ``importance_sampling_level="sequence"``, ``loss_type="grpo"``,
  ``epsilon=3e-4``, ``epsilon_high=4e-4``, ``beta=0``, ``steps_per_generation=4`` (one generation
  per 4 optimizer steps), EOS banned with ``generation_kwargs={"min_new_tokens": T}``; time per
  rollout = ``trainer.train()`` time between every 4th optimizer step.
- ``gspo``: ``sample`` + ``score_rollout`` + ``policy_update`` + ``engine.sync_weights`` with the default config
  (``old_logp=auto``, ``prefix_sharing=auto``; ``log_volatility`` off to match TRL's work); the HF
  engine gets ``eos_token_id=-1`` (never sampled).
- ``gspo-recompute``: the same with ``old_logp=recompute`` (pi_old recomputed, as TRL does).
- ``floor``: the same ``engine.generate`` call + 4 x (``response_logprobs`` in gspo's layout, trivial
  loss, backward, AdamW step), the bare compute of a rollout.
- ``gspo-vllm`` (run in ``.venv-vllm``, where TRL is not installed): gspo with the vLLM engine as the
  sampler (``ignore_eos``), against ``gspo`` with the HF engine in the same run.

A coordinator starts the workers, lets each build its model, then asks them for rollouts in turn:
rollout k of every contender runs right after rollout k of the previous one (TRL waits inside its own
training loop, in a callback, not counted), so the k-th rollouts of all contenders are neighbours in
time and a shared machine's drifting load hits them alike. Ratios are medians of the paired per-
rollout ratios; the first rollout of each contender is a warm-up and dropped. One torch thread per
worker; process CPU time (the work done, robust when other jobs share the cores) is the headline,
wall time beside it. Peak RSS is the worker's VmHWM over its rollouts (reset after setup through
``/proc/self/clear_refs``), so it holds the model, optimizer state and everything the rollouts
allocate; ``RSS after setup`` is what the process held before its first rollout.

Commands (the defaults are the runs in RESULTS.md; CPU time on this 2-core machine: table ~11 min,
scaling ~8 min, vllm ~2 min; wall time up to 2x that on a busy machine):

    . .venv/bin/activate && pip install "trl==1.16.0"     # keep torch 2.13.0+cpu (pip -c constraint)
    python benchmarks/bench_realistic.py table --profile  # dense + MoE: trl, gspo, floor, variants
    python benchmarks/bench_realistic.py scaling          # bench_realistic_scaling.png: vs G, vs length
    python benchmarks/bench_realistic.py scaling --replot # redraw the PNG from its JSON
    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        .venv-vllm/bin/python benchmarks/bench_realistic.py vllm   # gspo+vLLM vs gspo+HF (dense)
    python benchmarks/bench_realistic.py table --quick    # plumbing check, tiny shapes, seconds

Outputs (next to this file): ``bench_realistic_<mode>_output.txt`` (the log, appended),
``bench_realistic_<mode>.json`` (every rollout's times, RSS, the profile), the scaling PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import multiprocessing as mp
import os
import random
import re
import resource
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gspo.memory import proc_status_mib, reset_peak_rss

HERE = Path(__file__).resolve().parent
QWEN3_VOCAB = 151_936
PAD_ID, EOS_ID = 151_643, 151_645  # Qwen3's <|endoftext|> and <|im_end|>
LR, BETAS = 3e-4, (0.9, 0.99)


@dataclass(frozen=True)
class Shape:
    kind: str = "dense"  # dense | moe
    hidden: int = 256
    layers: int = 4
    vocab: int = QWEN3_VOCAB
    experts: int = 8  # moe: experts of intermediate size ``hidden``, top-2
    prompts: int = 2  # distinct prompts per rollout
    group: int = 8  # G
    prompt_min: int = 64  # prompt lengths uniform in [prompt_min, prompt_max]
    prompt_max: int = 96
    new_tokens: int = 128  # every response has exactly this many tokens (EOS banned)
    minibatches: int = 4
    rollouts: int = 3  # timed, after one warm-up
    threads: int = 1
    seed: int = 0

    @property
    def rows(self) -> int:
        return self.prompts * self.group


QUICK = dict(hidden=64, layers=2, vocab=4096, prompt_min=8, prompt_max=12, new_tokens=8, rollouts=2)


# ------------------------------------------------------------------------------------------------
# shared inputs (built identically in every worker)


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(t0: tuple[float, float]) -> tuple[float, float]:
    t1 = _now()
    return t1[0] - t0[0], t1[1] - t0[1]


def make_tokenizer(vocab: int) -> Any:
    """A word-level fast tokenizer with ``vocab`` ids: token ``t{i}`` is id i, Qwen3's specials at
    their ids (pad <|endoftext|>, eos <|im_end|>); text is space-separated tokens, so TRL's
    tokenization of a prompt gives exactly the ids gspo is handed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pad, eos = (PAD_ID, EOS_ID) if vocab > EOS_ID else (vocab - 2, vocab - 1)
    words = {f"t{i}": i for i in range(vocab) if i not in (pad, eos)}
    words |= {"<|endoftext|>": pad, "<|im_end|>": eos}
    tk = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


def make_prompts(sh: Shape) -> list[list[int]]:
    """Prompts of random token ids (below the specials), one list per prompt, for every rollout."""
    rng = random.Random(sh.seed)
    hi = min(PAD_ID, sh.vocab - 2)
    n = sh.prompts * (sh.rollouts + 1)
    return [[rng.randrange(hi) for _ in range(rng.randint(sh.prompt_min, sh.prompt_max))] for _ in range(n)]


def parity_reward(completions: list[str]) -> list[float]:
    """Fraction of even token ids in each completion: varies between samples, so advantages are not 0."""
    out = []
    for c in completions:
        w = c.split()
        out.append(sum(int(x[1:]) % 2 == 0 for x in w if x[1:].isdigit()) / max(len(w), 1))
    return out


def build_model(sh: Shape) -> Any:
    """Randomly initialised Qwen3 / Qwen3-MoE (seed 0), head_dim 64 (vLLM's CPU backend needs >= 32)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    heads = max(sh.hidden // 64, 1)
    common = dict(
        vocab_size=sh.vocab,
        hidden_size=sh.hidden,
        num_hidden_layers=sh.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1),
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=PAD_ID if sh.vocab > EOS_ID else sh.vocab - 2,
        eos_token_id=EOS_ID if sh.vocab > EOS_ID else sh.vocab - 1,
        bos_token_id=None,
    )
    torch.manual_seed(sh.seed)
    if sh.kind == "moe":
        cfg = Qwen3MoeConfig(
            moe_intermediate_size=sh.hidden,
            intermediate_size=3 * sh.hidden,
            num_experts=sh.experts,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            output_router_logits=False,
            **common,
        )
        return Qwen3MoeForCausalLM(cfg)
    return Qwen3ForCausalLM(Qwen3Config(intermediate_size=3 * sh.hidden, **common))


class Inputs:
    def __init__(self, sh: Shape) -> None:
        from gspo.tasks.datasets import Example

        self.tok = make_tokenizer(sh.vocab)
        self.prompt_ids = make_prompts(sh)
        self.examples = [Example(" ".join(f"t{i}" for i in p), "") for p in self.prompt_ids]
        self.task = SimpleNamespace(reward=lambda p, c, a: parity_reward(c), reward_name="parity")
        self.sh = sh

    def batch(self, r: int) -> tuple[list[Any], list[list[int]]]:
        s = slice(r * self.sh.prompts, (r + 1) * self.sh.prompts)
        return self.examples[s], self.prompt_ids[s]


# ------------------------------------------------------------------------------------------------
# contenders (inside a worker process)


def _cfg(sh: Shape, **kw: Any) -> Any:
    from gspo.config import Config

    return Config(
        prompts_per_step=sh.prompts,
        group_size=sh.group,
        max_new_tokens=sh.new_tokens,
        max_prompt_tokens=sh.prompt_max,
        num_minibatches=sh.minibatches,
        log_volatility=False,
        sft_steps=0,
        lr=LR,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        **kw,
    ).validate()


class _TimedGenerate:
    """Wraps an engine's (or model's) ``generate`` and keeps the (wall, cpu) of its last call."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.last = fn, (0.0, 0.0)

    def __call__(self, *a: Any, **k: Any) -> Any:
        t0 = _now()
        try:
            return self.fn(*a, **k)
        finally:
            self.last = _since(t0)


@contextlib.contextmanager
def _vllm_ignore_eos():
    """Inside: every ``vllm.SamplingParams`` the engine makes ignores EOS and has no stop ids, so
    responses have exactly ``max_tokens`` tokens like the other contenders'."""
    import vllm

    orig = vllm.SamplingParams

    def params(*a: Any, **k: Any) -> Any:
        k.pop("stop_token_ids", None)
        return orig(*a, **{**k, "ignore_eos": True})

    vllm.SamplingParams = params
    try:
        yield
    finally:
        vllm.SamplingParams = orig


class GspoContender:
    """gspo's RL step: sample + score_rollout + policy_update + engine.sync_weights."""

    def __init__(self, inp: Inputs, engine: str = "hf", **cfg_kw: Any) -> None:
        import torch

        from gspo.resolve import (
            engine_plan,
            for_model,
            layout_plan,
            optim_plan,
            sample_plan,
            score_plan,
            update_plan,
        )
        from gspo.rollout.hf import HFRolloutEngine
        from gspo.rollout.sampler import SyncSampler
        from gspo.training import run as RN

        sh = inp.sh
        self.inp, self.sh = inp, sh
        self.cfg = _cfg(sh, rollout_engine=engine, **cfg_kw)
        self.model = build_model(sh)
        self.opt, self.sched = RN.make_optimizer(self.model, optim_plan(self.cfg))
        if engine == "vllm":
            from gspo.rollout.vllm import VLLMRolloutEngine

            self.engine = VLLMRolloutEngine.from_trainer(engine_plan(self.cfg), self.model, inp.tok)
            self.vllm = True
        else:  # eos -1: never sampled, every response has new_tokens tokens
            self.engine = HFRolloutEngine(
                self.model, -1, inp.tok.pad_token_id, torch.Generator().manual_seed(0)
            )
            self.vllm = False
        self.gen = _TimedGenerate(self.engine.generate)
        self.engine.generate = self.gen
        self.sampler = SyncSampler(self.engine, inp.tok, inp.task, sample_plan(self.cfg))
        self.plan = for_model(update_plan(self.cfg), layout_plan(self.cfg), self.model, sh.kind == "moe")
        self.score = score_plan(self.cfg)

    def step(self, r: int) -> dict[str, Any]:
        from gspo.training import scoring as RO
        from gspo.training import update as U

        ex, ids = self.inp.batch(r)
        t0 = _now()
        with _vllm_ignore_eos() if self.vllm else contextlib.nullcontext():
            s = self.sampler.sample(1, ex, ids)
            data, _ = RO.score_rollout(s.batch, self.inp.tok, self.inp.task, ex, self.score, s.gen_s)
        self.engine.sleep()
        U.policy_update(self.model, self.opt, self.sched, data, self.plan, 1)
        self.engine.sync_weights()
        tot = _since(t0)
        n = int(data.response_mask_BT.sum())
        out = {"total": tot, "generate": self.gen.last, "tokens": n}
        if self.vllm:
            out["sync_wall"] = self.engine.last_sync_s
        return out


class FloorContender:
    """The bare compute of a rollout: gspo's ``engine.generate``, then 4 x (``response_logprobs`` in
    gspo's layout, trivial loss, backward, AdamW step)."""

    def __init__(self, inp: Inputs) -> None:
        self.g = GspoContender(inp)
        from gspo.resolve import choose_layout, layout_plan

        self.layout = choose_layout(self.g.model, layout_plan(self.g.cfg))

    def step(self, r: int) -> dict[str, Any]:
        from gspo import data as BA
        from gspo.data import left_pad
        from gspo.model.logprobs import response_logprobs

        g, sh = self.g, self.g.sh
        _, ids = g.inp.batch(r)
        rep = [p for p in ids for _ in range(sh.group)]
        t0 = _now()
        rb = g.engine.generate(rep, sh.new_tokens, 1.0)
        t_gen = _since(t0)
        p_ids, p_mask = left_pad(rep, g.inp.tok.pad_token_id)
        import torch

        data = BA.TrainBatch(
            p_ids, p_mask, rb.response_ids_BT, rb.response_mask_BT, rb.sampler_logp_BT, torch.zeros(len(rep))
        )
        mb = len(rep) // sh.minibatches
        mbs = [data.rows(slice(i * mb, (i + 1) * mb)) for i in range(sh.minibatches)]
        g.model.train()
        t1 = _now()
        for m in mbs:
            g.opt.zero_grad(set_to_none=True)
            logp = response_logprobs(
                g.model,
                m.prompt_ids_BP,
                m.prompt_mask_BP,
                m.response_ids_BT,
                m.response_mask_BT,
                1.0,
                g.cfg.logp_chunk_size,
                layout=self.layout,
            )
            (logp * m.response_mask_BT).sum().div(mb).backward()
            g.opt.step()
        t_upd = _since(t1)
        tot = (t_gen[0] + t_upd[0], t_gen[1] + t_upd[1])
        return {"total": tot, "generate": t_gen, "tokens": int(rb.response_mask_BT.sum())}


class TrlContender:
    """TRL's GRPOTrainer in GSPO mode; ``run(conn)`` answers the coordinator from inside its training
    loop (a callback at every 4th optimizer step sends the rollout's time and waits for the next go)."""

    def __init__(self, inp: Inputs) -> None:
        import datasets
        from trl import GRPOConfig, GRPOTrainer

        sh = inp.sh
        self.inp, self.sh = inp, sh
        ds = datasets.Dataset.from_list([{"prompt": e.prompt} for e in inp.examples])
        self.out = tempfile.TemporaryDirectory()
        args = GRPOConfig(
            output_dir=self.out.name,
            importance_sampling_level="sequence",
            loss_type="grpo",
            epsilon=3e-4,
            epsilon_high=4e-4,
            beta=0.0,
            num_generations=sh.group,
            per_device_train_batch_size=sh.rows // sh.minibatches,
            steps_per_generation=sh.minibatches,
            gradient_accumulation_steps=1,
            num_iterations=1,
            max_completion_length=sh.new_tokens,
            generation_kwargs={"min_new_tokens": sh.new_tokens},  # EOS banned: fixed lengths
            temperature=1.0,
            gradient_checkpointing=False,
            bf16=False,
            fp16=False,
            use_cpu=True,
            learning_rate=LR,
            adam_beta1=BETAS[0],
            adam_beta2=BETAS[1],
            weight_decay=0.0,
            max_grad_norm=1.0,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_steps=(sh.rollouts + 1) * sh.minibatches,
            shuffle_dataset=False,
            logging_strategy="no",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            log_completions=False,
            dataloader_num_workers=0,
            seed=sh.seed,
        )

        def parity(prompts, completions, **kwargs):  # noqa: ANN001, ANN202
            return parity_reward(completions)

        model = build_model(sh)
        self.gen = _TimedGenerate(model.generate)
        model.generate = self.gen  # TRL calls the unwrapped model's generate (one CPU process)
        self.trainer = GRPOTrainer(
            model=model, reward_funcs=[parity], args=args, train_dataset=ds, processing_class=inp.tok
        )

    def run(self, conn: Any) -> None:
        from transformers import TrainerCallback

        sh, gen = self.sh, self.gen
        n = sh.rollouts + 1

        class Marks(TrainerCallback):
            def __init__(self) -> None:
                self.k, self.resume = 0, _now()

            def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
                if state.global_step % sh.minibatches:
                    return
                tot = _since(self.resume)
                conn.send({"total": tot, "generate": gen.last, "tokens": sh.rows * sh.new_tokens})
                self.k += 1
                if self.k < n:
                    msg = conn.recv()
                    assert msg == ("go",), msg
                self.resume = _now()

        marks = Marks()
        self.trainer.add_callback(marks)
        marks.resume = _now()
        with contextlib.redirect_stdout(io.StringIO()):  # Trainer prints its final metrics dict
            self.trainer.train()


def _overrides(name: str) -> dict[str, Any]:
    """``gspo[logp_chunk_size=128,old_logp=recompute]`` -> its Config overrides."""
    m = re.fullmatch(r"gspo(?:\[(.*)\])?", name)
    if m is None:
        raise ValueError(f"contender {name!r}: expected gspo[key=value,...]")
    out: dict[str, Any] = {}
    for kv in filter(None, (m.group(1) or "").split(",")):
        k, v = kv.split("=")
        out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


def _final_mem() -> dict[str, float]:
    st = proc_status_mib()
    life = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak": st["VmHWM"], "rss_end": st["VmRSS"], "maxrss_lifetime": life}


def _worker(conn: Any, name: str, sh_dict: dict[str, Any], profile: bool) -> None:
    """One contender in its own process: build, report RSS, then rollouts on request."""
    try:
        import torch
        import transformers

        torch.set_num_threads(Shape(**sh_dict).threads)
        transformers.utils.logging.set_verbosity_error()
        warnings.filterwarnings("ignore")
        sh = Shape(**sh_dict)
        inp = Inputs(sh)
        if name == "trl":
            c: Any = TrlContender(inp)
            ids = inp.tok(inp.examples[0].prompt).input_ids
            assert ids == inp.prompt_ids[0], "TRL's tokenization differs from the prompt ids"
        elif name == "floor":
            c = FloorContender(inp)
        elif name == "gspo-recompute":
            c = GspoContender(inp, old_logp="recompute")
        elif name == "gspo-vllm":
            c = GspoContender(inp, engine="vllm")
        elif name == "gspo" or name.startswith("gspo["):  # gspo[key=value,...]: Config overrides
            c = GspoContender(inp, **_overrides(name))
        else:
            raise ValueError(name)
        model = c.trainer.model if name == "trl" else (c.g if name == "floor" else c).model
        n_params = sum(p.numel() for p in model.parameters())
        st = proc_status_mib()
        reset = reset_peak_rss()
        conn.send(
            {
                "ready": True,
                "rss_setup": st["VmRSS"],
                "hwm_setup": st["VmHWM"],
                "hwm_reset": reset,
                "params_M": n_params / 1e6,
            }
        )
        if name == "trl":
            msg = conn.recv()
            assert msg == ("go",), msg
            c.run(conn)
            mem = _final_mem()
            msg = conn.recv()
        else:
            r = 0
            while (msg := conn.recv()) == ("go",):
                conn.send(c.step(r))
                r += 1
            mem = _final_mem()  # before the profiler adds its own memory
            if msg == ("profile",):  # one more rollout (prompts of rollout 0), not timed
                conn.send(profile_step(c, 0))
                msg = conn.recv()
        assert msg == ("stop",), msg
        conn.send(mem)
    except BaseException as e:  # noqa: BLE001
        conn.send({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        raise


def profile_step(c: GspoContender, r: int) -> dict[str, Any]:
    """Where one more gspo rollout spends its CPU time: parts (record_function ranges around gspo's
    functions) and the top torch ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile, record_function

    import gspo.model.logprobs as F
    import gspo.rollout.hf as H
    from gspo.training import update as U

    def ranged(label: str, fn: Any) -> Any:
        def w(*a: Any, **k: Any) -> Any:
            with record_function(label):
                return fn(*a, **k)

        return w

    patches = [
        (H, "_sample", "generate: sampling (softmax, cdf, search)"),
        (H.HFRolloutEngine, "_last_logits", "generate: model step (decoder + LM head)"),
        (F, "logprobs_from_hidden", "train: LM head log-probs fwd (chunked)"),
        (F, "naive_logprobs_from_hidden", "train: LM head log-probs fwd (plain)"),
        (U, "forward", "train: fwd (decoder + LM head)"),
        (U, "_optimizer_step", "train: grad clip + AdamW step"),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, label in patches:
        setattr(obj, name, ranged(label, getattr(obj, name)))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            c.step(r)
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    ka = prof.key_averages()
    parts = {
        e.key: e.cpu_time_total / 1e6
        for e in ka
        if ":" in e.key and e.key.split(":")[0] in ("generate", "train")
    }
    total = sum(e.self_cpu_time_total for e in ka) / 1e6
    for e in ka:
        if "Backward" in e.key and "evaluate_function" in e.key and e.cpu_time_total / 1e6 > 0.01 * total:
            parts[e.key.replace("autograd::engine::evaluate_function: ", "bwd node: ")] = (
                e.cpu_time_total / 1e6
            )
    top = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:18]
    ops = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in top]
    return {"parts": parts, "ops": ops, "self_total": total}


# ------------------------------------------------------------------------------------------------
# coordinator


def run_contenders(names: list[str], sh: Shape, profile: bool = False, log: Any = print) -> dict[str, Any]:
    """Start one worker per contender, wait until all are built, then ``rollouts + 1`` rounds in which
    every contender takes one rollout in turn. -> {name: {"rollouts": [...], "mem": {...}}}."""
    ctx = mp.get_context("spawn")
    workers = {}
    for name in names:
        a, b = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(b, name, asdict(sh), profile), daemon=True)
        p.start()
        workers[name] = (p, a)
    out: dict[str, Any] = {n: {"rollouts": [], "mem": {}} for n in names}

    def recv(name: str) -> dict[str, Any]:
        p, conn = workers[name]
        while not conn.poll(5):
            if not p.is_alive():
                raise RuntimeError(f"worker {name} died (exit code {p.exitcode})")
        msg = conn.recv()
        if "error" in msg:
            raise RuntimeError(f"worker {name}: {msg['error']}\n{msg['traceback']}")
        return msg

    try:
        for name in names:  # setups run in parallel; a worker's first message says it is built
            out[name]["mem"].update(recv(name))
        for r in range(sh.rollouts + 1):
            for name in names:
                workers[name][1].send(("go",))
                res = recv(name)
                out[name]["rollouts"].append(res)
                log(
                    f"    rollout {r}{' (warm-up)' if r == 0 else ''} {name:15s} cpu {res['total'][1]:7.2f} s"
                    f"  wall {res['total'][0]:7.2f} s  (generate cpu {res['generate'][1]:6.2f} s)"
                )
        for name in names:
            if profile and name == "gspo":
                workers[name][1].send(("profile",))
                out[name]["profile"] = recv(name)
        for name in names:
            workers[name][1].send(("stop",))
            out[name]["mem"].update(recv(name))
    finally:
        for p, _ in workers.values():
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(res: dict[str, Any], base: str = "gspo") -> dict[str, Any]:
    """Medians per contender (drop the warm-up) and paired per-rollout ratios against ``base``."""
    s: dict[str, Any] = {}
    timed = {n: v["rollouts"][1:] for n, v in res.items()}
    for n, rs in timed.items():
        s[n] = {
            "cpu": _med([x["total"][1] for x in rs]),
            "wall": _med([x["total"][0] for x in rs]),
            "gen_cpu": _med([x["generate"][1] for x in rs]),
            **({"sync_wall": _med([x["sync_wall"] for x in rs])} if "sync_wall" in rs[0] else {}),
            "cpu_all": [x["total"][1] for x in rs],
            "wall_all": [x["total"][0] for x in rs],
            **{k: v for k, v in res[n]["mem"].items() if k != "ready"},
        }
    b = timed[base]
    for n, rs in timed.items():
        for clock, i in (("cpu", 1), ("wall", 0)):
            s[n][f"{clock}_per_{base}"] = _med(
                [x["total"][i] / y["total"][i] for x, y in zip(rs, b, strict=True)]
            )
    return s


def _fmt_table(kind: str, s: dict[str, Any]) -> str:
    lines = [
        f"{kind}: contender | cpu s/rollout | wall s/rollout | generate cpu s | / gspo (paired, cpu) | "
        "/ gspo (paired, wall) | peak RSS MiB | RSS after setup MiB | peak - setup MiB"
    ]
    for n, v in s.items():
        lines.append(
            f"  {n:15s} | {v['cpu']:8.2f} | {v['wall']:8.2f} | {v['gen_cpu']:7.2f} | {v['cpu_per_gspo']:5.2f} | "
            f"{v['wall_per_gspo']:5.2f} | {v['peak']:7.0f} | {v['rss_setup']:7.0f} | {v['peak'] - v['rss_setup']:7.0f}"
        )
    if "trl" in s:
        g, t = s["gspo"], s["trl"]
        lines.append(
            f"  => TRL / gspo time (target >= 2): cpu {t['cpu_per_gspo']:.2f}, wall {t['wall_per_gspo']:.2f}; "
            f"gspo / TRL peak RSS (target <= 1/3): {g['peak'] / t['peak']:.3f} "
            f"(above setup: {(g['peak'] - g['rss_setup']) / (t['peak'] - t['rss_setup']):.3f})"
        )
    p = next(iter(s.values()))["params_M"]
    lines.append(
        f"  (model {p:.1f} M params: weights + grads + AdamW m, v in float32 = {p * 16 / 1.048576:.0f} MiB)"
    )
    if "gspo-vllm" in s:
        lines.append(f"  => vLLM weight sync per rollout: {s['gspo-vllm']['sync_wall']:.2f} s wall")
    if "floor" in s:
        f = s["floor"]
        lines.append(
            f"  => gspo / floor (target <= 1.15): cpu {1 / f['cpu_per_gspo']:.3f}, wall {1 / f['wall_per_gspo']:.3f}"
        )
    return "\n".join(lines)


def _print_profile(kind: str, prof: dict[str, Any], log: Any) -> None:
    log(
        f"  profile of one gspo rollout ({kind}), CPU s (inclusive ranges; self-time total {prof['self_total']:.2f}):"
    )
    for k, v in sorted(prof["parts"].items(), key=lambda kv: -kv[1]):
        log(f"    {k:60s} {v:7.2f}")
    log("  top torch ops by self CPU time: op | s | calls")
    for k, v, c in prof["ops"]:
        log(f"    {k[:60]:60s} {v:7.2f}  {c}")


class Log:
    def __init__(self, path: Path) -> None:
        self.f = path.open("a")

    def __call__(self, *a: Any) -> None:
        line = " ".join(str(x) for x in a)
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


def cmd_table(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    names = args.contenders
    results = {}
    for kind in args.models:
        sh = Shape(kind=kind, rollouts=args.rollouts, threads=args.threads)
        if args.quick:
            sh = replace(sh, **QUICK)
        sh = replace(sh, **{k: v for k, v in args.shape.items()})
        log(f"\n== {kind}: {sh}")
        t0 = time.time()
        res = run_contenders(names, sh, profile=args.profile, log=log)
        s = summarize(res)
        log(_fmt_table(kind, s))
        log(f"  ({time.time() - t0:.0f} s wall for this model)")
        prof = res["gspo"].get("profile")
        if prof:
            _print_profile(kind, prof, log)
        results[kind] = {"shape": asdict(sh), "summary": s, "profile": prof}
    return results


def cmd_scaling(args: argparse.Namespace, log: Log) -> dict[str, Any]:
    """Time per rollout against G (at a fixed response length) and against the response length (at a
    fixed G), gspo vs TRL, one prompt per rollout; fresh workers per point."""
    base = Shape(kind=args.models[0], prompts=1, rollouts=args.rollouts, threads=args.threads)
    if args.quick:
        base = replace(base, **QUICK)
    base = replace(base, **{k: v for k, v in args.shape.items()})
    points = [("G", g, replace(base, group=g, new_tokens=args.fixed_t)) for g in args.groups]
    points += [("T", t, replace(base, group=args.fixed_g, new_tokens=t)) for t in args.lengths]
    out: dict[str, Any] = {"base": asdict(base), "points": []}
    for axis, val, sh in points:
        log(
            f"\n== scaling {axis} = {val}: G {sh.group}, T {sh.new_tokens}, prompt {sh.prompt_min}-{sh.prompt_max}"
        )
        res = run_contenders(args.contenders, sh, log=log)
        s = summarize(res)
        log(_fmt_table(f"{axis}={val}", s))
        out["points"].append({"axis": axis, "value": val, "shape": asdict(sh), "summary": s})
        (HERE / f"bench_realistic_scaling{args.suffix}.json").write_text(json.dumps(out, indent=1))
    plot_scaling(out, HERE / f"bench_realistic_scaling{args.suffix}.png")
    return out


def plot_scaling(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 8), sharex="col")
    base = out["base"]
    for j, (axis, label) in enumerate((("G", "group size G"), ("T", "response length (tokens)"))):
        pts = [p for p in out["points"] if p["axis"] == axis]
        if not pts:
            continue
        x = [p["value"] for p in pts]
        names = list(pts[0]["summary"])
        for n in names:
            ax[0, j].plot(x, [p["summary"][n]["cpu"] for p in pts], "o-", label=n)
        for n in names:
            if n != "gspo":
                ax[1, j].plot(x, [p["summary"][n]["cpu_per_gspo"] for p in pts], "o-", label=f"{n} / gspo")
        fixed = f"T = {pts[0]['shape']['new_tokens']}" if axis == "G" else f"G = {pts[0]['shape']['group']}"
        ax[0, j].set_title(f"CPU s per rollout + 4 updates vs {axis} ({fixed})")
        if len(x) > 1:  # log-log slope over the whole range: 1 = linear in G (or T)
            for k, n in enumerate(names):
                y = [p["summary"][n]["cpu"] for p in pts]
                slope = math.log(y[-1] / y[0]) / math.log(x[-1] / x[0])
                ax[0, j].annotate(
                    f"{n}: log-log slope {slope:.2f}",
                    (0.98, 0.04 + 0.07 * k),
                    xycoords="axes fraction",
                    ha="right",
                )
        ax[0, j].set_xscale("log", base=2)
        ax[0, j].set_yscale("log")
        ax[0, j].set_xticks(x, [str(v) for v in x])
        ax[0, j].legend()
        ax[0, j].grid(True, which="both", alpha=0.3)
        ax[1, j].set_xlabel(label)
        ax[1, j].set_ylabel("paired ratio of CPU time")
        ax[1, j].axhline(1.0, color="gray", lw=0.8)
        ax[1, j].legend()
        ax[1, j].grid(True, alpha=0.3)
    fig.suptitle(
        f"{base['kind']} Qwen3, vocab {base['vocab']}, hidden {base['hidden']}, {base['layers']} layers, "
        f"1 prompt of {base['prompt_min']}-{base['prompt_max']} tokens, 4 minibatches, fp32, 1 thread"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["table", "scaling", "vllm"])
    ap.add_argument("--models", nargs="+", default=None, choices=["dense", "moe"])
    ap.add_argument(
        "--contenders",
        nargs="+",
        default=None,
        help="trl gspo floor gspo-recompute gspo-vllm gspo[key=value,...] (Config overrides)",
    )
    ap.add_argument("--rollouts", type=int, default=None, help="timed rollouts per contender (+1 warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="profile gspo's last rollout (torch profiler)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: checks the plumbing in seconds")
    ap.add_argument("--set", nargs="*", default=[], help="Shape overrides, e.g. hidden=512 new_tokens=256")
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    ap.add_argument("--fixed-t", type=int, default=64, help="response length of the G curve")
    ap.add_argument("--fixed-g", type=int, default=4, help="G of the length curve")
    ap.add_argument("--replot", action="store_true", help="scaling: redraw the PNG from its JSON")
    ap.add_argument(
        "--out", default=None, help="JSON results (default benchmarks/bench_realistic_<mode>.json)"
    )
    args = ap.parse_args()
    args.shape = {k: int(v) for k, v in (kv.split("=") for kv in args.set)}
    defaults = {  # mode: (contenders, models, timed rollouts)
        "table": (
            ["trl", "gspo", "floor", "gspo-recompute", "gspo[logp_chunk_size=128]"],
            ["dense", "moe"],
            2,
        ),
        "scaling": (["trl", "gspo"], ["dense"], 1),
        "vllm": (["gspo", "gspo-vllm"], ["dense"], 2),
    }[args.mode]
    args.contenders = args.contenders or defaults[0]
    args.models = args.models or defaults[1]
    args.rollouts = args.rollouts if args.rollouts is not None else defaults[2]
    if args.mode == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # one torch thread, as the others
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    suffix = args.suffix = "_quick" if args.quick else ""
    if args.mode == "scaling" and args.replot:
        out = json.loads((HERE / f"bench_realistic_scaling{suffix}.json").read_text())
        plot_scaling(out, HERE / f"bench_realistic_scaling{suffix}.png")
        return
    log = Log(HERE / f"bench_realistic_{args.mode}{suffix}_output.txt")
    log(f"\n#### {time.strftime('%Y-%m-%d %H:%M:%S')}  {' '.join(sys.argv)}")
    log(f"#### load average at start: {os.getloadavg()} on {os.cpu_count()} cores")
    if args.mode == "scaling":
        res = cmd_scaling(args, log)
    else:
        res = cmd_table(args, log)
    log(f"#### load average at end: {os.getloadavg()}")
    path = Path(args.out) if args.out else HERE / f"bench_realistic_{args.mode}{suffix}.json"
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
