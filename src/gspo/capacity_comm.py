"""Bytes each rank moves per micro-batch and per RL step, and the seconds they take: the
communication half of ``gspo plan`` past one node (its memory half: :mod:`gspo.capacity`).

Ranks lie node by node (rank = node x gpus_per_node + local rank, torchrun's order). Per rank, the
bytes it *sends* (it receives as many), with ring / pairwise algorithms:

* all-gather or reduce-scatter of T bytes over n ranks: (n-1)/n T; all-reduce: 2 (n-1)/n T;
* all-to-all of a payload P over n ranks: (n-1)/n P (the part bound for the others);
* on gloo (``device: cpu``) a reduce-scatter of T bytes sends as an all-reduce, 2 (n-1)/n T: it
  reduces the whole tensor and keeps its shard (counted on the wire at 2 and 3 ranks,
  benchmarks/bench_ep.py; NCCL's ring sends (n-1)/n T).

Seconds: bytes / bandwidth per GPU and direction. A ring over ranks on more than one node runs at
the inter-node rate (the ring crosses nodes, one NIC per GPU); an all-to-all sends to the ranks of
its own node over NVLink and to the others over the NIC at once (the slower of the two). No latency
term and no overlap with compute: a communication time, a lower bound of nothing but the wires.

One micro-batch of the update, FSDP2 as :mod:`gspo.training.distributed` wraps it: the root group
(embeddings, final norm, LM head) gathered once (FSDP2 keeps the root unsharded for backward), each
decoder layer gathered in forward and again in backward (compute dtype), gradients reduce-scattered
at every micro-batch (float32 under bf16 mixed precision, else the trainer's dtype). Expert
parallelism over groups of ``ep`` consecutive ranks (the layout of transformers'
``DistributedConfig``: ep groups {0..ep-1}, ...; the world/ep ranks holding the same experts FSDP-shard
them): dense parameters as above over every rank; each layer's routed experts, num_experts/ep per
rank, gathered and reduced over the world/ep ranks that hold the same ones; tokens reach their
experts by all-to-all, dispatch and combine, in forward and in backward (and in the recompute under
activation checkpointing): tokens x top_k x hidden in the compute dtype, (ep-1)/ep of it leaving.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from gspo.capacity import BYTES, Shape, estimate, expert_parallel, rows_per_forward, tokens_and_pairs
from gspo.errors import GspoError
from gspo.limits import INT_LIMITS
from gspo.plans import CapacityPlan

MAX_GPU_GB = 1e6  # --gpu-memory-gb: a petabyte per GPU is a typo

# per GPU and direction, in Gb/s (1e9 bits/s): NVLink 4 on H100/H200 is 900 GB/s both ways together,
# 450 GB/s = 3600 Gb/s each way; one 400 Gb/s NDR InfiniBand NIC per GPU (ConnectX-7)
INTRA_GBPS = 3600.0
INTER_GBPS = 400.0
MIN_GBPS, MAX_GBPS = 1e-3, 1e6  # 1 Mb/s to 1 Pb/s per GPU: beyond, a typo (and times of inf or 0 s)
GPUS_PER_NODE = 8  # one node's GPUs when only --gpus is given


@dataclass(frozen=True)
class Link:
    """Where the ranks are and how fast they talk: bytes/s per GPU and direction."""

    nodes: int
    gpus_per_node: int
    intra: float
    inter: float

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def gpu_bytes_of(gb: float | None = None, gib: float | None = None) -> tuple[float, str]:
    """One GPU's memory in bytes, from ``--gpu-memory-gib`` (2**30 bytes, what ``nvidia-smi`` and
    ``torch.cuda`` report: an H200 is ~139.8 GiB) or ``--gpu-memory-gb`` (1e9 bytes: the "141 GB" of a
    data sheet), and the flag as given; 80 GB when neither is."""
    if gb is not None and gib is not None:
        raise GspoError("give --gpu-memory-gib or --gpu-memory-gb, not both")
    flag, value, unit = ("--gpu-memory-gib", gib, 2**30) if gib is not None else ("--gpu-memory-gb", gb, 1e9)
    value = 80.0 if value is None else value
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= MAX_GPU_GB):
        raise GspoError(f"{flag} must be a number in (0, {MAX_GPU_GB:g}] (got {value!r})")
    return value * unit, f"{flag} {value:g}"


def link_of(
    nodes: int, gpus_per_node: int | None, gpus: int | None, intra_gbps: float, inter_gbps: float
) -> Link:
    """The layout ``gspo plan`` was given: ``--nodes``, ``--gpus-per-node`` (needed past one node:
    torchrun's ``--nproc_per_node`` on each), ``--gpus`` (one node's worth, or their product) and the
    two rates in Gb/s; a one-line GspoError naming the flag otherwise."""
    for flag, v in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--gpus", gpus)):
        if v is not None and v < 1:
            raise GspoError(f"{flag} must be >= 1 (got {v})")
    if nodes > 1 and gpus_per_node is None:
        raise GspoError(
            f"--nodes {nodes} needs --gpus-per-node: the ranks torchrun starts on each node "
            "(--nproc_per_node; the plan prints the rendezvous command)"
        )
    per_node = gpus_per_node if gpus_per_node is not None else (gpus if gpus is not None else GPUS_PER_NODE)
    if gpus is not None and gpus != nodes * per_node:
        raise GspoError(f"--gpus {gpus} is not --nodes x --gpus-per-node = {nodes} x {per_node}")
    if nodes * per_node > INT_LIMITS["nproc"]:
        raise GspoError(
            f"--nodes x --gpus-per-node must be <= {INT_LIMITS['nproc']} ranks (got {nodes * per_node})"
        )
    for flag, v in (("--intra-gbps", intra_gbps), ("--inter-gbps", inter_gbps)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise GspoError(f"{flag} must be a positive finite number of Gb/s (got {v!r})")
        if not MIN_GBPS <= v <= MAX_GBPS:  # a time of "inf s" or "0 s" is no estimate
            raise GspoError(f"{flag} must be between {MIN_GBPS:g} and {MAX_GBPS:g} Gb/s (got {v:g})")
    return Link(nodes, per_node, intra_gbps * 1e9 / 8, inter_gbps * 1e9 / 8)


def _bad(field: str, msg: str, got: Any) -> GspoError:
    return GspoError(f"config field '{field}': {msg} (got {got!r})")


def check_layout(plan: CapacityPlan, shape: Shape, link: Link) -> None:
    """Refuse what the code cannot run on ``link``: a vLLM instance across nodes (its tensor-parallel
    group is consecutive ranks, which must lie on one node), expert parallelism on a dense model,
    without FSDP2, or not dividing the experts or the world."""
    tp = plan.vllm_tensor_parallel_size
    if plan.engine_spec.tensor_parallel and link.gpus_per_node % tp:
        why = "greater than" if tp > link.gpus_per_node else "does not divide"
        raise _bad(
            "vllm_tensor_parallel_size",
            f"{why} --gpus-per-node {link.gpus_per_node}: one vLLM instance would span nodes",
            tp,
        )
    ep = plan.expert_parallel_size
    if ep == 1:
        return
    if not shape.experts:
        raise _bad("expert_parallel_size", "must be 1 for a dense model (no experts to split)", ep)
    if plan.parallel != "fsdp" or link.world < 2:
        raise _bad("expert_parallel_size", "needs FSDP2 on more than one rank (parallel fsdp)", ep)
    if shape.experts % ep:
        raise _bad("expert_parallel_size", f"must divide the model's {shape.experts} experts", ep)
    if link.world % ep:
        raise _bad("expert_parallel_size", f"must divide the world size {link.world}", ep)


# --- the collectives: bytes one rank sends, and their seconds ---------------------------------------


def ring_bytes(total: float, n: int) -> float:
    """Bytes one rank sends in an all-gather or reduce-scatter of ``total`` bytes over ``n`` ranks."""
    return total * (n - 1) / n


def all_reduce_bytes(total: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``total`` bytes: a reduce-scatter, then an all-gather."""
    return 2 * ring_bytes(total, n)


