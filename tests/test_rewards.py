"""Reward functions, load_reward specs and safe_rewards error handling."""

from __future__ import annotations

import json
import math
import sys
import threading
import time

import numpy as np
import pytest

from gspo.errors import GspoError
from gspo.tasks.rewards import (
    boxed_match,
    code_execution_reward,
    combine,
    exact_match,
    extract_boxed,
    extract_code,
    format_reward,
    load_reward,
    make_code_reward,
    math_verify_reward,
    safe_rewards,
    with_timeout,
)


def _call(fn, completions, answers):
    return fn([""] * len(completions), completions, answers)


# ------------------------------------------------------------------------------------------------
# built-in rewards


def test_exact_match_strips_whitespace_only():
    """exact_match compares after strip(): surrounding whitespace ignored, case and inner text not."""
    assert _call(exact_match, [" 42\n", "42 ", "4 2", "Abc", ""], ["42", " 42", "42", "abc", ""]) == [
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
    ]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one, nested braces
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5 apples", "5"),
        ("\\boxed{12", None),  # truncated
        ("no box", None),
    ],
)
def test_extract_boxed(text, expected):
    """extract_boxed returns the content of the last \\boxed{} with balanced braces, else None."""
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\dfrac{3}{6}}", "1/2", 1.0),
        ("$\\boxed{x^2 + 1}$", "x^2+1", 1.0),
        ("first 3, then finally 1,000.", "1000", 1.0),  # last number, thousands comma
        ("it is 3.50", "7/2", 1.0),
        ("reasoning...\n#### 72", "Natalia sold 48... #### 72", 1.0),  # GSM8K style reference
        ("\\boxed{41}", "42", 0.0),
        ("1, 2, 3", "123", 0.0),  # a list is not one thousands-separated number
        ("no number here", "3", 0.0),
        ("\\boxed{5}", "$\\boxed{5}$", 1.0),
    ],
)
def test_boxed_match(completion, answer, expected):
    """boxed_match: last \\boxed{} else the final number, compared after normalization."""
    assert _call(boxed_match, [completion], [answer]) == [expected]


def test_math_verify_reward():
    """math_verify: symbolic equality (0.5 == 1/2, 1+x^2), wrong answers 0, works off the main thread."""
    pytest.importorskip("math_verify")
    completions = ["so \\boxed{\\frac{1}{2}}", "answer: $\\boxed{1+x^2}$", "I get \\boxed{4}", "#### 72"]
    answers = ["0.5", "x^2+1", "3", "72"]
    assert _call(math_verify_reward, completions, answers) == [1.0, 1.0, 0.0, 1.0]
    out: list = []
    t = threading.Thread(target=lambda: out.append(_call(math_verify_reward, completions, answers)))
    t.start()
    t.join(30)
    assert out == [[1.0, 1.0, 0.0, 1.0]]
    assert load_reward("math").__wrapped__ is math_verify_reward  # under the reward time limit


def test_math_without_math_verify_is_clear_error(monkeypatch):
    """Without math-verify installed, load_reward('math') says how to install it."""
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import raise ImportError
    with pytest.raises(GspoError, match=r"pip install gspo\[math\]"):
        load_reward("math")
    assert load_reward("boxed").__wrapped__ is boxed_match  # the dependency-free fallback still loads


def test_format_reward_full_match_dotall():
    """format_reward uses re.fullmatch with DOTALL: the whole completion must match, across lines."""
    fn = format_reward(r"<think>.*</think>\s*<answer>.*</answer>")
    completions = [
        "<think>a\nb</think>\n<answer>4</answer>",
        "<think>x</think><answer>4</answer> extra",
        "<answer>4</answer>",
    ]
    assert _call(fn, completions, ["", "", ""]) == [1.0, 0.0, 0.0]
    assert _call(load_reward("format:\\d+"), ["123", "12a"], ["", ""]) == [1.0, 0.0]
    with pytest.raises(GspoError, match=r"reward 'format:\(': invalid regex"):
        load_reward("format:(")


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("Here:\n```python\nx = 1\n```\nand\n```py\nx = 2\n```", "x = 2\n"),  # last python block
        ("```\nx = 3\n```", "x = 3\n"),  # untagged
        ("```python\nx = 4\n```\n```bash\nls\n```", "x = 4\n"),  # other languages ignored
        ("```python\nx = 5\n", "x = 5\n"),  # unterminated (truncated generation)
        ("x = 6", "x = 6"),  # no fence: the whole completion
    ],
)
def test_extract_code(completion, expected):
    """extract_code picks the last python (else untagged) fenced block, else the whole text."""
    assert extract_code(completion) == expected


