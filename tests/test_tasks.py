"""Tasks: the arithmetic generator and r1_zero grading."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.tasks import (
    R1_ZERO_TEMPLATE,
    ArithmeticTask,
    Example,
    Grade,
    Task,
    column_addition_solution,
    grade_r1_zero,
    make_task,
    parse_r1_zero,
    r1_zero_prompt,
)

GOOD = " 3+5=8 2+4+0=6 </think> <answer> 68 </answer>"


def test_template_shape() -> None:
    prompt = r1_zero_prompt("23+45")
    assert prompt.startswith("A conversation between User and Assistant.")
    assert prompt.endswith("\nUser: 23+45\nAssistant: <think>")
    assert R1_ZERO_TEMPLATE.count("{question}") == 1


def test_arithmetic_is_deterministic_from_seed() -> None:
    a, b = ArithmeticTask(n_train=50, n_val=20, seed=3), ArithmeticTask(n_train=50, n_val=20, seed=3)
    assert a.train_examples() == b.train_examples()
    assert a.validation_examples() == b.validation_examples()
    other = ArithmeticTask(n_train=50, n_val=20, seed=4)
    assert other.train_examples() != a.train_examples()


def test_validation_split_does_not_depend_on_n_train() -> None:
    small, big = ArithmeticTask(n_train=10, n_val=30), ArithmeticTask(n_train=500, n_val=30)
    assert small.validation_examples() == big.validation_examples()


@pytest.mark.parametrize("digits,operands", [(1, 2), (2, 2), (3, 2), (2, 3)])
def test_splits_are_disjoint_and_sized(digits: int, operands: int) -> None:
    task = ArithmeticTask(n_train=60, n_val=20, digits=digits, operands=operands)
    train, val = task.train_examples(), task.validation_examples()
    assert (len(train), len(val)) == (60, 20)
    train_q, val_q = {e.question for e in train}, {e.question for e in val}
    assert len(train_q) == 60 and len(val_q) == 20 and not train_q & val_q
    assert len({e.id for e in train + val}) == 80


def test_too_many_problems_is_an_error() -> None:
    with pytest.raises(ValueError):
        ArithmeticTask(n_train=80, n_val=10, digits=1, operands=2)  # only 81 problems exist


@pytest.mark.parametrize("digits,operands", [(1, 2), (2, 2), (3, 2), (2, 3), (3, 4)])
def test_solutions_grade_correct(digits: int, operands: int) -> None:
    task = ArithmeticTask(n_train=40, n_val=10, digits=digits, operands=operands)
    for ex in task.train_examples() + task.validation_examples():
        terms = [int(x) for x in ex.question.split("+")]
        assert len(terms) == operands and all(len(str(t)) == digits for t in terms)
        assert ex.answer == str(sum(terms)) and ex.solution is not None
        assert task.grade(ex.solution, ex, truncated=False) == Grade(1.0, 1.0)
        assert task.prompt(ex) == r1_zero_prompt(ex.question)


def test_column_addition_chain_of_thought() -> None:
    assert column_addition_solution([23, 45]) == GOOD
    assert column_addition_solution([57, 38]) == " 7+8=15 5+3+1=9 </think> <answer> 95 </answer>"
    assert column_addition_solution([99, 99, 99]).endswith("9+9+9+2=29 </think> <answer> 297 </answer>")


def test_task_protocol_and_registry() -> None:
    task = make_task("arithmetic", n_train=5, n_val=5)
    assert isinstance(task, Task) and task.name == "arithmetic"
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_task("nope")


def test_wrong_number_is_incorrect_but_well_formed() -> None:
    assert grade_r1_zero(GOOD.replace("68 <", "69 <"), "68", False) == Grade(1.0, 0.0)


@pytest.mark.parametrize(
    "completion",
    [
        " 3+5=8 2+4+0=6 <answer> 68 </answer>",  # no </think>
        " 3+5=8 </think> 68",  # no answer tags
        " 3+5=8 </think> <answer> 68",  # unclosed answer
        " 3+5=8 </think><answer> 68 </answer>",  # no space between tags
        " 3+5=8 <answer> 68 </answer> </think>",  # wrong order
        " </answer> 68 </think> <answer>",  # close before open
        "",
    ],
)
def test_malformed_gets_no_reward(completion: str) -> None:
    assert grade_r1_zero(completion, "68", False) == Grade(0.0, 0.0)


def test_truncated_gets_nothing_even_if_correct() -> None:
    assert grade_r1_zero(GOOD, "68", truncated=True) == Grade(0.0, 0.0)
    assert Grade(1.0, 0.5).reward == 0.5


def test_parse() -> None:
    assert parse_r1_zero(GOOD) == (True, "68")
    assert parse_r1_zero(" x </think> <answer></answer>") == (True, "")
    assert parse_r1_zero("no tags") == (False, None)


def test_answers_compare_numerically() -> None:
    def wrap(answer: str) -> str:
        return f" x </think> <answer> {answer} </answer>"

    assert grade_r1_zero(wrap("$1,234.00"), "1234", False).reward == 1.0
    assert grade_r1_zero(wrap("68.0"), "68", False).reward == 1.0
    assert grade_r1_zero(wrap("12345678901234567890123456789"), "12345678901234567890123456780", False).reward == 0.0
    assert grade_r1_zero(wrap("yes"), "yes", False).reward == 1.0  # non-numeric gold: exact match


@settings(max_examples=300, deadline=None)
@given(st.text(), st.text(max_size=20), st.booleans())
def test_grading_never_raises(completion: str, gold: str, truncated: bool) -> None:
    grade = grade_r1_zero(completion, gold, truncated)
    assert grade.format_reward in (0.0, 1.0) and grade.answer_reward in (0.0, 1.0)
    assert grade.answer_reward <= grade.format_reward


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["</think>", "<answer>", "</answer>", " ", "4", "2", "x", "<", ">"]), max_size=30))
def test_grading_never_raises_on_tag_soup(parts: list[str]) -> None:
    completion = "".join(parts)
    grade = grade_r1_zero(completion, "42", False)
    assert grade.answer_reward <= grade.format_reward
    ok, answer = parse_r1_zero(completion)
    assert ok == (grade.format_reward == 1.0) and (answer is None) == (not ok)


def test_example_is_frozen() -> None:
    ex = Example(id="a", question="1+1", answer="2")
    with pytest.raises(AttributeError):
        ex.answer = "3"  # type: ignore[misc]
