"""The deterministic sample a time-boxed mutation run names (scripts/mutation_sample.py)."""

import argparse

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("scripts/mutation_sample.py")


def statuses(function, count, status="not checked"):
    return {f"{function}__mutmut_{n}": status for n in range(1, count + 1)}


def test_every_kth_mutant_of_each_function_from_the_first(script):
    names = {**statuses("graphborrow.core.borrow.x_f", 7), **statuses("graphborrow.core.borrow.x_g", 2),
             **statuses("graphborrow.core.arena.x_h", 5)}
    chosen = script.sample(names, {"graphborrow.core.borrow.*": 3})
    assert chosen == [
        "graphborrow.core.borrow.x_f__mutmut_1", "graphborrow.core.borrow.x_f__mutmut_4", "graphborrow.core.borrow.x_f__mutmut_7",
        "graphborrow.core.borrow.x_g__mutmut_1",
    ]


def test_mutants_with_a_result_are_left_out_unless_rerun(script):
    names = {**statuses("graphborrow.core.runs.x_f", 3, "killed"), "graphborrow.core.runs.x_f__mutmut_5": "not checked"}
    assert script.sample(names, {"graphborrow.core.runs.*": 2}) == ["graphborrow.core.runs.x_f__mutmut_5"]
    assert script.sample(names, {"graphborrow.core.runs.*": 2}, rerun=True) == [
        "graphborrow.core.runs.x_f__mutmut_1", "graphborrow.core.runs.x_f__mutmut_3", "graphborrow.core.runs.x_f__mutmut_5",
    ]


@pytest.mark.parametrize("text", ["graphborrow.core.arena.*", "graphborrow.core.arena.*=0", "graphborrow.core.arena.*=two"])
def test_a_stride_must_be_a_whole_number_of_at_least_one(script, text):
    with pytest.raises(argparse.ArgumentTypeError, match="PATTERN=K with K a whole number >= 1"):
        script._stride(text)
