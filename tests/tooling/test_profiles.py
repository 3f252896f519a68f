"""The Hypothesis profiles: the deep one really runs every property test 50 times longer."""

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


def test_reports_the_profile_example_count():
    _count(f"profile={settings.default.max_examples}")


def _examples(profile: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{profile}.txt"
    env = dict(os.environ, GRAPHBORROW_HYPOTHESIS=profile, GRAPHBORROW_COUNT_EXAMPLES=str(out))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "property or not property",
         f"{__file__}::test_counted_with_its_own_example_count",
         f"{__file__}::test_reports_the_profile_example_count"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = out.read_text().split()
    profile = [line.split("=")[1] for line in lines if line.startswith("profile=")]
    return {"own": lines.count("own"), "profile": int(profile[0])}


@pytest.mark.deep  # runs what make deep runs
def test_the_deep_profile_runs_fifty_times_the_examples(tmp_path):
    ci, deep = _examples("ci", tmp_path), _examples("deep", tmp_path)
    assert ci["own"] == 3 and deep["own"] == 150
    assert ci["profile"] == 100 and deep["profile"] == 5000