def test_code_execution_reward_end_to_end(monkeypatch):
    """Code reward: passing asserts 1; failing assert, syntax error, infinite loop, network use 0."""
    from gspo.tasks import sandbox

    if sandbox.landlock_abi() == 0:  # the other layers still apply; the refusal is tested elsewhere
        monkeypatch.setattr(sandbox, "REQUIRE_FS_ISOLATION", False)
    fn = make_code_reward(timeout_s=1.5, workers=4)
    tests = "assert add(2, 3) == 5\n"
    completions = [
        "Sure:\n```python\ndef add(a, b):\n    return a + b\n```",
        "```python\ndef add(a, b):\n    return a - b\n```",
        "```python\ndef add(a, b)\n    return a + b\n```",
        "```python\ndef add(a, b):\n    while True:\n        pass\n```",
        "```python\nimport socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n"
        "def add(a, b):\n    return a + b\n```",
    ]
    t0 = time.monotonic()
    assert _call(fn, completions, [tests] * 5) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert time.monotonic() - t0 < 8.0
    assert _call(code_execution_reward, [completions[0]], [tests]) == [1.0]
    assert load_reward("code") is code_execution_reward


# ------------------------------------------------------------------------------------------------
# load_reward


USER_REWARD = """
def length_reward(prompts, completions, answers):
    return [float(len(c)) for c in completions]

def trl_style(completions, **kwargs):
    return [0.0 for _ in completions]

NOT_A_FUNCTION = 3
"""


def test_load_reward_builtins_and_unknown():
    """Registry names map to the built-ins; an unknown name lists the choices."""
    assert load_reward("exact_match") is exact_match  # linear in the completion: no time limit needed
    assert load_reward("boxed").__wrapped__ is boxed_match
    with pytest.raises(GspoError, match=r"unknown reward 'nope' \(built-in: exact_match, math, boxed, code"):
        load_reward("nope")


def test_load_reward_by_import_path(tmp_path, monkeypatch):
    """'package.module:function' imports the module; errors name the spec and what is missing."""
    pkg = tmp_path / "gspo_test_rewardpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("gspo_test_rewardpkg.mod:length_reward")
    assert _call(fn, ["ab", "abcd"], ["", ""]) == [2.0, 4.0]
    with pytest.raises(
        GspoError,
        match=r"reward 'gspo_test_rewardpkg.mod:missing': gspo_test_rewardpkg.mod "
        r"has no attribute 'missing'",
    ):
        load_reward("gspo_test_rewardpkg.mod:missing")
    with pytest.raises(
        GspoError,
        match=r"reward 'gspo_test_nosuchpkg.mod:f': cannot import module "
        r"'gspo_test_nosuchpkg.mod': ModuleNotFoundError",
    ):
        load_reward("gspo_test_nosuchpkg.mod:f")
    with pytest.raises(GspoError, match=r"NOT_A_FUNCTION is not callable \(got int\)"):
        load_reward("gspo_test_rewardpkg.mod:NOT_A_FUNCTION")
    with pytest.raises(
        GspoError,
        match=r"trl_style\(completions, \*\*kwargs\) cannot be called as "
        r"fn\(prompts, completions, answers\)",
    ):
        load_reward("gspo_test_rewardpkg.mod:trl_style")


