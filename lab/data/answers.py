r"""Final answers of worked solutions, as math-reasoning evaluations read them.

`answer_of` takes a solution's final answer: the first number after its last GSM8K "####" marker (else the text
there), the content of its last LaTeX `\boxed{…}` (MATH's convention, braces balanced), or else its last number;
numbers are normalized ("1,000.0" → "1000", "$3.50" → "3.5"). `reference_answer` reads a problem's answer the same
way when it is a worked solution, and normalizes it otherwise. Symbolic equivalence (MATH's `grader.py`, sympy) is
not attempted: two answers match when their normalized strings are equal.
"""

from __future__ import annotations

import math
import re

__all__ = ["answer_of", "reference_answer"]

_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _norm(x: str) -> str:
    x = x.strip().rstrip(".").replace(",", "").replace(" ", "").replace("$", "")
    try:
        v = float(x)
    except ValueError:
        return x
    return str(int(v)) if math.isfinite(v) and v == int(v) else repr(v)


def _boxed(text: str) -> str:
    i, depth = text.rfind("\\boxed{") + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return text[i:]


def answer_of(text: str) -> str | None:
    """A solution's final answer: the first number after its last "####" (else the text there), the content of its
    last \\boxed{…}, or its last number; None if it has none. Numbers are normalized ("1,000.0" → "1000")."""
    text = str(text)
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        nums = _NUM.findall(tail)
        return _norm(nums[0]) if nums else (_norm(tail) or None)
    if "\\boxed{" in text:
        return _norm(_boxed(text)) or None
    nums = _NUM.findall(text)
    return _norm(nums[-1]) if nums else None


def reference_answer(answer) -> str:
    """The problem's answer: `answer_of` of a worked solution (with "####" or \\boxed), else the whole value."""
    a = str(answer)
    return answer_of(a) if ("####" in a or "\\boxed{" in a) else _norm(a)
