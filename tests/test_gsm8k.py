"""GSM8K task and the local data loaders: gold extraction, grading, errors, first_n, fingerprints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import GSM8K_DIR

from grpolab.tasks import BUILT_IN, Example, Task, make_task
from grpolab.tasks.datasets import DataError, first_n, hub_records, load_rows, rows_sha256, text_sha256
from grpolab.tasks.gsm8k import GSM8KTask, split_gsm8k_answer
from grpolab.tasks.r1_zero import R1_ZERO_TEMPLATE


@pytest.fixture(scope="module")
def gsm8k_dir() -> Path:
    """The official files, shipped in the repository under data/gsm8k (MIT licence)."""
    path = GSM8K_DIR
    assert (path / "train.jsonl").is_file() and (path / "test.jsonl").is_file(), f"GSM8K files missing in {path}"
    return path


ROWS = [
    {
        "question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72 clips.\n#### 72",
    },
    {"question": "A house costs $1,200 and a car $80. Total?", "answer": "1200+80=<<1200+80=1280>>1,280\n#### 1,280"},
    {"question": "It is 3 degrees and drops 10. Temperature?", "answer": "3-10=<<3-10=-7>>-7\n#### -7"},
]


def _write_jsonl(path: Path, rows: list[dict], extra_lines: tuple[str, ...] = ()) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines), encoding="utf-8")
    return path


@pytest.fixture()
def small_task(tmp_path: Path) -> GSM8KTask:
    train = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    test = _write_jsonl(tmp_path / "test.jsonl", ROWS[::-1])
    return GSM8KTask(train_path=train, test_path=test)


def test_examples_gold_solution_and_ids(small_task: GSM8KTask) -> None:
    assert isinstance(small_task, Task)
    train = small_task.train_examples()
    assert [e.id for e in train] == ["train-0", "train-1", "train-2"]
    assert [e.id for e in small_task.validation_examples()] == ["test-0", "test-1", "test-2"]
    assert [e.answer for e in train] == ["72", "1280", "-7"]
    assert train[0].solution == (
        " In May she sold 48/2 = 24 clips.\nIn all 48+24 = 72 clips. </think> <answer> 72 </answer>"
    )
    assert train[1].solution.endswith("1,280 </think> <answer> 1280 </answer>")
    assert small_task.prompt(train[0]) == R1_ZERO_TEMPLATE.format(question=ROWS[0]["question"])
    assert small_task.prompt(train[0]).endswith("Assistant: <think>")


@pytest.mark.parametrize(
    ("completion", "truncated", "rewards"),
    [
        (" 48+24=72 </think> <answer> 72 </answer>", False, (1.0, 1.0)),
        (" so </think> <answer> The answer is $72.00 </answer> trailing", False, (1.0, 1.0)),
        (" so </think> <answer> \\boxed{72} </answer>", False, (1.0, 1.0)),
        (" 48+24=73 </think> <answer> 73 </answer>", False, (1.0, 0.0)),
        (" so </think> <answer>  </answer>", False, (1.0, 0.0)),
        (" 72", False, (0.0, 0.0)),  # no tags
        (" so </think> 72", False, (0.0, 0.0)),  # no answer tags
        (" so </think> <answer> 72", False, (0.0, 0.0)),  # answer never closed
        (" so <answer> 72 </answer> </think>", False, (0.0, 0.0)),  # wrong order
        (" so </think><answer> 72 </answer>", False, (0.0, 0.0)),  # no space between the tags
        (" so </think> <answer> 72 </answer>", True, (0.0, 0.0)),  # hit the token limit
    ],
)
def test_grade_rewards(small_task: GSM8KTask, completion: str, truncated: bool, rewards: tuple) -> None:
    grade = small_task.grade(completion, small_task.train_examples()[0], truncated)
    assert (grade.format_reward, grade.answer_reward) == rewards


def test_every_official_test_solution_grades_correct_and_a_wrong_number_does_not(gsm8k_dir: Path) -> None:
    task = GSM8KTask(train_path=gsm8k_dir / "train.jsonl", test_path=gsm8k_dir / "test.jsonl")
    examples = task.validation_examples()
    raw = [json.loads(line) for line in (gsm8k_dir / "test.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(examples) == len(raw) == 1319 and len(task.train_examples()) == 7473
    for example, row in zip(examples, raw):
        assert example.answer == row["answer"].split("####")[-1].strip().replace(",", "")
        assert "<<" not in example.solution and example.solution.endswith(f"<answer> {example.answer} </answer>")
        grade = task.grade(example.solution, example, truncated=False)
        assert (grade.format_reward, grade.answer_reward) == (1.0, 1.0), example.id
        tail = f"<answer> {example.answer} </answer>"
        wrong = example.solution.replace(tail, f"<answer> {int(example.answer) + 1} </answer>")
        grade = task.grade(wrong, example, truncated=False)
        assert (grade.format_reward, grade.answer_reward) == (1.0, 0.0), example.id
    assert not {e.question for e in examples} & {e.question for e in task.train_examples()}


def test_reference_selection_and_fingerprint(gsm8k_dir: Path) -> None:
    task = make_task(
        "gsm8k", train_path=gsm8k_dir / "train.jsonl", test_path=gsm8k_dir / "test.jsonl", n_train=6400, n_val=1024
    )
    fingerprint = task.data_fingerprint()
    assert (fingerprint["train_rows"], fingerprint["validation_rows"]) == (6400, 1024)
    assert task.validation_examples()[-1].id == "test-1023"


def test_registered() -> None:
    assert isinstance(
        make_task(
            "gsm8k", train_path=GSM8K_DIR / "train.jsonl", test_path=GSM8K_DIR / "test.jsonl", n_train=2, n_val=2
        ),
        GSM8KTask,
    )
    assert "gsm8k" in BUILT_IN


def test_first_n(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    task = GSM8KTask(train_path=path, test_path=path, n_train=2, n_val=1)
    assert [e.answer for e in task.train_examples()] == ["72", "1280"]
    assert [e.id for e in task.validation_examples()] == ["test-0"]
    rows = load_rows(path)
    assert first_n(rows, None) == rows and first_n(rows, 0) == []
    with pytest.raises(DataError, match="first 4 rows but it has only 3"):
        GSM8KTask(train_path=path, test_path=path, n_train=4)


def test_fingerprint_stable_and_sensitive(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ROWS)
    fingerprint = GSM8KTask(train_path=path, test_path=path, n_val=2).data_fingerprint()
    assert fingerprint == GSM8KTask(train_path=path, test_path=path, n_val=2).data_fingerprint()
    assert fingerprint["train_sha256"] == rows_sha256(load_rows(path))
    assert fingerprint["validation_sha256"] == rows_sha256(load_rows(path)[:2])
    assert fingerprint["prompt_template_sha256"] == text_sha256(R1_ZERO_TEMPLATE)
    assert len(fingerprint["train_sha256"]) == 64
    changed = [dict(r) for r in ROWS]
    changed[1]["question"] += " "
    other = _write_jsonl(tmp_path / "b.jsonl", changed)
    changed_fp = GSM8KTask(train_path=other, test_path=path, n_val=2).data_fingerprint()
    assert changed_fp["train_sha256"] != fingerprint["train_sha256"]
    assert changed_fp["validation_sha256"] == fingerprint["validation_sha256"]
    assert rows_sha256(ROWS[:2]) != rows_sha256(ROWS[1::-1])  # order matters


def test_loader_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="missing.jsonl: file not found"):
        GSM8KTask(train_path=tmp_path / "missing.jsonl", test_path=tmp_path / "missing.jsonl")
    bad = _write_jsonl(tmp_path / "bad.jsonl", ROWS[:2], ("\n", '{"question": "q", "answer": \n'))
    with pytest.raises(DataError, match=r"bad\.jsonl:4: not valid JSON"):
        load_rows(bad)
    missing = _write_jsonl(tmp_path / "missing_field.jsonl", [ROWS[0], {"question": "q"}])
    with pytest.raises(DataError, match=r"missing_field\.jsonl:2: missing field 'answer'"):
        load_rows(missing)
    wrong_type = _write_jsonl(tmp_path / "wrong_type.jsonl", [{"question": "q", "answer": 3}])
    with pytest.raises(DataError, match=r"wrong_type\.jsonl:1: field 'answer' is int"):
        load_rows(wrong_type)
    not_object = _write_jsonl(tmp_path / "list.jsonl", [[1, 2]])  # type: ignore[list-item]
    with pytest.raises(DataError, match=r"list\.jsonl:1: expected a JSON object"):
        load_rows(not_object)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"question": "q", "answer": "a"}\n\xff\xfe\n')
    with pytest.raises(DataError, match=r"binary\.jsonl:2: not valid UTF-8"):
        load_rows(binary)
    no_mark = _write_jsonl(tmp_path / "no_mark.jsonl", [ROWS[0], {"question": "q", "answer": "it is 4"}])
    with pytest.raises(DataError, match=r"no_mark\.jsonl: row 1: answer does not end in '#### <number>'"):
        GSM8KTask(train_path=no_mark, test_path=no_mark)
    with pytest.raises(DataError, match="unknown data format '.csv'"):
        load_rows(_write_jsonl(tmp_path / "rows.csv", ROWS))


def test_split_gsm8k_answer() -> None:
    assert split_gsm8k_answer("a <<1+1=2>>2 b\n#### 1,000") == ("a 2 b", "1000")
    for answer in ("no mark", "#### ", "#### seven", "#### 3/4"):
        with pytest.raises(DataError):
            split_gsm8k_answer(answer)


def test_custom_field_names(tmp_path: Path) -> None:
    rows = [{"problem": r["question"], "solution": r["answer"], "extra": 1} for r in ROWS]
    path = _write_jsonl(tmp_path / "custom.jsonl", rows)
    task = GSM8KTask(train_path=path, test_path=path, question_field="problem", answer_field="solution")
    assert [e.answer for e in task.train_examples()] == ["72", "1280", "-7"]
    assert load_rows(path, "problem", "solution") == ROWS  # fingerprints ignore field names and extras


def test_parquet_matches_jsonl(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_rows(path) == ROWS
    jsonl = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    parquet_task = GSM8KTask(train_path=path, test_path=path)
    assert parquet_task.data_fingerprint() == GSM8KTask(train_path=jsonl, test_path=jsonl).data_fingerprint()
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="broken.parquet: not a readable Parquet file"):
        load_rows(tmp_path / "broken.parquet")


def test_optional_packages_missing_give_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import now fails, as when not installed
    with pytest.raises(DataError, match="reading Parquet needs pyarrow"):
        load_rows(tmp_path / "train.parquet")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"needs the datasets package: pip install 'grpolab\[hub\]'"):
        hub_records("openai/gsm8k", "test", "main")


def test_ids_unique_across_splits(small_task: GSM8KTask) -> None:
    examples: list[Example] = small_task.train_examples() + small_task.validation_examples()
    assert len({e.id for e in examples}) == len(examples)


def test_hub_sources_are_parsed_and_need_the_datasets_package(monkeypatch):
    import sys

    from grpolab.tasks.datasets import DataError, load_source

    with pytest.raises(DataError, match="expected hub:NAME:SPLIT"):
        load_source("hub:openai/gsm8k")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(DataError, match="datasets"):
        load_source("hub:openai/gsm8k:main:test")
