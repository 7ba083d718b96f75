"""The weights by registry: each ``algorithm.weight`` registers, in its own module of ``grpolab.objectives.surrogates``,
its per-token function, its formula, the fields it reads and its checks. The config's choices, ``grpolab algorithms``,
the loss and the one rule for a weight's fields read the registry; nothing else in the package branches on a weight's
name. A weight registered by a script of its own, before the spec is built, is a choice like the built-in ones."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError

import grpolab
from grpolab.common.validation import describe_validation_error
from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.objectives.surrogates import CLIP_RANGE, SURROGATES, readers_of

PACKAGE = Path(grpolab.__file__).resolve().parent
REGISTRY = PACKAGE / "objectives" / "surrogates"
# the fields a weight reads that no other setting does: set away from their default, the weight is chosen
OWN_FIELDS = sorted({f for s in SURROGATES.values() for f in s.reads} - set(CLIP_RANGE))


def test_the_config_choices_and_help_are_the_registered_weights():
    field = AlgorithmSpec.model_fields["weight"]
    assert get_args(field.annotation) == tuple(SURROGATES)
    for s in SURROGATES.values():
        assert f"{s.name} ({s.summary})" in field.description


def test_every_weight_is_listed_with_its_formula_and_the_fields_it_reads(capsys):
    from grpolab.commands.cli import main

    assert main(["algorithms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for s in SURROGATES.values():
        line = next(line for line in lines if line.startswith(f"  {s.name} "))
        assert s.formula_line() in line and all(name in line for name in s.reads), line


def test_no_branch_on_a_weight_name_outside_the_registry():
    """A weight's name appears only in its module and in the presets that choose it."""
    branch = re.compile(r"\bweight\s*(==|!=|(not\s+)?in\s*[\(\[{])\s*[\"']")  # against a name
    names = [n for n in SURROGATES if n not in ("none", "clip")]  # two names other settings use as words
    quoted = re.compile("|".join(rf"[\"']{n}[\"']" for n in names))
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(REGISTRY) or path.name == "presets.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if branch.search(line) or (quoted.search(line) and path.name != "peer_names.py"):
                found.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not found, found


def _away_from_default(field: str) -> float:
    default = AlgorithmSpec.model_fields[field].default
    return 4.0 if default is None else default + 1.5


@pytest.mark.parametrize(
    "field, weight",
    [(f, w) for f in OWN_FIELDS for w in SURROGATES if w not in readers_of(f)],
)
def test_a_field_of_another_weight_is_refused_in_one_line_naming_its_readers(field, weight):
    value = _away_from_default(field)
    with pytest.raises(ValidationError) as err:
        AlgorithmSpec(name="t", weight=weight, **{field: value})
    lines = describe_validation_error(err.value)
    readers = " or ".join(readers_of(field))
    want = f"{field} {value:g} is read by weight {readers} only; weight {weight} does not read it"
    assert len(lines) == 1 and want in lines[0], lines


@pytest.mark.parametrize("field, weight", [(f, w) for f in OWN_FIELDS for w in readers_of(f)])
def test_a_field_is_accepted_by_the_weights_that_read_it(field, weight):
    spec = AlgorithmSpec(name="t", weight=weight, **{field: _away_from_default(field)})
    assert getattr(spec, field) == _away_from_default(field)


# A weight of its own: half of REINFORCE's loss, its low clip indicator where A < 0 (to be counted), reading
# eps_high only to be listed with it; registered before the spec module is imported, as the package's are.
NEW_WEIGHT = """
import torch
from grpolab.objectives.surrogates.registry import SurrogateOutput, register

@register("half", formula="-A * logp / 2", summary="half of REINFORCE", reads=("eps_high",))
def half(x, eps_high):
    return SurrogateOutput(-x.advantages * x.masked_logprobs / 2, x.ratio, (x.advantages < 0).expand_as(x.ratio))

from pydantic import ValidationError
from grpolab.commands.cli import main
from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.objectives.losses import PolicyLossInput, policy_loss, step_denominators

g = torch.Generator().manual_seed(0)
logp = torch.randn(4, 5, generator=g, dtype=torch.float64)
mask = torch.ones(4, 5, dtype=torch.float64)
adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
results = {}
for weight in ("half", "none"):
    spec = AlgorithmSpec(name="t", weight=weight)
    leaf = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(PolicyLossInput(leaf, logp.detach(), adv, mask), spec, step_denominators(spec, mask, 5))
    loss.backward()
    results[weight] = (loss.detach(), leaf.grad, metrics.means())
torch.testing.assert_close(results["half"][0], results["none"][0] / 2, rtol=0, atol=0)
torch.testing.assert_close(results["half"][1], results["none"][1] / 2, rtol=0, atol=0)
assert results["half"][2]["clip_low_frac"] == 0.5 and results["none"][2]["clip_low_frac"] == 0.0
try:
    AlgorithmSpec(name="t", weight="half", ratio_cap=4.0)
    raise SystemExit("ratio_cap was accepted with weight half")
except ValidationError as err:
    assert "ratio_cap 4 is read by weight dppo only; weight half does not read it" in str(err), err
assert main(["config", "--algorithm.weight", "half"]) == 0
main(["algorithms"])
print("registered")
"""


def test_a_weight_registered_in_a_module_of_its_own_is_a_choice_everywhere():
    """No other file changes: the config accepts it, the loss computes it, the rule names the weights that read a
    field it does not, ``grpolab config`` takes it on the command line and ``grpolab algorithms`` lists it."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(NEW_WEIGHT)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "  half     -A * logp / 2  [eps_high]" in done.stdout
    assert 'weight = "half"' in done.stdout
    assert done.stdout.rstrip().endswith("registered")
