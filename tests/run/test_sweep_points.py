"""Point identity and storage: what makes a point 'done', and what makes it run again."""

import json
import os

import nbformat
import pytest

from graphborrow.core.atomicfile import write_atomic
from graphborrow.run.sweep import read_csv, write_csv
from graphborrow.run.sweep.execute import Execution
from graphborrow.run.sweep.points import (
    CHECKSUM,
    PointStore,
    _record_checksum,
    notebook_digest,
    point_identity,
    point_ids,
)


def notebook(code="x = 1"):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# title"), nbformat.v4.new_code_cell(code)]
    return nb


def test_identity_covers_every_parameter_and_the_code_but_not_output_folders():
    digest = notebook_digest(notebook())
    base = point_identity({"BATCH_SIZE": 1, "VOCAB": 64, "OUTPUT_DIR": "/a"}, digest)
    assert base == point_identity({"VOCAB": 64, "BATCH_SIZE": 1, "OUTPUT_DIR": "/b"}, digest)
    assert base != point_identity({"BATCH_SIZE": 1, "VOCAB": 128, "OUTPUT_DIR": "/a"}, digest)
    assert base != point_identity({"BATCH_SIZE": 1, "VOCAB": 64, "DATA_DIR": "/d"}, digest)
    assert base != point_identity({"BATCH_SIZE": 1, "VOCAB": 64}, notebook_digest(notebook("x = 2")))
    edited_markdown = notebook()
    edited_markdown.cells[0].source = "# another title"
    assert notebook_digest(edited_markdown) == digest, "prose does not change what a point computes"


def test_point_ids_are_readable_and_unique():
    points = [{"MODE": "a b"}, {"MODE": "a_b"}, {"MODE": "c"}]
    ids = point_ids(points, ["MODE"], ["1" * 64, "2" * 64, "3" * 64])
    assert ids[2] == "mode=c"
    assert len(set(ids)) == 3 and ids[0].startswith("mode=a_b-") and ids[1].startswith("mode=a_b-")
    long = point_ids([{"LADDER": list(range(1, 60))}], ["LADDER"], ["f" * 64])[0]
    assert len(long) <= 90 and long.endswith("-ffffffff")


DIGEST = "d" * 64


def save(store, point_id, params, run, digest=DIGEST):
    """Store ``run`` as the point of ``params`` (its identity computed as a sweep computes it)."""
    return store.save(point_id, point_identity(params, digest), params, run, notebook_name="nb.ipynb",
                      notebook_digest=digest)


def load(store, point_id, params, digest=DIGEST):
    return store.load(point_id, point_identity(params, digest), params, "nb.ipynb")


def rewrite_record(folder, change, checksum=True):
    """Edit a point's record; with ``checksum`` as a writer that knows the format would (recomputed)."""
    record = json.loads((folder / "point.json").read_text())
    change(record)
    if checksum:
        record[CHECKSUM] = _record_checksum(record)
    (folder / "point.json").write_text(json.dumps(record))


def execution(code=0, results=None, notebook=b'{"cells": []}'):
    results = {"results/nb.json": json.dumps({"device_work": 1, "results": {"bytes": 7}}).encode()} \
        if results is None else results
    return Execution(code, None if code == 0 else "ValueError: boom", 1.5, notebook, results, "log\n",
                     "tcp://127.0.0.1:1", "hostA")


def test_saved_point_loads_back_as_done(tmp_path):
    store = PointStore(tmp_path)
    saved = save(store, "p", {"BATCH_SIZE": 1}, execution())
    assert saved.status == "ok" and saved.results["results.bytes"] == 7
    assert sorted(os.listdir(tmp_path / "p")) == ["nb.ipynb", "papermill.log", "point.json", "results"]
    loaded, why = load(store, "p", {"BATCH_SIZE": 1})
    assert why is None and loaded.status == "done"
    assert loaded.results == saved.results and (loaded.worker, loaded.host) == ("tcp://127.0.0.1:1", "hostA")
    assert load(store, "never-ran", {"BATCH_SIZE": 1}) == (None, None)


