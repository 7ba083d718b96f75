"""A TRL name where grpolab has another: the unknown-field line names grpolab's setting (or says that none
corresponds), on the command line, through ``load_config`` and in a TOML file; and the map of TRL's names
(``grpolab.common.peer_names``) can only point at real grpolab fields and at real TRL 1.16 ``GRPOConfig`` fields."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpolab.commands.cli import main
from grpolab.config import ConfigError, config_fields, load_config


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]


# TRL's name (as typed, value) -> the grpolab field its line suggests (None: the line says none corresponds)
SUGGESTED = {
    ("learning_rate", "1e-5"): "optim.lr",
    ("num_generations", "8"): "rollout.group_size",  # was "did you mean task.generators?"
    ("max_completion_length", "256"): "rollout.max_new_tokens",
    ("loss_type", "dapo"): "algorithm.name",
    ("beta", "0.04"): "algorithm.beta",
    ("epsilon", "0.2"): "algorithm.eps_low",
    ("epsilon_high", "0.28"): "algorithm.eps_high",
    ("temperature", "0.7"): "rollout.temperature",
    ("top_p", "1.0"): "rollout.top_p",
    ("per_device_train_batch_size", "4"): "optim.micro_batch_size",
    ("gradient_accumulation_steps", "4"): None,
    ("num_iterations", "2"): "algorithm.epochs",
    ("max_steps", "100"): "steps",
    ("scale_rewards", "batch"): "algorithm.normalizer",
    ("importance_sampling_level", "sequence"): "algorithm.weight",
    ("mask_truncated_completions", "true"): None,
    ("max_prompt_length", "512"): "rollout.max_prompt_tokens",
    ("logging_steps", "10"): "log_every",
    ("save_steps", "50"): "checkpoint.every",
    ("eval_steps", "10"): "eval.every",
    ("report_to", "wandb"): "log.trackers",
    ("bf16", "true"): "model.dtype",
    ("gradient_checkpointing", "true"): "model.gradient_checkpointing",
    ("use_vllm", "true"): "rollout.engine",
    ("vllm_mode", "colocate"): "rollout.engine",
    ("warmup_ratio", "0.1"): None,
    ("lr_scheduler_type", "cosine"): None,
    ("weight_decay", "0.1"): "optim.weight_decay",
    ("max_grad_norm", "0.5"): "optim.max_grad_norm",
    ("adam_beta1", "0.9"): "optim.betas",
    ("adam_beta2", "0.99"): "optim.betas",
    ("optim.learning_rate", "1e-5"): "optim.lr",  # a TRL leaf under a grpolab section
    ("rollout.num_generations", "8"): "rollout.group_size",
    ("algorithm.epsilon", "0.2"): "algorithm.eps_low",
}


def expected(name: str, field: str | None) -> str:
    if field is None:
        return f"{name}: unknown field; TRL's {name.rpartition('.')[2]} has no grpolab equivalent: "
    return f"{name}: unknown field; did you mean {field}? (TRL's {name.rpartition('.')[2]}"


@pytest.mark.parametrize(("typed", "field"), list(SUGGESTED.items()), ids=[name for name, _ in SUGGESTED])
def test_a_trl_name_on_the_command_line_gets_grpolabs_name(typed, field, tmp_path, capsys):
    name, value = typed
    out = tmp_path / "run"
    assert main(["train", "--task", "arithmetic", f"--{name}", value, "--output-dir", str(out)]) == 2
    (line,) = error_lines(capsys)
    assert line.startswith(f"error: {expected(name, field)}"), line
    assert not out.exists()


def test_the_line_words_the_value_the_trl_user_gave(capsys):
    """loss_type 'dapo' in TRL is only a reduction, not grpolab's dapo preset; 'dr_grpo' likewise."""
    args = ["--loss_type", "dapo", "--scale_rewards", "none", "--importance_sampling_level", "sequence"]
    assert main(["config", *args]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 3
    loss, scale, level = sorted(lines, key=lambda line: args.index(f"--{line.split()[1].rstrip(':')}"))
    assert "--algo grpo --algorithm.aggregation token" in loss and "dynamic sampling" in loss
    assert "'none' is 'none'" in scale
    assert "--algorithm.weight gspo" in level
    assert main(["config", "--loss_type", "dr_grpo"]) == 2
    (line,) = error_lines(capsys)
    assert "--algorithm.aggregation constant" in line and "scale_rewards none" in line


def test_load_config_and_a_toml_file_give_the_same_lines(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"learning_rate": 1e-5, "num_generations": 8, "optim.learning_rate": 1e-5})
    lines = str(err.value).splitlines()
    assert sorted(line.split(";")[1] for line in lines) == [
        " did you mean optim.lr? (TRL's learning_rate",
        " did you mean optim.lr? (TRL's learning_rate",
        " did you mean rollout.group_size? (TRL's num_generations)",
    ]
    config = tmp_path / "trl.toml"
    config.write_text('loss_type = "grpo"\nbeta = 0.0\n\n[optim]\nlearning_rate = 1e-6\n\n[trl]\nmax_steps = 10\n')
    with pytest.raises(ConfigError) as err:
        load_config(config)
    lines = sorted(str(err.value).splitlines())
    assert [line.split(" (")[0] for line in lines] == [
        "beta: unknown field; did you mean algorithm.beta?",
        "loss_type: unknown field; did you mean algorithm.name?",
        "optim.learning_rate: unknown field; did you mean optim.lr?",
        "trl.max_steps: unknown field; did you mean steps?",
    ]


