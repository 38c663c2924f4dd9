"""Tools a model calls from its turn: a calculator and Python, and the tool-calling environment.

Tool-call formats parsed from a model turn (the first call in the turn is run):

- tags: ``<calc>12+34</calc>``, ``<python>print(2**10)</python>``
- the Hermes/Qwen chat-template format: ``<tool_call>{"name": "calc", "arguments": {"expression":
  "12+34"}}</tool_call>`` (``python`` takes ``{"code": ...}``)
- call form, for vocabularies without ``<`` or ``/`` (the embedded character tokenizer):
  ``calc(12+34)``

The observation is the tool's output, ``<output>...</output>`` after a tag or JSON call and
``=...`` after a call-form call (``calc(12+34)=46``). A malformed call (unclosed tag, bad JSON,
unknown tool, unbalanced parentheses, an expression the calculator refuses) gets an ``error: ...``
observation, never an exception. A turn without a tool call is the answer: the task's reward scores
it and the trajectory is done.

Under ``--chat-template`` (:mod:`gspo.envs.chat`) the tools are declared to the template
(:attr:`ToolEnv.chat_tools`, JSON schemas), the model is expected to call them in the Hermes/Qwen
``<tool_call>`` JSON format (the other formats are still parsed), and the output goes back as a
``tool`` message holding the bare output (``46``, ``error: ...``), which the template wraps.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gspo.envs.base import Step, score_turn
from gspo.tasks.datasets import Example, Prompt

MAX_EXPR_CHARS = 256
MAX_DIGITS = 100  # calculator integers (operands and results) up to 10^100
MAX_OUTPUT_CHARS = 512  # tool output shown to the model
PYTHON_TIMEOUT_S = 5.0  # the code reward's sandbox limit

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class ToolError(ValueError):
    """A tool call the tool refuses: becomes an ``error: ...`` observation."""


def _bounded(x: Any) -> Any:
    if isinstance(x, complex):  # e.g. (-1) ** 0.5
        raise ToolError("complex result (a negative number to a fractional power?)")
    if isinstance(x, int) and abs(x) >= 10**MAX_DIGITS:
        raise ToolError(f"number too large (limit 10^{MAX_DIGITS})")
    if isinstance(x, float) and x != x:
        raise ToolError("result is not a number")
    if isinstance(x, float) and x in (float("inf"), float("-inf")):
        raise ToolError("number too large for a float (limit about 1.8e308)")
    if not isinstance(x, int | float):
        raise ToolError("result is not a real number")
    return x


def _check_pow(a: int | float, b: int | float) -> None:
    """Refuse ``a ** b`` before computing it when its size is out of bounds (10 ** 10 ** 9 would
    take minutes); 0 and +-1 to any power are small."""
    if a == 0 or abs(a) == 1:
        return
    log10 = b * math.log10(abs(a))
    if log10 > 4 * MAX_DIGITS:
        raise ToolError(f"number too large (limit 10^{MAX_DIGITS})")
    if log10 < -4 * MAX_DIGITS:
        raise ToolError("underflow: result too small for a float (below about 1e-308)")


def _binop(op: ast.operator, a: int | float, b: int | float) -> int | float:
    try:
        if isinstance(op, ast.Pow):
            _check_pow(a, b)
        out = _BINOPS[type(op)](a, b)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:  # float overflow, or an int too large to convert to a float
        raise ToolError("number too large for a float (limit about 1.8e308)") from None
    if (
        out == 0
        and isinstance(op, ast.Mult | ast.Div | ast.Pow)
        and a != 0
        and (b != 0 or isinstance(op, ast.Pow))
    ):
        raise ToolError("underflow: result too small for a float (below about 1e-308)")
    return _bounded(out)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _binop(node.op, _eval(node.left), _eval(node.right))
    raise ToolError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Value of an arithmetic expression (``+ - * / // % **``, parentheses, int/float literals),
    parsed with :mod:`ast` and evaluated node by node (never ``eval``); numbers bounded by
    ``10^MAX_DIGITS``. Raises :class:`ToolError` on anything else."""
    if len(expression) > MAX_EXPR_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise ToolError(f"cannot parse {expression.strip()[:40]!r}") from None
    v = _eval(tree.body)
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e15 else format(v, ".12g")
    return str(v)


def python_tool(code: str, timeout_s: float = PYTHON_TIMEOUT_S) -> str:
    """Run ``code`` in the code reward's sandbox (:func:`gspo.tasks.sandbox.run_untrusted`: same
    isolation, same time limit); its stdout, or the last line of its error."""
    from gspo.tasks.sandbox import run_untrusted

    res = run_untrusted(code, timeout_s=timeout_s)
    if res.timed_out:
        raise ToolError(f"timed out after {timeout_s:g} s")
    if res.returncode != 0:
        lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
        raise ToolError(lines[-1] if lines else f"exit code {res.returncode}")
    return res.stdout.rstrip("\n")


