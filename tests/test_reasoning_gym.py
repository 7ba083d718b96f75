"""reasoning-gym's generators as a task (the real package): items, disjoint validation, the generators' own scorers
with partial credit kept as a term, prompts, fingerprints and refused settings."""

from __future__ import annotations

import pytest
from test_chat_prompts import chat_model_dir
from transformers import AutoTokenizer

from grpolab.tasks import build_task
from grpolab.tasks.configs import BUILT_IN
from grpolab.tasks.reasoning_gym import ReasoningGymTaskConfig, reasoning_gym_version, stated_answer

pytest.importorskip("reasoning_gym", reason="the task runs the real package: pip install 'grpolab[envs]'")

SUMS = {"name": "chain_sum", "settings": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
LETTERS = {"name": "letter_counting", "weight": 3.0, "settings": {"min_words": 1, "max_words": 3}}
BASE = {"name": "reasoning_gym", "generators": [SUMS, LETTERS], "n_train": 40, "n_val": 12}


def task_of(**changes):
    return build_task({**BASE, **changes})


def test_a_weighted_mix_of_generators_seeded_apart_from_validation():
    import reasoning_gym

    task = task_of()
    train, val = task.train_examples(), task.validation_examples()
    assert (len(train), len(val)) == (40, 12)
    assert [e.id for e in val[:2]] == ["val-0", "val-1"] and train[0].id == "train-0"
    sources = [e.fields["generator"] for e in train]
    assert set(sources) == {"chain_sum", "letter_counting"} and sources.count("letter_counting") > 20  # weight 3:1
    for e in train[:10]:  # the generator's own item: the same question and answer as reasoning-gym makes alone
        assert e.question and e.answer
    alone = reasoning_gym.create_dataset("chain_sum", seed=1_000_001, size=12, **SUMS["settings"])
    firsts = [i for i, e in enumerate(val) if e.fields["generator"] == "chain_sum"]
    assert firsts and val[firsts[0]].question == alone[firsts[0]]["question"].strip()
    assert not {e.question for e in train} & {e.question for e in val}
    assert task_of().train_examples() == train and task_of().validation_examples() == val  # seeded: exact again
    assert task_of(seed=7).train_examples() != train and task_of(seed=7).validation_examples() != val


def test_validation_questions_are_never_trained_on_even_where_problems_are_few():
    one_animal = {"name": "leg_counting", "settings": {"min_animals": 1, "max_animals": 1, "max_instances": 1}}
    task = task_of(generators=[one_animal], n_train=30, n_val=20)  # 37 animals: a draw repeats a question often
    asked = {e.question for e in task.validation_examples()}
    assert len(task.train_examples()) == 30 and not asked & {e.question for e in task.train_examples()}
    assert task.data_fingerprint()["train_skipped_as_validation"] > 0
    with pytest.raises(ValueError, match="too few distinct problems; widen the generators' settings"):
        task_of(generators=[one_animal], n_train=30, n_val=300)  # validation asks every problem there is


@pytest.mark.parametrize(
    "completion, truncated, extracted, correct, score",
    [
        ("There are 2. The answer is 2.", False, "2", 1.0, 1.0),
        ("The answer is **1**\nNo: the answer is 2", False, "2", 1.0, 1.0),  # the last statement counts
        ("The answer is 2 times.", False, "2 times", 0.0, 1 / 7),  # the generator's partial credit: a term
        ("The answer is 4.", False, "4", 0.0, 0.0),
        ("I count 2 of them.", False, None, 0.0, 0.0),  # not in the asked form
        ("The answer is 2.", True, "2", 0.0, 0.0),  # truncated
    ],
)
def test_the_generators_own_scorer_with_partial_credit_as_its_own_term(
    completion, truncated, extracted, correct, score
):
    task = task_of(generators=[LETTERS], score_weight=0.5)
    example = next(e for e in task.validation_examples() + task.train_examples() if e.answer == "2")
    grade = task.grade(completion, example, truncated)
    assert grade.extracted == extracted and grade.answer_reward == correct
    assert grade.format_reward == float(extracted is not None and not truncated)
    assert dict(grade.components) == pytest.approx({"correct": correct, "score": score})
    assert grade.reward == pytest.approx(correct + 0.5 * score)


def test_answer_forms_reasoning_gyms_tags_and_r1_zero():
    tags = task_of(answer="answer_tags")
    example = tags.validation_examples()[0]
    assert tags.grade(f"so <answer>{example.answer}</answer>", example, False).answer_reward == 1.0
    assert tags.grade(f"The answer is {example.answer}.", example, False).format_reward == 0.0
    r1 = task_of(prompt="r1_zero")
    assert r1.grade(f" sum </think> <answer> {example.answer} </answer>", example, False).answer_reward == 1.0
    assert r1.prompt(example).endswith(f"User: {example.question}\nAssistant: <think>")
    assert stated_answer('The answer is "ainomma".') == "ainomma" and stated_answer("The answer is .") is None


def test_reward_terms_weights_and_binary_rewards():
    settings = ReasoningGymTaskConfig(**{k: v for k, v in BASE.items() if k != "name"})
    assert settings.reward_weights() == {"correct": 1.0, "score": 0.0} and settings.nonbinary_rewards() == []
    weighted = settings.model_copy(update={"score_weight": 0.5})
    assert weighted.reward_weights() == {"correct": 1.0, "score": 0.5}
    assert "task.score_weight" in weighted.nonbinary_rewards()[0]  # BNPO refuses it up front (MaxRL takes it: >= 0)
    assert BUILT_IN["reasoning_gym"] is ReasoningGymTaskConfig


def test_chat_prompts_are_the_models_template_with_the_answer_instruction(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir(tmp_path, "qwen3"))
    task = task_of(system="Be brief.")
    example = task.validation_examples()[0]
    with pytest.raises(RuntimeError, match="bind_tokenizer"):
        task.prompt(example)
    task.bind_tokenizer(tokenizer)
    assert task.prompt(example) == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{example.question}\n\n"
        "End your reply with: The answer is <answer>.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert task.messages(example)[-1] == {
        "role": "user",
        "content": f"{example.question}\n\nEnd your reply with: The answer is <answer>.",
    }


