"""The generic dataset task: sources, field mapping, splits, fingerprints, refusals, rewards."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from grpolab.tasks import Task, build_task
from grpolab.tasks.datasets import DataError, rows_sha256
from grpolab.tasks.prompts import fill_template, template_fields

MATH_DIR = Path(__file__).parent / "data" / "math_tiny"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def rows(n: int, start: int = 0) -> list[dict]:
    return [{"q": f"{i}+{i}", "a": str(2 * i), "uid": f"p{i}", "topic": "add"} for i in range(start, start + n)]


def task_of(**settings) -> Task:
    return build_task({"name": "dataset", **settings})


def rows_task(path: Path, **settings) -> Task:
    """A dataset task of the rows in ``path`` (question ``q``, answer ``a``; ``rows``), validated on the same rows."""
    return task_of(train=str(path), validation=str(path), question_field="q", answer_field="a", **settings)


def test_math_fixture_with_boxed_answers_and_the_math_verifier():
    task = task_of(
        train=str(MATH_DIR / "train.jsonl"),
        validation=str(MATH_DIR / "test.jsonl"),
        question_field="problem",
        id_field="unique_id",
        prompt={
            "format": "template",
            "template": "Problem: {problem}\nSubject: {subject}\nPut the answer in \\boxed{}.\n",
            "answer": "boxed",
        },
    )
    assert isinstance(task, Task)
    train, val = task.train_examples(), task.validation_examples()
    assert (len(train), len(val)) == (12, 6) and train[0].id == "train/prealgebra/0.json"
    assert task.prompt(val[0]).startswith("Problem: Compute $\\frac{2}{3}") and "in \\boxed{}." in task.prompt(val[0])
    # every fixture solution grades correct with its own boxed answer; a wrong one does not
    for e in train + val:
        assert task.grade(e.fields["solution"], e, False).answer_reward == 1.0, e.id
    wrong = task.grade("so \\boxed{\\frac{5}{7}}", train[0], False)
    assert (wrong.format_reward, wrong.answer_reward, wrong.extracted) == (1.0, 0.0, "\\frac{5}{7}")
    assert task.grade("the answer is 5/6", train[0], False).format_reward == 0.0  # no box
    assert task.grade(train[0].fields["solution"], train[0], True).reward == 0.0  # truncated


def test_gold_read_from_a_solution_field(tmp_path):
    task = task_of(
        train=str(MATH_DIR / "train.jsonl"),
        validation_size=3,
        question_field="problem",
        answer_field="solution",
        gold="boxed",
        prompt={"format": "template", "template": "{problem}", "answer": "boxed"},
    )
    golds = {e.question: e.answer for e in task.train_examples() + task.validation_examples()}
    assert golds["Simplify $\\sqrt{50}$."] == "5\\sqrt{2}" and len(golds) == 12
    gsm = write_jsonl(tmp_path / "g.jsonl", [{"question": "q", "answer": "3+4=7\n#### 7"}] * 2)
    assert task_of(train=str(gsm), validation=str(gsm), gold="gsm8k").train_examples()[0].answer == "7"


def test_seeded_split_first_n_and_ids(tmp_path):
    path = write_jsonl(tmp_path / "all.jsonl", rows(40))
    a = task_of(train=str(path), validation_size=0.25, split_seed=3, question_field="q", answer_field="a")
    b = task_of(train=str(path), validation_size=10, split_seed=3, question_field="q", answer_field="a")
    c = task_of(train=str(path), validation_size=10, split_seed=4, question_field="q", answer_field="a")
    ids = lambda t: ([e.id for e in t.train_examples()], [e.id for e in t.validation_examples()])  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)
    train, val = ids(a)
    assert len(train) == 30 and len(val) == 10 and not set(train) & {i.replace("validation", "train") for i in val}
    assert all(i.startswith("train-") for i in train) and all(i.startswith("validation-") for i in val)
    firsts = task_of(
        train=str(path), validation_size=10, split_seed=3, n_train=5, n_val=2, question_field="q", answer_field="a"
    )
    assert ids(firsts) == (train[:5], val[:2])
    with pytest.raises(DataError, match="asked for the first 50"):
        task_of(train=str(path), validation_size=10, n_train=50, question_field="q", answer_field="a")
    with pytest.raises(DataError, match="leaves no train"):
        task_of(train=str(path), validation_size=40, question_field="q", answer_field="a")


def test_parquet_and_jsonl_give_the_same_examples_and_fingerprint(tmp_path):
    pytest.importorskip("pyarrow", reason="parquet files need pyarrow: pip install 'grpolab[parquet]'")
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = rows(6)
    jsonl = write_jsonl(tmp_path / "d.jsonl", data)
    pq.write_table(pa.Table.from_pylist(data), tmp_path / "d.parquet")
    settings = dict(validation_size=2, question_field="q", answer_field="a", id_field="uid")
    a, b = task_of(train=str(jsonl), **settings), task_of(train=str(tmp_path / "d.parquet"), **settings)
    assert a.train_examples() == b.train_examples() and a.validation_examples() == b.validation_examples()
    fa, fb = a.data_fingerprint(), b.data_fingerprint()
    assert fa["train_sha256"] == fb["train_sha256"] and fa["validation_rows"] == 2
    assert fa["train_sha256"] == rows_sha256([r for r in data if r["uid"] in {e.id for e in a.train_examples()}])


def test_fingerprint_changes_with_rows_prompt_and_rewards(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(8))
    base = dict(train=str(path), validation_size=2, question_field="q", answer_field="a")
    f0 = task_of(**base).data_fingerprint()
    assert f0 == task_of(**base).data_fingerprint()
    assert (
        task_of(**base, prompt={"format": "template", "template": "Q {q}", "answer": "last_number"}).data_fingerprint()[
            "prompt_template_sha256"
        ]
        != f0["prompt_template_sha256"]
    )
    assert (
        task_of(**base, rewards=[{"function": "numeric"}]).data_fingerprint()["rewards_sha256"] != f0["rewards_sha256"]
    )
    user = task_of(**base, rewards=[{"function": "reward_fns:brevity"}]).data_fingerprint()["rewards"][0]
    assert user["source"].endswith("reward_fns.py") and len(user["source_sha256"]) == 64
    write_jsonl(path, rows(7) + [{"q": "7+7", "a": "15"}])
    assert task_of(**base).data_fingerprint()["train_sha256"] != f0["train_sha256"]


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"q": "1+1"}, "missing field 'a'"),
        ({"q": "1+1", "a": "  "}, "field 'a' must be a non-empty answer"),
        ({"q": "", "a": "2"}, "field 'q' must be non-empty text"),
        ({"q": "1+1", "a": True}, "field 'a' must be a non-empty answer"),
        ({"q": "1+1", "a": "2", "uid": "p0"}, "duplicate id 'p0' \\(first at .*d.jsonl:[14]\\)"),
        ({"q": "1+1", "a": "2", "uid": None}, "field 'uid' must be a non-empty id"),
        ('{"q": "1+1", "a": ', "not valid JSON"),
        ([1, 2], "expected an object"),
        ({"q": "1+1", "a": "2", "uid": "zz"}, None),  # a good row: no error
    ],
)
def test_malformed_rows_are_refused_with_file_and_line(tmp_path, bad_row, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows(3) + [bad_row])
    ids = {"id_field": "uid"} if isinstance(bad_row, dict) and "uid" in bad_row else {}
    if message is None:
        assert (
            len(
                task_of(
                    train=str(path), validation_size=1, question_field="q", answer_field="a", **ids
                ).train_examples()
            )
            == 3
        )
        return
    with pytest.raises(
        DataError, match=f"d.jsonl:[14]: {message}" if "duplicate" in message else f"d.jsonl:4: {message}"
    ):
        task_of(train=str(path), validation_size=1, question_field="q", answer_field="a", **ids)


def test_ids_must_be_unique_across_splits_and_template_fields_present(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows(3))
    val = write_jsonl(tmp_path / "val.jsonl", rows(2, start=2))
    with pytest.raises(DataError, match="val.jsonl:1: duplicate id 'p2' \\(first at .*train.jsonl:3\\)"):
        task_of(train=str(train), validation=str(val), question_field="q", answer_field="a", id_field="uid")
    with pytest.raises(DataError, match="train.jsonl:1: missing field 'level'"):
        task_of(
            train=str(train),
            validation=str(val),
            question_field="q",
            answer_field="a",
            prompt={"format": "template", "template": "{level}: {q}", "answer": "last_number"},
        )
    with pytest.raises(DataError, match="missing.jsonl: file not found"):
        task_of(train=str(tmp_path / "missing.jsonl"), validation_size=1)
    with pytest.raises(DataError, match="expected hub:NAME:SPLIT"):
        task_of(train="hub:only-a-name", validation_size=1)


def test_templates_fill_named_fields_and_keep_other_braces():
    template = "Solve {question} ({topic}); answer in \\boxed{} or {{braces}}."
    assert template_fields(template) == ["question", "topic"]
    assert (
        fill_template(template, {"question": "1+1", "topic": "add"})
        == "Solve 1+1 (add); answer in \\boxed{} or {braces}."
    )


def test_weighted_rewards_are_logged_per_component_and_summed(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(4))
    task = rows_task(
        path,
        rewards=[
            {"function": "numeric", "name": "correct"},
            {"function": "reward_fns:brevity", "weight": 0.5},
            {"function": "reward_fns:mentions_gold", "weight": 0.25},
            {"function": "reward_fns:scaled", "weight": 2.0, "options": {"scale": 0.5}},
        ],
    )
    example = task.train_examples()[3]  # 3+3 = 6
    grade = task.grade(" 3+3=6 </think> <answer> 6 </answer>", example, False)  # 36 characters
    assert dict(grade.components) == {
        "correct": 1.0,
        "brevity": pytest.approx(0.8),
        "mentions_gold": 1.0,
        "scaled": 0.5,
    }
    assert grade.answer_reward == 1.0 and grade.failed == ()
    assert grade.reward == pytest.approx(1.0 + 0.5 * 0.8 + 0.25 * 1.0 + 2.0 * 0.5)
    wrong = task.grade(" 3+3=7 </think> <answer> 7 </answer>", example, False)
    assert wrong.answer_reward == 0.0 and dict(wrong.components)["scaled"] == 0.0
    batch = task.grade_batch([(" </think> <answer> 6 </answer>", example, False)] * 9)
    assert batch == [task.grade(" </think> <answer> 6 </answer>", example, False)] * 9


def test_user_functions_that_fail_score_zero_are_counted_and_logged_once(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", rows(10))
    task = task_of(
        train=str(path),
        validation=str(write_jsonl(tmp_path / "v.jsonl", rows(1, start=10))),
        question_field="q",
        answer_field="a",
        id_field="uid",
        rewards=[{"function": "numeric"}, {"function": "reward_fns:faulty", "timeout_s": 0.5}],
    )
    examples = task.train_examples()  # ids p0 .. p9
    start = time.perf_counter()
    with caplog.at_level("WARNING"):
        grades = task.grade_batch([(" </think> <answer> 0 </answer>", e, False) for e in examples])
    assert time.perf_counter() - start < 10
    values = [dict(g.components)["faulty"] for g in grades]
    assert values == [0.0] * 6 + [1.0] * 4  # raises, sleeps, NaN, text, None, inf: 0; the rest 1
    assert [g.failed for g in grades] == [("faulty",)] * 6 + [()] * 4
    assert all(not math.isnan(g.reward) for g in grades)
    logged = [r for r in caplog.records if "reward 'faulty' failed" in r.getMessage()]
    assert len(logged) == 1
    assert task.rewards.terms[1].failures == 6


def test_a_function_stuck_in_a_loop_that_swallows_the_soft_timeout_is_killed(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", rows(2))
    task = rows_task(path, rewards=[{"function": "numeric"}, {"function": "reward_fns:busy_forever", "timeout_s": 0.5}])
    start = time.perf_counter()
    grade = task.grade("x", task.train_examples()[0], False)
    assert grade.failed == ("busy_forever",) and time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "function, message",
    [
        ("reward_fns:no_such_function", "cannot be imported"),
        ("no_such_module:f", "cannot be imported"),
        ("reward_fns:not_a_function", "not callable"),
    ],
)
def test_bad_user_functions_are_refused_up_front(tmp_path, function, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows(2))
    with pytest.raises(ValueError, match=message):
        rows_task(path, rewards=[{"function": function}])
    with pytest.raises(ValueError, match="takes no option"):
        rows_task(path, rewards=[{"function": "reward_fns:brevity", "options": {"scale": 2}}])


def test_a_task_class_by_import_path(tmp_path):
    task = build_task({"name": "custom_task:CountdownTask", "n": 6})
    assert isinstance(task, Task) and len(task.train_examples()) == len(task.validation_examples()) == 3
    assert task.grade("<answer>7</answer>", task.train_examples()[0], False).answer_reward in (0.0, 1.0)
    with pytest.raises(ValueError, match="takes no argument|unexpected keyword"):
        build_task({"name": "custom_task:CountdownTask", "nope": 1})
    with pytest.raises(ValueError, match="does not follow the Task contract"):
        build_task({"name": "custom_task:NotATask"})
    with pytest.raises(ValueError, match="cannot be imported"):
        build_task({"name": "custom_task:Missing"})


def test_suite_snapshot_freezes_the_data_files_and_the_prompt(tmp_path):
    from grpolab.config import load_config
    from grpolab.studies.suite.snapshot import snapshot_data

    cfg = load_config(
        None,
        {
            "model": "m",
            "task.name": "dataset",
            "task.train": str(MATH_DIR / "train.jsonl"),
            "task.validation": str(MATH_DIR / "test.jsonl"),
            "task.question_field": "problem",
            "task.prompt": {"format": "template", "template": "{problem} Box it: \\boxed{}", "answer": "boxed"},
        },
    )
    out = snapshot_data(cfg, tmp_path / "snap")
    assert out["task_paths"] == {
        "task.train": str(tmp_path / "snap" / "files" / "train.jsonl"),
        "task.validation": str(tmp_path / "snap" / "files" / "validation.jsonl"),
    }
    assert (tmp_path / "snap" / "files" / "train.jsonl").read_bytes() == (MATH_DIR / "train.jsonl").read_bytes()
    assert (
        len((tmp_path / "snap" / "train.jsonl").read_text().splitlines()) == 12
    )  # the rows used, as id/question/answer
    # GSM8K's copies, too, stay the official files (the rows written beside them once overwrote the train copy)
    gsm8k = load_config("configs/gsm8k_qwen3_0.6b.toml", {"model": "m", "task.n_train": 3, "task.n_val": 2})
    paths = snapshot_data(gsm8k, tmp_path / "gsm8k")["task_paths"]
    assert Path(paths["task.train_path"]).read_bytes() == Path(gsm8k.task.train_path).read_bytes()
    assert build_task(
        gsm8k.task.model_copy(update={"train_path": paths["task.train_path"], "test_path": paths["task.test_path"]})
    ).train_examples()
    assert (tmp_path / "snap" / "prompt_template.txt").read_text() == "{problem} Box it: \\boxed{}"


def test_the_documented_dataset_example_is_a_valid_config():
    import re
    import tomllib

    from grpolab.config import validate_config

    readme = (Path(__file__).parents[1] / "docs" / "your-data.md").read_text()
    block = re.search(r"```toml\n(\[task\]\nname = \"dataset\".*?)```", readme, re.DOTALL).group(1)
    cfg = validate_config({**tomllib.loads(block), "model": {"path": "m"}})
    assert cfg.task.prompt.answer == "boxed" and [r.function for r in cfg.task.rewards] == [
        "math",
        "my_rewards:brevity",
    ]
    assert cfg.reward.overlong_buffer == 256
