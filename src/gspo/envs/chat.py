"""Chat-native trajectories (``--chat-template`` with an environment): the conversation rendered by the
tokenizer's chat template, turn by turn, as the model sees it at inference.

A trajectory is the conversation ``[system?, user, assistant, tool, assistant, ...]``:

- the prompt: the template's rendering of the first messages, the environment's tools declared
  (``apply_chat_template(..., tools=env.chat_tools)``), and the generation prompt;
- a model turn: the model's own sampled tokens up to and including its EOS (the template's
  end-of-turn token), never re-tokenized; its text is the assistant message's content;
- an observation: the environment's messages (a string: one ``tool`` message); its tokens are the
  template's text after the model's end-of-turn token up to the next generation prompt (what the
  template places after the turn, e.g. ChatML's newline, the messages, ``<|im_start|>assistant\\n``).

Per turn the conversation is rendered before and after the observation; the observation is the text
after the k-th EOS of the second rendering, k counted in the first. So the trajectory's ids equal
``apply_chat_template(conversation, tools=..., tokenize=True)`` up to its last EOS whenever the
model's turns are the tokenizer's own tokenization of their text (a sampled sequence that is not,
e.g. ``4`` ``6`` where the vocabulary has ``46``, stays as sampled: the log-probs are of what was
sampled). A template that re-renders an earlier turn differently (Qwen3 dropping past reasoning)
does not change the trajectory: it holds what the model was conditioned on when it sampled.

Tool calls: the model is expected to write them as the template does (:func:`tool_call_text`; the
Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``). A template that ignores
``tools=`` (SmolLM2's plain ChatML) gets the tools declared by gspo in the system message, in the words
of Qwen2.5's template (:func:`tools_system_text`), with a warning; there the tool message renders as
the template renders any role (``<|im_start|>tool``). A template that cannot render a ``tool``
message, or that does not end an assistant turn with the tokenizer's EOS, is refused in one line.
"""

from __future__ import annotations

import json
from typing import Any

from gspo.errors import GspoError, one_line, warn
from gspo.tasks.datasets import Prompt

Messages = list[dict[str, Any]]


def render(tokenizer: Any, messages: Messages, tools: Messages | None, generation_prompt: bool) -> str:
    """The template's text of ``messages``; a failure is one line naming the message's role."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )
    except Exception as e:  # noqa: BLE001 (jinja raises anything, a template's raise_exception too)
        raise GspoError(
            f"the tokenizer's chat template cannot render a {messages[-1].get('role')!r} message: "
            f"{one_line(e, typed=False)}"
        ) from None
    if not isinstance(text, str):
        raise GspoError(f"the tokenizer's chat template returned {type(text).__name__}, expected a string")
    return text


def tools_system_text(tools: Messages) -> str:
    """The tools' declaration as Qwen2.5's template writes it into the system message."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """A call in the Hermes/Qwen format, exactly as Qwen2.5's template renders ``tool_calls``."""
    args = json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def tool_call_text(tokenizer: Any, name: str, arguments: dict[str, Any]) -> str:
    """The text of an assistant turn that calls ``name(**arguments)``, as the template renders a
    ``tool_calls`` entry (between the generation prompt and the EOS); :func:`hermes_call` when the
    template does not render ``tool_calls``. Demonstrations use it, so the model learns the format
    the template itself writes."""
    user = [{"role": "user", "content": "x"}]
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    start = render(tokenizer, user, None, True)
    full = render(tokenizer, [*user, {"role": "assistant", "content": "", "tool_calls": [call]}], None, False)
    turn = full[len(start) :] if full.startswith(start) else ""
    turn = turn.split(tokenizer.eos_token)[0] if tokenizer.eos_token else ""
    return turn if turn.strip() else hermes_call(name, arguments)