def test_load_reward_by_file_path(tmp_path):
    """'path/to/file.py:function' loads the file (which may import a sibling module)."""
    (tmp_path / "gspo_test_helper.py").write_text("SCALE = 10.0\n")
    f = tmp_path / "my_reward.py"
    f.write_text(
        "from gspo_test_helper import SCALE\n" + USER_REWARD.replace("float(len(c))", "SCALE * len(c)")
    )
    fn = load_reward(f"{f}:length_reward")
    assert _call(fn, ["abc"], [""]) == [30.0]
    with pytest.raises(GspoError, match=rf"reward '{f}:nope': {f} has no attribute 'nope'"):
        load_reward(f"{f}:nope")
    missing = tmp_path / "missing.py"
    with pytest.raises(GspoError, match=rf"reward '{missing}:f': file not found: {missing}"):
        load_reward(f"{missing}:f")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('bad import')\n")
    with pytest.raises(
        GspoError, match=rf"reward '{broken}:f': importing {broken} failed: RuntimeError: bad import"
    ):
        load_reward(f"{broken}:f")


def test_load_reward_module_in_cwd(tmp_path, monkeypatch):
    """'my_module:fn' finds my_module.py in the cwd even though a console script's sys.path lacks it."""
    (tmp_path / "gspo_test_cwd_reward.py").write_text(USER_REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    fn = load_reward("gspo_test_cwd_reward:length_reward")
    assert _call(fn, ["abc"], [""]) == [3.0]


def test_combine_weighted_sum():
    """combine returns sum_k w_k * r_k per sample; a component with the wrong length raises."""
    fn = combine([(exact_match, 1.0), (format_reward(r"\d+"), 0.25)])
    assert _call(fn, ["42", "41", "x"], ["42", "42", "42"]) == [1.25, 0.25, 0.0]
    bad = combine([(exact_match, 1.0), (lambda p, c, a: [1.0], 1.0)])
    with pytest.raises(ValueError, match="returned 1 values for 2 samples"):
        _call(bad, ["a", "b"], ["a", "b"])
    with pytest.raises(ValueError):
        combine([])


# ------------------------------------------------------------------------------------------------
# safe_rewards

P, C, A = ["p0", "p1", "p2", "p3"], ["c0", "c1", "c2", "c3"], ["a0", "a1", "a2", "a3"]


def raising(prompts, completions, answers):
    if "c2" in completions:
        raise ValueError("boom on c2")
    return [1.0] * len(completions)


def nan_at_3(prompts, completions, answers):
    return [math.nan if c == "c3" else 0.5 for c in completions]


def inf_at_1(prompts, completions, answers):
    return [math.inf if c == "c1" else 0.5 for c in completions]


def wrong_length(prompts, completions, answers):
    return [1.0] * (len(completions) - 1) if len(completions) > 1 else [1.0]


def str_at_0(prompts, completions, answers):
    return ["good" if c == "c0" else 1.0 for c in completions]


def test_safe_rewards_passes_good_values_through():
    """Valid returns (list, numpy array, bools, ints) become floats with zero bad samples."""
    assert safe_rewards(lambda p, c, a: [1, 0.5, True, 0], P, C, A) == ([1.0, 0.5, 1.0, 0.0], 0)
    assert safe_rewards(lambda p, c, a: np.array([0.1, 0.2, 0.3, 0.4]), P, C, A)[0] == pytest.approx(
        [0.1, 0.2, 0.3, 0.4]
    )
    assert safe_rewards(raising, [], [], []) == ([], 0)


@pytest.mark.parametrize(
    "fn,message",
    [
        (raising, "reward function raising raised ValueError: boom on c2"),
        (nan_at_3, "reward function nan_at_3 returned nan for sample 3 (completion 'c3')"),
        (inf_at_1, "reward function inf_at_1 returned inf for sample 1"),
        (lambda p, c, a: [-math.inf] * 4, "returned -inf for sample 0"),
        (wrong_length, "reward function wrong_length returned 3 values for 4 samples"),
        (str_at_0, "reward function str_at_0 returned str 'good' for sample 0"),
        (lambda p, c, a: [None] * 4, "returned None for sample 0"),
        (lambda p, c, a: 1.0, "returned float instead of a list of 4 floats"),
    ],
)
def test_safe_rewards_error_mode(fn, message):
    """on_error='error': each kind of bad reward is a one-line GspoError naming function and sample."""
    with pytest.raises(GspoError) as ei:
        safe_rewards(fn, P, C, A, on_error="error", name=fn.__name__)
    assert message in str(ei.value)
    assert "\n" not in str(ei.value)


def test_safe_rewards_error_mode_names_the_spec():
    """The message names the caller's ``name`` (the reward spec), or 'reward' when none is given."""
    with pytest.raises(GspoError, match="^reward function my.mod:fn returned nan for sample 3"):
        safe_rewards(nan_at_3, P, C, A, name="my.mod:fn")
    with pytest.raises(GspoError, match="^reward function reward raised ValueError: boom on c2$"):
        safe_rewards(raising, P, C, A)


@pytest.mark.parametrize(
    "fn,expected,n_bad",
    [
        (raising, [1.0, 1.0, 0.0, 1.0], 1),  # whole call raised -> per-sample isolation
        (nan_at_3, [0.5, 0.5, 0.5, 0.0], 1),
        (inf_at_1, [0.5, 0.0, 0.5, 0.5], 1),
        (wrong_length, [1.0, 1.0, 1.0, 1.0], 0),  # per-sample calls return one value each
        (str_at_0, [0.0, 1.0, 1.0, 1.0], 1),
    ],
)
def test_safe_rewards_zero_mode(fn, expected, n_bad):
    """on_error='zero': offending samples score 0.0, the others keep their reward, bad ones counted."""
    assert safe_rewards(fn, P, C, A, on_error="zero") == (expected, n_bad)


@pytest.mark.parametrize(
    "fn,first",
    [
        (lambda p, c, a: 1.0, "sample 0: returned float instead of a list of 1 floats"),
        (lambda p, c, a: [math.nan] * len(c), "sample 0: returned nan"),
        (lambda p, c, a: 1 / 0, "sample 0: raised ZeroDivisionError: division by zero"),
    ],
)
def test_safe_rewards_zero_mode_all_failed_is_an_error(fn, first):
    """on_error='zero' with every score of the batch failing: one line, not all-zero rewards."""
    with pytest.raises(GspoError) as ei:
        safe_rewards(fn, P, C, A, on_error="zero", name="my.mod:fn")
    msg = str(ei.value)
    assert msg.startswith("reward function my.mod:fn failed on all 4 samples of the batch (") and first in msg
    assert "all-zero rewards" in msg and "\n" not in msg
    assert safe_rewards(raising, P, C, A, on_error="zero")[1] == 1  # some good samples: still zeros + count


def test_safe_rewards_gives_rewards_string_prompts():
    """Chat-message prompts reach the reward as the text of their last user message."""
    seen = []

    def fn(prompts, completions, answers):
        seen.extend(prompts)
        return [1.0] * len(completions)

    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert safe_rewards(fn, [chat, "plain"], ["4", "x"], ["4", "x"]) == ([1.0, 1.0], 0)
    assert seen == ["2+2?", "plain"]


def test_safe_rewards_gspo_error_propagates():
    """A GspoError from the reward (setup problem, e.g. missing package) is never zeroed away."""

    def needs_pkg(p, c, a):
        raise GspoError("reward 'math' needs the math-verify package: pip install gspo[math]")

    for mode in ("error", "zero"):
        with pytest.raises(GspoError, match="needs the math-verify package"):
            safe_rewards(needs_pkg, P, C, A, on_error=mode)
    with pytest.raises(ValueError, match="on_error"):
        safe_rewards(exact_match, P, C, A, on_error="ignore")


# ------------------------------------------------------------------------------------------------
# time limit of user reward functions

SLOW_REWARD = """
import time, pathlib

def slow(prompts, completions, answers):
    try:
        time.sleep(30)
    finally:
        pathlib.Path(__file__).with_name("cleanup-ran").write_text("yes")
    return [1.0] * len(completions)

def stubborn(prompts, completions, answers):
    while True:
        try:
            time.sleep(30)
        except Exception:
            pass

def fast(prompts, completions, answers):
    return [0.5] * len(completions)

def uses_signals(prompts, completions, answers):
    import signal
    old = signal.signal(signal.SIGALRM, lambda *a: None)  # main-thread only, like math-verify
    signal.signal(signal.SIGALRM, old)
    return [1.0] * len(completions)
"""


@pytest.fixture
def slow_file(tmp_path):
    f = tmp_path / "slow_reward.py"
    f.write_text(SLOW_REWARD)
    return f


@pytest.mark.parametrize("mode", ["error", "zero"])
def test_user_reward_timeout_interrupts_with_one_line(slow_file, mode):
    """A user reward that sleeps 30 s is interrupted at timeout_s (its finally runs) and raises one
    line naming the function and the limit, in both on_error modes."""
    spec = f"{slow_file}:slow"
    fn = load_reward(spec, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(GspoError) as ei:
        safe_rewards(fn, P, C, A, on_error=mode, name=spec)
    assert time.monotonic() - t0 < 5.0
    msg = str(ei.value)
    assert (
        msg.startswith(f"reward function {spec} timed out after 0.5 s (reward timeout_s=0.5")
        and "\n" not in msg
    )
    assert (slow_file.parent / "cleanup-ran").read_text() == "yes"  # really interrupted, not abandoned


def test_user_reward_timeout_not_swallowed_by_except_exception(slow_file):
    """The interruption is a BaseException: ``except Exception`` in the function does not hide it."""
    fn = load_reward(f"{slow_file}:stubborn", timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(GspoError, match="timed out after 0.3 s"):
        fn(P, C, A)
    assert time.monotonic() - t0 < 5.0


def test_user_reward_timeout_off_the_main_thread(slow_file):
    """From another thread (no signal handler there) the call is abandoned at the deadline: the error
    still comes on time and says the call goes on in the background."""
    fn = load_reward(f"{slow_file}:slow", timeout_s=0.3)
    box = []

    def call():
        t0 = time.monotonic()
        try:
            fn(P, C, A)
        except GspoError as e:
            box.append((str(e), time.monotonic() - t0))

    t = threading.Thread(target=call)
    t.start()
    t.join(10)
    msg, elapsed = box[0]
    assert "timed out after 0.3 s" in msg and "still running in a background thread" in msg and elapsed < 5


def test_user_reward_timeout_defaults_and_pass_through(slow_file):
    """Fast functions are unaffected (values, errors, main-thread signal use); default 60 s; None or 0
    disables it; built-ins are not wrapped; a bad value is a one-line error."""
    from gspo.tasks.rewards import DEFAULT_REWARD_TIMEOUT_S

    assert DEFAULT_REWARD_TIMEOUT_S == 60.0
    fn = load_reward(f"{slow_file}:fast")
    assert fn.timeout_s == 60.0 and fn.__name__ == "fast"
    assert safe_rewards(fn, P, C, A) == ([0.5] * 4, 0)
    assert safe_rewards(load_reward(f"{slow_file}:uses_signals", timeout_s=5), P, C, A) == ([1.0] * 4, 0)
    assert not hasattr(load_reward(f"{slow_file}:fast", timeout_s=None), "timeout_s")
    assert not hasattr(load_reward(f"{slow_file}:fast", timeout_s=0), "timeout_s")
    assert load_reward("boxed", timeout_s=1).timeout_s == 1  # built-ins are time-limited too
    assert load_reward("boxed", timeout_s=0) is boxed_match
    assert load_reward("exact_match", timeout_s=1) is exact_match  # but a strip and a compare cannot hang
    with pytest.raises(GspoError, match="timeout_s must be a positive number of seconds"):
        load_reward(f"{slow_file}:fast", timeout_s=-1)
    with pytest.raises(GspoError, match="raised ValueError: boom on c2"):  # errors pass through the wrapper
        safe_rewards(with_timeout(raising, "raising", 5), P, C, A)
    for _ in range(50):  # many short calls leave no watchdog threads behind for long
        load_reward(f"{slow_file}:fast", timeout_s=5)(P, C, A)
    time.sleep(0.2)
    assert sum(t.name == "gspo-reward-timeout" for t in threading.enumerate()) == 0


def test_build_task_passes_the_reward_timeout(slow_file, tmp_path):
    """build_task(reward_timeout_s=...) reaches the user reward."""
    from gspo.tasks import build_task

    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"p{i}", "answer": "a"}) for i in range(20)))
    task = build_task(str(data), f"{slow_file}:fast", 0, 2, reward_timeout_s=7)
    assert task.reward.timeout_s == 7.0
