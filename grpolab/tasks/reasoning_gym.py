"""reasoning-gym's procedural generators as a task: ``task.name = "reasoning_gym"``.

Each ``[[task.generators]]`` names a reasoning-gym generator (``reasoning_gym.create_dataset``'s name), its
weight and its settings (the generator's config fields, passed through). The items come from reasoning-gym's
own ``CompositeDataset`` (weighted choice of a generator per item, each generator seeded from the composite's
seed): ``n_train`` training items from ``seed``, ``n_val`` validation items from ``val_seed``.

**Disjoint validation.** reasoning-gym seeds item ``i`` of a generator with ``seed + i`` (and generator ``j`` of a
composite with ``seed + j + 1``), so two seeds closer than the item counts give the same items shifted: the
settings refuse seeds whose ranges overlap (``val_seed`` defaults to ``seed + 1,000,000``). Distinct seeds can
still draw the same problem where a generator has few (``leg_counting`` with one animal): any training item whose
question is a validation question is skipped and the next one drawn, so no validation question is ever trained
on; the fingerprint records how many were skipped.

**Reward.** The generator's own ``score_answer(answer, entry)`` grades the answer extracted from the completion.
Two terms: ``correct`` (1.0 when the score is 1.0, the task's accuracy, weight 1) and ``score`` (the generator's
score itself, partial credit included, weight ``score_weight``, 0 by default: logged, not in the RL reward, so the
RL reward stays binary and every objective applies; set it to train on partial credit too). A truncated completion
or one without an answer in the asked form scores 0 on both. Each scorer call runs in a killable worker process
(``grpolab.tasks.sandbox``, the item generated again there) within ``timeout_s``: a scorer that raises or hangs
scores 0 with both terms failed, never a stalled or ended run; completions are graded several at once.
``imports`` names modules that register generators of one's own (``reasoning_gym.register_dataset``).

**Tools.** ``[task.tools]`` (``enabled = ["python"]``, the sandboxed Python tool, or the calculator) makes the
rollouts multi-turn: the prompt says how to call them (in the chat template's tools where it shows them, else at the
end of the user's message), and the answer is graded in the whole reply as without tools.

**Prompts.** ``chat`` (the default): the tokenizer's chat template over the question and an instruction saying
how to answer: ``answer = "answer_is"`` ("End your reply with: The answer is <answer>."; the text after the last
``answer is`` on its line is the answer) or ``"answer_tags"`` (reasoning-gym's own convention, ``<answer>...</answer>``,
read by its ``extract_answer``). ``r1_zero``: the r1_zero prompt, the answer inside ``</think> <answer> ... </answer>``.

reasoning-gym is imported only when such a task is configured (the ``envs`` extra).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import math
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from grpolab.tasks.base import Example, Grade, Task, TaskSettings
from grpolab.tasks.datasets import canonical_json, file_sha256, text_sha256
from grpolab.tasks.environment import import_extra, installed_version
from grpolab.tasks.prompts import PromptBuilder
from grpolab.tasks.r1_zero import parse_r1_zero
from grpolab.tasks.sandbox import MAX_WORKERS, WorkerPool
from grpolab.tools.protocol import ToolsConfig

logger = logging.getLogger(__name__)

VAL_SEED_OFFSET = 1_000_000  # the default val_seed - seed: far beyond any item count, so no item is shared
CONTROLLED = ("seed", "size")  # generator config fields the task sets itself (task.seed / val_seed, n_train / n_val)
INSTRUCTIONS = {
    "answer_is": "End your reply with: The answer is <answer>.",
    "answer_tags": "Give your final answer between <answer> and </answer> tags.",
}
# Generators of reasoning-gym 0.1.25 whose items depend on the order of Python's string hashing (a set iterated
# unsorted): they differ from process to process unless PYTHONHASHSEED is fixed (found by generating their items
# under two hash seeds; the other 100 gave the same items).
HASH_ORDER_DEPENDENT = frozenset(
    {"isomorphic_strings", "knight_swap", "polynomial_multiplication", "ransom_note", "word_ladder"}
)
CORRECT, SCORE = "correct", "score"  # the grade's components (reward/<name> in the metrics)
_ANSWER_IS = re.compile(r"answer is:?[ \t]*(.*?)[ \t]*$", re.IGNORECASE | re.MULTILINE)


def _reasoning_gym() -> Any:
    """The reasoning_gym package, or one line saying how to install it."""
    return import_extra("reasoning_gym", "reasoning_gym")


def reasoning_gym_version() -> str:
    """The installed reasoning-gym's version (its distribution's: the module's ``__version__`` lags behind)."""
    return installed_version("reasoning-gym", "reasoning_gym")