def test_grpolabs_own_mistypes_still_get_the_closest_field(capsys):
    assert main(["config", "--optim.lrr", "1", "--stpes", "2"]) == 2
    assert sorted(error_lines(capsys)) == [
        "error: optim.lrr: unknown field; did you mean optim.lr?",
        "error: stpes: unknown field; did you mean steps?",
    ]


def test_every_name_of_the_map_gives_its_line(capsys):
    from grpolab.common.peer_names import TRL_GRPO

    plain = [name for name in TRL_GRPO if "=" not in name]
    assert main(["config", *(arg for name in plain for arg in (f"--{name}", "0"))]) == 2
    lines = {line.split()[1].rstrip(":"): line.removeprefix("error: ") for line in error_lines(capsys)}
    assert sorted(lines) == sorted(plain)
    for name in plain:
        assert lines[name].startswith(expected(name, TRL_GRPO[name][0])), lines[name]


# ---- the map cannot rot ---------------------------------------------------------------------------------------
def test_every_grpolab_field_the_map_names_is_a_real_field():
    from grpolab.common.peer_names import PEER_NAMES

    fields = {f.name for f in config_fields()}
    top_level = {f.name for f in config_fields() if not f.section}
    for framework, names in PEER_NAMES.items():
        for name, (field, note) in names.items():
            assert field is None or field in fields, f"{framework}'s {name} points at {field}, not a grpolab field"
            assert field is not None or note, (
                f"{framework}'s {name}: a name with no counterpart says what comes closest"
            )
            base = name.partition("=")[0]
            assert base in names, f"{name}: a value's entry needs the plain name's entry too"
            assert base not in top_level, f"{name} is a grpolab field: it never reaches the unknown-field line"


def _class_fields(path: Path, classes: set[str]) -> tuple[set[str], dict[str, str]]:
    """The annotated fields of ``classes`` in the source file ``path`` and each field's help text."""
    tree = ast.parse(path.read_text())
    names, helps = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                    helps[item.target.id] = " ".join(
                        c.value for c in ast.walk(item) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    )
    return names, helps


def test_every_trl_name_of_the_map_is_a_grpo_config_field_or_trl_grpo_flag_of_trl_1_16():
    """Read from the installed sources (no import: TRL pulls in transformers' trainer), so a TRL that renames a
    field, or a loss type the map does not word, fails here."""
    from grpolab.common.peer_names import OLDER_TRL_NAMES, TRL_GRPO

    trl, transformers = importlib.util.find_spec("trl"), importlib.util.find_spec("transformers")
    if trl is None or transformers is None:
        pytest.skip("needs trl (the test extra)")
    trl_dir = Path(trl.submodule_search_locations[0])
    version = importlib.metadata.version("trl")
    if not version.startswith("1.16."):
        pytest.skip(f"the map is TRL 1.16's; trl {version} is installed")
    own, helps = _class_fields(trl_dir / "trainer" / "grpo_config.py", {"GRPOConfig"})
    base, _ = _class_fields(trl_dir / "trainer" / "base_config.py", {"_BaseConfig"})
    training, _ = _class_fields(
        Path(transformers.submodule_search_locations[0]) / "training_args.py", {"TrainingArguments"}
    )
    model_config, _ = _class_fields(trl_dir / "trainer" / "model_config.py", {"ModelConfig"})
    script, _ = _class_fields(trl_dir / "scripts" / "grpo.py", {"GRPOScriptArguments"})
    script_base, _ = _class_fields(trl_dir / "scripts" / "utils.py", {"ScriptArguments"})
    grpo_config = own | base | training | model_config | script | script_base  # and the trl grpo command's flags
    assert {"num_generations", "loss_type", "learning_rate", "per_device_train_batch_size"} <= grpo_config
    plain = {name.partition("=")[0] for name in TRL_GRPO} - OLDER_TRL_NAMES
    if not importlib.metadata.version("transformers").startswith("5.19."):  # TrainingArguments' names vary by version
        plain &= own | base | model_config | script | script_base
    assert sorted(plain - grpo_config) == [], "names that are neither GRPOConfig fields nor flags"
    assert "max_prompt_length" not in own | base, "its line says TRL 1.16's GRPOConfig has no such field"
    loss_types = re.findall(r"'(\w+)'", helps["loss_type"].split("Supported values are")[1].split(".")[0])
    assert set(loss_types) == {"grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"}
    assert sorted(t for t in loss_types if f"loss_type={t}" not in TRL_GRPO) == []


def test_a_trl_name_is_answered_without_torch_or_transformers(tmp_path):
    """The refusal is the CLI's fast path (tests/test_cli_imports.py): the map is plain data."""
    probe = (
        "import sys\nfrom grpolab.commands.cli import main\nrc = main(['train', '--learning_rate', '1e-5'])\n"
        "print(rc, sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "did you mean optim.lr?" in done.stdout, done.stdout + done.stderr
    assert done.stdout.strip().endswith("2 []"), done.stdout + done.stderr
