"""The built-in task for real instruct models: problems, split, grading and chat prompts."""

from __future__ import annotations

import pytest
from test_chat_prompts import chat_model_dir
from transformers import AutoTokenizer

from grpolab.tasks import build_task
from grpolab.tasks.chat_arithmetic import ChatArithmeticTask, stated_answer


def test_every_problem_once_in_whole_commutative_pairs():
    task = ChatArithmeticTask(operations="+*-", low=2, high=9, n_val=40)
    val, train = task.validation_examples(), task.train_examples()
    questions = [e.question for e in val + train]
    assert len(questions) == len(set(questions)) == 64 + 64 + 36  # a - b only with a >= b
    turned = lambda q: " ".join(reversed(q.split()))  # noqa: E731
    val_questions = {e.question for e in val}
    assert len(val) == 40 and not any(turned(e.question) in val_questions for e in train if "-" not in e.question)
    assert all(str(eval(e.question)) == e.answer for e in val + train)
    assert ChatArithmeticTask(operations="+*-", n_val=40).validation_examples() == val  # seeded
    assert ChatArithmeticTask(operations="+*-", n_val=40, seed=1).validation_examples() != val
    assert len(ChatArithmeticTask(operations="*", n_val=10, n_train=5).train_examples()) == 5


@pytest.mark.parametrize("bad", [{"operations": "/"}, {"operations": "*", "n_val": 64}, {"n_train": 1000}])
def test_impossible_settings_are_refused(bad):
    with pytest.raises(ValueError):
        build_task({"name": "chat_arithmetic", **bad})


@pytest.mark.parametrize(
    "completion, truncated, fmt, correct",
    [
        ("7 * 8 = 56. The answer is 56.", False, 1, 1),
        ("The answer is 54. No wait, the final answer is 56", False, 1, 1),  # the last statement counts
        ("The Answer is: **56**", False, 1, 1),
        ("7 * 8 = 56", False, 0, 0),  # no statement in the asked form
        ("The answer is N.", False, 0, 0),
        ("The answer is 56.", True, 0, 0),  # truncated
        ("The answer is 65.", False, 1, 0),
    ],
)
def test_grading(completion, truncated, fmt, correct):
    task = ChatArithmeticTask(operations="*", n_val=2)
    example = next(e for e in task.validation_examples() + task.train_examples() if e.question == "7 * 8")
    grade = task.grade(completion, example, truncated)
    assert (grade.format_reward, grade.answer_reward) == (fmt, correct)
    assert stated_answer("the answer is 1,024") == "1024"


def test_prompts_are_the_models_chat_template(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir(tmp_path, "qwen3"))
    task = build_task({"name": "chat_arithmetic", "system": "Be brief."})
    with pytest.raises(RuntimeError, match="bind_tokenizer"):
        task.prompt(task.validation_examples()[0])
    task.bind_tokenizer(tokenizer)
    example = task.validation_examples()[0]
    assert task.prompt(example) == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is {example.question}? "
        "End your reply with: The answer is <number>.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(task.data_fingerprint()["prompt_template_sha256"]) == 64