def test_changed_identity_is_not_done(tmp_path):
    store = PointStore(tmp_path)
    save(store, "p", {"VOCAB": 64}, execution())
    loaded, why = load(store, "p", {"VOCAB": 128})
    assert loaded is None and "other parameters or another version of the notebook" in why
    assert "_superseded/p-" in why


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "results" / "nb.json").write_text("{not json"), "results/nb.json is damaged"),
    (lambda d: (d / "results" / "nb.json").unlink(), "results/nb.json is missing"),
    (lambda d: (d / "nb.ipynb").write_bytes(b""), "nb.ipynb is damaged"),
    (lambda d: (d / "point.json").write_text('{"schema": 3, "iden'), "point.json is damaged"),
    (lambda d: rewrite_record(d, lambda r: r["files"].update({"../../elsewhere.json": r["files"].pop("results/nb.json")})),
     "outside the point"),
])
def test_damaged_point_is_named_and_not_done(tmp_path, damage, message):
    store = PointStore(tmp_path)
    save(store, "p", {}, execution())
    damage(tmp_path / "p")
    loaded, why = load(store, "p", {})
    assert loaded is None and message in why


def test_failed_and_result_less_points_run_again(tmp_path):
    store = PointStore(tmp_path)
    failed = save(store, "f", {}, execution(code=1))
    assert failed.status == "failed" and failed.error == "ValueError: boom"
    assert "failed last time (ValueError: boom)" in load(store, "f", {})[1]
    empty = save(store, "e", {}, execution(results={}))
    assert empty.status == "failed" and "wrote no results file" in empty.error
    bad = save(store, "b", {}, execution(results={"results/x.json": b"[1, 2]"}))
    assert bad.status == "failed" and "holds a list" in bad.error


def test_saving_again_replaces_the_whole_folder(tmp_path):
    store = PointStore(tmp_path)
    save(store, "p", {}, execution(code=1, results={"results/old.json": b'{"a": 1}'}))
    save(store, "p", {}, execution())
    assert sorted(os.listdir(tmp_path / "p" / "results")) == ["nb.json"], "no file of the old run survives"
    assert [p.name for p in tmp_path.iterdir()] == ["p"], "no staging folder is left behind"


def test_a_finished_point_of_other_parameters_is_kept_aside_not_deleted(tmp_path):
    """Issue 24: changing a fixed parameter used to delete the old point folder with one log line."""
    store = PointStore(tmp_path)
    save(store, "p", {"VOCAB": 64}, execution(results={"results/nb.json": b'{"results": {"bytes": 64}}'}))
    save(store, "p", {"VOCAB": 128}, execution())
    kept = tmp_path / "_superseded" / f"p-{point_identity({'VOCAB': 64}, DIGEST)[:8]}"
    assert json.loads((kept / "results" / "nb.json").read_text()) == {"results": {"bytes": 64}}
    assert json.loads((kept / "point.json").read_text())["params"] == {"VOCAB": 64}
    assert load(store, "p", {"VOCAB": 128})[0].status == "done"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_superseded", "p"]


def test_leftover_staging_folders_are_cleared(tmp_path):
    (tmp_path / ".point-abc").mkdir()
    (tmp_path / ".point-abc" / "half.json").write_text("{")
    PointStore(tmp_path).clear_leftovers()
    assert not (tmp_path / ".point-abc").exists()


def test_results_csv_has_worker_and_host_and_no_output_folder(tmp_path):
    store = PointStore(tmp_path)
    point = save(store, "p", {"LADDER": [4, 2], "OUTPUT_DIR": "/x"}, execution())
    rows = read_csv(write_csv(tmp_path / "results.csv", [point]))
    assert rows[0]["worker"] == "tcp://127.0.0.1:1" and rows[0]["host"] == "hostA"
    assert rows[0]["LADDER"] == "[4, 2]" and "OUTPUT_DIR" not in rows[0]
    assert rows[0]["results.bytes"] == "7"
    assert read_csv(write_csv(tmp_path / "empty.csv", [])) == []


def test_write_atomic_leaves_the_old_file_when_a_write_fails(tmp_path):
    path = write_atomic(tmp_path / "f.txt", "old")
    with pytest.raises(TypeError):
        write_atomic(path, 3)  # fails while writing the temporary file
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"], "no temporary file is left behind"
