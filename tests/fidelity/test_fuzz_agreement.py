"""A fuzz program agrees with its recording only when something was compared."""

from graphborrow.fidelity.fuzz.generate import Program
from graphborrow.fidelity.fuzz.run import NOTHING_COMPARED, compare_program, simulate_program
from tests.conftest import load_script

replay_fuzz = load_script("scripts/replay_fuzz.py")


def recorded(name: str, source: str) -> dict:
    return simulate_program(Program(name=name, kind="rule", source=source))


def test_a_program_that_allocates_nothing_and_raises_nothing_neither_agrees_nor_differs():
    nothing = recorded("nothing", "x = 1\n")
    result = compare_program(nothing, nothing)
    assert (result.compared, result.agrees) == (False, None)
    assert result.summary().splitlines()[0] == f"nothing: {NOTHING_COMPARED}"
    assert "agrees" not in result.summary()


def test_an_allocation_or_an_error_is_something_to_compare():
    one = recorded("one", "import torch\nx = torch.empty(1024, device='cuda')\n")
    assert compare_program(one, one).agrees is True
    raised = recorded("raised", "raise ValueError('no')\n")  # no block, no event: the error is compared
    assert compare_program(raised, raised).agrees is True
    assert compare_program(raised, recorded("raised", "x = 1\n")).agrees is False


def test_the_totals_count_a_program_with_nothing_to_compare_apart():
    rows = [{"name": "a", "kind": "rule", "agrees": True}, {"name": "b", "kind": "rule", "agrees": None},
            {"name": "c", "kind": "rule", "agrees": False}, {"name": "d", "kind": "rule", "agrees": False}]
    assert replay_fuzz.tally(rows, {"c"}) == {"rule": {"programs": 4, "agree": 1, "listed": 1, "unchecked": 1}}
    assert [replay_fuzz.mark(r, {"c"}) for r in rows] == ["agrees", "unchecked", "listed", "DIFFERS"]
