"""Final answers of worked solutions: GSM8K markers, LaTeX boxes, last numbers, normalization (hand cases)."""

from lab.data.answers import answer_of, reference_answer


def test_answer_of_and_reference_answer_hand_cases():
    assert answer_of("3 + 4 = 7 apples, then 12.\n#### 1,000") == "1000"
    assert answer_of("so it is \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert answer_of("x is 3.0 then 12.50") == "12.5"
    assert answer_of("x is 3.0") == "3" and answer_of("no digits here") is None
    assert answer_of("#### seven") == "seven"
    assert reference_answer("Natalia sold 48 + 24 = 72.\n#### 72") == "72"
    assert reference_answer(" 3.50 ") == "3.5" and reference_answer(7) == "7"
    assert reference_answer("\\frac{1}{2}") == "\\frac{1}{2}"  # not its last number
