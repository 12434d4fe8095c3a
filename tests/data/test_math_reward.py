"""math_verify_reward: a table of equal / unequal / malformed answers, and its registration."""

import sys
import threading
import time

import pytest

from verl_ds.data.math_reward import final_answer, last_boxed, math_verify_reward
from verl_ds.data.reward import get_reward_fn

# (response, gold answer, expected reward)
CASES = [
    # equal as math
    (r"so the probability is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
    ("The total is 1,000 dollars.\n#### 1,000", "1000", 1.0),
    ("1,000", "1000", 1.0),
    (r"\boxed{10\%}", "10", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{\pi}", r"\pi", 1.0),
    (r"\boxed{2\cdot 3}", "6", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{\text{5 cm}}", "5", 1.0),
    (r"It costs \boxed{\$18}.", "18", 1.0),
    ("x=3", "3", 1.0),
    (r"Hence $x = -\frac{\sqrt{3}}{2}$, i.e. the answer is $-\frac{\sqrt{3}}{2}$.", r"-\frac{\sqrt3}{2}", 1.0),
    (r"first \boxed{1}, on reflection \boxed{\frac{a+1}{\{b\}}} no: \boxed{\frac{7}{2}}", "3.5", 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "Natalia sold ... \n#### 72", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    # different
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{8}", 0.0),
    (r"\boxed{3}", "4", 0.0),
    (r"\boxed{72} wait, no: \boxed{71}", "72", 0.0),  # the last box counts
    ("#### 1,001", "1000", 0.0),
    (r"The answer is \pi", "3.14", 0.0),
    ("I think 2 or maybe 3", "3", 0.0),  # no marker: the last line must be the answer itself
    # unparseable gold never scores
    ("???", "???", 0.0),
    (r"\boxed{???}", "???", 0.0),
    ("3", "", 0.0),
    # malformed or empty responses
    (r"\boxed{", "3", 0.0),
    (r"\boxed{3", "3", 0.0),
    (r"\boxed{3} then \boxed{", "3", 0.0),  # truncated: the last box is unclosed
    ("", "3", 0.0),
    ("   \n  ", "3", 0.0),
    (r"\frac{1}{0} \sqrt{ \left( ]]", "3", 0.0),
    ("x" * 100_000, "3", 0.0),
    ("}" * 5000 + r"\boxed{" + "{" * 5000, "3", 0.0),
    (r"\boxed{" + "1+" * 100 + "1}", "101", 1.0),
    (r"\boxed{" + "1+" * 2000 + "1}", "2001", 0.0),  # over the length bound
]


@pytest.mark.parametrize("response,answer,expected", CASES)
def test_math_verify_reward_table(response, answer, expected):
    assert math_verify_reward(response, answer) == expected


@pytest.mark.parametrize("bad", [None, 3, b"\\boxed{3}", object(), ["3"]])
def test_never_raises_on_odd_inputs(bad):
    assert math_verify_reward(bad, "3") == 0.0


def test_integer_gold_and_speed():
    assert math_verify_reward(r"\boxed{12}", 12) == 1.0
    start = time.monotonic()
    assert math_verify_reward(r"\boxed{9^{9^{9^{9}}}}", r"9^{9^{9^{9}}} + 1") == 0.0
    assert time.monotonic() - start < 15


def test_works_off_the_main_thread():
    # math-verify's SIGALRM timeout cannot be set there: it runs without one instead of failing.
    out = []
    worker = threading.Thread(target=lambda: out.append(math_verify_reward(r"\boxed{\frac{1}{2}}", "0.5")))
    worker.start()
    worker.join()
    assert out == [1.0]


def test_extraction_helpers():
    assert last_boxed(r"a \boxed{\frac{1}{\sqrt{2}}} b") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\fbox{1} \boxed {2}") == "2"
    assert last_boxed(r"\boxed{1") is None and last_boxed("no box") is None
    assert final_answer("The answer is: $42$.\nThanks!") == "42"
    assert final_answer("work\n#### 1,234 ") == "1,234"
    assert final_answer("line one\nline two\n\n") == "line two"
    assert final_answer("") is None


def test_registered_lazily():
    fn = get_reward_fn("math_verify")
    assert fn(r"\boxed{\frac{1}{2}}", "0.5") == 1.0
    assert "verl_ds.data.math_reward" in sys.modules
