"""Multi-turn play on vLLM's request queue: each trajectory's turn is a request of its own.

:meth:`gspo.rollout.vllm.VLLMRolloutEngine.play` runs this loop over vLLM's public
``LLMEngine`` (``add_request`` / ``step`` / ``has_unfinished_requests``), which batches the running
requests continuously: when a trajectory's turn ends, its next turn is submitted as soon as its
observation is due, while the other trajectories' requests keep decoding; the context of a new
turn's request is the whole trajectory so far (its prefix is in vLLM's prefix cache). Imports no
vLLM (the sampling parameters come from the engine).

Exact: a request's sampling randomness is its own seed, derived from (engine seed, call, row,
turn), so it does not depend on which requests share a step; and which requests share a step is
a function of the data (:class:`~gspo.rollout.turns.Ticks`: a pending observation's turn is
submitted at the first tick after its turn ended, which waits for it), not of how long a tool took.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from gspo.errors import GspoError
from gspo.rollout.turns import Ticks, TurnEnd, is_pending


def play_requests(
    engine: Any,
    contexts: list[list[int]],
    budgets: list[int],
    turn_end: TurnEnd,
    params: Callable[[int, int, int], Any],
    eos_token_id: int,
    prefix: str,
    tick: int = 1,
    routing: tuple[Callable[[int, Any, int], None], Callable[[Any, int], Any]] | None = None,
) -> None:
    """Play every trajectory on vLLM's ``engine`` (an ``LLMEngine``): row ``i`` starts with a turn
    of at most ``budgets[i]`` tokens after ``contexts[i]``; ``turn_end`` as in
    :meth:`gspo.rollout.hf.HFRolloutEngine.play`. ``params(row, turn, budget)`` are the turn's
    ``SamplingParams``; request ids are ``{prefix}-{row}-{turn}``. ``routing = (routed, take)`` (R3):
    before ``turn_end``, ``routed(row, take(out, m), n)`` gets a finished request's routing of its
    ``m`` positions fed (its context and its ``n`` tokens but the last)."""
    ctx = [list(c) for c in contexts]
    turn = [0] * len(contexts)
    rows: dict[str, int] = {}  # request id -> row, of the requests in flight
    ticks = Ticks(tick)

    render = getattr(getattr(engine, "renderer", None), "render_cmpl", None)  # vLLM >= 0.32's way in

    def submit(r: int, obs: list[int], budget: int) -> None:
        ctx[r] += obs
        rid, prompt = f"{prefix}-{r}-{turn[r]}", {"prompt_token_ids": list(ctx[r])}
        engine.add_request(rid, render([prompt])[0] if render else prompt, params(r, turn[r], budget))
        rows[rid] = r
        turn[r] += 1

    try:
        for r, b in enumerate(budgets):
            submit(r, [], b)
        step = 0
        while True:
            for r, nxt in ticks.due(step) if ticks.parked else []:
                if nxt is not None:
                    submit(r, *nxt)
            if not engine.has_unfinished_requests():
                if not ticks.parked:
                    return
                step = ticks.next_due()  # nothing decodes: on to the next tick a trajectory is due at
                continue
            done = sorted((rows.pop(o.request_id), o) for o in engine.step() if o.finished)
            for r, out in done:  # in row order: the answers' order is the data's
                ids, lps = _turn(out.outputs[0], eos_token_id)
                if routing is not None:
                    routing[0](r, routing[1](out, len(ctx[r]) + len(ids) - 1), len(ids))
                ctx[r] += ids
                nxt = turn_end(r, ids, lps)
                if is_pending(nxt):
                    ticks.park(r, step, nxt)  # type: ignore[arg-type]
                elif nxt is not None:
                    submit(r, *nxt)  # type: ignore[misc]
            step += 1
    finally:
        if rows:  # an error mid-play: nothing of this call stays queued in vLLM
            engine.abort_request(list(rows))


def _turn(completion: Any, eos_token_id: int) -> tuple[list[int], list[float]]:
    """A finished request's tokens (up to its first EOS) and their sampler log-probs."""
    ids = list(completion.token_ids)
    if completion.logprobs is None:
        raise GspoError("vLLM returned no log-probs; SamplingParams(logprobs=0) is required")
    lps = [float(getattr(e[t], "logprob", e[t])) for t, e in zip(ids, completion.logprobs, strict=True)]
    if eos_token_id in ids:
        n = ids.index(eos_token_id) + 1
        ids, lps = ids[:n], lps[:n]
    return ids, lps


def truncation_params(top_k: int, top_p: float) -> dict[str, Any]:
    """vLLM ``SamplingParams`` for a top-k / top-p truncation (only what is on: vLLM's own defaults,
    which mean "off", differ across versions)."""
    out: dict[str, Any] = {}
    if top_k > 0:
        out["top_k"] = int(top_k)
    if top_p < 1.0:
        out["top_p"] = float(top_p)
    return out


def turn_params(engine: Any, temperature: float, greedy: bool) -> Callable[[int, int, int], Any]:
    """``params(row, turn, budget)``: a turn's ``SamplingParams`` on ``engine`` (a
    :class:`~gspo.rollout.vllm.VLLMRolloutEngine`), as its ``generate`` samples, with the request's
    own seed (:func:`turn_seed`) and only its final output returned."""
    import vllm

    greedy = greedy or temperature == 0
    truncation = {} if greedy else truncation_params(engine.top_k, engine.top_p)
    kind = vllm.sampling_params.RequestOutputKind.FINAL_ONLY
    seed, call, dp, eos = engine.seed, engine.calls, engine.dp_rank, engine.eos_token_id

    def params(row: int, turn: int, budget: int) -> Any:
        return vllm.SamplingParams(
            n=1, temperature=0.0 if greedy else temperature, **truncation, max_tokens=budget, logprobs=0,
            seed=turn_seed(seed, call, row, turn, dp), stop_token_ids=[eos], detokenize=False, output_kind=kind,
        )  # fmt: skip

    return params


def turn_seed(seed: int, call: int, row: int, turn: int, instance: int) -> int:
    """A request's sampling seed: one stream per (engine seed, play call, row, turn, vLLM instance),
    whichever requests it is batched with."""
    key = f"{seed}/{call}/{row}/{turn}/{instance}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % (2**31 - 1)