def test_tools_are_offered_where_the_chat_template_shows_them_else_in_the_users_message(tmp_path):
    """SmolLM2's chat template, like this one, ignores its ``tools`` argument: the tools' instruction then ends
    the user's message; a template that shows its tools gets them there alone."""
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir(tmp_path, "qwen3"))
    task = task_of(tools={"enabled": ["calculator"], "max_turns": 3})
    assert list(task.toolset.tools) == ["calculator"] and task.toolset.max_turns == 3
    task.bind_tokenizer(tokenizer)
    example = task.validation_examples()[0]
    asked = f"{example.question}\n\nEnd your reply with: The answer is <answer>."
    note = task.toolset.instruction().strip()
    assert note.startswith("The Assistant may call a tool by writing <tool_call>")
    assert task.messages(example)[-1]["content"] == f"{asked}\n\n{note}" and note in task.prompt(example)
    tokenizer.chat_template = "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}" + tokenizer.chat_template
    task = task_of(tools={"enabled": ["calculator"]})
    task.bind_tokenizer(tokenizer)
    assert task.messages(example)[-1]["content"] == asked
    assert task.prompt(example).startswith('TOOLS [{"type": "function", "function": {"name": "calculator"')
    assert note not in task.prompt(example)


@pytest.mark.parametrize(
    "change",
    [
        {"generators": [{**SUMS, "settings": {**SUMS["settings"], "max_digits": 2}}, LETTERS]},
        {"generators": [SUMS, {**LETTERS, "weight": 1.0}]},
        {"generators": [SUMS]},
        {"n_train": 41},
        {"n_val": 13},
        {"seed": 1},
        {"val_seed": 5000},
        {"prompt": "r1_zero"},
        {"answer": "answer_tags"},
        {"score_weight": 0.5},
        {"system": "Be brief."},
        {"tools": {"enabled": ["calculator"]}},
    ],
)
def test_the_fingerprint_is_stable_and_changes_with_every_setting(change):
    fingerprint = task_of().data_fingerprint()
    assert fingerprint == task_of().data_fingerprint()
    assert fingerprint["reasoning_gym_version"] == reasoning_gym_version() == "0.1.25"
    assert fingerprint["generators"][1] == LETTERS and fingerprint["val_seed"] == 1_000_000
    changed = task_of(**change).data_fingerprint()
    compared = lambda f: {k: v for k, v in f.items() if k.endswith(("_sha256", "_rows"))}  # noqa: E731
    assert compared(changed) != compared(fingerprint)  # what a resume compares (grpolab.run.resume.check_data)
    data_changes = {"generators", "n_train", "n_val", "seed", "val_seed"}
    if set(change) & data_changes:  # the generated items themselves, not only the settings recorded
        assert (changed["train_sha256"], changed["validation_sha256"]) != (
            fingerprint["train_sha256"],
            fingerprint["validation_sha256"],
        )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"generators": [{"name": "leg_count"}]}, "unknown reasoning-gym generator; reasoning-gym has ab, acre,"),
        ({"generators": [{"name": "gcd", "settings": {"max_val": 9}}]}, "unknown setting 'max_val'; gcd has"),
        ({"generators": [{"name": "gcd", "settings": {"max_value": 1}}]}, "bad settings {'max_value': 1}: max_value"),
        ({"generators": [{"name": "gcd", "settings": {"seed": 3}}]}, "settings.seed is set by the task"),
        ({"generators": [SUMS, SUMS]}, "named twice"),
        ({"generators": []}, "task.generators is empty: add a [[task.generators]] table"),
        ({"generators": [{"name": "gcd", "weight": 0}]}, "greater than 0"),
        ({"seed": 0, "val_seed": 30}, "too close: reasoning-gym seeds item i with seed + i"),
        ({"prompt": "r1_zero", "system": "Be brief."}, "task.system applies to task.prompt 'chat'"),
    ],
)
def test_bad_settings_are_refused_in_one_line(change, message):
    with pytest.raises(ValueError) as refused:
        task_of(**change)
    assert message in str(refused.value) and len(str(refused.value).splitlines()) == 1


