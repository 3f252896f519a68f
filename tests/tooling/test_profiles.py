"""The Hypothesis profiles: CI's draws the same examples every run, the search's draws from its
seed, and the deep one really runs every property test 50 times longer."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

COUNT_TO = os.environ.get("GRAPHBORROW_COUNT_EXAMPLES")


def _count(name: str) -> None:
    if COUNT_TO:
        with open(COUNT_TO, "a") as f:
            f.write(name + "\n")


@settings(max_examples=3)
@given(st.integers())
def test_counted_with_its_own_example_count(x):
    _count("own")


@given(st.integers(), st.floats(allow_nan=False))
def test_records_what_it_draws(x, y):
    _count(f"drew={x!r},{y!r}")


def test_reports_the_profile_example_count():
    _count(f"profile={settings.default.max_examples}")


def _run(profile: str, out: Path, *tests: str, options: tuple = ()) -> list[str]:
    """What the tests recorded, run in a fresh pytest under ``profile``, on what Hypothesis takes for
    a CI machine (``CI=true``, as where the project's CI runs), which loads a profile of its own."""
    env = dict(os.environ, GRAPHBORROW_HYPOTHESIS=profile, GRAPHBORROW_COUNT_EXAMPLES=str(out), CI="true")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "property or not property", *options,
         *(f"{__file__}::{test}" for test in tests)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out.read_text().split()


def _examples(profile: str, tmp_path: Path) -> dict:
    lines = _run(profile, tmp_path / f"{profile}.txt", "test_counted_with_its_own_example_count",
                 "test_reports_the_profile_example_count")
    profile = [line.split("=")[1] for line in lines if line.startswith("profile=")]
    return {"own": lines.count("own"), "profile": int(profile[0])}


def test_ci_draws_the_same_examples_every_run_and_the_search_draws_from_its_seed(tmp_path):
    runs = {}
    for name, profile, seed in (("ci 1", "ci", ()), ("ci 2", "ci", ()), ("search 1", "search", ("--hypothesis-seed=1",)),
                                ("search 1 again", "search", ("--hypothesis-seed=1",)),
                                ("search 2", "search", ("--hypothesis-seed=2",))):
        runs[name] = _run(profile, tmp_path / f"{name}.txt", "test_records_what_it_draws", options=seed)
    assert len(runs["ci 1"]) == 100 and runs["ci 1"] == runs["ci 2"]
    assert runs["search 1"] == runs["search 1 again"]
    assert runs["search 1"] != runs["search 2"] and runs["search 1"] != runs["ci 1"]


@pytest.mark.deep  # runs what make deep runs
def test_the_deep_profile_runs_fifty_times_the_examples(tmp_path):
    ci, deep = _examples("ci", tmp_path), _examples("deep", tmp_path)
    assert ci["own"] == 3 and deep["own"] == 150
    assert ci["profile"] == 100 and deep["profile"] == 5000