@dataclass
class ToolCall:
    tool: str  # "calc" or "python"
    argument: str
    style: str  # "tag", "json" or "call"


_NAMES = {"calc": "calc", "calculator": "calc", "python": "python"}
_TAG = re.compile(r"<(calc|python|tool_call)>")


def _call_form(text: str, start: int) -> ToolCall | str:
    """``calc(...)`` from ``start`` (the ``calc(``): up to the matching parenthesis."""
    depth, i0 = 0, start + len("calc")
    for i in range(i0, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return ToolCall("calc", text[i0 + 1 : i], "call")
    return "unbalanced parentheses in calc(...)"


def parse_tool_call(text: str) -> ToolCall | str | None:
    """The first tool call in ``text``; a string says why a call is malformed; None: no call."""
    m, c = _TAG.search(text), text.find("calc(")
    if m is None and c < 0:
        return None
    if m is None or (0 <= c < m.start()):
        return _call_form(text, c)
    name, body_start = m.group(1), m.end()
    end = text.find(f"</{name}>", body_start)
    if end < 0:
        return f"unclosed <{name}>"
    body = text[body_start:end]
    if name != "tool_call":
        return ToolCall(name, body, "tag")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return f"tool_call is not valid JSON ({e.msg})"
    if not isinstance(call, dict) or _NAMES.get(str(call.get("name"))) is None:
        return f"unknown tool {call.get('name') if isinstance(call, dict) else call!r} (tools: calc, python)"
    args = call.get("arguments", {})
    if isinstance(args, str):  # some templates carry the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return "tool_call arguments are not valid JSON"
    tool = _NAMES[str(call["name"])]
    key = "expression" if tool == "calc" else "code"
    if not isinstance(args, dict) or not isinstance(args.get(key), str):
        return f'tool_call to {tool} needs arguments {{"{key}": "..."}}'
    return ToolCall(tool, args[key], "json")


def _wrap(call: ToolCall | str, out: str) -> str:
    """A tool's output as plain-text observation: ``=out`` after a call-form call, else ``<output>``."""
    return f"={out}" if isinstance(call, ToolCall) and call.style == "call" else f"<output>{out}</output>"


def tool_output(call: ToolCall | str, tools: tuple[str, ...]) -> str:
    """The bare output of a parsed call (``error: ...`` for a malformed or refused one), at most
    ``MAX_OUTPUT_CHARS`` characters (then marked truncated)."""
    if isinstance(call, str):
        return f"error: {call}"
    if call.tool not in tools:
        return f"error: tool {call.tool} is not available (tools: {', '.join(tools)})"
    try:
        out = calculator(call.argument) if call.tool == "calc" else python_tool(call.argument)
    except ToolError as e:
        out = f"error: {e}"
    except (Exception, RecursionError) as e:  # a policy's input must never stop the run: it is told why
        out = f"error: {type(e).__name__}"
    if len(out) > MAX_OUTPUT_CHARS:
        out = out[:MAX_OUTPUT_CHARS] + "...(truncated)"
    return out


def _schema(name: str, description: str, arg: str, arg_description: str) -> dict[str, Any]:
    params = {"type": "object", "properties": {arg: {"type": "string", "description": arg_description}}}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": params | {"required": [arg]}},
    }


# each tool as the chat template's `tools=` declares it (OpenAI function schema)
TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    "calc": _schema(
        "calc",
        "Evaluate an arithmetic expression (+ - * / // % **, parentheses, numbers).",
        "expression",
        "the expression, e.g. 12+34",
    ),
    "python": _schema("python", "Run Python code and return what it prints.", "code", "the program"),
}


class ToolEnv:
    """A task with tools: a turn with a tool call gets the tool's output; a turn without one is the
    answer, scored by ``reward(prompts, completions, answers)``, and ends the trajectory."""

    def __init__(
        self,
        reward: Callable[..., list[float]],
        tools: tuple[str, ...] = ("calc", "python"),
        reward_name: str | None = None,
    ) -> None:
        self.reward, self.tools, self.reward_name = reward, tools, reward_name
        self.example: Example | None = None

    @property
    def chat_tools(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, declared to a chat template (``tools=``)."""
        return [TOOL_SCHEMAS[t] for t in self.tools]

    def reset(self, example: Example) -> Prompt:
        self.example = example
        return example.prompt

    def step(self, model_turn: str) -> Step:
        try:
            call = parse_tool_call(model_turn)
        except (ValueError, RecursionError) as e:  # JSON nested too deep, or a number past int's limit
            call = f"tool_call cannot be parsed ({type(e).__name__})"
        if call is not None:
            out = tool_output(call, self.tools)
            return Step(_wrap(call, out), 0.0, [{"role": "tool", "content": out}])
        ex = self.example
        assert ex is not None, "step before reset"
        return Step(None, score_turn(self.reward, self.reward_name, ex, model_turn))
