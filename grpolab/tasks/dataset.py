"""A task from your own data: rows from JSONL, Parquet or the hub, a prompt format, weighted rewards.

Rows are mapped by ``question_field`` / ``answer_field`` (and optionally ``id_field``); the
validation split is its own source or a seeded split of the train rows (``validation_size``), and
``n_train`` / ``n_val`` take the first rows of each split. Every row is checked up front: a
missing or non-text field, an empty question or answer, a gold answer that cannot be read, a field
the prompt template names but the row lacks, and a duplicate id are refused with the file and line
(``file:line`` for JSONL, ``file row N`` for Parquet). Example ids are the id field's values or
``<split>-<row index in its source>``.

Grading: the answer is extracted in ``prompt.answer``'s format (``grpolab.tasks.extract``); each
reward term scores it (``grpolab.tasks.rewards``); the first term is the correctness (accuracy,
pass@k), the weighted sum is the RL reward, and every term is logged as ``reward/<name>``.
"""

from __future__ import annotations

import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from grpolab.tasks.base import Example, Grade, Task, TaskSettings
from grpolab.tasks.datasets import (
    DataError,
    canonical_json,
    file_sha256,
    first_n,
    rows_sha256,
    source_records,
    text_sha256,
)
from grpolab.tasks.extract import AnswerFormat, extract_answer, last_boxed
from grpolab.tasks.folder_hash import model_sha256
from grpolab.tasks.prompts import PromptBuilder, PromptFormat, template_fields
from grpolab.tasks.reward_model_spec import (
    MODEL_PREFIX,
    RewardModelSpec,
    is_model_reward,
    reward_model_name,
    reward_model_spec,
)
from grpolab.tasks.rewards import VERIFIERS, RewardSet, Sample, check_function_name, reward_term
from grpolab.tasks.sandbox import IMPORT_PATH, MAX_WORKERS, is_pickled, pickled_callable, target_label
from grpolab.tools.protocol import ToolsConfig


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    """The row as plain JSON values (dates, decimals and bytes as strings), as workers receive it."""
    return json.loads(json.dumps(record, default=str, ensure_ascii=False))


def read_gold(text: str, gold_format: str) -> str | None:
    """The gold answer held in an answer field: the text, its last ``\\boxed{}``, or the number after ``####``."""
    if gold_format == "boxed":
        return last_boxed(text)
    if gold_format == "gsm8k":
        from grpolab.tasks.gsm8k import split_gsm8k_answer

        try:
            return split_gsm8k_answer(text)[1]
        except DataError:
            return None
    return text.strip()


def seeded_split(n_rows: int, size: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, validation indices), both in file order; ``size`` a count or a fraction < 1."""
    count = round(size * n_rows) if size < 1 else int(size)
    if not 1 <= count < n_rows:
        raise DataError(f"validation_size {size:g} of {n_rows} rows leaves no train or no validation rows")
    chosen = set(random.Random(f"grpolab-split-{seed}").sample(range(n_rows), count))
    return [i for i in range(n_rows) if i not in chosen], sorted(chosen)


def rows_of(source: str, split: str) -> list[tuple[str, Any]]:
    """``source_records`` of a split's source; DataError when it has no rows (a run could draw no prompt)."""
    records = source_records(source)
    if not records:
        raise DataError(f"{source}: no rows; a task needs at least one {split} example")
    return records


