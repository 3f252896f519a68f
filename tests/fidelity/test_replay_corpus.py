"""python -m graphborrow replay-corpus: a folder of traces replayed, printed, and recorded as a labelled run."""

import json

import pytest

from graphborrow.__main__ import main
from graphborrow.fidelity import corpus


def test_a_run_is_printed_and_recorded_under_its_label(tmp_path, capsys):
    out = tmp_path / "agreement.json"
    args = ["replay-corpus", "--corpus", "data/traces/corpus", "--only", "seed000,seed001_ring", "--json", str(out),
            "--label", "first", "--commit", "abc1234"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "seed000" in printed and "seed001_ring" in printed and '"traces": 2' in printed
    record = json.loads(out.read_text())
    (run,) = record["runs"]
    assert run["label"] == "first" and run["commit"] == "abc1234" and run["summary"]["1.0"] == 2
    assert run["command"] == "python -m graphborrow replay-corpus " + " ".join(args[1:])
    ring = next(row for row in run["traces"] if row["name"] == "seed001_ring")
    assert ring["variant"] == "ring_overflow" and ring["checks"] > 200
    assert sum(ring["unverifiable_reasons"].values()) == ring["unverifiable"]
    assert main(args[:-4] + ["--label", "second"]) == 0 and main(args) == 0  # the same label replaces its run
    assert [r["label"] for r in json.loads(out.read_text())["runs"]] == ["second", "first"]


def test_a_missing_corpus_or_trace_is_named(tmp_path, capsys):
    assert main(["replay-corpus", "--corpus", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder of traces" in capsys.readouterr().err
    assert main(["replay-corpus", "--only", "seed999"]) == 2
    assert "no traces" in capsys.readouterr().err


def test_a_file_that_is_no_record_of_runs_is_refused(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"something": "else"}')
    with pytest.raises(ValueError, match="not a record of replay runs"):
        corpus.record_run(path, "x", "c", "cmd", [])
    assert path.read_text() == '{"something": "else"}'  # left as it was


def test_the_summary_counts_bands_and_refusals():
    rows = [{"agreement": 1.0}, {"agreement": 0.995}, {"agreement": 0.95}, {"agreement": 0.5}, {"refused": "x"}]
    assert corpus.summarize(rows) == {"1.0": 1, "[0.99, 1)": 1, "[0.9, 0.99)": 1, "< 0.9": 1, "refused": 1, "traces": 5}