class ChatFormat:
    """How one tokenizer's chat template renders trajectories (``system``: the config's system prompt)."""

    def __init__(self, tokenizer: Any, system: str | None) -> None:
        eos = getattr(tokenizer, "eos_token", None)
        if not isinstance(eos, str) or not eos:
            raise GspoError("--chat-template with an environment needs a tokenizer with an EOS token")
        self.tokenizer, self.system, self.eos = tokenizer, system, eos
        self._declares: dict[str, bool] = {}

    def declares(self, tools: Messages) -> bool:
        """Whether the template writes ``tools`` into the prompt (renders differently with them)."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._declares:
            probe = [{"role": "user", "content": "x"}]
            self._declares[key] = render(self.tokenizer, probe, tools, True) != render(
                self.tokenizer, probe, None, True
            )
            if not self._declares[key]:
                warn(
                    "the tokenizer's chat template does not declare tools (tools= changes nothing); gspo "
                    "lists them in the system message, as Qwen2.5's template does"
                )
        return self._declares[key]

    def start(self, prompt: Prompt, tools: Messages | None) -> Conversation:
        """The conversation of a prompt from ``env.reset`` (a string: one user message after the
        system prompt; chat messages: as they are, the system prompt first when they have none)."""
        if isinstance(prompt, str):
            messages = [{"role": "system", "content": self.system}] if self.system else []
            messages.append({"role": "user", "content": prompt})
        else:
            messages = [dict(m) for m in prompt]
            if self.system and not any(m.get("role") == "system" for m in messages):
                messages.insert(0, {"role": "system", "content": self.system})
        if tools and not self.declares(tools):
            text = tools_system_text(tools)
            if messages[0].get("role") == "system":
                messages[0] = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
            else:
                messages.insert(0, {"role": "system", "content": text})
            tools = None
        return Conversation(self, messages, tools)


class Conversation:
    """One trajectory's messages so far, and the template's text of them with the generation prompt."""

    def __init__(self, fmt: ChatFormat, messages: Messages, tools: Messages | None) -> None:
        self.fmt, self.messages, self.tools = fmt, messages, tools
        self.text = render(fmt.tokenizer, messages, tools, True)

    def prompt_ids(self) -> list[int]:
        return self.fmt.tokenizer(self.text, add_special_tokens=False).input_ids

    def observe(self, model_turn: str, observation: Messages) -> list[int]:
        """Token ids after the model's turn (``model_turn``, its text; its tokens end at EOS) up to the
        next generation prompt, with ``observation`` rendered in between."""
        tok, eos = self.fmt.tokenizer, self.fmt.eos
        self.messages.append({"role": "assistant", "content": model_turn})
        k = render(tok, self.messages, self.tools, False).count(eos)
        if k <= self.text.count(eos):
            raise GspoError(
                f"the tokenizer's chat template does not end an assistant turn with its EOS token {eos!r}, "
                "where the model's turn ends: chat-template multi-turn rollouts need it"
            )
        self.messages += observation
        self.text = render(tok, self.messages, self.tools, True)
        pos = -len(eos)
        for _ in range(k):
            pos = self.text.find(eos, pos + len(eos))
            if pos < 0:
                raise GspoError(
                    "the tokenizer's chat template renders earlier turns without their end-of-turn "
                    f"token {eos!r} once a {observation[-1]['role']!r} message follows them"
                )
        return tok(self.text[pos + len(eos) :], add_special_tokens=False).input_ids


def demo_tokens(
    fmt: ChatFormat, prompt: Prompt, tools: Messages | None, demo: list[tuple[str, bool]]
) -> tuple[list[int], list[int], list[int], list[int]]:
    """``(prompt_ids, ids, model_mask, obs_mask)`` of a demonstration (``(text, is_model_turn)``
    segments after the prompt; an observation's text is one ``tool`` message) as a chat-template
    rollout makes it: the model's turns as the tokenizer's tokens of their text and EOS, the rest
    the template's. The warm start on these teaches exactly the token sequence RL samples from."""
    conv = fmt.start(prompt, tools)
    prompt_ids, tok = conv.prompt_ids(), fmt.tokenizer
    ids: list[int] = []
    model: list[int] = []
    last = ""
    for text, is_model in demo:
        if is_model:
            t, last = tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id], text
        else:
            t = conv.observe(last, [{"role": "tool", "content": text}])
        ids += t
        model += [int(is_model)] * len(t)
    return prompt_ids, ids, model, [1 - m for m in model]