class DatasetTask(Task):
    """A task from rows of your own (``task.name = "dataset"``); see the module docstring."""

    name = "dataset"

    def __init__(self, cfg: DatasetTaskConfig):
        self.cfg = cfg
        p = cfg.prompt
        self.toolset = cfg.tools.build()
        self.prompts = PromptBuilder(p.format, p.template, p.system, p.chat_template_kwargs, self.toolset)
        self.answer_format = p.answer or "r1_zero"
        self.rewards = RewardSet(
            [
                reward_term(r.function, r.name, r.weight, r.options, r.timeout_s)
                for r in cfg.rewards
                if not is_model_reward(r.function)
            ]
        )
        self.reward_models: list[RewardModelSpec] = [
            reward_model_spec(r.function, r.name, r.weight, r.options)
            for r in cfg.rewards
            if is_model_reward(r.function)
        ]
        train = rows_of(cfg.train, "train")
        if cfg.validation is not None:
            validation = rows_of(cfg.validation, "validation")
            splits = {
                "train": (cfg.train, train, range(len(train))),
                "validation": (cfg.validation, validation, range(len(validation))),
            }
        else:
            train_rows, val_rows = seeded_split(len(train), cfg.validation_size or 0, cfg.split_seed)
            splits = {"train": (cfg.train, train, train_rows), "validation": (cfg.train, train, val_rows)}
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self._examples: dict[str, list[Example]] = {}
        seen: dict[str, str] = {}
        for split, (source, records, indices) in splits.items():
            n = cfg.n_train if split == "train" else cfg.n_val
            indices = first_n(list(indices), n, source=f"{split} split of {source}")
            examples, rows = [], []
            for index in indices:
                location, record = records[index]
                example = self._example(location, record, f"{split}-{index}")
                if example.id in seen:
                    raise DataError(f"{location}: duplicate id {example.id!r} (first at {seen[example.id]})")
                seen[example.id] = location
                examples.append(example)
                rows.append(dict(example.fields))
            self._examples[split], self._rows[split] = examples, rows

    def _example(self, location: str, record: Any, default_id: str) -> Example:
        cfg = self.cfg
        if not isinstance(record, dict):
            raise DataError(f"{location}: expected an object, got {type(record).__name__}")
        for name in (cfg.question_field, cfg.answer_field, cfg.id_field, *self.prompts.fields):
            if name is not None and name != "question" and name not in record:
                raise DataError(f"{location}: missing field {name!r} (fields: {', '.join(map(str, record))})")
        question, answer = record[cfg.question_field], record[cfg.answer_field]
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{location}: field {cfg.question_field!r} must be non-empty text, got {question!r}")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
            raise DataError(f"{location}: field {cfg.answer_field!r} must be a non-empty answer, got {answer!r}")
        gold = read_gold(str(answer), cfg.gold)
        if not gold:
            raise DataError(
                f"{location}: no gold answer in field {cfg.answer_field!r} (task.gold = {cfg.gold!r}): "
                f"{str(answer)[-80:]!r}"
            )
        example_id = default_id
        if cfg.id_field is not None:
            value = record[cfg.id_field]
            if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
                raise DataError(f"{location}: field {cfg.id_field!r} must be a non-empty id, got {value!r}")
            example_id = str(value)
        return Example(id=example_id, question=question, answer=gold, fields=_jsonable(record))

    # ---- the Task contract ----------------------------------------------------------------------
    def train_examples(self) -> list[Example]:
        return list(self._examples["train"])

    def validation_examples(self) -> list[Example]:
        return list(self._examples["validation"])

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """Chat prompts render with this tokenizer's chat template."""
        self.prompts.bind_tokenizer(tokenizer)

    def prompt(self, example: Example) -> str:
        return self.prompts.render({**example.fields, "question": example.question})

    def prompt_template(self) -> str:
        return self.prompts.describe()

    def messages(self, example: Example) -> list[dict[str, str]]:
        """The prompt as chat messages before any chat template (what a reward model's own template renders)."""
        if self.prompts.format == "chat":
            return self.prompts.messages({**example.fields, "question": example.question})
        return [{"role": "user", "content": self.prompt(example)}]

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        extracted = extract_answer(completion, self.answer_format)
        sample = Sample(completion, example.answer, example.question, example.id, extracted, truncated, example.fields)
        values, failed, error = self.rewards.score(sample)
        return Grade(
            format_reward=float(extracted is not None and not truncated),
            answer_reward=values[self.rewards.terms[0].name],
            extracted=extracted,
            components=tuple(values.items()),
            total=self.rewards.total(values),
            failed=failed,
            error=error,
        )

    def grade_batch(self, items: list[tuple[str, Example, bool]]) -> list[Grade]:
        """``grade`` over (completion, example, truncated) items, several at once (reward functions and
        math-verify run in worker processes), in order."""
        with ThreadPoolExecutor(MAX_WORKERS) as pool:
            return list(pool.map(lambda item: self.grade(*item), items))

    def data_fingerprint(self) -> dict[str, Any]:
        """Row counts and SHA-256s of the rows used, the prompt and the reward functions (a reward model: its
        folder and the SHA-256 over its files), for the manifest."""
        rewards = []
        for r in self.cfg.rewards:
            entry = {"function": r.function, "name": r.name, "weight": r.weight, "options": r.options}
            source = (
                getattr(sys.modules.get(r.function.partition(":")[0]), "__file__", None)
                if ":" in r.function and not is_model_reward(r.function)
                else None
            )
            if source:  # a user function: which file, and its exact text
                entry.update(source=source, source_sha256=file_sha256(Path(source)))
            if is_model_reward(r.function):  # a reward model: which folder, and its exact files
                folder = Path(r.function[len(MODEL_PREFIX) :]).resolve()
                entry.update(model_dir=str(folder), model_sha256=model_sha256(folder))
            rewards.append(entry)
        return {
            "task": self.name,
            "train": self.cfg.train,
            "validation": self.cfg.validation,
            "train_rows": len(self._rows["train"]),
            "train_sha256": rows_sha256(self._rows["train"]),
            "validation_rows": len(self._rows["validation"]),
            "validation_sha256": rows_sha256(self._rows["validation"]),
            "prompt_template_sha256": text_sha256(self.prompt_template()),
            "answer_format": self.answer_format,
            "rewards": rewards,
            "rewards_sha256": text_sha256(canonical_json(rewards)),
        }


