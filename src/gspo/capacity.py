"""Per-GPU memory of a run, before it starts: the model behind ``gspo plan``.

What one rank holds (bytes), for a decoder-only (dense or MoE) transformer:

* **weights, optimizer**: every parameter in the trainer's dtype and AdamW's two moments, each divided by the
  world size under FSDP2 (``parallel: fsdp``), whole under DDP or in one process;
* **gradients**: the same size as the weights they belong to, held from the first backward of a minibatch to
  its optimizer step (so at the peak only when a minibatch takes more than one micro-batch per rank); under
  FSDP2 also the unsharded working set: the root group (with the embeddings) and, per decoder layer being
  gathered, its all-gather buffer and unsharded copy (this layer and the prefetched next one, in the compute
  dtype), its unsharded gradients and the reduce-scatter buffer (float32);
* **activations** of one training micro-batch: per token and layer the tensors a decoder layer keeps for
  backward (counted per projection below, times a factor fitted to measurements), plus the attention
  probabilities (``heads x pairs x 4`` bytes per layer: gspo loads transformers' sdpa attention, which keeps
  them when given a mask), and the chunked LM head's buffers; with activation checkpointing only each layer's
  input is kept, and one layer's activations while it is recomputed;
* **sampler**: the HF engine's KV cache for one generation chunk, beside its copy in another dtype (kept
  through the update) or under FSDP2 the trainer's weights gathered while it samples; vLLM its configured
  share of the GPU, given back during the update by sleep mode on a GPU;
* **start-up**: this rank's shard while one full tensor at a time is read (each rank its own shards, from a
  local folder or a hub snapshot) or broadcast from rank 0 (whose copy is host memory) and sharded; then
  AdamW's moments (on a resume) and the sampler started: vLLM's share and the larger of its first weight sync
  and its start check (a probe through the sharded module, one layer at a time).

Each phase is a per-GPU peak: start-up, update (at the first layer's backward or the LM head's, whichever is
larger), rollout and weight sync; the run's peak is the largest. The per-token count's factor and the update
peak's shape were fitted to, and checked against, measured peaks (``benchmarks/memory_probe.py``,
``benchmarks/RESULTS_scale.md``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo.errors import GspoError, one_line
from gspo.plans import CapacityPlan

# what a decoder layer keeps per token, relative to the per-projection count (fitted: see module doc)
ACTIVATION_FACTOR = 1.05
# per token-pair and layer, attention keeps its probabilities (float32, one per head) and the
# backward of the softmax holds two more tensors of that size for the layer being differentiated
ATTN_TRANSIENT = 3
LM_HEAD_BUFFERS = 2  # [chunk, V] float32 buffers of the chunked LM head
HF_GENERATION_CHUNK = 256  # rows the HF engine samples at once (gspo.rollout.hf)
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# what vLLM's share holds besides its weights and KV cache, taken off the cache's capacity (GiB):
# vLLM (0.32) sizes the cache as its share less all its instance consumed once made: its weights,
# memory outside PyTorch (cuBLAS and NCCL workspaces), its profile run's peak (the activations of
# max_num_batched_tokens tokens, the sampler's logits for max_num_seqs rows) and, measured or not,
# its CUDA graphs; and a process's CUDA context (about 0.5 GiB) lies outside every allocator. An
# allowance for vLLM's defaults, not measured by gspo (no GPU here): benchmarks/gpu_check.sh's vLLM
# step prints vLLM's own "Available KV cache memory" beside the plan's
CUDA_CONTEXT_GIB = 0.5
VLLM_NON_KV_GIB = 1.5
MAX_MODEL_CONFIG_BYTES = 16 << 20  # an HF config.json is a few kB

# config numbers of models users ask for by hub id (this machine cannot download them)
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "Qwen/Qwen3-30B-A3B": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                               num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                               num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False),
    "Qwen/Qwen3-235B-A22B": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                                 num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                                 num_experts_per_tok=8, moe_intermediate_size=1536, tie_word_embeddings=False),
}  # fmt: skip


MAX_DIM = 2**31 - 1  # above any real model's width, layer, head or vocabulary count


def _count(
    c: dict[str, Any], key: str, where: str, low: int = 1, high: int = MAX_DIM, default: Any = None
) -> int:
    """``c[key]`` (``default`` where missing or null) as a whole number in ``[low, high]``."""
    v = c.get(key)
    v = default if v is None else v
    if v is None:
        raise GspoError(f"{where}: missing '{key}'")
    whole = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v == int(v)
    if not whole or not low <= v <= high:
        raise GspoError(f"{where}: '{key}' must be a whole number in [{low}, {high}] (got {v!r:.40})")
    return int(v)


@dataclass(frozen=True)
class Shape:
    """The numbers of a model config the memory model reads."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (0 for MoE layers)
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    tied: bool = False

    @classmethod
    def from_config(cls, c: Any, where: str = "model config") -> Shape:
        """The numbers of an HF config dict; a one-line GspoError naming ``where`` and the key when one
        is missing, not a whole positive number, or the shape is impossible (heads that do not
        divide the hidden size without a ``head_dim``, key/value heads that do not divide the heads)."""
        if not isinstance(c, dict):
            raise GspoError(f"{where}: expected a JSON object of config numbers, got {type(c).__name__}")
        heads, hidden = _count(c, "num_attention_heads", where), _count(c, "hidden_size", where)
        kv_heads = _count(c, "num_key_value_heads", where, default=heads)
        if c.get("head_dim") is None and hidden % heads:
            raise GspoError(
                f"{where}: 'num_attention_heads' {heads} does not divide 'hidden_size' {hidden} (no 'head_dim')"
            )
        if heads % kv_heads:
            raise GspoError(
                f"{where}: 'num_key_value_heads' {kv_heads} does not divide 'num_attention_heads' {heads}"
            )
        key = "num_experts" if c.get("num_experts") is not None else "num_local_experts"
        experts = _count(c, key, where, low=0, default=0)
        tied = c.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise GspoError(f"{where}: 'tie_word_embeddings' must be true or false (got {tied!r:.40})")
        return cls(
            vocab=_count(c, "vocab_size", where), hidden=hidden, layers=_count(c, "num_hidden_layers", where),
            heads=heads, kv_heads=kv_heads, head_dim=_count(c, "head_dim", where, default=hidden // heads),
            intermediate=0 if experts else _count(c, "intermediate_size", where), experts=experts,
            top_k=_count(c, "num_experts_per_tok", where, high=experts) if experts else 0,
            moe_intermediate=_count(c, "moe_intermediate_size", where) if experts else 0, tied=tied,
        )  # fmt: skip

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        h = self.hidden
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 2 * h + 2 * self.head_dim
        mlp = (
            3 * h * self.intermediate
            if not self.experts
            else self.experts * (3 * h * self.moe_intermediate + h)
        )
        return attn + mlp

    def expert_params(self) -> int:
        """Parameters of one layer's routed experts (gate, up and down of each; the router is not one)."""
        return self.experts * 3 * self.hidden * self.moe_intermediate

    def root_params(self) -> int:
        """Parameters outside the decoder layers: embeddings, LM head (unless tied), final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return embed + self.layers * self.layer_params() + self.hidden

    def saved_floats_per_token(self) -> float:
        """Floats one decoder layer keeps per token for backward (x ACTIVATION_FACTOR): attention's
        input, norm, q/k/v, their norms and rotations, output (3h + 4q + 4kv), then the MLP's input,
        norm, gate, up, activation and product (2h + 4i), or for MoE the router's logits and
        probabilities and, per routed copy, input, output and the four expert tensors."""
        h, i = self.hidden, self.intermediate
        attn = 3 * h + 4 * self.q_dim + 4 * self.kv_dim
        mlp = (
            2 * h + 4 * i
            if not self.experts
            else 2 * h + 2 * self.experts + self.top_k * (2 * h + 4 * self.moe_intermediate)
        )
        return ACTIVATION_FACTOR * (attn + mlp)


def shape_of(spec: str) -> Shape:
    """``embedded:<name>``, ``gguf:PATH``, a local HF folder (its config.json) or a known hub id (KNOWN_MODELS)."""
    if spec in KNOWN_MODELS:
        return Shape.from_config(KNOWN_MODELS[spec], f"model {spec}")
    if spec.startswith(("embedded:", "gguf:")):  # (a GGUF file's config comes with its weights)
        from gspo.model.load import load_model_and_tokenizer

        config = load_model_and_tokenizer(spec, meta=True)[0].config.to_dict()
        return Shape.from_config(config, f"config field 'model': {spec}")
    path = Path(spec).expanduser() / "config.json"
    if path.is_file():
        where = f"config field 'model': {path}"
        try:
            if path.stat().st_size > MAX_MODEL_CONFIG_BYTES:
                raise GspoError(
                    f"{where}: larger than {MAX_MODEL_CONFIG_BYTES >> 20} MiB, not a model config"
                )
            config = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError) as e:
            raise GspoError(f"{where}: cannot read the model's shape ({one_line(e, typed=False)})") from None
        return Shape.from_config(config, where)
    raise GspoError(
        f"config field 'model': {spec!r} is neither an embedded model, a local folder with config.json, "
        f"nor a model whose numbers gspo ships ({', '.join(KNOWN_MODELS)})"
    )


def response_tokens(plan: CapacityPlan) -> int:
    """Tokens after the prompt of one sampled sequence: ``max_new_tokens``, or in a multi-turn run
    (an environment) the whole trajectory's ``max_trajectory_tokens`` (model turns and observations)."""
    return plan.max_trajectory_tokens if plan.multi_turn else plan.max_new_tokens


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank (GPU) by part, and the peak of each phase of a run: start-up, then per RL step
    the rollout, the update and the weight sync. Every tensor is counted once, in the phases where
    it is resident."""

    weights: float
    optimizer: float
    gradients: float
    fsdp_unsharded: float
    activations: float  # of one micro-batch, at the update's peak
    lm_head: float
    sampler: float  # while sampling: KV cache and logits plus the HF copy or gathered weights; vLLM's share
    sync: float  # extra while the sampler's weights are refreshed (2x the largest piece streamed)
    update_peak: float
    rollout_peak: float
    rows_per_forward: int
    sampler_kept: float = 0.0  # the sampler's memory that stays through the update and the sync
    load: float = 0.0  # start-up: the buffers of one weight tensor being broadcast and sharded
    start_engine: float = 0.0  # start-up: the sampler started, its first sync or vLLM's start check
    startup_peak: float = 0.0  # on --resume (AdamW's moments loaded first): the start-up that must fit
    sync_peak: float = 0.0
    fresh_startup_peak: float = 0.0  # a fresh run: AdamW's moments are made at the first optimizer step

    @property
    def peak(self) -> float:
        return max(self.startup_peak, self.update_peak, self.rollout_peak, self.sync_peak)

    def phases(self) -> dict[str, float]:
        return {
            "start-up": self.startup_peak, "update": self.update_peak, "rollout": self.rollout_peak,
            "weight sync": self.sync_peak,
        }  # fmt: skip


def rows_per_forward(plan: CapacityPlan, world: int) -> int:
    per_minibatch = max(1, plan.prompts_per_step * plan.group_size // world // plan.num_minibatches)
    return min(plan.micro_batch_size or per_minibatch, per_minibatch)


def tokens_and_pairs(plan: CapacityPlan, rows: int) -> tuple[int, int]:
    """Tokens of one training forward and the attention pairs it computes: responses of a group
    share their prompt's forward where prefix sharing applies (group_size > 1); packed rows form one
    sequence with a block mask (transformers' sdpa, the attention gspo loads, takes it dense)."""
    P, T = plan.max_prompt_tokens, response_tokens(plan)
    if plan.packing == "on":
        return rows * (P + T), (rows * (P + T)) ** 2
    if plan.group_size > 1 and plan.prefix_sharing != "off":
        return P + rows * T, P * P + rows * T * (P + T)
    return rows * (P + T), rows * (P + T) ** 2


def gathered_layer_params(shape: Shape, ep: int = 1) -> float:
    """Parameters of one decoder layer a rank holds unsharded while it runs: the whole layer, or
    under expert parallelism over ``ep`` ranks its dense part and num_experts/ep of its experts."""
    return shape.layer_params() - shape.expert_params() * (1 - 1 / ep)


def _unsharded(shape: Shape, compute: int, ep: int = 1) -> float:
    """FSDP2's working set: the root group (embeddings, LM head), and per gathered decoder layer its
    all-gather buffer and unsharded parameters (this layer and the prefetched next one), then in
    backward its unsharded gradients and the reduce-scatter buffer (reduced in float32)."""
    root = shape.vocab * shape.hidden * (1 if shape.tied else 2)
    return root * compute + gathered_layer_params(shape, ep) * (4 * compute + 2 * 4)


def ep_buffers(shape: Shape, tokens: int, ep: int, compute: int) -> float:
    """Expert parallelism's all-to-all buffers for one MoE layer in flight: the routed copies of a
    micro-batch's tokens (tokens x top_k x hidden, compute dtype) sent and received."""
    return 2.0 * tokens * shape.top_k * shape.hidden * compute if ep > 1 and shape.experts else 0.0


def _update_parts(plan: CapacityPlan, shape: Shape, world: int, compute: int) -> tuple[float, float, int]:
    """Activations and LM-head buffers of one micro-batch at the update's peak, and its rows."""
    rows = rows_per_forward(plan, world)
    tokens, pairs = tokens_and_pairs(plan, rows)
    per_layer = tokens * shape.saved_floats_per_token() * compute
    attn = pairs * shape.heads * 4  # sdpa with a mask keeps float32 probabilities
    if plan.activation_checkpointing:
        kept = shape.layers * tokens * shape.hidden * compute
    else:
        kept = shape.layers * (per_layer + attn)
    # the peak: the first layer's backward (its attention transients; under checkpointing its
    # recomputed activations too) or the LM head's backward, on top of what every layer keeps
    layer_peak = kept + ATTN_TRANSIENT * attn + (per_layer if plan.activation_checkpointing else 0.0)
    lm = LM_HEAD_BUFFERS * plan.logp_chunk_size * shape.vocab * 4 + shape.vocab * shape.hidden * 4
    activations, lm_part = (layer_peak, 0.0) if layer_peak >= kept + lm else (kept, lm)
    return activations, lm_part, rows


def expert_parallel(plan: CapacityPlan, shape: Shape, world: int) -> int:
    """Ranks each MoE layer's experts are split over: ``expert_parallel_size`` for an MoE under
    FSDP2 on more than one rank, else 1."""
    sharded = plan.parallel == "fsdp" and world > 1 and shape.experts
    return plan.expert_parallel_size if sharded else 1


def largest_tensor(shape: Shape) -> int:
    """Elements of the model's largest single tensor: the embedding (or LM head), a dense MLP
    projection, or a MoE layer's fused gate-and-up experts (transformers 5: experts x 2i x h)."""
    h = shape.hidden
    return max(shape.vocab * h, shape.intermediate * h, 2 * shape.experts * shape.moe_intermediate * h)


def estimate(plan: CapacityPlan, shape: Shape, world: int, gpu_bytes: float | None = None) -> Estimate:
    """Per-rank memory of ``plan`` on ``world`` GPUs of ``gpu_bytes`` (FSDP2 shards by ``world``;
    under expert parallelism the experts too, over the ranks holding the same ones)."""
    bw = BYTES[plan.dtype]
    compute = 2 if plan.mixed_precision == "bf16" else bw
    shards = world if plan.parallel == "fsdp" and world > 1 else 1
    ep = expert_parallel(plan, shape, world)
    n = shape.params()
    weights, optimizer, grads = n * bw / shards, 2 * n * bw / shards, n * bw / shards
    activations, lm_part, rows = _update_parts(plan, shape, world, compute)
    tokens = tokens_and_pairs(plan, rows)[0]
    unsharded = _unsharded(shape, compute, ep) + ep_buffers(shape, tokens, ep, compute) if shards > 1 else 0.0
    several = plan.prompts_per_step * plan.group_size // world // plan.num_minibatches > rows
    held_grads = grads if several else 0.0
    s = _sampler(plan, shape, world, gpu_bytes, compute, shards, ep)
    if plan.rollout_devices:  # the sampler on its own device: here one tensor at a time
        s = _Sampler(0.0, 0.0, 0.0, transfer_piece(plan, shape), 0.0)
    states = weights + optimizer
    update = states + held_grads + unsharded + activations + lm_part + s.kept
    # start-up: FSDP2 from disk holds one full tensor at a time in the trainer's dtype (broadcast
    # from rank 0, or read by this rank) and copies this rank's shard out of it; AdamW's moments
    # exist before the sampler starts only when a checkpoint is resumed (a fresh run makes them at
    # its first optimizer step, counted in the update)
    load = 2 * largest_tensor(shape) * bw if shards > 1 else 0.0
    startup = weights + max(load, optimizer + s.start)
    return Estimate(
        weights, optimizer, held_grads, unsharded, activations, lm_part, s.sampling, s.sync, update,
        states + s.sampling, rows, s.kept, load, s.start, startup, states + s.at_sync + s.sync,
        weights + max(load, s.start),
    )  # fmt: skip


def _sleeps(gpu_bytes: float | None) -> bool:
    return gpu_bytes is not None  # sleep mode exists on GPUs only


@dataclass(frozen=True)
class _Sampler:
    sampling: float  # beside the trainer's weights and moments while it samples
    kept: float  # through the update (the HF engine's copy; vLLM where it cannot sleep)
    at_sync: float  # resident while the weights are streamed into it
    sync: float  # the streamed piece
    start: float  # its start, at most: what it holds plus its first sync or start check


def _sampler(
    plan: CapacityPlan,
    shape: Shape,
    world: int,
    gpu_bytes: float | None,
    compute: int,
    shards: int,
    ep: int = 1,
) -> _Sampler:
    """The sampler's memory in each phase. A weight sync streams the trainer's weights one decoder
    layer (or the embedding) at a time, gathered in the trainer's dtype, plus their converted copy:
    twice the largest piece (measured on vLLM: 0.9-2.0x that piece, benchmarks/RESULTS_scale.md
    section 4)."""
    rb, bw = BYTES[plan.rollout_dtype or plan.dtype], BYTES[plan.dtype]
    sync = 2 * max(shape.layer_params(), shape.vocab * shape.hidden) * bw
    if plan.engine_spec.gpu_share:
        own = shape.params() * rb / plan.vllm_tensor_parallel_size  # its weights, inside its share
        share = plan.vllm_gpu_memory_utilization * gpu_bytes if gpu_bytes else shape.params() * rb
        sleeps = _sleeps(gpu_bytes)  # asleep (level 2) in the update; only its weights woken for a sync
        # the start check runs a 24-token probe through the trainer's module: under FSDP2 the root
        # group and two decoder layers gathered in the compute dtype, and the probe's logits
        gathered = _unsharded(shape, compute, ep) - gathered_layer_params(shape, ep) * 2 * 4
        check = (gathered if shards > 1 else 0.0) + 24 * shape.vocab * 4 * 2
        return _Sampler(
            share, 0.0 if sleeps else share, own if sleeps else share, sync, share + max(sync, check)
        )
    rows = min(HF_GENERATION_CHUNK, max(1, plan.prompts_per_step * plan.group_size // world))
    kv = rows * (plan.max_prompt_tokens + response_tokens(plan)) * 2 * shape.layers * shape.kv_dim * rb
    logits = rows * shape.vocab * 4 * 2
    if plan.engine_spec.copies_weights(
        plan.dtype, plan.rollout_dtype
    ):  # a whole copy in the sampler's dtype, kept
        copy = shape.params() * rb
        return _Sampler(kv + logits + copy, copy, copy, sync, copy + sync)
    # samples from the trainer's own module: under FSDP2 every group gathered (compute dtype); under
    # EP each experts module is unsharded by FSDP2 over its efsdp ranks (this rank's num_experts/ep,
    # a new buffer even when efsdp is 1) and then gathered whole beside that (whole_experts)
    gathered = shape.params() * compute if shards > 1 else 0.0
    if ep > 1:
        gathered += shape.layers * shape.expert_params() / ep * compute
    return _Sampler(kv + logits + gathered, 0.0, 0.0, 0.0, 0.0)


def transfer_piece(plan: CapacityPlan, shape: Shape) -> float:
    """Rollout devices: the trainer's extra memory while a version crosses, one tensor at a time: the
    largest gathered whole (trainer's dtype) and its copy in the sampler's dtype."""
    return largest_tensor(shape) * (BYTES[plan.dtype] + BYTES[plan.rollout_dtype or plan.dtype])


def sampler_side(plan: CapacityPlan, shape: Shape, gpu_bytes: float) -> tuple[list[str], float]:
    """Rollout devices: the sampler process's device (its own GPU), and its peak. It holds its model
    in the sampler's dtype, ``K + 1`` buffers the versions are received into, and the HF engine's KV
    cache and logits or vLLM's share (whose own weights copy lies inside it)."""
    gib = lambda b: f"{b / 2**30:8.1f} GiB"  # noqa: E731
    rb, K = BYTES[plan.rollout_dtype or plan.dtype], plan.async_staleness
    model = shape.params() * rb
    buffers = (K + 1) * model
    if plan.engine_spec.gpu_share:
        engine, what = plan.vllm_gpu_memory_utilization * gpu_bytes, "vLLM's share (its weights inside)"
    else:
        rows = min(HF_GENERATION_CHUNK, max(1, plan.prompts_per_step * plan.group_size))
        kv = rows * (plan.max_prompt_tokens + response_tokens(plan)) * 2 * shape.layers * shape.kv_dim * rb
        engine, what = kv + rows * shape.vocab * 4 * 2, "HF engine: KV cache and logits"
    peak = model + buffers + engine
    lines = [
        f"sampler side ({','.join(plan.rollout_devices)}, one process, {plan.engine_spec.name} engine, "
        f"{plan.rollout_dtype or plan.dtype}):",
        f"  model                   {gib(model)}",
        f"  received versions       {gib(buffers)}   (K+1 = {K + 1} buffers a thread fills while it samples)",
        f"  engine                  {gib(engine)}   ({what})",
        f"  sampler peak            {gib(peak)}"
        + (f" of {gpu_bytes / 2**30:.1f} GiB: {'fits' if peak <= gpu_bytes else 'does NOT fit'}"
           if not plan.rollout_devices[:1] == ("cpu",) else " (host memory)"),
        "trainer side (the GPUs below): no sampler; a version crosses one tensor at a time"
        f" ({gib(transfer_piece(plan, shape)).strip()} at most, in the weight sync)",
    ]  # fmt: skip
    return lines, peak


def largest_micro_batch(plan: CapacityPlan, shape: Shape, world: int, gpu_bytes: float) -> int:
    """The largest ``micro_batch_size`` (sequences per forward) whose peak fits, 0 when none does.
    Below a whole minibatch the peak grows with the micro-batch (bisection: ~20 estimates for a
    million sequences); the whole minibatch in one forward holds no gradients across micro-batches,
    so it may fit where smaller ones do not: tried first."""

    def fits(m: int) -> bool:
        return (
            estimate(dataclasses.replace(plan, micro_batch_size=m), shape, world, gpu_bytes).peak <= gpu_bytes
        )

    per_minibatch = max(1, plan.prompts_per_step * plan.group_size // world // plan.num_minibatches)
    if fits(per_minibatch):
        return per_minibatch
    lo, hi = 0, per_minibatch - 1  # fits(lo) (0: none), the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def kv_bytes_per_token(plan: CapacityPlan, shape: Shape) -> float:
    """vLLM's KV cache per token on one rank: keys and values of every layer, this rank's KV heads
    (split over the tensor-parallel ranks; a head is copied where there are more ranks than heads)."""
    heads = -(-shape.kv_heads // plan.vllm_tensor_parallel_size)
    return 2 * shape.layers * heads * shape.head_dim * BYTES[plan.rollout_dtype or plan.dtype]


def kv_lines(plan: CapacityPlan, shape: Shape, world: int, kv_bytes: float) -> list[str]:
    """vLLM's KV-cache capacity in tokens (its share less its weights, ``kv_bytes``, less the CUDA
    context and vLLM's memory outside the cache: :data:`VLLM_NON_KV_GIB`; at most) beside the tokens
    one step's rollout asks of each rank (its instance's rows x
    prompt + response); a warning line when the batch asks more: vLLM then preempts and recomputes
    sequences (slower, not a failure)."""
    per_token = kv_bytes_per_token(plan, shape)
    kv_bytes -= (CUDA_CONTEXT_GIB + VLLM_NON_KV_GIB) * 2**30  # see the constants
    capacity = max(0.0, kv_bytes) / per_token
    rows = plan.prompts_per_step * plan.group_size // world * plan.vllm_tensor_parallel_size
    asked = rows * (plan.max_prompt_tokens + response_tokens(plan))
    lines = [
        f"vLLM KV cache per rank at most {max(0.0, kv_bytes) / 2**30:.1f} GiB (its share less its weights "
        f"and {CUDA_CONTEXT_GIB + VLLM_NON_KV_GIB:g} GiB of CUDA context, activations and graphs): "
        f"{capacity / 1e3:,.0f}k tokens at {per_token / 2**10:.0f} KiB per token; a step asks up to "
        f"{asked / 1e3:,.0f}k ({rows} rows x {plan.max_prompt_tokens}+{response_tokens(plan)} tokens)"
    ]
    if asked > capacity:
        lines.append(
            f"warning: the batch asks {asked / max(capacity, 1):.1f}x the KV cache vLLM holds: it will preempt "
            "and recompute sequences (slower, not a failure); fewer prompts_per_step or max_new_tokens, or a "
            "larger vllm_gpu_memory_utilization, avoid it"
        )
    return lines


def _title(
    plan: CapacityPlan, spec: str, shape: Shape, gpus: int, gpu_bytes: float, given: str, nodes: int
) -> str:
    """The plan's first line: the model, the machines and how the model is split over them."""
    ep = expert_parallel(plan, shape, gpus)
    kind = f"MoE, {shape.experts} experts top-{shape.top_k}" if shape.experts else "dense"
    sharded = plan.parallel == "fsdp" and gpus > 1
    shard = f"FSDP2 over {gpus}" if sharded else ("DDP" if gpus > 1 else "1 process")
    shard += f", experts over EP groups of {ep}" if ep > 1 else ""
    where = f"{nodes} nodes x {gpus // nodes} GPUs" if nodes > 1 else f"{gpus} GPU(s)"
    return (
        f"{spec}: {shape.params() / 1e9:.2f}B parameters, {shape.layers} layers ({kind}); {where} x "
        f"{gpu_bytes / 2**30:.1f} GiB ({given or f'{gpu_bytes:.4g} bytes'}); {shard}; trainer {plan.dtype}"
        + (", bf16 compute" if plan.mixed_precision == "bf16" else "")
        + (", activation checkpointing" if plan.activation_checkpointing else "")
    )


def report(
    plan: CapacityPlan,
    spec: str,
    gpus: int,
    gpu_bytes: float,
    given: str = "",
    nodes: int = 1,
    shape: Shape | None = None,
) -> tuple[str, bool]:
    """``gspo plan``'s table for ``plan`` on ``gpus`` GPUs (over ``nodes``) of ``gpu_bytes`` each
    (``given``: the flag as the user wrote it), phase by phase, and whether every phase fits (no
    margin beyond the GPU)."""
    if not (isinstance(gpu_bytes, (int, float)) and math.isfinite(gpu_bytes) and gpu_bytes > 0):
        raise GspoError(f"GPU memory must be a positive number of bytes (got {gpu_bytes!r})")
    shape = shape or shape_of(spec)
    e = estimate(plan, shape, gpus, gpu_bytes)
    gib = lambda b: f"{b / 2**30:8.1f} GiB"  # noqa: E731
    sharded = plan.parallel == "fsdp" and gpus > 1
    P, T = plan.max_prompt_tokens, response_tokens(plan)
    vllm = plan.engine_spec.gpu_share
    states = e.weights + e.optimizer
    side = sampler_side(plan, shape, gpu_bytes) if plan.rollout_devices else ([], 0.0)
    lines = [
        _title(plan, spec, shape, gpus, gpu_bytes, given, nodes),
        "per GPU, start-up ("
        + ("each rank reads its own shards from the files (a hub id fetched once per node first)" if sharded
           else "weights loaded")
        + "):",
        f"  weights                 {gib(e.weights)}",
        f"  loading one tensor      {gib(e.load)}   (one tensor whole, read or broadcast; this rank's shard copied out)",
        f"  AdamW moments           {gib(e.optimizer)}   (loaded before the sampler on --resume; none yet on a fresh run)",
        f"  sampler started         {gib(e.start_engine)}   ("
        + ("vLLM's share + max(first weight sync, start check one layer at a time)" if vllm
           else "the HF engine's copy and its first sync" if e.start_engine else "samples from the trainer")
        + ")",
        f"  start-up peak, fresh    {gib(e.fresh_startup_peak)}   (no AdamW moments yet)",
        f"  start-up peak, resume   {gib(e.startup_peak)}   (AdamW moments loaded first)",
        f"per GPU, update (micro-batch of {e.rows_per_forward} x up to {P}+{T} tokens):",
        f"  weights + AdamW moments {gib(states)}",
        f"  gradients held          {gib(e.gradients)}",
        f"  FSDP2 unsharded groups  {gib(e.fsdp_unsharded)}",
        f"  activations             {gib(e.activations)}",
        f"  LM head buffers         {gib(e.lm_head)}",
        f"  sampler kept            {gib(e.sampler_kept)}   ("
        + ("vLLM asleep" if vllm and not e.sampler_kept else "vLLM awake: no sleep mode off a GPU" if vllm
           else f"the HF engine's {plan.rollout_dtype} copy" if e.sampler_kept else "none")
        + ")",
        f"  update peak             {gib(e.update_peak)}",
        f"per GPU, rollout ({plan.engine_spec.name} engine):",
        f"  weights + AdamW moments {gib(states)}",
        f"  sampler                 {gib(e.sampler)}",
        f"  rollout peak            {gib(e.rollout_peak)}",
        "per GPU, weight sync:",
        f"  weights + AdamW moments {gib(states)}",
        f"  sampler resident        {gib(e.sync_peak - states - e.sync)}",
        f"  weight sync             {gib(e.sync)}   (2x the largest piece streamed, in {plan.dtype})",
        f"  sync peak               {gib(e.sync_peak)}",
    ]  # fmt: skip
    lines[1:1] = side[0]  # rollout devices: the sampler's GPU first, then the trainer's
    fits = e.peak <= gpu_bytes  # no margin: every measured estimate was at or below the truth
    fits = fits and (side[1] <= gpu_bytes or plan.rollout_devices[:1] == ("cpu",))
    worst = max(e.phases().items(), key=lambda kv: kv[1])[0]
    verdict = "fits" if fits else "does NOT fit"
    if vllm:
        need = shape.params() * BYTES[plan.rollout_dtype or plan.dtype] / plan.vllm_tensor_parallel_size
        tp, kv = plan.vllm_tensor_parallel_size, shape.kv_heads
        copies = f"; tensor parallel {tp} over {kv} KV heads: each on {tp // kv} ranks" if tp > kv else ""
        lines.append(f"vLLM weights in its share {gib(need).strip()} of {gib(e.sampler).strip()}{copies}")
        if need + (CUDA_CONTEXT_GIB + VLLM_NON_KV_GIB) * 2**30 >= e.sampler:  # no KV cache at all
            fits, verdict = (
                False,
                "does NOT fit (vllm_gpu_memory_utilization leaves vLLM no room for its weights, "
                "activations and KV cache)",
            )
        lines += kv_lines(plan, shape, gpus, e.sampler - need)
    lines.append(f"peak {gib(e.peak).strip()} ({worst}) of {gpu_bytes / 2**30:.1f} GiB per GPU: {verdict}")
    best = largest_micro_batch(plan, shape, gpus, gpu_bytes)
    lines.append(f"largest micro_batch_size that fits: {best}" if best else "no micro_batch_size fits")
    return "\n".join(lines), fits