def reduce_scatter_bytes(total: float, n: int, gloo: bool = False) -> float:
    """Bytes one rank sends in a reduce-scatter of ``total`` bytes over ``n`` ranks: a ring (NCCL), or
    gloo's all-reduce of the whole tensor."""
    return all_reduce_bytes(total, n) if gloo else ring_bytes(total, n)


def all_to_all_bytes(payload: float, n: int) -> float:
    """Bytes one rank sends in an all-to-all of its ``payload`` spread evenly over ``n`` ranks."""
    return payload * (n - 1) / n


def ring_seconds(nbytes: float, link: Link, crosses: bool) -> float:
    """A ring collective's time: at the NIC's rate when its ranks span nodes, else NVLink's."""
    return nbytes / (link.inter if crosses else link.intra)


def all_to_all_seconds(nbytes: float, n: int, link: Link) -> float:
    """An all-to-all over ``n`` consecutive ranks: the share for peers on the same node goes over
    NVLink, the rest over the NIC, both at once."""
    if n < 2:
        return 0.0
    local = min(n, link.gpus_per_node) - 1
    return max(nbytes * local / (n - 1) / link.intra, nbytes * (n - 1 - local) / (n - 1) / link.inter)


@dataclass(frozen=True)
class Move:
    """One kind of collective: what, the bytes one rank sends, the seconds, over which link."""

    what: str
    nbytes: float
    seconds: float
    via: str