def test_a_scorer_that_hangs_or_raises_fails_its_terms_within_the_bound_and_the_others_go_on():
    """The generators' scorers run in killable workers (``grpolab.tasks.sandbox``): a generator of one's own,
    registered by a module in ``task.imports``, whose scorer hangs on one answer and raises on another."""
    import time

    task = task_of(generators=[{"name": "grpolab_repeat"}], imports=["rg_generators"], timeout_s=1.0, n_val=4)
    example = task.validation_examples()[0]
    items = [(f"The answer is {text}.", example, False) for text in ("hang", "raise", example.answer, "x")]
    started = time.monotonic()
    hang, raised, right, wrong = task.grade_batch(items)
    assert time.monotonic() - started < 30  # the hanging scorer was killed at its bound (1 s), not waited for
    assert hang.failed == raised.failed == ("correct", "score") and hang.reward == raised.reward == 0.0
    assert (right.failed, right.answer_reward, wrong.failed, wrong.answer_reward) == ((), 1.0, (), 0.0)
    fingerprint = task.data_fingerprint()
    assert fingerprint["imports"]["rg_generators"]["source"].endswith("rg_generators.py")
    with pytest.raises(ValueError, match="task.imports: 'no_such_module' cannot be imported: ModuleNotFoundError"):
        task_of(imports=["no_such_module"])
    unstable = task_of(
        generators=[{"name": "grpolab_repeat", "settings": {"per_process": True}}], imports=["rg_generators"]
    )
    example = unstable.validation_examples()[0]  # its item comes out otherwise in the scorer's process: not scored
    assert unstable.grade(f"The answer is {example.answer}.", example, False).failed == ("correct", "score")
    with pytest.raises(ValueError, match="items of grpolab_repeat failed: OverflowError: too high to repeat; check"):
        task_of(generators=[{"name": "grpolab_repeat", "settings": {"high": 10**6}}], imports=["rg_generators"])


def test_a_generator_whose_items_follow_the_hash_order_needs_a_fixed_hash_seed(monkeypatch):
    word_ladder = [{"name": "word_ladder"}]
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="word_ladder.*set PYTHONHASHSEED=0"):
        task_of(generators=word_ladder)
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # a fixed hash seed: the run's processes all draw the same items
    ReasoningGymTaskConfig(generators=word_ladder)
