"""The course plan: one table, read by notebook 00, docs/teaching.md and each notebook's Time line."""

import re
from pathlib import Path

import pytest

from graphborrow.studies import course
from graphborrow.studies.presets import PRESETS
from graphborrow.studies.shipped import numbered_notebooks

ROOT = Path(__file__).resolve().parents[2]
TEACHING = (ROOT / "docs" / "teaching.md").read_text()


def test_every_notebook_is_a_lesson_and_each_class_fills_its_time():
    assert [x.notebook for x in course.LESSONS] == [p.stem for p in numbered_notebooks()]
    for path, total in course.PATHS.items():
        assert sum(course.path_minutes(path).values()) == total, f"the {path} does not add up to {total} minutes"
    assert all(x.short <= x.minutes for x in course.LESSONS), "the two-hour class never takes longer"


def test_the_teaching_page_shows_the_course_plan():
    rows = re.findall(r"^\| (\d\d) [^|]+\| (\d+) \| (\d+|homework) \| ([^|]+) \|$", TEACHING, re.M)
    assert [(n, int(m), 0 if s == "homework" else int(s), plan.strip()) for n, m, s, plan in rows] == [
        (x.notebook[:2], x.minutes, x.short, x.short_plan) for x in course.LESSONS]
    totals = re.search(r"^\| \*\*total\*\* \| \*\*(\d+)\*\* \| \*\*(\d+)\*\* \|", TEACHING, re.M)
    assert totals and tuple(map(int, totals.groups())) == tuple(course.PATHS.values())


def test_the_teaching_page_states_the_presets_as_the_code_has_them():
    for preset, values in PRESETS.items():
        item = re.search(rf'^- `"{preset}"`.*?(?=^- |^## )', TEACHING, re.M | re.S).group(0)
        item = " ".join(item.split())
        for key in ("HIDDEN", "INTERMEDIATE", "VOCAB", "PREFILL_TOKENS"):
            assert re.search(rf"\b{values[key]}\b", item.replace(" ", "")) or str(values[key]) in item, (
                f"docs/teaching.md's {preset} preset does not state {key} = {values[key]}")
        ladder = values["LADDER"]
        assert f"batch {ladder[0]} … {ladder[-1]} × {values['DRAFT_TOKENS']} draft tokens" in item
        assert values["DTYPE"] in item


def test_the_course_table_links_every_notebook():
    table = course.course_table()
    for x in course.LESSONS:
        assert f"]({x.notebook}.ipynb)" in table and f"| {x.minutes} |" in table
    with pytest.raises(KeyError, match="no notebook of the course"):
        course.lesson("42")
    with pytest.raises(KeyError, match="not a class"):
        course.path_minutes("one hour")


def test_the_classes_last_what_they_are_called_and_the_readme_gives_the_same_minutes():
    assert course.PATHS == {"three-hour class": 180, "two-hour class": 120}
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(\d\d_\w+)` \| (\d+) \|", readme, re.M))
    assert rows == {x.notebook: str(x.minutes) for x in course.LESSONS}