def stated_answer(completion: str) -> str | None:
    """The text after the last ``answer is`` on its line, without markup around it (``**``, quotes, a final
    period), or None when there is none or it is empty."""
    found = _ANSWER_IS.findall(completion)
    if not found:
        return None
    answer = found[-1].strip()
    answer = answer[:-1] if answer.endswith(".") else answer
    answer = answer.strip().strip("*").strip("`").strip()
    if len(answer) >= 2 and answer[0] == answer[-1] and answer[0] in "\"'":
        answer = answer[1:-1].strip()
    return answer or None


def extract(completion: str, answer: str) -> str | None:
    """The answer in ``completion`` stated in the form ``answer`` names (answer_is, answer_tags, r1_zero)."""
    if answer == "answer_is":
        return stated_answer(completion)
    if answer == "answer_tags":
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion)
    ok, stated = parse_r1_zero(completion)
    return stated if ok else None


class GeneratorConfig(TaskSettings):
    """One reasoning-gym generator of the mix."""

    name: str = Field(description="a reasoning-gym generator, e.g. gcd, lcm, letter_counting, chain_sum")
    weight: float = Field(1.0, gt=0, description="its share of the items (weights are normalized)")
    settings: dict[str, Any] = Field(
        default_factory=dict, description="the generator's config fields, e.g. {min_words = 1, max_words = 3}"
    )


