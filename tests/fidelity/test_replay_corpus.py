"""python -m graphborrow replay-corpus: a folder of traces replayed, printed, and recorded as a labelled run."""

import json
import pickle

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


def test_the_summary_counts_bands_refusals_and_traces_that_made_no_check():
    rows = [{"agreement": 1.0}, {"agreement": 0.995}, {"agreement": 0.95}, {"agreement": 0.5}, {"refused": "x"},
            {"agreement": None}, {"unreadable": "y"}]
    assert corpus.summarize(rows) == {"1.0": 1, "[0.99, 1)": 1, "[0.9, 0.99)": 1, "< 0.9": 1, "refused": 1,
                                      "unchecked": 1, "unreadable": 1, corpus.STATS_DISAGREE: 0, "traces": 7}


def test_a_trace_that_makes_no_check_is_shown_undefined_never_in_a_band(tmp_path, capsys):
    empty = tmp_path / "corpus"
    empty.mkdir()
    with open(empty / "nothing.pickle", "wb") as f:
        pickle.dump({"segments": [], "device_traces": [[]]}, f)
    assert main(["replay-corpus", "--corpus", str(empty)]) == 0
    out = capsys.readouterr().out
    assert "undefined (0 checks" in out and '"1.0": 0' in out and '"unchecked": 1' in out


def _corpus_with_bad_files(tmp_path):
    """Two real traces of the committed corpus beside files a corpus folder should not hold."""
    import shutil

    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in ("seed000", "seed001_ring"):
        shutil.copy(f"data/traces/corpus/{name}.pickle.gz", folder)
    (folder / "junk.pickle.gz").write_text("not gzip at all")
    with open(folder / "evil.pickle", "wb") as f:
        pickle.dump(_Reducer(), f)
    with open(folder / "no_trace.pickle", "wb") as f:
        pickle.dump({"segments": []}, f)
    (folder / "sub.pickle").mkdir()  # a folder with a trace's name
    return folder


class _Reducer:
    def __reduce__(self):
        return (print, ("code ran",))


def test_a_file_that_is_no_trace_is_an_unreadable_row_and_the_good_traces_still_replay(tmp_path, capsys):
    """Junk had been counted with the traces the simulator refuses, and the run exited 0."""
    folder = _corpus_with_bad_files(tmp_path)
    assert main(["replay-corpus", "--corpus", str(folder)]) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert "4 of 6 files are not traces" in captured.err and "--only" in captured.err
    assert "code ran" not in out
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith("{")}
    assert "1.0000 (" in lines["seed000"] and "1.0000 (" in lines["seed001_ring"]
    for name in ("junk", "evil", "no_trace", "sub"):
        assert "unreadable: " in lines[name], lines[name]
    assert "builtins.print" in lines["evil"] and "device_traces" in lines["no_trace"]
    summary = json.loads(out.splitlines()[-1])
    assert summary["unreadable"] == 4 and summary["refused"] == 0 and summary["1.0"] == 2 and summary["traces"] == 6


def test_rows_are_named_after_their_file(tmp_path):
    import shutil

    shutil.copy("data/traces/corpus/seed000.pickle.gz", tmp_path / "tampered.pickle.gz")
    row = corpus.replay_file(tmp_path / "tampered.pickle.gz")
    assert row["name"] == "tampered" and row["agreement"] == 1.0


def test_a_trace_whose_statistics_disagree_is_never_counted_as_one(tmp_path, capsys):
    """Every block and segment check can agree while the recorded memory_stats() do not (an
    allocation made larger after the fact): the row and the summary say so."""
    import gzip

    with gzip.open("data/traces/corpus/seed000.pickle.gz", "rb") as f:
        snapshot = pickle.load(f)
    stats = snapshot["memory_stats"]
    stats["num_alloc_retries"] = stats.get("num_alloc_retries", 0)  # unobservable: never compared
    stats["allocation.all.allocated"] += 1  # one allocation the trace never made
    folder = tmp_path / "corpus"
    folder.mkdir()
    with gzip.open(folder / "stats.pickle.gz", "wb") as f:
        pickle.dump(snapshot, f)
    assert main(["replay-corpus", "--corpus", str(folder)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("stats"))
    checked = corpus.replay_file(folder / "stats.pickle.gz")["stats_checked"]
    assert "1.0000 (" in line and f"stats {checked - 1}/{checked})" in line
    summary = json.loads(out.splitlines()[-1])
    assert summary["1.0"] == 0 and summary[corpus.STATS_DISAGREE] == 1


@pytest.mark.parametrize("make", [lambda p: p.mkdir(), lambda p: p.write_text("not json"), lambda p: p.write_text("[1, 2]")])
def test_a_json_record_that_cannot_take_the_run_is_refused_before_any_replay(tmp_path, capsys, make):
    target = tmp_path / "runs.json"
    make(target)
    before = target.read_text() if target.is_file() else None
    assert main(["replay-corpus", "--only", "seed000", "--json", str(target)]) == 2
    captured = capsys.readouterr()
    assert "seed000" not in captured.out and "--json" in captured.err  # nothing replayed, the fix named
    assert (target.read_text() if target.is_file() else None) == before


def test_the_default_corpus_is_the_checkout_s_from_any_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["replay-corpus", "--only", "seed000"]) == 0
    assert "seed000" in capsys.readouterr().out
    assert main(["replay-corpus", "--corpus", "nowhere"]) == 2
    assert str(corpus.default_corpus().resolve()) in capsys.readouterr().err
