"""`math_verify_reward`: a response's final answer compared with the reference as math, by math-verify.

math-verify (HuggingFace) parses LaTeX / plain expressions to sympy and compares them: fractions,
decimals, `\\sqrt`, `\\pi`, `\\cdot`, thousands separators, `x = 3` vs `3`, units in `\\text{...}`,
`^\\circ`, `\\%` (10% equals 10 and 0.1) are handled there. Registered as `math_verify` in
`verl_ds.data.reward`, imported on first use.
"""

from __future__ import annotations

import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

_MAX_ANSWER_CHARS = 512  # longer final answers score 0: bounds sympy's work
# Per parse / verify. math-verify times out with SIGALRM, so only in the main thread; elsewhere the
# length bound alone guards (math-verify then logs one warning).
_TIMEOUT_S = 5
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"answer\s+is\b\s*:?", re.IGNORECASE)
_NUMBER_IN_TEXT = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{\s*([-+.\d][^{}]*)\}")  # \text{5 cm} -> 5 cm
_CONFIGS = (LatexExtractionConfig(), ExprExtractionConfig())


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces matched; None if absent or unclosed."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    depth, start = 1, matches[-1].end()
    for i in range(start, len(text)):
        depth += (text[i] == "{") - (text[i] == "}")
        if depth == 0:
            return text[start:i]
    return None


def final_answer(text: str) -> str | None:
    """The answer `text` commits to: the last `\\boxed{}`, else what follows the last `####`, else the
    rest of the line after the last "answer is", else the last non-empty line (which must then be the
    answer itself); cleaned of `$` and a final period. None when there is none, it is empty, or the
    last `\\boxed{` is unclosed."""
    if _BOXED.search(text):
        answer = last_boxed(text)
    elif "####" in text:
        answer = text.rsplit("####", 1)[1]
    elif m := list(_ANSWER_IS.finditer(text)):
        answer = text[m[-1].end() :].split("\n", 1)[0]
    else:
        lines = [line for line in text.splitlines() if line.strip()]
        answer = lines[-1] if lines else None
    if answer is None:
        return None
    answer = _NUMBER_IN_TEXT.sub(r"\1", answer.replace("\\$", "").replace("$", ""))
    answer = answer.strip().rstrip(".").strip()
    return answer or None


def _parse(answer: str | None, timeout: int | None) -> list:
    if answer is None or len(answer) > _MAX_ANSWER_CHARS:
        return []
    return parse(f"${answer}$", extraction_config=_CONFIGS, parsing_timeout=timeout)


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when the response's :func:`final_answer` equals the reference's as math, else 0.0.

    0.0, never an exception, for a gold answer math-verify cannot parse (even if the response is
    identical), a non-str, unparseable or malformed response, an answer over 512 characters, or a
    timeout. ``answer`` may be a number.
    """
    if not isinstance(response, str):
        return 0.0
    try:
        timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        gold = _parse(final_answer(str(answer)), timeout)
        if not any(not isinstance(g, str) for g in gold):  # only the raw string came back: unparseable
            return 0.0
        pred = _parse(final_answer(response), timeout)
        return 1.0 if pred and verify(gold, pred, timeout_seconds=timeout) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never crash the loop
        return 0.0
