"""Which surviving mutants the mutation record may call wording-only (scripts/mutation_report.py)."""

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def report():
    return load_script("scripts/mutation_report.py")


@pytest.mark.parametrize("before, after, wording", [
    ('raise ValueError("disable() needs a reason")', 'raise ValueError("XXdisable() needs a reasonXX")', True),
    ('"call _record_memory_history() before the work"', '"CALL _RECORD_MEMORY_HISTORY() BEFORE THE WORK"', True),
    ('s._raise_on_live_borrows("graph replay")', 's._raise_on_live_borrows("XXgraph replayXX")', True),
    # values, not prose: a state compared, a kind chosen, a key looked up
    ('if block["state"] == "inactive":', 'if block["state"] == "XXinactiveXX":', False),
    ('kind = "small" if is_small(size) else "large"', 'kind = "XXsmallXX" if is_small(size) else "large"', False),
    ('x = d.get("segment type", k)', 'x = d.get("SEGMENT TYPE", k)', False),
    # more than the words changed
    ('raise ValueError("needs a reason")', 'raise ValueError(None)', False),
    ('f"[{a:#x}, {a + n:#x}) overlap"', 'f"[{a:#x}, {a - n:#x}) overlap"', False),
])
def test_only_prose_in_a_message_counts_as_wording(report, before, after, wording):
    assert report._only_wording([f"-    {before}", f"+    {after}"]) is wording