def _ring(what: str, nbytes: float, link: Link, crosses: bool) -> Move:
    return Move(what, nbytes, ring_seconds(nbytes, link, crosses), "IB" if crosses else "NVLink")


def micro_batch_moves(
    shape: Shape,
    link: Link,
    ep: int,
    tokens: int,
    compute: int,
    reduce: int,
    backward: bool,
    recompute: bool,
    gloo: bool = False,
) -> tuple[Move, ...]:
    """One FSDP2 micro-batch of ``tokens`` tokens on ``link`` with experts over ``ep`` ranks: the
    gathers of forward (and backward), the gradients' reduce-scatter, the experts' gathers and
    reduce-scatter within their world/ep holders, the tokens' all-to-alls (module doc; ``gloo``:
    reduce-scatters as gloo sends them)."""
    W, L, passes = link.world, shape.layers, 2 if backward else 1
    apart = shape.expert_params() if ep > 1 else 0  # per layer, outside the all-rank groups
    across = link.nodes > 1
    gathered = ring_bytes(shape.root_params() * compute, W) + passes * L * ring_bytes(
        (shape.layer_params() - apart) * compute, W
    )
    moves = [_ring("FSDP2 all-gather", gathered, link, across)]
    if backward:
        grads = reduce_scatter_bytes((shape.params() - L * apart) * reduce, W, gloo)
        moves.append(_ring("FSDP2 reduce-scatter", grads, link, across))
    if ep == 1:
        return tuple(moves)
    holders, share = W // ep, shape.expert_params() / ep
    crosses = across and holders > 1
    if holders > 1:  # (ep = world: every expert lives whole on one rank)
        experts = passes * L * ring_bytes(share * compute, holders)
        moves.append(_ring("experts all-gather", experts, link, crosses))
        if backward:
            moves.append(
                _ring(
                    "experts reduce-scatter",
                    L * reduce_scatter_bytes(share * reduce, holders, gloo),
                    link,
                    crosses,
                )
            )
    exchanges = 2 * (1 + backward + (backward and recompute))  # dispatch + combine per pass
    a2a = exchanges * L * all_to_all_bytes(tokens * shape.top_k * shape.hidden * compute, ep)
    via = "NVLink" if ep <= link.gpus_per_node else "IB+NVLink"
    moves.append(Move("tokens all-to-all", a2a, all_to_all_seconds(a2a, ep, link), via))
    return tuple(moves)


def recomputes_pi_old(plan: CapacityPlan) -> bool:
    """Whether each step runs a forward-only pass for pi_old (the plan's one decision,
    :func:`gspo.plans.pi_old_source`)."""
    return plan.pi_old == "recompute"


def forward_only_batches(plan: CapacityPlan, shape: Shape, per_minibatch: int) -> int:
    """Forward-only micro-batches of one update, ``per_minibatch`` micro-batches to a minibatch
    (:func:`gspo.training.update.record_pi_old` and ``measure_volatility`` restated without a model;
    tests/test_plan_nodes.py checks it against :func:`gspo.resolve.for_model`'s plan): minibatch 0's
    training forward is pi_old's; minibatches 1.. get one when the trainer's pi_old is needed
    (recomputed, or for the mismatch correction) or pi_old's routing (the volatility minibatch, R2);
    under R3 one without replay wherever pi_old's own routing is needed; volatility measured after
    the first step (one minibatch, or a replay) costs one forward of its minibatch."""
    n, moe = plan.num_minibatches, bool(shape.experts)
    replay = plan.replay if moe else None
    vol_i = (1 if n > 1 else 0) if moe and plan.volatility else None
    trainer = plan.trainer_pi_old
    count = 0
    for i in range(n):
        own = i == vol_i or (replay == "R2" and i > 0)
        count += int(replay == "R3" and own) + int(i > 0 and (trainer or (own and replay != "R3")))
    if vol_i is not None and (vol_i == 0 or replay is not None):  # volatility "forward"
        count += 1
    return count * per_minibatch