class ReasoningGymTaskConfig(TaskSettings):
    """Procedural generators of reasoning-gym, graded by their own scorers."""

    name: Literal["reasoning_gym"] = Field("reasoning_gym", description="procedural generators of reasoning-gym")
    generators: list[GeneratorConfig] = Field(
        default_factory=list, description="[[task.generators]] tables: name, weight, settings (at least one)"
    )
    n_train: int = Field(1000, ge=1, description="training items (drawn with seed)")
    n_val: int = Field(64, ge=1, description="validation items (drawn with val_seed)")
    seed: int = Field(0, ge=0, description="the training items' seed")
    val_seed: int | None = Field(
        None, ge=0, description="the validation items' seed; None = seed + 1000000 (item ranges never overlap)"
    )
    prompt: Literal["chat", "r1_zero"] = Field("chat", description="chat = the tokenizer's chat template; r1_zero")
    answer: Literal["answer_is", "answer_tags"] = Field(
        "answer_is",
        description="chat: how the reply states its answer: 'The answer is X.' or <answer>X</answer> "
        "(reasoning-gym's convention); r1_zero prompts use the r1_zero tags",
    )
    system: str | None = Field(None, description="chat: a system message (None: the template's default, if any)")
    score_weight: float = Field(
        0.0, ge=0, description="weight of the generator's score (partial credit) in the RL reward; 0 = logged only"
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        description="time bound of one scorer call (in a killable worker); past it the sample is a failed one (no part in the advantages or the loss)",
    )
    tools: ToolsConfig = Field(
        default_factory=ToolsConfig,
        description='tools the model may call (e.g. enabled = ["python"]); the prompt says how',
    )
    imports: list[str] = Field(
        default_factory=list,
        description="modules that register generators of your own (reasoning_gym.register_dataset), imported first",
    )

    FILES: ClassVar[tuple[str, ...]] = ()

    @property
    def validation_seed(self) -> int:
        return self.seed + VAL_SEED_OFFSET if self.val_seed is None else self.val_seed

    @model_validator(mode="after")
    def _known_generators(self) -> ReasoningGymTaskConfig:
        """Unknown generators, repeated ones, unknown or invalid settings and overlapping seeds, each in one line."""
        _reasoning_gym()
        from reasoning_gym.factory import DATASETS

        for module in self.imports:
            try:
                importlib.import_module(module)
            except Exception as err:
                raise ValueError(f"task.imports: {module!r} cannot be imported: {type(err).__name__}: {err}") from None

        known = sorted(n for n in DATASETS if n != "composite")
        if not self.generators:
            raise ValueError(
                "task.generators is empty: add a [[task.generators]] table naming a reasoning-gym generator "
                '(e.g. name = "gcd", settings = { max_value = 16 })'
            )
        names = [g.name for g in self.generators]
        for i, g in enumerate(self.generators):
            where = f"task.generators[{i}] ({g.name})"
            if g.name not in known:
                raise ValueError(f"{where}: unknown reasoning-gym generator; reasoning-gym has {', '.join(known)}")
            if names.count(g.name) > 1:
                raise ValueError(f"{where}: named twice; a generator appears once in the mix (one settings table)")
            if g.name in HASH_ORDER_DEPENDENT and not os.environ.get("PYTHONHASHSEED", "random").isdigit():
                raise ValueError(
                    f"{where}: its items depend on Python's string hashing, which changes from process to process "
                    "(a resume and the scorers' workers would see other items); set PYTHONHASHSEED=0 (any fixed "
                    "number) in the environment of every run and resume"
                )
            config_cls = DATASETS[g.name][1]
            allowed = [f.name for f in dataclass_fields(config_cls) if f.name not in CONTROLLED]
            for key in g.settings:
                if key in CONTROLLED:
                    raise ValueError(
                        f"{where}: settings.{key} is set by the task (task.seed / task.val_seed, task.n_train / "
                        "task.n_val); remove it"
                    )
                if key not in allowed:
                    raise ValueError(f"{where}: unknown setting {key!r}; {g.name} has {', '.join(allowed)}")
            try:
                config = config_cls(**g.settings)
                if hasattr(config, "validate"):
                    config.validate()
            except Exception as err:  # the generators' own checks are asserts, or errors of their own
                raise ValueError(f"{where}: bad settings {g.settings}: {err or type(err).__name__}") from None
        if self.prompt == "r1_zero" and self.system is not None:
            raise ValueError("task.system applies to task.prompt 'chat'; the r1_zero prompt is fixed")
        self._seeds_apart(len(self.generators))
        return self

    def _seeds_apart(self, k: int) -> None:
        """reasoning-gym seeds item i of generator j with seed + j + 1 + i: the two seed ranges must not overlap."""
        train = (self.seed, self.seed + k + 2 * self.n_train + self.n_val)  # the draws may run past n_train
        val = (self.validation_seed, self.validation_seed + k + self.n_val)
        if train[0] <= val[1] and val[0] <= train[1]:
            raise ValueError(
                f"task.seed {self.seed} and task.val_seed {self.validation_seed} are too close: reasoning-gym seeds "
                "item i with seed + i, so validation would repeat training items; leave task.val_seed unset "
                f"(seed + {VAL_SEED_OFFSET}) or move it past {train[1]}"
            )

    def nonbinary_rewards(self) -> list[str]:
        """The score term once weighted: partial credit takes values between 0 and 1, and adds to ``correct``."""
        return (
            [f"task.score_weight ({self.score_weight:g}, the generators' partial credit)"] if self.score_weight else []
        )

    def reward_weights(self) -> dict[str, float]:
        return {CORRECT: 1.0, SCORE: self.score_weight}

    def prompt_format(self) -> str | None:
        return self.prompt

    def build(self) -> ReasoningGymTask:
        return ReasoningGymTask(self)


def _mix(spec: dict[str, Any]) -> Any:
    """reasoning-gym's CompositeDataset of ``spec`` (generators, seed, size, and the modules that register generators
    of one's own, imported first)."""
    for module in spec["imports"]:
        importlib.import_module(module)
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    specs = [DatasetSpec(name=g["name"], weight=g["weight"], config=dict(g["settings"])) for g in spec["generators"]]
    return CompositeDataset(CompositeConfig(size=spec["size"], seed=spec["seed"], datasets=specs))


