"""The audit of every notebook parameter: each has a rule, and each rule refuses what it should.

docs/reliability.md lists the parameters; this test checks every one of them is refused, by
name, when its value is outside its rule, and that every parameter a shipped notebook
declares has a rule.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from graphborrow.core.errors import ParameterError
from graphborrow.run.sweep.parameters import (
    PARAMETERS,
    PATH_PARAMETERS,
    Choice,
    IntList,
    OptionalPath,
    Range,
    Text,
    declared_parameters,
    validate,
)

ROOT = Path(__file__).resolve().parents[2]


def outside(rule) -> list:
    """Values the rule must refuse."""
    if isinstance(rule, Range):
        kinds = [True, "1", [1]] + ([1.5] if rule.integer else []) + ([] if rule.none_ok else [None])
        below = rule.lo - 1 if rule.integer else (rule.lo / 2 if rule.lo > 0 else rule.lo - 0.5)
        return [below, rule.hi + 1, *kinds]
    if isinstance(rule, IntList):
        return [[], [rule.hi + 1], [rule.lo - 1], [1.5], [True], "1,2"] + ([] if rule.none_ok else [None])
    if isinstance(rule, Choice):
        return ["no-such-choice", 1.5] + ([] if any(v is None for v in rule.values) else [None])
    if isinstance(rule, OptionalPath):
        return ["", 5, ["a"]]
    if isinstance(rule, Text):
        return ["", 5, None]
    raise AssertionError(f"no cases for {type(rule).__name__}")


@pytest.mark.parametrize("name", sorted(n for n in PARAMETERS if n not in PATH_PARAMETERS))
def test_every_parameter_refuses_values_outside_its_rule_by_name(name):
    for value in outside(PARAMETERS[name]):
        with pytest.raises(ParameterError, match=name):
            validate({name: value})


@pytest.mark.parametrize("name", PATH_PARAMETERS)
def test_the_runners_folders_are_not_parameters_to_set(name):
    with pytest.raises(ParameterError, match=f"{name} is set by the runner"):
        validate({name: "somewhere"})


def test_every_parameter_of_every_shipped_notebook_has_a_rule_and_a_line_in_the_audit():
    page = (ROOT / "docs" / "reliability.md").read_text()
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert notebooks
    for nb in notebooks:
        for name in declared_parameters(nb):
            assert name in PARAMETERS, f"{nb.name} declares {name}, which has no rule"
    for name in PARAMETERS:
        assert f"`{name}`" in page, f"{name} is missing from the audit table"


def test_the_audit_table_states_each_rule_as_the_code_has_it():
    """A rule changed in the code and not in the table (a new None default, a new choice) fails here."""
    page = (ROOT / "docs" / "reliability.md").read_text()
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for name, rule in zip(cells[0::3], cells[1::3]):
            if name.startswith("`") and name.endswith("`"):
                rows[name.strip("`")] = rule
    for name, rule in PARAMETERS.items():
        if name in PATH_PARAMETERS:
            continue
        text = rows[name]
        try:
            rule.check(name, None)
            takes_none = True
        except ParameterError:
            takes_none = False
        assert ("None" in text) == takes_none, f"{name}: the table says {text!r}"
        if isinstance(rule, Choice) and not callable(rule.options):
            for value in rule.values:
                assert str(value) in text, f"{name}: the table leaves out {value!r}"