class PromptConfig(TaskSettings):
    """How prompts are made and where the completion states its answer (``grpolab.tasks.prompts``)."""

    format: PromptFormat = Field(
        "r1_zero", description="r1_zero; chat = the tokenizer's chat template; template = your format string"
    )
    template: str | None = Field(
        None,
        description="template: the whole prompt; chat: the user message (default "
        "'{question}'); fields as {name}: question and the data row's fields",
    )
    system: str | None = Field(None, description="chat: a system message")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="chat: passed to the chat template, e.g. {enable_thinking = false}"
    )
    answer: AnswerFormat | None = Field(
        None,
        description="where the completion states its answer: r1_zero ('</think> <answer> X </answer>'), "
        "answer_tags (the last <answer>X</answer>), boxed (the last \\boxed{X}), last_number; None = r1_zero for "
        "the r1_zero format, else required",
    )

    @model_validator(mode="after")
    def _answer_format(self) -> PromptConfig:
        if self.answer is None:
            if self.format != "r1_zero":
                raise ValueError(
                    f"prompt.answer is required with prompt.format {self.format!r}: answer_tags, boxed or last_number"
                )
            self.answer = "r1_zero"
        PromptBuilder(self.format, self.template, self.system, self.chat_template_kwargs)  # refuses bad combinations
        return self


class RewardConfig(TaskSettings):
    """One weighted reward function (``grpolab.tasks.rewards``)."""

    function: str = Field(
        description="a verifier (numeric, math, exact, regex), 'package.module:function' (from Python: the "
        "function itself, pickled by value), or 'model:DIR', a reward model (grpolab.tasks.reward_model_spec; its options there)"
    )
    name: str | None = Field(None, description="label in the metrics (reward/<name>); default: the function's name")
    weight: float = Field(1.0, description="its weight in the RL reward (0 = logged only)")
    timeout_s: float | None = Field(
        None, gt=0, description="time bound per call (math: 2 s, regex: 1 s, user functions: 10 s)"
    )
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the verifier or function")

    @property
    def term_name(self) -> str:
        """Its grade component's name: ``name``, else the function's (a reward model: its folder's)."""
        if self.name:
            return self.name
        if is_model_reward(self.function):
            return reward_model_name(self.function)
        return target_label(self.function)

    @field_validator("function", mode="before")
    @classmethod
    def _pickle_callable(cls, value: Any) -> Any:
        """A Python function (from ``grpolab.train(rewards=[f])`` or a config dict) travels pickled by value."""
        return pickled_callable(value) if callable(value) else value

    @field_validator("function")
    @classmethod
    def _known(cls, value: str) -> str:
        if value in VERIFIERS or is_model_reward(value):
            return value
        if not IMPORT_PATH.fullmatch(value) and not is_pickled(value):
            raise ValueError(
                f"unknown reward function {value!r}; use a verifier ({', '.join(VERIFIERS)}), "
                f"'package.module:function', a Python function or '{MODEL_PREFIX}DIR'"
            )
        return check_function_name(value)

    @model_validator(mode="after")
    def _model_options(self) -> RewardConfig:
        if is_model_reward(self.function):
            if self.timeout_s is not None:
                raise ValueError(f"reward {self.function!r}: a reward model takes no timeout_s")
            reward_model_spec(self.function, self.name, self.weight, self.options)
        return self