@dataclass(frozen=True)
class Traffic:
    """What one rank sends in one RL step: ``update_batches`` update micro-batches, ``forward_batches``
    forward-only ones (pi_old's log-probs or routing, volatility), and the weights gathered once for
    the sampler."""

    ep: int
    update: tuple[Move, ...]
    update_batches: int
    forward: tuple[Move, ...]
    forward_batches: int
    sync: tuple[Move, ...]

    def step(self) -> tuple[float, float]:
        """(bytes, seconds) of the whole step."""
        parts = [(self.update, self.update_batches), (self.forward, self.forward_batches), (self.sync, 1)]
        return (
            sum(m.nbytes * k for ms, k in parts for m in ms),
            sum(m.seconds * k for ms, k in parts for m in ms),
        )


def traffic(plan: CapacityPlan, shape: Shape, link: Link, ep: int | None = None) -> Traffic:
    """Per-rank traffic of ``plan`` on ``link`` (``ep``: the config's ``expert_parallel_size`` unless
    given). DDP all-reduces the gradients of each micro-batch in the trainer's dtype; one process moves
    nothing."""
    W, bw = link.world, BYTES[plan.dtype]
    compute = 2 if plan.mixed_precision == "bf16" else bw
    reduce = 4 if plan.mixed_precision == "bf16" else bw
    rows = rows_per_forward(plan, W)
    tokens = tokens_and_pairs(plan, rows)[0]
    per_rank = max(1, plan.prompts_per_step * plan.group_size // W)
    per_minibatch = max(1, per_rank // plan.num_minibatches)
    update_batches = plan.num_minibatches * math.ceil(per_minibatch / rows)
    forward_batches = forward_only_batches(plan, shape, math.ceil(per_minibatch / rows))
    if ep is None:
        ep = expert_parallel(plan, shape, W)
    across = link.nodes > 1
    if W == 1:
        return Traffic(1, (), update_batches, (), forward_batches, ())
    if plan.parallel == "ddp":
        grads = _ring("DDP all-reduce", all_reduce_bytes(shape.params() * bw, W), link, across)
        return Traffic(1, (grads,), update_batches, (), forward_batches, ())
    gloo = plan.device == "cpu"  # the backend gspo's distributed setup picks for the CPU
    update = micro_batch_moves(
        shape, link, ep, tokens, compute, reduce, True, plan.activation_checkpointing, gloo
    )
    forward = micro_batch_moves(shape, link, ep, tokens, compute, reduce, False, False, gloo)
    # the sampler needs every weight: vLLM and the HF engine's own copy get them in the trainer's
    # dtype, the HF engine sampling from the trainer's module gathers it in the compute dtype
    copy = plan.engine_spec.copies_weights(plan.dtype, plan.rollout_dtype)
    sync = ring_bytes(shape.params() * (bw if copy else compute), W)
    return Traffic(
        ep, update, update_batches, forward, forward_batches, (_ring("weight sync", sync, link, across),)
    )


def suggested_ep(shape: Shape, link: Link) -> int:
    """The EP size to compare with: the largest divisor of the experts and the world within one node
    (its all-to-alls on NVLink), 1 for a dense model."""
    if not shape.experts:
        return 1
    g = math.gcd(shape.experts, link.world)
    return max(d for d in range(1, min(g, link.gpus_per_node) + 1) if g % d == 0)


# --- gspo plan's lines ------------------------------------------------------------------------------


def _gbps(bps: float) -> str:
    return f"{bps * 8 / 1e9:g} Gb/s ({bps / 1e9:g} GB/s)"


def _cell(nbytes: float, seconds: float, via: str = "") -> str:
    return f"{nbytes / 1e9:10.2f} GB {seconds:9.3f} s {via:<9}"


def _rows(columns: list[tuple[Move, ...]], k: list[int]) -> list[str]:
    """One line per kind of collective, a cell per column (``k``: how many times each column runs it)."""
    kinds = list(dict.fromkeys(m.what for ms in columns for m in ms))
    lines = []
    for what in kinds:
        cells = []
        for ms, n in zip(columns, k, strict=True):
            m = next((m for m in ms if m.what == what), None)
            cells.append(_cell(m.nbytes * n, m.seconds * n, m.via) if m else f"{'-':>13}{'':>22}")
        lines.append(f"  {what:<24}" + "".join(cells).rstrip())
    total = [
        (sum(m.nbytes for m in ms) * n, sum(m.seconds for m in ms) * n)
        for ms, n in zip(columns, k, strict=True)
    ]
    lines.append(f"  {'total':<24}" + "".join(_cell(b, s) for b, s in total).rstrip())
    return lines


def comm_report(plan: CapacityPlan, shape: Shape, link: Link, gpu_bytes: float | None = None) -> list[str]:
    """``gspo plan``'s communication lines: bytes each rank sends per micro-batch and per step and
    their seconds, without EP and with it side by side (the run's ``expert_parallel_size``, or the
    largest within a node to compare with), and each one's per-GPU memory peak."""
    ep = expert_parallel(plan, shape, link.world)
    sizes = sorted({1, ep if ep > 1 else suggested_ep(shape, link)} if plan.parallel == "fsdp" else {1})
    peaks = {
        e: estimate(dataclasses.replace(plan, expert_parallel_size=e), shape, link.world, gpu_bytes).peak
        for e in sizes
    }
    runs = [traffic(plan, shape, link, e) for e in sizes]
    heads = [
        ("FSDP2" if plan.parallel == "fsdp" else plan.parallel.upper()) if e == 1 else f"EP {e} + FSDP2"
        for e in sizes
    ]
    heads = [
        h + (" (this run)" if e == ep and len(sizes) > 1 else "") for h, e in zip(heads, sizes, strict=True)
    ]
    t, rows = runs[0], rows_per_forward(plan, link.world)
    lines = [
        f"interconnect: {link.nodes} node(s) x {link.gpus_per_node} GPUs (rank = node x {link.gpus_per_node}"
        f" + local rank); per GPU and direction NVLink {_gbps(link.intra)}, IB {_gbps(link.inter)}"
        " (--intra-gbps, --inter-gbps)",
        "bytes each rank sends (GB = 1e9 bytes) and their time at those rates (no latency, no overlap "
        "with compute); under EP the FSDP2 rows are the dense parameters, the experts' rows their "
        "world/ep holders:",
        f"  {'':<24}" + "".join(f"{h:>35}" for h in heads),
        f"per update micro-batch ({rows} sequence(s), {tokens_and_pairs(plan, rows)[0]} tokens at most):",
        *_rows([r.update for r in runs], [1] * len(runs)),
        f"per step ({t.update_batches} update micro-batches, {t.forward_batches} forward-only"
        f" micro-batches, one weight sync):",
    ]
    steps = [
        ("update", [r.update for r in runs], t.update_batches),
        ("forward-only", [r.forward for r in runs], t.forward_batches),
        ("weight sync", [r.sync for r in runs], 1),
    ]
    for name, cols, k in steps:
        cells = [_cell(sum(m.nbytes for m in ms) * k, sum(m.seconds for m in ms) * k) for ms in cols]
        lines.append(f"  {name:<24}" + "".join(cells).rstrip())
    lines.append(f"  {'step total':<24}" + "".join(_cell(*r.step()) for r in runs).rstrip())
    if plan.rollout_devices:  # rank 0 -> the sampler's GPU, beside the trainer's traffic
        nbytes = shape.params() * BYTES[plan.rollout_dtype or plan.dtype]
        lines.append(
            f"  {'to the sampler':<24}{_cell(nbytes, nbytes / link.intra).rstrip()}   (rank 0 alone, every "
            f"version: one broadcast per tensor to {','.join(plan.rollout_devices)} in {plan.rollout_dtype or plan.dtype}, "
            "NVLink rate)"
        )
    lines.append(
        f"  {'per-GPU memory peak':<24}"
        + "".join(f"{peaks[e] / 2**30:9.1f} GiB{'':>22}" for e in sizes).rstrip()
    )
    return lines


def launch_lines(link: Link, config: str | None, flags: tuple[str, ...] = ()) -> list[str]:
    """How to start the run the plan describes: ``gspo train`` on one node (it starts torchrun),
    torchrun with a c10d rendezvous on each node past one; with every config flag the plan was given
    (``flags``, as typed), so the run is the one planned."""
    import shlex

    train = " ".join(
        ["gspo train", *(["--config", shlex.quote(config)] if config else []), *map(shlex.quote, flags)]
    )
    if link.nodes == 1:
        return [f"launch: {train}" + (f" --nproc {link.world}" if link.world > 1 else "")]
    return [
        f"launch: on each node i = 0..{link.nodes - 1} (MASTER: node 0's address; output_dir on a "
        "filesystem every node sees; nproc comes from torchrun's WORLD_SIZE):",
        f"  torchrun --nnodes {link.nodes} --nproc_per_node {link.gpus_per_node} --node_rank $i "
        f"--rdzv_backend c10d --rdzv_endpoint $MASTER:29500 --rdzv_id gspo -m {train}",
    ]