@functools.lru_cache(maxsize=8)
def _mix_of(spec_json: str) -> Any:
    return _mix(json.loads(spec_json))


def score_in_worker(spec: dict[str, Any], index: int, question: str, answer: str) -> float:
    """The score of ``answer`` for item ``index`` of the mix ``spec`` by its generator's own ``score_answer``, run in
    a killable worker (``grpolab.tasks.sandbox``): the item is generated again there (seeded), the mix once; an item
    that comes out with another question than the trainer's (a generator that depends on the process's hash order)
    is refused rather than scored."""
    data = _mix_of(canonical_json(spec))
    entry = data[index]
    if entry["question"].strip() != question:
        raise RuntimeError(
            f"item {index} of the mix came out with another question in the scorer's process: generator "
            f"{entry['metadata'].get('source_dataset')!r} is not reproducible across processes"
        )
    return float(data.score_answer(answer, entry))


_scorers = WorkerPool.shared("grpolab.tasks.reasoning_gym:score_in_worker")
_reported: set[str] = set()  # the first scorer failure per generator is logged with its reason


class ReasoningGymTask(Task):
    """Training and validation items of a reasoning-gym mix, prompts, and the generators' scorers as the grade."""

    def __init__(self, cfg: ReasoningGymTaskConfig):
        self.cfg, self.name = cfg, cfg.name
        generators = [g.model_dump() for g in cfg.generators]
        self._specs = {
            "val": {"generators": generators, "seed": cfg.validation_seed, "size": cfg.n_val, "imports": cfg.imports},
            # drawn past n_train only to replace items that repeat a validation question
            "train": {
                "generators": generators,
                "seed": cfg.seed,
                "size": 2 * cfg.n_train + cfg.n_val,
                "imports": cfg.imports,
            },
        }
        try:  # a generator's own failure at these settings (settings its checks let through), in one line
            val_data, train_data = _mix(self._specs["val"]), _mix(self._specs["train"])
            val_entries = [(i, val_data[i]) for i in range(cfg.n_val)]
            asked = {e["question"] for _, e in val_entries}
            train_entries, self.skipped, index = [], 0, 0
            while len(train_entries) < cfg.n_train and index < len(train_data):
                entry = train_data[index]
                if entry["question"] in asked:
                    self.skipped += 1
                else:
                    train_entries.append((index, entry))
                index += 1
        except Exception as err:
            names = ", ".join(g.name for g in cfg.generators)
            raise ValueError(
                f"reasoning-gym task: generating the items of {names} failed: {type(err).__name__}: {err}; "
                "check the generators' settings"
            ) from None
        if len(train_entries) < cfg.n_train:
            raise ValueError(
                f"reasoning-gym task: only {len(train_entries)} of {index} training items differ from the "
                f"{cfg.n_val} validation questions: these settings allow too few distinct problems; widen the "
                "generators' settings or lower task.n_train / task.n_val"
            )
        self._where: dict[str, tuple[str, int]] = {}  # example id -> (split, index in its mix): what the scorer needs
        self._val = [self._example("val", i, *item) for i, item in enumerate(val_entries)]
        self._train = [self._example("train", i, *item) for i, item in enumerate(train_entries)]
        self.toolset = cfg.tools.build()
        if cfg.prompt == "r1_zero":
            self._prompts = PromptBuilder("r1_zero", None, cfg.system, toolset=self.toolset)
        else:
            template = "{question}\n\n" + INSTRUCTIONS[cfg.answer]
            self._prompts = PromptBuilder("chat", template, cfg.system, toolset=self.toolset)
        self.answer_form = "r1_zero" if cfg.prompt == "r1_zero" else cfg.answer

    def _example(self, split: str, number: int, index: int, entry: dict[str, Any]) -> Example:
        """An Example of one reasoning-gym entry (its question stripped of trailing blank lines)."""
        example_id = f"{split}-{number}"
        self._where[example_id] = (split, index)
        source = entry["metadata"]["source_dataset"]
        return Example(
            id=example_id, question=entry["question"].strip(), answer=str(entry["answer"]), fields={"generator": source}
        )

    def train_examples(self) -> list[Example]:
        return list(self._train)

    def validation_examples(self) -> list[Example]:
        return list(self._val)

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self._prompts.bind_tokenizer(tokenizer)

    def prompt(self, example: Example) -> str:
        return self._prompts.render({"question": example.question})

    def prompt_template(self) -> str:
        return self._prompts.describe()

    def messages(self, example: Example) -> list[dict[str, str]]:
        if self.cfg.prompt == "chat":
            return self._prompts.messages({"question": example.question})
        return [{"role": "user", "content": self.prompt(example)}]

    def score(self, answer: str, example: Example) -> float | None:
        """The example's generator's own score of ``answer`` (0.0 to 1.0), within ``timeout_s``; None when the scorer
        raised, ran past its bound or gave no number (its first failure per generator is logged)."""
        split, index = self._where[example.id]
        reply = _scorers.call([self._specs[split], index, example.question, answer], timeout_s=self.cfg.timeout_s)
        value = reply.value if reply.ok else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        generator = example.fields["generator"]
        if generator not in _reported:
            _reported.add(generator)
            why = reply.error if not reply.ok else f"it returned {value!r}, not a number"
            logger.warning(
                "reasoning-gym generator %r: its scorer failed on item %s (it scores 0, counted in "
                "reward/score_failed; later failures are only counted): %s",
                generator,
                example.id,
                why,
            )
        return None

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        """``correct`` = the generator's score is 1.0; ``score`` = that score (partial credit); format: an answer
        stated in the asked form, not truncated. A scorer that fails scores 0 on both, named in ``failed``."""
        answer = extract(completion, self.answer_form)
        score = 0.0 if truncated or answer is None else self.score(answer, example)
        failed = (CORRECT, SCORE) if score is None else ()
        score = score or 0.0
        correct = float(score >= 1.0)
        return Grade(
            format_reward=float(answer is not None and not truncated),
            answer_reward=correct,
            extracted=answer,
            components=((CORRECT, correct), (SCORE, score)),
            total=correct + self.cfg.score_weight * score,
            failed=failed,
            error="the generator's scorer failed (its first error is in the log)" if failed else None,
        )

    def grade_batch(self, items: list[tuple[str, Example, bool]]) -> list[Grade]:
        """``grade`` over (completion, example, truncated) items, several at once (the scorers' worker processes)."""
        with ThreadPoolExecutor(MAX_WORKERS) as pool:
            return list(pool.map(lambda item: self.grade(*item), items))

    def data_fingerprint(self) -> dict[str, Any]:
        """The generators (names, weights, settings), sizes, seeds, reasoning-gym's version, and SHA-256s of those
        settings, of the generated items (id, generator, question, answer) and of the prompt."""

        def rows(examples: list[Example]) -> str:
            return "\n".join(canonical_json([e.id, e.fields["generator"], e.question, e.answer]) for e in examples)

        generators = [g.model_dump() for g in self.cfg.generators]
        imports = {}  # a module of one's own: its file and exact text (its generators make the items)
        for module in self.cfg.imports:
            source = getattr(sys.modules.get(module), "__file__", None)
            imports[module] = {"source": source, "source_sha256": file_sha256(Path(source)) if source else None}
        identity = {
            "reasoning_gym_version": reasoning_gym_version(),
            "generators": generators,
            "imports": imports,
            "seed": self.cfg.seed,
            "val_seed": self.cfg.validation_seed,
            "prompt": self.cfg.prompt,
            "answer": self.answer_form,
            "score_weight": self.cfg.score_weight,
            **({"tools": self.cfg.tools.model_dump(mode="json")} if self.toolset is not None else {}),
        }
        return {
            "task": self.name,
            **identity,
            # what a resume compares (the *_sha256 and *_rows keys): the package's version and every setting too,
            # since a new reasoning-gym may grade the same items differently
            "settings_sha256": text_sha256(canonical_json(identity)),
            "train_rows": len(self._train),
            "train_skipped_as_validation": self.skipped,
            "validation_rows": len(self._val),
            "train_sha256": text_sha256(rows(self._train)),
            "validation_sha256": text_sha256(rows(self._val)),
            "prompt_template_sha256": text_sha256(self.prompt_template()),
        }