class DatasetTaskConfig(TaskSettings):
    """Your own data (JSONL, Parquet or the hub), prompt format and reward functions."""

    name: Literal["dataset"] = Field("dataset", description="your own data, prompt format and rewards")
    train: str = Field(description="a .jsonl or .parquet file, or hub:NAME[:CONFIG]:SPLIT")
    validation: str | None = Field(None, description="as train; None = a seeded split of train (validation_size)")
    validation_size: float | None = Field(
        None,
        gt=0,
        description="without validation: a count (>= 1) or a fraction (< 1) of the train rows, drawn with split_seed",
    )
    split_seed: int = Field(0, description="the seed of validation_size's split")
    n_train: int | None = Field(None, ge=1, description="the first N train rows (after the split; None = all)")
    n_val: int | None = Field(None, ge=1, description="the first M validation rows (None = all)")
    question_field: str = Field("question", description="the rows' question field")
    answer_field: str = Field("answer", description="the rows' gold answer field (see gold)")
    id_field: str | None = Field(None, description="a field of unique ids; None = '<split>-<row>'")
    gold: Literal["text", "boxed", "gsm8k"] = Field(
        "text",
        description="how the answer field holds the gold "
        "answer: as text, in its last \\boxed{} (MATH solutions), or "
        "after '####' (GSM8K)",
    )
    prompt: PromptConfig = Field(
        default_factory=PromptConfig, description="how prompts are made and where the answer is stated"
    )
    rewards: list[RewardConfig] = Field(
        default_factory=lambda: [RewardConfig(function="math")],
        min_length=1,
        description="weighted; the first is the task's correctness (accuracy)",
    )
    tools: ToolsConfig = Field(
        default_factory=ToolsConfig,
        description="tools the model may call; the prompt "
        "says how (chat: the template's tools argument; template: {tools})",
    )

    FILES: ClassVar[tuple[str, ...]] = ("train", "validation")

    @model_validator(mode="after")
    def _split(self) -> DatasetTaskConfig:
        if (self.validation is None) == (self.validation_size is None):
            raise ValueError("give either task.validation (a source) or task.validation_size (a split of train)")
        if self.validation_size is not None and self.validation_size >= 1 and self.validation_size % 1:
            raise ValueError(f"task.validation_size {self.validation_size}: a count must be whole, a fraction < 1")
        if is_model_reward(self.rewards[0].function):
            raise ValueError(
                "task.rewards: the first reward is the task's correctness (accuracy, pass@k): make it a "
                "verifier or function (with weight = 0 to keep it out of the RL reward), the model after it"
            )
        if not self.tools.enabled and "tools" in template_fields(self.prompt.template or ""):
            raise ValueError("task.prompt.template names {tools} but task.tools.enabled is empty")
        return self

    def nonbinary_rewards(self) -> list[str]:
        """Reward models, verifiers (0 or 1 each) weighted other than 0 or 1, and a second term with a weight
        (two correct terms add up to 2); a user function's values are known only when it runs."""
        terms, weighted = [], [(i, r) for i, r in enumerate(self.rewards) if r.weight != 0]
        for i, r in weighted:
            label = f"task.rewards[{i}] ({r.name or r.function}, weight {r.weight:g})"
            if is_model_reward(r.function):
                terms.append(f"task.rewards[{i}] ({r.function}), a reward model's score,")
            elif r.function in VERIFIERS and r.weight != 1:
                terms.append(label)
        if len(weighted) > 1:
            i, r = weighted[1]
            terms.append(
                f"task.rewards[{i}] ({r.name or r.function}), a second weighted term added to "
                f"task.rewards[{weighted[0][0]}],"
            )
        return terms

    def negative_rewards(self) -> list[str]:
        """Reward models (a score of either sign, clipped or not) and terms of negative weight; a user function's
        values are known only when it runs."""
        terms = []
        for i, r in enumerate(self.rewards):
            if is_model_reward(r.function) and r.weight != 0:
                terms.append(f"task.rewards[{i}] ({r.function}), a reward model's score,")
            elif r.weight < 0:
                terms.append(f"task.rewards[{i}] ({r.name or r.function}, weight {r.weight:g})")
        return terms

    def clipped_reward_models(self) -> list[str]:
        return [r.term_name for r in self.rewards if is_model_reward(r.function) and r.options.get("clip") is not None]

    def reward_weights(self) -> dict[str, float]:
        """Each reward's component name and weight (a reward model's term: weight x its normalized score)."""
        return {r.term_name: r.weight for r in self.rewards}

    def prompt_format(self) -> str | None:
        return self.prompt.format

    def absolute_reward_models(self) -> dict[str, Any]:
        if not any(is_model_reward(r.function) for r in self.rewards):
            return {}
        return {
            "rewards": [
                r.model_copy(update={"function": MODEL_PREFIX + str(Path(r.function[len(MODEL_PREFIX) :]).resolve())})
                if is_model_reward(r.function)
                else r
                for r in self.rewards
            ]
        }

    def build(self) -> DatasetTask:
        return DatasetTask(self)
